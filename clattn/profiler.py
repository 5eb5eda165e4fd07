"""``clattn profile``: what a device can do, whether clattn is right on it, and its best profile.

Five steps, each in the report (terminal table, ``--json``, ``--out FILE``):

1. **Device**: the properties that matter and the registry profile it gets, with the rule.
2. **Ceilings** (:mod:`clattn.bandwidth`, measured as clpeak does): streaming read and copy
   bandwidth, kernel launch latency (event and round trip), host<->device transfers.
3. **Correctness** (:mod:`clattn.checks`): decode (plain, split, RoPE, sliding window with
   sinks) and the merge kernels against the CPU fallback (:mod:`clattn.reference`) on this
   device. A failure is loud, nothing is saved and the exit code is 1.
4. **Tuning** (:mod:`clattn.tuning`): for representative model shapes (Llama-3-8B 32/8/128,
   Qwen2.5-0.5B 14/2/64, f16) at a few (batch, context) points, a bounded coordinate search
   over the Profile fields (kernel fields first, then the split planner's), each candidate
   verified against the fallback before it is timed. The winner is chosen as CLBlast does: the
   lowest sum over the shapes of ``time / best time for that shape``. ``--budget`` bounds the
   wall time; ``--quick`` keeps to a handful of distinct kernels.
5. **Output**: ``--save`` writes a user profile matched to this device by name (atomically, at
   the very end; Ctrl-C saves nothing); ``--plot FILE`` draws achieved GB/s against the read
   ceiling (needs matplotlib: ``pip install clattn[plot]``).

Exit codes: 0 fine; 1 correctness failed (or no candidate could be timed); 2 usage/device
errors; 3 only the plot could not be drawn; 130 interrupted.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import re
import sys
import time
from typing import Any, Callable

import numpy as np

from . import runtime
from .checks import correctness
from .fileio import write_atomic
from .profiles.record import Profile
from .tuning import Candidate, Progress, Settings, Tuner, _first_line, _params_text

# -- small helpers ---------------------------------------------------------------------------

def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip()).strip("-.").lower() or "device"


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)




# -- the whole profile ---------------------------------------------------------------------

def rep_mode(settings: Settings) -> str:
    return "quick" if settings.quick else "full"


def _ceilings(rt: Any, s: Settings) -> tuple[dict, dict]:
    """(name -> bandwidth result object, name -> error text)."""
    from . import bandwidth
    res, errs = {}, {}
    jobs: list[tuple[str, Callable[[], Any]]] = [
        ("read", lambda: bandwidth.read_bandwidth(rt, s.ceiling_bytes, s.ceiling_target_s)),
        ("copy", lambda: bandwidth.copy_bandwidth(rt, s.ceiling_bytes // 2, s.ceiling_target_s)),
        ("launch", lambda: bandwidth.launch_latency(rt, max(s.ceiling_target_s, 0.05))),
        ("transfer", lambda: bandwidth.transfer_bandwidth(rt, s.ceiling_bytes // 4,
                                                          s.ceiling_target_s)),
    ]
    for name, job in jobs:
        try:
            res[name] = job()
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - a ceiling that cannot be measured is reported
            errs[name] = _first_line(exc)
    return res, errs


def profile_entry(name: str, device_name: str, best: Profile, base_name: str,
                  summary: str) -> dict:
    """The user-profile entry ``--save`` writes (all of the tuned profile's fields)."""
    params = {k: v for k, v in best.to_dict().items() if k not in ("name", "source")}
    return {"name": name, "label": f"{device_name} (measured)", "base": base_name,
            "source": f"measured by clattn profile on {_dt.date.today().isoformat()}",
            "notes": summary, "match": {"device": [device_name]}, "params": params}


def _per_shape(tuner: Tuner, default: Candidate, best: Candidate,
               read_gbps: float | None) -> list[dict]:
    rows = []
    order = {m.name: i for i, m in enumerate(tuner.models)}
    for s in sorted(tuner.shapes, key=lambda s: (order[s.model], s.context, s.batch)):
        conf = tuner.confirmed_times
        td = conf.get(default.id, default.times).get(s.key)
        tt = conf.get(best.id, best.times).get(s.key)
        row = {"shape": s.key, "model": s.model, "batch": s.batch, "context": s.context,
               "bytes": s.bytes_moved, "default_ms": td and td * 1e3, "tuned_ms": tt and tt * 1e3,
               "speedup": (td / tt) if td and tt else None,
               "default_gbps": s.bytes_moved / td * 1e-9 if td else None,
               "tuned_gbps": s.bytes_moved / tt * 1e-9 if tt else None,
               "tuned_plan": best.plans.get(s.key)}
        row["fraction_of_read_bw"] = (row["tuned_gbps"] / read_gbps
                                      if row["tuned_gbps"] and read_gbps else None)
        rows.append(row)
    return rows


def profile_device(device: Any, settings: Settings, *, progress: bool = True,
                   log: Callable[[str], None] | None = None) -> dict:
    """Run every step on ``device`` and return the report (a JSON-able dict)."""
    from .cli import device_report
    from .profiles import device_info, fit, match

    say = log or (lambda text: None)
    t_start = time.perf_counter()
    rt = runtime.Runtime.for_device(device)
    info = device_info(device)
    current = match(info)
    builtin = match(info, user=False)
    cur_fit, cur_notes = fit(current.profile, info)
    base_fit, base_notes = fit(builtin.profile, info)
    report: dict = {
        "clattn_profile": 1, "date": _now(), "mode": rep_mode(settings),
        "device": info, "device_report": device_report(device),
        "profile": {"name": current.profile.name, "level": current.level, "rule": current.rule,
                    "fit_notes": cur_notes, "params": cur_fit.to_dict()},
        "builtin_profile": {"name": builtin.profile.name, "rule": builtin.rule,
                            "fit_notes": base_notes, "params": base_fit.to_dict()},
    }
    say(f"device: {info.get('device_name')} ({info.get('platform_name')}); profile "
        f"{current.profile.name} [{current.level}]")

    # 2. ceilings
    say("measuring ceilings (read, copy, launch latency, transfers)...")
    t = time.perf_counter()
    res, errs = _ceilings(rt, settings)
    steps = report["step_seconds"] = {"ceilings": time.perf_counter() - t}
    report["ceilings"] = {k: _jsonable(v) for k, v in res.items()}
    report["ceilings"]["summary"] = {k: v.summary() for k, v in res.items()}
    report["ceilings"]["errors"] = errs
    read_gbps = getattr(res.get("read"), "gbps", None)

    # 3. correctness
    say("checking correctness against the CPU fallback...")
    t = time.perf_counter()
    checks = correctness(device, f32=settings.f32_check)
    steps["correctness"] = time.perf_counter() - t
    passed = all(c.passed for c in checks)
    report["correctness"] = {"passed": passed, "profile": cur_fit.name,
                             "checks": [_jsonable(c) for c in checks]}

    # 4. tuning
    tuning: dict = {"ran": False}
    report["tuning"] = tuning
    if not passed:
        tuning["reason"] = "skipped: correctness failed"
    else:
        say(f"tuning ({rep_mode(settings)}, budget {settings.budget_s:.0f} s)...")
        prog = Progress(settings.budget_s, enabled=progress)
        seeds = [(cur_fit, f"current ({current.level})")] if cur_fit != base_fit else []
        tuner = Tuner(rt, info, base_fit, settings, prog, seeds)
        try:
            tuner.run()
        finally:
            prog.done()
            tuning.update(_tuning_report(tuner, read_gbps))
        tuning["ran"] = True
        steps["tuning"] = tuner.elapsed()
    report["elapsed_s"] = time.perf_counter() - t_start
    return report


def _tuning_report(tuner: Tuner, read_gbps: float | None) -> dict:
    best = tuner.chosen
    default = tuner.candidates[0] if tuner.candidates else None
    out: dict = {
        "settings": _jsonable(tuner.settings),
        "shapes": [dict(_jsonable(s), key=s.key, bytes=s.bytes_moved) for s in tuner.shapes],
        "skipped_shapes": tuner.skipped_shapes,
        "elapsed_s": tuner.elapsed(),
        "stopped": tuner.stop_reason or tuner.kernel_stop or None,
        "candidates": [{"id": c.id, "origin": c.origin, "status": c.status, "reason": c.reason,
                        "score": c.score, "params": c.params(),
                        "times_ms": {k: v * 1e3 for k, v in c.times.items()},
                        "reused_times": c.reused, "plans": c.plans}
                       for c in tuner.candidates],
        "confirmation": tuner.confirmation,
        "best": None, "per_shape": [],
    }
    if best is not None and default is not None and default.status == "ok":
        out["best"] = {"id": best.id, "score": best.score, "params": best.params(),
                       "profile": best.profile.to_dict(),
                       "default_score": default.score}
        out["per_shape"] = _per_shape(tuner, default, best, read_gbps)
    return out


# -- rendering ------------------------------------------------------------------------------

def _table(head: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return ["  " + fmt(head)] + ["  " + fmt(r) for r in rows]


def _num(v: Any, fmt: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def format_report(rep: dict) -> str:
    """The human summary of a report."""
    info = rep["device"]
    L = [f"clattn profile ({rep['mode']}) of {info.get('device_name')} "
         f"[{info.get('platform_name')}], {rep['date']}", "", "Device", rep["device_report"]]
    p = rep["profile"]
    L.append(f"  profile              {p['name']} [{p['level']}]: {p['rule']}")
    for n in p.get("fit_notes") or []:
        L.append(f"  fitted               {n}")
    # ceilings
    c = rep["ceilings"]
    L += ["", "Ceilings (clattn.bandwidth, clpeak's method)"]
    if "read" in c:
        r = c["read"]
        L.append(f"  read bandwidth       {r['gbps']:.2f} GB/s ({r['best']}; "
                 f"median {r['median_gbps']:.2f})")
    if "copy" in c:
        r = c["copy"]
        L.append(f"  copy bandwidth       {r['gbps']:.2f} GB/s read+write ({r['best']})")
    if "launch" in c:
        r = c["launch"]
        L.append(f"  launch latency       dispatch {r['queued_to_end_us']:.1f} us "
                 f"(event queued->end; empty kernel {r['kernel_us']:.1f} us), "
                 f"round trip {r['round_trip_us']:.1f} us "
                 f"(enqueue + wait; best {r['round_trip_min_us']:.1f})")
    if "transfer" in c:
        r = c["transfer"]
        L.append(f"  transfers            host->device {r['h2d']['gbps']:.2f} GB/s, device->host "
                 f"{r['d2h']['gbps']:.2f} GB/s")
    for k, e in (c.get("errors") or {}).items():
        L.append(f"  {k:<20} NOT MEASURED: {e}")
    # correctness
    cor = rep["correctness"]
    L += ["", f"Correctness vs the CPU fallback (profile {cor['profile']})"]
    rows = [["PASS" if ch["passed"] else "FAIL", ch["name"],
             "inf" if ch["max_abs_err"] is None else f"{ch['max_abs_err']:.2e}", f"{ch['tol']:g}",
             ch["detail"]] for ch in cor["checks"]]
    L += _table(["", "check", "max err", "tol", "problem"], rows)
    if not cor["passed"]:
        bad = [ch for ch in cor["checks"] if not ch["passed"]]
        worst = max(math.inf if ch["max_abs_err"] is None else ch["max_abs_err"] for ch in bad)
        L += ["", f"  !!! CORRECTNESS FAILED on this device: {len(bad)} of {len(cor['checks'])} "
                  f"checks, max error {worst:.3g}. Tuning skipped, nothing saved. !!!"]
    # tuning
    t = rep["tuning"]
    L += [""]
    if not t.get("ran") and "candidates" not in t:
        L.append(f"Tuning {t.get('reason', 'not run')}")
    else:
        cands = t["candidates"]
        counts: dict[str, int] = {}
        for cd in cands:
            counts[cd["status"]] = counts.get(cd["status"], 0) + 1
        ctext = ", ".join(f"{v} {k}" for k, v in counts.items())
        st = t["settings"]
        L.append(f"Tuning: {len(t['shapes'])} shapes, {len(cands)} candidates ({ctext}), "
                 f"{t['elapsed_s']:.0f} s of a {st['budget_s']:.0f} s budget"
                 + (f"; stopped: {t['stopped']}" if t.get("stopped") else ""))
        for k, why in (t.get("skipped_shapes") or {}).items():
            L.append(f"  shape {k} not measured: {why}")
        best_id = t["best"]["id"] if t.get("best") else None
        rows = []
        for cd in cands:
            prof = Profile.from_dict(cd["params"])
            rows.append(["*" if cd["id"] == best_id else "", f"#{cd['id']}", cd["origin"],
                         _params_text(prof), _num(cd["score"]),
                         cd["status"] + (f": {cd['reason']}" if cd["reason"] else "")])
        L += _table(["", "id", "from", "parameters", "score", "status"], rows, right={4})
        L.append("  (score: sum over shapes of time / best time for that shape; lower is better)")
        if t.get("per_shape"):
            L += ["", f"Default ({rep['builtin_profile']['name']}) vs tuned (#{best_id}) per shape"]
            rows = [[r["shape"], _num(r["default_ms"], ".3f"), _num(r["tuned_ms"], ".3f"),
                     _num(r["speedup"], ".2f") + "x", _num(r["tuned_gbps"], ".2f"),
                     _num(r["fraction_of_read_bw"] and 100 * r["fraction_of_read_bw"], ".0f") + "%"]
                    for r in t["per_shape"]]
            L += _table(["shape", "default ms", "tuned ms", "speedup", "tuned GB/s",
                         "of read BW"], rows, right={1, 2, 3, 4, 5})
            b = t["best"]
            conf = t.get("confirmation") or {}
            again = ", ".join(f"{k} {v:.2f}" for k, v in (conf.get("scores") or {}).items())
            L.append(f"  tuned: {_params_text(Profile.from_dict(b['params']))} "
                     f"(search score {b['score']:.2f} vs default {_num(b['default_score'])}"
                     + (f"; timed again side by side: {again}" if again else "") + ")")
            if conf.get("kept_default"):
                L.append(f"  kept the default: {conf['kept_default']}")
    if rep.get("saved"):
        L += ["", f"Saved user profile {rep['saved']['name']!r} to {rep['saved']['path']}"]
    elif rep.get("save_skipped"):
        L += ["", f"Not saved: {rep['save_skipped']}"]
    steps = ", ".join(f"{k} {v:.0f} s" for k, v in (rep.get("step_seconds") or {}).items())
    L.append(f"\nTotal {rep.get('elapsed_s', 0):.0f} s ({steps}).")
    return "\n".join(L)


def plot_report(rep: dict, path: str) -> str | None:
    """Draw achieved GB/s vs context against the read ceiling; None, or why it could not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install clattn[plot]"
    rows = (rep.get("tuning") or {}).get("per_shape") or []
    if not rows:
        return "nothing to plot: no tuning results"
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    read = ((rep.get("ceilings") or {}).get("read") or {}).get("gbps")
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for b in sorted({r["batch"] for r in mine}):
            pts = sorted((r for r in mine if r["batch"] == b), key=lambda r: r["context"])
            xs = [r["context"] for r in pts]
            line, = ax.plot(xs, [r["tuned_gbps"] for r in pts], "o-", label=f"B={b} tuned")
            ax.plot(xs, [r["default_gbps"] for r in pts], "x--", color=line.get_color(),
                    label=f"B={b} default")
        if read:
            ax.axhline(read, color="k", linestyle=":", label=f"read ceiling {read:.1f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("achieved GB/s (K+V+q+out bytes / time)")
        ax.set_title(model)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    fig.suptitle(f"clattn decode on {rep['device'].get('device_name')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


# -- command line ----------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="device name fragment, 'pocl', 'intel', 'oclgrind' or 'P:D' "
                        "(default: PYOPENCL_CTX or the default device)")
    p.add_argument("--quick", action="store_true",
                   help="a handful of candidates and fewer shapes (under a minute on a CPU)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="wall time for tuning (default 20 with --quick, else 300)")
    p.add_argument("--save", action="store_true",
                   help="save the tuned parameters as a user profile for this device")
    p.add_argument("--name", default=None,
                   help="name of the saved profile (default: measured-<device name>)")
    p.add_argument("--out", metavar="FILE", help="write the JSON report to FILE")
    p.add_argument("--plot", metavar="FILE",
                   help="PNG of achieved GB/s vs context length (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def run(args: argparse.Namespace) -> int:
    from .profiles import save_user_profile

    err = sys.stderr
    if args.budget is not None and not args.budget > 0:
        raise ValueError(f"--budget {args.budget}: must be a positive number of seconds")
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", args.name):
        raise ValueError(f"--name {args.name!r}: use letters, digits, '.', '_' and '-' only")
    dev = runtime.select_device(args.device)
    if dev is None:
        print("clattn profile: no OpenCL device found (install one, e.g. "
              "pip install 'clattn[pocl]').", file=err)
        return 2
    settings = Settings.make(bool(args.quick), args.budget)
    quiet = bool(getattr(args, "no_progress", False))

    def log(text: str) -> None:
        if not quiet:
            print(f"clattn profile: {text}", file=err, flush=True)

    try:
        rep = profile_device(dev, settings, progress=not quiet, log=log)
    except KeyboardInterrupt:
        print("\nclattn profile: interrupted; nothing was saved.", file=err)
        return 130

    rc = 0
    tuning = rep["tuning"]
    if not rep["correctness"]["passed"]:
        rc = 1
        bad = [c for c in rep["correctness"]["checks"] if not c["passed"]]
        errs = [c["max_abs_err"] for c in bad]
        worst = max((math.inf if e is None else e) for e in errs)
        print(f"clattn profile: CORRECTNESS FAILED on {dev.name.strip()}: "
              f"{', '.join(c['name'] for c in bad)}; max error {worst:.3g}", file=err)
    elif not tuning.get("best"):
        rc = 1
        print("clattn profile: tuning produced no timed candidate "
              f"({tuning.get('stopped') or 'see the candidates'})", file=err)

    if args.save:
        if rc:
            rep["save_skipped"] = ("correctness failed" if not rep["correctness"]["passed"]
                                   else "no tuned result")
        else:
            best = Profile.from_dict(tuning["best"]["profile"])
            name = args.name or f"measured-{_slug(dev.name)}"
            speed = ", ".join(f"{r['shape']}: {r['speedup']:.2f}x" for r in tuning["per_shape"]
                              if r.get("speedup"))
            entry = profile_entry(name, dev.name.strip(), best,
                                  rep["builtin_profile"]["name"],
                                  f"clattn profile ({rep['mode']}): speedup over "
                                  f"{rep['builtin_profile']['name']}: {speed}")
            path = save_user_profile(entry)
            rep["saved"] = {"name": name, "path": str(path), "entry": entry}
    if args.plot:
        why = plot_report(rep, args.plot)
        if why:
            print(f"clattn profile: --plot: {why}", file=err)
            rep["plot_error"] = why
            rc = rc or 3
        else:
            rep["plot"] = args.plot
    if args.out:
        write_atomic(args.out, json.dumps(_jsonable(rep), indent=2) + "\n")
    if args.json:
        print(json.dumps(_jsonable(rep), indent=2))
    else:
        print(format_report(_jsonable(rep)))
    return rc


__all__ = ["profile_device", "format_report", "plot_report", "profile_entry",
           "add_arguments", "run"]
