"""``clattn tune`` (alias ``clattn profile``): arguments, the run, the outputs, the exit code.

The report is printed before anything is written; then ``--save`` (the user profile),
``--plot`` and ``--out`` are attempted, each failure said with what and why.

Exit codes: :data:`EXIT_OK` every check passed and everything asked for was written;
:data:`EXIT_WRONG` a correctness check failed (the registry profile's or the tuned
one's); :data:`EXIT_FAILED` could not run (no device, bad arguments, nothing could be
timed) or could not write an output; :data:`EXIT_PLOT` only the plot could not be drawn
(matplotlib missing); :data:`EXIT_INTERRUPTED` Ctrl-C (nothing written). With several, the
first of 1, 2, 3 in that order wins.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from .. import runtime
from ..fileio import write_atomic
from ..profiles import save_user_profile, user_profile_dir
from ..profiles.record import Profile
from . import session
from .budget import RunClock
from .report import Report, format_report, jsonable, plot_report
from .search import Settings
from .timing import first_line

EXIT_OK, EXIT_WRONG, EXIT_FAILED, EXIT_PLOT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``clattn tune``."""
    p.add_argument("--device", default=None,
                   help="device name fragment, 'pocl', 'intel', 'oclgrind' or 'P:D' "
                        "(default: PYOPENCL_CTX or the default device)")
    p.add_argument("--quick", action="store_true",
                   help="a handful of candidates and fewer shapes, in a 20 s budget")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="wall time of the whole run: ceilings, correctness checks and "
                        "tuning (default 20 with --quick, else 300). The current profile's "
                        "correctness checks always run in full (the tuning gets what they "
                        "leave), and each stage times its default on its first shape, so a "
                        "device whose compiler is slower than the budget overruns it by "
                        "those; a tuned profile whose checks do not fit is dropped; the "
                        "report says where the time went and what was left out")
    p.add_argument("--save", action="store_true",
                   help="save the tuned parameters as a user profile for this device")
    p.add_argument("--name", default=None,
                   help="name of the saved profile (default: measured-<device name>)")
    p.add_argument("--out", metavar="FILE", help="write the JSON report to FILE")
    p.add_argument("--plot", metavar="FILE",
                   help="PNG of achieved GB/s vs context length (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def profile_entry(name: str, device_name: str, best: Profile, base_name: str,
                  summary: str) -> dict[str, Any]:
    """The user-profile entry ``--save`` writes (every field of the tuned profile)."""
    params = {k: v for k, v in best.to_dict().items() if k not in ("name", "source")}
    return {"name": name, "label": f"{device_name} (measured)", "base": base_name,
            "source": f"measured by clattn tune on {_dt.date.today().isoformat()}",
            "notes": summary, "match": {"device": [device_name]}, "params": params}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip()).strip("-.").lower() or "device"


@dataclass
class Outputs:
    """What was written, what was not and why."""

    saved: dict[str, Any] | None = None  # name, path, entry
    not_saved: str = ""
    plot: str = ""
    plot_error: str = ""
    errors: list[str] = field(default_factory=list)  # "what PATH: why" of failed writes


def verdict(rep: Report) -> tuple[int, list[str]]:
    """The exit code a report deserves, and the lines that say why."""
    if rep.failed_checks:
        bad = rep.failed_checks
        worst = max(c.max_abs_err for c in bad)
        which = "the tuned profile" if rep.correctness_passed else "the registry profile"
        return EXIT_WRONG, [f"CORRECTNESS FAILED on {rep.device.get('device_name')} "
                            f"({which}): {', '.join(c.name for c in bad)}; max error {worst:.3g}"]
    if rep.tuning is not None and rep.tuning.chosen is None:
        return EXIT_FAILED, [f"tuning produced no timed candidate "
                             f"({rep.tuning.stopped or 'see the candidates'})"]
    return EXIT_OK, []


def _save(rep: Report, name: str | None, out: Outputs) -> None:
    if rep.failed_checks:
        out.not_saved = "correctness failed"
        return
    if rep.chosen is None:
        out.not_saved = "no tuned result"
        return
    dev = str(rep.device.get("device_name") or "device").strip()
    name = name or f"measured-{_slug(dev)}"
    speed = ", ".join(f"{r.shape.key}: {r.speedup:.2f}x" for r in rep.tuning.per_shape if r.speedup)
    pre = ", ".join(f"{r.shape.key}: {r.speedup:.2f}x"
                    for r in (rep.prefill.per_shape if rep.prefill else ()) if r.speedup)
    entry = profile_entry(name, dev, rep.chosen, rep.builtin.name,
                          f"clattn tune ({rep.mode}): speedup over {rep.builtin.name}: {speed}"
                          + (f"; prefill {pre}" if pre else ""))
    try:
        path = save_user_profile(entry)
    except (OSError, ValueError) as exc:
        out.errors.append(f"the user profile (--save) {user_profile_dir() / (name + '.json')}: "
                          f"{first_line(exc)}")
        return
    out.saved = {"name": name, "path": str(path), "entry": entry}


def _plot(rep: Report, path: str, out: Outputs) -> None:
    """Draw into a temporary file beside ``path``, moved there once whole (a failure or a
    Ctrl-C while drawing leaves no half-written picture)."""
    target = os.path.abspath(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                                   dir=os.path.dirname(target))
        os.close(fd)
        why = plot_report(rep, tmp)
        if not why:
            os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        out.errors.append(f"the plot (--plot) {path}: {first_line(exc)}")
        return
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    if why:
        out.plot_error = why
    else:
        out.plot = path


def _write_outputs(args: argparse.Namespace, rep: Report) -> Outputs:
    """--save, --plot, then --out (which records the other two); failures collected."""
    out = Outputs()
    if args.save:
        _save(rep, args.name, out)
    if args.plot:
        _plot(rep, args.plot, out)
    if args.out:
        doc = dict(rep.to_json(), outputs=jsonable(out))
        try:
            write_atomic(args.out, json.dumps(doc, indent=2) + "\n")
        except OSError as exc:
            out.errors.append(f"the JSON report (--out) {args.out}: {first_line(exc)}")
    return out


def _say_outputs(out: Outputs, prog: str, as_json: bool) -> None:
    info = sys.stderr if as_json else sys.stdout
    if out.saved:
        print(f"Saved user profile {out.saved['name']!r} to {out.saved['path']}", file=info)
    if out.not_saved:
        print(f"Not saved: {out.not_saved}", file=info)
    if out.plot:
        print(f"Plot written to {out.plot}", file=info)
    if out.plot_error:
        print(f"{prog}: --plot: {out.plot_error}", file=sys.stderr)
    for e in out.errors:
        print(f"{prog}: could not write {e}", file=sys.stderr)
    if out.errors:
        print(f"{prog}: the measurements above are complete; {len(out.errors)} output(s) "
              f"could not be written", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run ``clattn tune`` with parsed arguments; the exit code."""
    prog = f"clattn {getattr(args, 'command', None) or 'tune'}"
    err = sys.stderr
    if args.budget is not None and not args.budget > 0:
        raise ValueError(f"--budget {args.budget}: must be a positive number of seconds")
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", args.name):
        raise ValueError(f"--name {args.name!r}: use letters, digits, '.', '_' and '-' only")
    settings = Settings.make(bool(args.quick), args.budget)
    clock = RunClock(settings.budget_s)
    dev = runtime.select_device(args.device)
    if dev is None:
        print(f"{prog}: no OpenCL device found (install one, e.g. "
              "pip install 'clattn[pocl]').", file=err)
        return EXIT_FAILED
    quiet = bool(args.no_progress)

    def log(text: str) -> None:
        if not quiet:
            print(f"{prog}: {text}", file=err, flush=True)

    try:
        rep = session.tune_device(dev, settings, progress=not quiet, log=log, run=clock)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted; nothing was saved.", file=err)
        return EXIT_INTERRUPTED
    rc, why = verdict(rep)
    for line in why:
        print(f"{prog}: {line}", file=err)
    print(json.dumps(rep.to_json(), indent=2) if args.json else format_report(rep), flush=True)
    try:
        out = _write_outputs(args, rep)
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted while writing; no file was half written.", file=err)
        return EXIT_INTERRUPTED
    _say_outputs(out, prog, bool(args.json))
    if out.errors and rc == EXIT_OK:
        rc = EXIT_FAILED
    if out.plot_error and rc == EXIT_OK:
        rc = EXIT_PLOT
    return rc


__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PLOT", "EXIT_WRONG", "Outputs",
           "add_arguments", "profile_entry", "run", "verdict"]
