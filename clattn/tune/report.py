"""The ``clattn tune`` report as typed data, its text form, its JSON form and its plot."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..device_fit import REPORT_SHAPE
from ..profiles import device_info
from ..profiles.record import Profile
from .ceilings import FMA_LANES, FmaPeak, Latency, Measurement, Transfer
from .checks import Check, KvBytes
from .prefill_search import PrefillShapeResult, prefill_params_text
from .roofline import Roofline, decode_roofline
from .search import ShapeResult, TuningResult, params_text
from .timing import cell, table

#: the device properties the report (and ``clattn devices``) shows: (label, info field)
DEVICE_FIELDS = [
    ("platform", "platform_name"), ("device", "device_name"), ("vendor", "device_vendor"),
    ("type", "device_type"), ("version", "device_version"), ("OpenCL C", "opencl_c_version"),
    ("driver", "driver_version"), ("compute units", "max_compute_units"),
    ("max work-group size", "max_work_group_size"), ("max work-item sizes", "max_work_item_sizes"),
    ("local memory", "local_mem_size_bytes"), ("local memory type", "local_mem_type"),
    ("global memory", "global_mem_size_bytes"), ("max allocation", "max_mem_alloc_size_bytes"),
    ("fp16 (cl_khr_fp16)", "has_fp16"), ("subgroup extensions", "subgroup_extensions"),
    ("sub-group sizes", "sub_group_sizes"),
]


def _value_text(v: Any) -> str:
    if isinstance(v, list):
        return ", ".join(str(x) for x in v) if v else "none"
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 20:
        return f"{v} ({v / (1 << 20):.0f} MiB)"
    return "unknown" if v is None else str(v)


def format_device(info: dict[str, Any]) -> str:
    """What a kernel author needs to know about one device (from ``device_info``)."""
    width = max(len(k) for k, _ in DEVICE_FIELDS)
    return "\n".join(f"  {k:<{width}}  {_value_text(info.get(f))}" for k, f in DEVICE_FIELDS)


def device_report(dev: Any) -> str:
    """:func:`format_device` of a pyopencl device."""
    return format_device(device_info(dev))


# -- the report -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileChoice:
    """A profile the registry picks for the device, fitted to it, and why."""

    name: str
    level: str
    rule: str
    fit_notes: tuple[str, ...]
    profile: Profile


@dataclass
class CeilingsResult:
    """The measured ceilings; ``errors``: name -> why it could not be measured."""

    read: Measurement | None = None
    copy: Measurement | None = None
    launch: Latency | None = None
    transfer: Transfer | None = None
    fma: FmaPeak | None = None
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Report:
    """Everything one ``clattn tune`` run measured.

    ``correctness``: the registry profile's checks; ``tuning``: the decode stage;
    ``prefill``: the prefill stage (from the decode stage's winner); ``winner_checks``: the
    chosen profile's, or None when it is the profile already checked. ``kv_bytes``: pool
    bytes per token of each page format for the shape of the quantized checks.
    """

    date: str
    mode: str
    device: dict[str, Any]
    profile: ProfileChoice
    builtin: ProfileChoice
    ceilings: CeilingsResult
    correctness: list[Check]
    tuning: TuningResult | None = None
    tuning_note: str = ""
    winner_checks: list[Check] | None = None
    step_seconds: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    kv_bytes: KvBytes | None = None
    prefill: TuningResult | None = None
    #: the whole run's time budget (``--budget``; None: none stated)
    budget_s: float | None = None

    @property
    def correctness_passed(self) -> bool:
        """Every check of the registry profile passed."""
        return all(c.passed for c in self.correctness)

    @property
    def winner_passed(self) -> bool:
        """The chosen profile passed (True when it needed no checks of its own)."""
        return self.winner_checks is None or all(c.passed for c in self.winner_checks)

    @property
    def failed_checks(self) -> list[Check]:
        """Every failed check, the winner's included."""
        return [c for c in self.correctness + (self.winner_checks or []) if not c.passed]

    @property
    def chosen(self) -> Profile | None:
        """The tuned profile (the prefill stage's choice, which carries the decode stage's),
        or None when tuning found nothing."""
        c = self.prefill.chosen if self.prefill and self.prefill.chosen else None
        c = c or (self.tuning.chosen if self.tuning else None)
        return c.profile if c else None

    def fraction_of_peak(self, row: PrefillShapeResult) -> float | None:
        """Tuned GFLOP/s of a prefill shape over the median f32 multiply-add peak."""
        fma = self.ceilings.fma
        return row.tuned_gflops / fma.gflops if row.tuned_gflops and fma and fma.gflops else None

    def fraction_of_read(self, row: ShapeResult) -> float | None:
        """Median tuned GB/s over the median read ceiling (like with like)."""
        read = self.ceilings.read
        gbps = row.tuned_gbps
        return gbps / read.median_gbps if gbps and read and read.median_gbps else None

    def roofline(self, row: ShapeResult) -> Roofline | None:
        """The shape's roofline bound on the measured median read bandwidth and multiply-add
        peak (None without a read ceiling)."""
        read, fma = self.ceilings.read, self.ceilings.fma
        if not (read and read.median_gbps):
            return None
        sh = row.shape
        return decode_roofline(batch=sh.batch, context=sh.context,
                               num_qo_heads=sh.num_qo_heads, head_dim=sh.head_dim,
                               bytes_moved=sh.bytes_moved, read_gbps=read.median_gbps,
                               fma_gflops=fma.gflops if fma else None,
                               head_dim_v=sh.head_dim_v)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict: every field, and the derived figures."""
        out = jsonable(self)
        if self.tuning:
            for row, j in zip(self.tuning.per_shape, out["tuning"]["per_shape"]):
                j["fraction_of_read_bw"] = self.fraction_of_read(row)
                roof = self.roofline(row)
                j["roofline"] = None if roof is None else dict(
                    bound=roof.bound, bound_s=roof.bound_s, memory_s=roof.memory_s,
                    compute_s=roof.compute_s, fraction=roof.fraction(row.tuned_s))
        if self.prefill:
            for row, j in zip(self.prefill.per_shape, out["prefill"]["per_shape"]):
                j["fraction_of_fma_peak"] = self.fraction_of_peak(row)
        return out


def jsonable(obj: Any) -> Any:
    """Dataclasses (with their properties), dicts, lists and numbers as JSON values;
    non-finite floats become None, fields marked ``repr=False`` are left out."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.repr}
        for klass in type(obj).__mro__:  # inherited properties too
            for name, attr in vars(klass).items():
                if isinstance(attr, property) and name not in out:
                    out[name] = jsonable(getattr(obj, name))
        return out
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (np.integer, int)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, str) or obj is None:
        return obj
    return str(obj)


# -- text -------------------------------------------------------------------------------------
def _ceiling_lines(c: CeilingsResult) -> list[str]:
    lines = ["", "Ceilings (clattn.tune.ceilings, clpeak's method; best and median repetition)"]
    if c.read:
        lines.append(f"  read bandwidth       {c.read.gbps:.2f} GB/s ({c.read.best}; "
                     f"median {c.read.median_gbps:.2f})")
        if c.read.sizing:
            lines.append(f"                       {c.read.sizing.summary()}")
    if c.copy:
        lines.append(f"  copy bandwidth       {c.copy.gbps:.2f} GB/s read+write ({c.copy.best}; "
                     f"median {c.copy.median_gbps:.2f})")
    if c.launch:
        r = c.launch
        lines.append(f"  launch latency       dispatch {r.queued_to_end_us:.1f} us "
                     f"(event queued->end; empty kernel {r.kernel_us:.1f} us), "
                     f"round trip {r.round_trip_us:.1f} us "
                     f"(enqueue + wait; best {r.round_trip_min_us:.1f})")
    if c.transfer:
        lines.append(f"  transfers            host->device {c.transfer.h2d.gbps:.2f} GB/s, "
                     f"device->host {c.transfer.d2h.gbps:.2f} GB/s")
    if c.fma:
        lines.append(f"  f32 multiply-add     {c.fma.gflops:.1f} GFLOP/s median (best "
                     f"{c.fma.best_gflops:.1f} of {c.fma.repetitions}; {FMA_LANES // c.fma.width} "
                     f"chains of float{c.fma.width} a * b + c)")
    for k, e in c.errors.items():
        lines.append(f"  {k:<20} NOT MEASURED: {e}")
    return lines


def _checks_lines(title: str, checks: list[Check]) -> list[str]:
    rows = [["PASS" if ch.passed else "FAIL", ch.name, cell(ch.max_abs_err, ".2e"),
             f"{ch.tol:g}", ch.detail] for ch in checks]
    return ["", title] + table(["", "check", "max err", "tol", "problem"], rows)


def _candidate_lines(t: TuningResult, title: str = "Tuning",
                     text: Any = params_text) -> list[str]:
    counts: dict[str, int] = {}
    for cd in t.candidates:
        counts[cd.status] = counts.get(cd.status, 0) + 1
    ctext = ", ".join(f"{v} {k}" for k, v in counts.items())
    budget = t.settings.budget_s if t.budget_s is None else t.budget_s
    lines = [f"{title}: {len(t.shapes)} shapes, {len(t.candidates)} candidates ({ctext}), "
             + (f"{t.elapsed_s:.0f} s, no time budget" if math.isinf(budget)
                else f"{t.elapsed_s:.0f} s of a {budget:.0f} s budget")
             + (f"; stopped: {t.stopped}" if t.stopped else "")]
    for k, why in t.skipped_shapes.items():
        lines.append(f"  shape {k} not measured: {why}")
    for why, origins in t.not_tried.items():
        lines.append(f"  not tried ({why}): {', '.join(origins)}")
    for note in t.memory_notes:
        lines.append(f"  memory: {note}")
    best_id = t.chosen.id if t.chosen else None
    rows = [["*" if cd.id == best_id else "", f"#{cd.id}", cd.origin, text(cd.profile),
             cell(cd.score, ".2f"), cd.status + (f": {cd.reason}" if cd.reason else "")]
            for cd in t.candidates]
    lines += table(["", "id", "from", "parameters", "score", "status"], rows, right={4})
    lines.append("  (score: sum over shapes of median kernel time / best time for that shape; "
                 "lower is better)")
    return lines


def _tuned_lines(t: TuningResult, text: Any, how: str) -> list[str]:
    """The chosen parameters, the scores, and the confirmation's verdict."""
    chosen, default, conf = t.chosen, t.default, t.confirmation
    again = ", ".join(f"#{k} {v:.2f}" for k, v in conf.scores.items()) if conf else ""
    lines = [f"  tuned: {text(chosen.profile)} "
             f"(search score {cell(chosen.score, '.2f')} "
             f"vs default {cell(default.score if default else None, '.2f')}"
             + (f"; timed again {how}: {again}" if again else "") + ")"]
    if conf and conf.kept_default:
        lines.append(f"  kept the default: {conf.kept_default}")
    if conf and conf.error:
        lines.append(f"  re-timing failed: {conf.error}")
    return lines


def _per_shape_lines(rep: Report, t: TuningResult) -> list[str]:
    chosen = t.chosen
    lines = ["", f"Default ({rep.builtin.name}) vs tuned (#{chosen.id}) per shape "
                 f"(median kernel time over calls rotating over page sets)"]
    rows = []
    for r in t.per_shape:
        frac = rep.fraction_of_read(r)
        roof = rep.roofline(r)
        rfrac = roof.fraction(r.tuned_s) if roof else None
        rows.append([r.shape.key, cell(r.default_s and r.default_s * 1e3, ".3f"),
                     cell(r.tuned_s and r.tuned_s * 1e3, ".3f"), cell(r.speedup, ".2f") + "x",
                     cell(r.tuned_gbps, ".2f"), cell(frac and 100 * frac, ".0f") + "%",
                     cell(roof and roof.bound_s * 1e3, ".3f"), roof.bound if roof else "-",
                     cell(rfrac and 100 * rfrac, ".0f") + "%", str(r.page_sets)])
    lines += table(["shape", "default ms", "tuned ms", "speedup", "tuned GB/s",
                    "of read BW (medians)", "roofline ms", "bound", "of roofline",
                    "page sets"], rows, right={1, 2, 3, 4, 5, 6, 8, 9})
    lines.append("  (roofline: the larger of bytes moved / median read bandwidth and "
                 "heads x (head_dim + head_dim_v) multiply-adds per row / the median "
                 "multiply-add peak)")
    return lines + _tuned_lines(t, params_text, "side by side")


def _prefill_lines(rep: Report, t: TuningResult) -> list[str]:
    """The prefill stage: its candidates, then default vs tuned per shape."""
    lines = [""] + _candidate_lines(t, "Prefill tuning", prefill_params_text)
    if not (t.per_shape and t.chosen):
        return lines
    chosen = t.chosen
    lines += ["", f"Prefill default vs tuned (#{chosen.id}) per shape (median kernel time)"]
    rows = [[r.shape.key, cell(r.default_s and r.default_s * 1e3, ".3f"),
             cell(r.tuned_s and r.tuned_s * 1e3, ".3f"), cell(r.speedup, ".2f") + "x",
             cell(r.default_gflops, ".1f"), cell(r.tuned_gflops, ".1f"),
             cell(rep.fraction_of_peak(r) and 100 * rep.fraction_of_peak(r), ".0f") + "%"]
            for r in t.per_shape]
    lines += table(["shape", "default ms", "tuned ms", "speedup", "default GFLOP/s",
                    "tuned GFLOP/s", "of f32 FMA peak"], rows, right={1, 2, 3, 4, 5, 6})
    return lines + _tuned_lines(t, prefill_params_text, "round-robin")


def format_report(rep: Report) -> str:
    """The human summary of a report."""
    info = rep.device
    lines = [f"clattn tune ({rep.mode}) of {info.get('device_name')} "
             f"[{info.get('platform_name')}], {rep.date}", "", "Device", format_device(info)]
    p = rep.profile
    lines.append(f"  profile              {p.name} [{p.level}]: {p.rule}")
    lines.append(f"  fit for              {REPORT_SHAPE}")
    lines += [f"  fitted               {n}" for n in p.fit_notes]
    lines += _ceiling_lines(rep.ceilings)
    lines += _checks_lines(f"Correctness vs the CPU backend (profile {p.name})", rep.correctness)
    if rep.kv_bytes:
        lines.append(f"  KV bytes per token per layer, {rep.kv_bytes.summary()}")
    if not rep.correctness_passed:
        bad = [c for c in rep.correctness if not c.passed]
        worst = max(c.max_abs_err for c in bad)
        lines += ["", f"  !!! CORRECTNESS FAILED on this device: {len(bad)} of "
                      f"{len(rep.correctness)} checks, max error {worst:.3g}. Tuning skipped, "
                      f"nothing saved. !!!"]
    lines.append("")
    t = rep.tuning
    if t is None:
        lines.append(f"Tuning {rep.tuning_note or 'not run'}")
    else:
        lines += _candidate_lines(t)
        if t.per_shape and t.chosen:
            lines += _per_shape_lines(rep, t)
    if rep.prefill is not None:
        lines += _prefill_lines(rep, rep.prefill)
    if rep.winner_checks is not None:
        lines += _checks_lines("Correctness of the tuned profile vs the CPU backend",
                               rep.winner_checks)
        if not rep.winner_passed:
            lines += ["", "  !!! THE TUNED PROFILE FAILED its correctness checks: not saved. !!!"]
    elif rep.chosen is not None:
        lines += ["", "The tuned profile is the profile checked above."]
    steps = ", ".join(f"{k} {v:.0f} s" for k, v in rep.step_seconds.items())
    budget = f" of a {rep.budget_s:.0f} s budget" \
        if rep.budget_s is not None and math.isfinite(rep.budget_s) else ""
    lines.append(f"\nTotal {rep.elapsed_s:.0f} s{budget} ({steps}).")
    return "\n".join(lines)


# -- plot -------------------------------------------------------------------------------------
def plot_report(rep: Report, path: str) -> str | None:
    """Draw achieved GB/s against context next to the read ceiling, as a PNG.

    Returns
    -------
    str or None
        None when drawn; else why not (matplotlib missing, nothing to plot). A file that
        cannot be written raises ``OSError``.
    """
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "matplotlib is not installed: pip install clattn[plot]"
    rows = rep.tuning.per_shape if rep.tuning else []
    if not rows:
        return "nothing to plot: no tuning results"
    models = list(dict.fromkeys(r.shape.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    read = rep.ceilings.read
    try:
        for ax, model in zip(axes[0], models):
            mine = [r for r in rows if r.shape.model == model]
            for b in sorted({r.shape.batch for r in mine}):
                pts = sorted((r for r in mine if r.shape.batch == b), key=lambda r: r.shape.context)
                xs = [r.shape.context for r in pts]
                line, = ax.plot(xs, [r.tuned_gbps for r in pts], "o-", label=f"B={b} tuned")
                ax.plot(xs, [r.default_gbps for r in pts], "x--", color=line.get_color(),
                        label=f"B={b} default")
            if read:
                ax.axhline(read.median_gbps, color="k", linestyle=":",
                           label=f"read ceiling {read.median_gbps:.1f} GB/s (median)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("achieved GB/s (KV pool rows + q + out bytes / median kernel time)")
            ax.set_title(model)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize="small")
        fig.suptitle(f"clattn decode on {rep.device.get('device_name')}")
        fig.tight_layout()
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)
    return None


__all__ = ["CeilingsResult", "DEVICE_FIELDS", "ProfileChoice", "Report", "device_report",
           "format_device", "format_report", "jsonable", "plot_report"]
