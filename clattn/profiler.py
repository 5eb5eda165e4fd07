"""``clattn profile``: what a device can do, whether clattn is right on it, and its best profile.

Five steps, each in the report (terminal table, ``--json``, ``--out FILE``):

1. **Device**: the properties that matter and the registry profile it gets, with the rule.
2. **Ceilings** (:mod:`clattn.bandwidth`, measured as clpeak does): streaming read and copy
   bandwidth, kernel launch latency (event and round trip), host<->device transfers.
3. **Correctness**: decode (plain, split, RoPE, sliding window with sinks) and the merge
   kernels against the CPU fallback (:mod:`clattn.reference`) on this device. A failure is
   loud, nothing is saved and the exit code is 1.
4. **Tuning**: for representative model shapes (Llama-3-8B 32/8/128, Qwen2.5-0.5B 14/2/64,
   f16) at a few (batch, context) points, a bounded coordinate search over the Profile fields
   (kernel fields first, then the split planner's), each candidate verified against the
   fallback before it is timed. The winner is chosen as CLBlast does: the lowest sum over the
   shapes of ``time / best time for that shape``. ``--budget`` bounds the wall time;
   ``--quick`` keeps to a handful of distinct kernels.
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
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from . import reference, runtime
from .profiles.record import Profile

# -- what is measured ------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    name: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int


#: representative shapes: a GQA-4 model with head_dim 128 and a GQA-7 one with head_dim 64
MODELS = (Model("llama-3-8b", 32, 8, 128), Model("qwen2.5-0.5b", 14, 2, 64))
#: (batch, context) points per model
FULL_POINTS = ((1, 1024), (8, 1024), (1, 8192), (8, 8192))
QUICK_POINTS = ((1, 1024), (8, 1024), (1, 8192))
PAGE_SIZE = 16
DTYPE = "float16"

#: the Profile fields the search varies (kernel fields need new kernels; plan fields do not)
KERNEL_FIELDS = ("vec", "tile_rows", "strategy", "thread_limit", "use_local_kv", "reduction")
PLAN_FIELDS = ("wgs_per_cu", "min_partition_rows")
TUNED_FIELDS = KERNEL_FIELDS + ("subgroup_size",) + PLAN_FIELDS
#: the order the coordinate search visits them: the cheap plan fields before the other
#: strategy (rarely a win, and its kernels are the slowest to build and to run)
SEARCH_ORDER = ("vec", "tile_rows", "wgs_per_cu", "min_partition_rows", "strategy",
                "thread_limit", "use_local_kv", "reduction")
GRID: dict[str, tuple] = {
    "strategy": ("rows", "tiled"),
    "vec": (1, 2, 4, 8, 16),
    "tile_rows": (1, 2, 4, 8),
    "thread_limit": (32, 64, 128, 256, 512, 1024),
    "use_local_kv": (True, False),
    "reduction": ("local", "subgroup"),
    "wgs_per_cu": (1, 2, 4, 8, 16),
    "min_partition_rows": (64, 128, 256, 512, 1024, 2048),
}


@dataclass(frozen=True)
class Settings:
    """How hard one run tries (``quick`` or full)."""

    quick: bool
    budget_s: float  # tuning wall time, the final side-by-side re-timing included
    points: tuple = FULL_POINTS
    max_kernels: int = 40  # distinct kernel configurations (each one compiles)
    max_plans: int = 16  # plan-only variations (no compile)
    passes: int = 2  # coordinate-search passes over the fields
    target_s: float = 0.1  # timed calls per repetition last about this long
    reps: int = 5  # repetitions (the best one counts)
    prune: float = 3.0  # a candidate this many times slower than the best on a shape is dropped
    ceiling_bytes: int = 256 << 20
    ceiling_target_s: float = 0.25
    f32_check: bool = True

    @classmethod
    def make(cls, quick: bool, budget: float | None) -> "Settings":
        if quick:
            return cls(True, 20.0 if budget is None else budget, QUICK_POINTS, max_kernels=6,
                       max_plans=3, passes=1, target_s=0.03, reps=3, prune=2.5,
                       ceiling_bytes=128 << 20, ceiling_target_s=0.03, f32_check=False)
        return cls(False, 300.0 if budget is None else budget)


@dataclass(frozen=True)
class Shape:
    """One decode workload: a model at (batch, context), every sequence ``context`` rows."""

    model: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    context: int
    dtype: str = DTYPE
    page_size: int = PAGE_SIZE

    @property
    def key(self) -> str:
        return f"{self.model} B={self.batch} ctx={self.context}"

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def num_pages(self) -> int:
        return self.batch * math.ceil(self.context / self.page_size)

    @property
    def pages_bytes(self) -> int:
        return (self.num_pages * 2 * self.num_kv_heads * self.page_size * self.head_dim
                * self.itemsize)

    @property
    def bytes_moved(self) -> int:
        """K and V rows read, plus q read and out written (lse and tables neglected)."""
        kv = self.batch * self.context * 2 * self.num_kv_heads * self.head_dim * self.itemsize
        return kv + 2 * self.batch * self.num_qo_heads * self.head_dim * self.itemsize


def shapes_for(points: Iterable[tuple[int, int]], models: Iterable[Model] = MODELS) -> list[Shape]:
    """Every (model, batch, context), cheapest first (so slow candidates are pruned early)."""
    out = [Shape(m.name, m.num_qo_heads, m.num_kv_heads, m.head_dim, b, c)
           for m in models for b, c in points]
    return sorted(out, key=lambda s: (s.bytes_moved, s.key))


def _spec(model_or_shape: Any, **kw: Any):
    from .spec import AttentionSpec
    m = model_or_shape
    return AttentionSpec(m.num_qo_heads, m.num_kv_heads, m.head_dim, page_size=PAGE_SIZE,
                         dtype=kw.pop("dtype", DTYPE), **kw)


# -- small helpers ---------------------------------------------------------------------------

def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _first_line(exc: BaseException, n: int = 160) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(exc).__name__
    return line if len(line) <= n else line[: n - 3] + "..."


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


def _write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def _params_text(p: Profile) -> str:
    if p.strategy == "rows":
        return (f"rows vec={p.vec} tile={p.tile_rows} wgs/cu={p.wgs_per_cu} "
                f"minpart={p.min_partition_rows}")
    red = p.reduction + (f"/{p.subgroup_size}" if p.subgroup_size else "")
    return (f"tiled vec={p.vec} tile={p.tile_rows} threads={p.thread_limit} "
            f"local_kv={'y' if p.use_local_kv else 'n'} {red} wgs/cu={p.wgs_per_cu} "
            f"minpart={p.min_partition_rows}")


class Progress:
    """One stderr line: a bar of the time budget, counts and what runs now.

    On a terminal the line is redrawn in place; otherwise one line per finished step.
    """

    def __init__(self, budget_s: float, enabled: bool = True, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.budget = max(budget_s, 1e-9)
        self.t0 = time.perf_counter()
        self._width = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _line(self, text: str) -> str:
        frac = min(1.0, self.elapsed() / self.budget)
        n = int(round(frac * 20))
        bar = "#" * n + "." * (20 - n)
        return f"tuning [{bar}] {self.elapsed():4.0f}/{self.budget:.0f} s  {text}"

    def update(self, text: str) -> None:
        """Transient status (terminal only)."""
        if self.enabled and self.tty:
            line = self._line(text)[:118]
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
            self.stream.flush()

    def step(self, text: str) -> None:
        """A finished step: redrawn on a terminal, one line elsewhere."""
        if not self.enabled:
            return
        if self.tty:
            self.update(text)
        else:
            self.stream.write(self._line(text) + "\n")
            self.stream.flush()

    def done(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


# -- correctness ---------------------------------------------------------------------------

TOL = {"float16": 2e-3, "float32": 1e-4}


@dataclass
class Check:
    """One comparison against the CPU fallback."""

    name: str
    passed: bool
    max_abs_err: float
    tol: float
    detail: str = ""


def compare(got_out: Any, got_lse: Any, ref_out: Any, ref_lse: Any,
            dtype: str) -> tuple[bool, float, str]:
    """(ok, max abs error over out and finite lse, what is wrong) with atol = rtol = TOL[dtype]."""
    tol = TOL[str(np.dtype(dtype))]
    o = np.asarray(got_out, dtype=np.float64)
    r = np.asarray(ref_out, dtype=np.float64)
    s = np.asarray(got_lse, dtype=np.float64)
    rs = np.asarray(ref_lse, dtype=np.float64)
    problems = []
    if o.shape != r.shape or s.shape != rs.shape:
        return False, math.inf, f"shape {o.shape}/{s.shape}, expected {r.shape}/{rs.shape}"
    if np.isnan(o).any() or np.isnan(s).any():
        problems.append(f"NaN in {'out' if np.isnan(o).any() else 'lse'}")
    empty, got_empty = np.isneginf(rs), np.isneginf(s)
    if (empty != got_empty).any():
        problems.append(f"lse -inf at {int((empty != got_empty).sum())} wrong place(s)")
    fin = ~empty & ~got_empty & np.isfinite(s)
    with np.errstate(invalid="ignore"):
        d_o = np.abs(o - r)
        d_s = np.abs(s[fin] - rs[fin])
    err = float(np.nanmax(d_o, initial=0.0))
    err = max(err, float(np.nanmax(d_s, initial=0.0)))
    if np.isnan(d_o).all() and d_o.size:
        err = math.inf
    bad = int((d_o > tol + tol * np.abs(r)).sum()) + int((d_s > tol + tol * np.abs(rs[fin])).sum())
    if bad:
        problems.append(f"{bad} value(s) outside atol=rtol={tol:g}")
    return not problems, err, "; ".join(problems)


def make_case(spec: Any, lengths: list[int], seed: int, *, window: bool = False,
              rope: bool = False) -> tuple[tuple, dict]:
    """A random host batch: positional args and keywords of ``BatchDecode.run``."""
    rng = np.random.default_rng(seed)
    ps, dt = spec.page_size, spec.np_dtype
    B, H, Hkv, D = len(lengths), spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    npages = [(n + ps - 1) // ps for n in lengths]
    total = sum(npages)
    P = total + 2
    q = rng.standard_normal((B, H, D)).astype(dt)
    pages = rng.standard_normal((P, 2, Hkv, ps, D)).astype(dt)
    indices = rng.permutation(P)[:total].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([n - (k - 1) * ps if k else 0 for n, k in zip(lengths, npages)], np.int32)
    kw: dict = {}
    rows = list(lengths)
    if window:
        wo = np.array([n // 3 for n in lengths], np.int32)
        sk = np.array([min(4, int(w)) for w in wo], np.int32)
        kw.update(window_offset=wo, sink_size=sk)
        rows = [n - int(w) + int(s) for n, w, s in zip(lengths, wo, sk)]
    if rope:
        kpo = rng.integers(0, 40, size=B).astype(np.int32)
        kw.update(rotary_mode=1, rope_theta=5e5, k_pos_offset=kpo,
                  q_pos=(kpo + np.array(rows, np.int32)).astype(np.int32))
    return (q, pages, indptr, indices, last), kw


VERIFY_LENGTHS = [0, 1, 45, 200, 333]


def _decode_check(name: str, dec: Any, spec: Any, args: tuple, kw: dict,
                  split: Any = None) -> Check:
    try:
        ro, rl = reference.batch_decode(spec, *args, **kw)
        out, lse, _ = dec.run(*args, **kw, split=split)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return Check(name, False, math.inf, TOL[spec.dtype], _first_line(exc))
    ok, err, why = compare(out, lse, ro, rl, spec.dtype)
    return Check(name, ok, err, TOL[spec.dtype], why)


def correctness(device: Any, *, f32: bool = True) -> list[Check]:
    """Decode and merge on ``device`` (its registry profile) against the CPU fallback."""
    from .decode import BatchDecode
    from .merge import merge_state_, merge_states

    checks: list[Check] = []
    llama, qwen = MODELS
    cases = [
        (llama, {}, dict(), "plain"),
        (qwen, {}, dict(), "plain"),
        (qwen, {}, dict(rope=True), "RoPE"),
        (qwen, {"sliding_window": True}, dict(window=True), "sliding window + sinks"),
        (qwen, {"sliding_window": True}, dict(window=True, rope=True),
         "sliding window + sinks + RoPE"),
    ]
    if f32:
        cases.append((qwen, {"dtype": "float32"}, dict(), "plain"))
    for i, (model, spec_kw, case_kw, what) in enumerate(cases):
        spec = _spec(model, **dict(spec_kw))
        label = (f"decode {spec.dtype.replace('float', 'f')} "
                 f"{spec.num_qo_heads}/{spec.num_kv_heads}/{spec.head_dim} {what}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                dec = BatchDecode(spec, device, backend="opencl").build()
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(label, False, math.inf, TOL[spec.dtype],
                                "build failed: " + _first_line(exc)))
            continue
        args, kw = make_case(spec, VERIFY_LENGTHS, seed=100 + i, **case_kw)
        checks.append(_decode_check(label, dec, spec, args, kw))
        checks.append(_decode_check(label + ", split", dec, spec, args, kw,
                                    split=2 * spec.page_size))
    # merge kernels
    rng = np.random.default_rng(7)
    N, H, D = 6, 4, 64
    for dt in ("float16",):
        v = rng.standard_normal((N, H, D)).astype(dt)
        vo = rng.standard_normal((N, H, D)).astype(dt)
        s = (rng.standard_normal((N, H)) * 4).astype(np.float32)
        so = (rng.standard_normal((N, H)) * 4).astype(np.float32)
        s[0, :] = -np.inf       # this side empty
        so[1, :] = -np.inf      # other side empty
        s[2, :2] = so[2, :2] = -np.inf  # both empty
        label = f"merge_state_ {dt.replace('float', 'f')} [N={N}, H={H}, D={D}]"
        try:
            rv, rs = reference.merge_state(v, s, vo, so)
            gv, gs = v.copy(), s.copy()
            merge_state_(gv, gs, vo, so, device=device)
            ok, err, why = compare(gv, gs, rv, rs, dt)
            checks.append(Check(label, ok, err, TOL[dt], why))
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(label, False, math.inf, TOL[dt], _first_line(exc)))
        K = 3
        vk = rng.standard_normal((N, K, H, D)).astype(dt)
        sk = (rng.standard_normal((N, K, H)) * 4).astype(np.float32)
        sk[0, :, :] = -np.inf
        sk[1, 1:, :] = -np.inf
        label = f"merge_states {dt.replace('float', 'f')} [N={N}, K={K}, H={H}, D={D}]"
        try:
            rv, rs = reference.merge_states(vk, sk)
            gv, gs = merge_states(vk, sk, device=device)
            ok, err, why = compare(gv, gs, rv, rs, dt)
            checks.append(Check(label, ok, err, TOL[dt], why))
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(label, False, math.inf, TOL[dt], _first_line(exc)))
    return checks


# -- tuning --------------------------------------------------------------------------------

@dataclass
class Candidate:
    """One parameter set tried by the tuner."""

    id: int
    profile: Profile
    origin: str
    kernel_key: Any = field(repr=False, default=None)
    status: str = "pending"  # ok | skipped | pruned | stopped
    reason: str = ""
    times: dict = field(default_factory=dict)  # shape key -> seconds per call
    plans: dict = field(default_factory=dict)  # shape key -> plan text
    reused: int = 0  # shapes whose time came from an identical earlier launch
    score: float | None = None

    def params(self) -> dict:
        return {k: getattr(self.profile, k) for k in TUNED_FIELDS}


class _Workload:
    """One shape's device-resident inputs, shared by every candidate."""

    def __init__(self, rt: Any, shape: Shape, seed: int) -> None:
        from . import bandwidth
        cl = runtime.cl()
        import pyopencl.array  # noqa: F401
        q = rt.queue
        rng = np.random.default_rng(seed)
        ps = shape.page_size
        B, H, Hkv, D = shape.batch, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
        P = shape.num_pages
        npg = P // B
        self.indptr = (np.arange(B + 1) * npg).astype(np.int32)
        self.last = np.full(B, shape.context - (npg - 1) * ps, np.int32)
        self.indices = rng.permutation(P).astype(np.int32)  # pages scattered, as in a real pool
        self.pages = cl.array.empty(q, (P, 2, Hkv, ps, D), shape.dtype)
        bandwidth.fill_random(rt, self.pages, seed=seed)
        self.q = cl.array.to_device(q, rng.standard_normal((B, H, D)).astype(shape.dtype))
        self.d_indptr = cl.array.to_device(q, self.indptr)
        self.d_indices = cl.array.to_device(q, self.indices)
        self.d_last = cl.array.to_device(q, self.last)
        self.out = cl.array.empty(q, (B, H, D), shape.dtype)
        self.lse = cl.array.empty(q, (B, H), np.float32)
        q.finish()

    def release(self) -> None:
        for a in (self.pages, self.q, self.d_indptr, self.d_indices, self.d_last, self.out,
                  self.lse):
            try:
                a.base_data.release()
            except Exception:  # noqa: BLE001
                pass


def _plan_sig(plan: Any) -> tuple:
    return (plan.part_rows, plan.num_parts) if plan.split else (0, 1)


class Tuner:
    """Coordinate search over Profile fields; every candidate verified, then timed."""

    def __init__(self, rt: Any, info: dict, base: Profile, settings: Settings,
                 progress: Progress, extra_seeds: Iterable[tuple[Profile, str]] = ()) -> None:
        from .codegen import Limits
        self.rt, self.info, self.settings, self.progress = rt, info, settings, progress
        self.limits = Limits.from_info(info)
        self.models = list(MODELS)
        self.specs = {m.name: _spec(m) for m in self.models}
        self.shapes = [s for s in shapes_for(settings.points, self.models)]
        self.skipped_shapes: dict[str, str] = {}
        max_alloc = int(info.get("max_mem_alloc_size_bytes") or 0)
        glob = int(info.get("global_mem_size_bytes") or 0)
        total = 0
        keep = []
        for s in self.shapes:
            if max_alloc and s.pages_bytes > max_alloc:
                self.skipped_shapes[s.key] = (f"KV pool {s.pages_bytes >> 20} MiB > max allocation "
                                              f"{max_alloc >> 20} MiB")
                continue
            if glob and total + s.pages_bytes > glob // 2:
                self.skipped_shapes[s.key] = "the device's memory is too small for all shapes"
                continue
            total += s.pages_bytes
            keep.append(s)
        self.shapes = keep
        self.base = base
        self.seeds = [(base, "default")] + [(p, o) for p, o in extra_seeds]
        self.candidates: list[Candidate] = []
        self._keys: dict[tuple, Candidate] = {}
        self._kernel_ok: dict[Any, str | None] = {}  # kernel key -> None (verified) or reason
        self._measured: dict[tuple, float] = {}  # (kernel key, shape, plan sig) -> seconds
        self._best: dict[str, float] = {}  # shape key -> best seconds so far
        self._workloads: dict[str, _Workload] = {}
        self._ref: dict[str, tuple] = {}
        self._kernels_tried = 0
        self._kernel_costs: list[float] = []  # seconds each new kernel took, start to end
        self._reserve = 0.0  # seconds kept for confirm(): 4x the default's timing time
        self._plans_tried = 0
        self.stop_reason = ""
        self.kernel_stop = ""
        self.chosen: Candidate | None = None
        self.confirmation: dict = {}
        self.confirmed_times: dict[int, dict[str, float]] = {}
        self.t0 = time.perf_counter()

    # ---- bookkeeping
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def deadline(self) -> float:
        """Seconds into tuning when the search stops: the budget less the re-timing reserve."""
        return self.settings.budget_s - min(self._reserve, 0.5 * self.settings.budget_s)

    def over_budget(self) -> bool:
        return self.elapsed() > self.deadline()

    def _geometry_key(self, prof: Profile) -> tuple:
        from .codegen import decode_geometry, merge_geometry
        geo = []
        for m in self.models:
            spec = self.specs[m.name]
            geo.append(decode_geometry(spec, prof, self.limits))
            geo.append(merge_geometry(spec.head_dim, spec.dtype, prof, self.limits))
        return tuple(geo)

    def _workload(self, shape: Shape) -> _Workload:
        if shape.key not in self._workloads:
            self._workloads[shape.key] = _Workload(self.rt, shape, seed=len(self._workloads) + 11)
        return self._workloads[shape.key]

    def release(self) -> None:
        for w in self._workloads.values():
            w.release()
        self._workloads.clear()

    # ---- one candidate
    def _decoder(self, spec: Any, prof: Profile) -> Any:
        from .decode import BatchDecode
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return BatchDecode(spec, self.rt.device, backend="opencl", profile=prof)

    def _verify(self, dec: Any, spec: Any, name: str) -> str | None:
        """None if ``dec`` agrees with the fallback (split and not), else why not."""
        if name not in self._ref:
            args, kw = make_case(spec, VERIFY_LENGTHS, seed=5)
            self._ref[name] = (args, kw, reference.batch_decode(spec, *args, **kw))
        args, kw, (ro, rl) = self._ref[name]
        for split in (None, 2 * spec.page_size):
            out, lse, _ = dec.run(*args, **kw, split=split)
            ok, err, why = compare(out, lse, ro, rl, spec.dtype)
            if not ok:
                return (f"wrong result on {name}{' (split)' if split else ''}: max error "
                        f"{err:.3g} ({why})")
        return None

    def _time(self, dec: Any, w: _Workload, plan: Any, shape: Shape,
              prune: bool = True) -> float | str:
        """Seconds per call (best repetition), or a string saying why it was dropped."""
        q = self.rt.queue
        cl = runtime.cl()

        def call() -> Any:
            return dec.run(w.q, w.pages, w.d_indptr, w.d_indices, w.d_last, plan=plan,
                           out=w.out, lse=w.lse)

        call()  # warm-up: some drivers (PoCL) finish compiling at the first launch of a size
        q.finish()
        t0 = time.perf_counter()
        call()
        q.finish()
        warm = time.perf_counter() - t0
        best_known = self._best.get(shape.key) if prune else None
        if best_known is not None and warm > 1.5 * self.settings.prune * best_known + 0.002:
            return f"pruned: {warm / best_known:.1f}x the best time on {shape.key}"
        n = int(min(200, max(1, math.ceil(self.settings.target_s / max(warm, 1e-6)))))
        best = math.inf
        for _ in range(self.settings.reps):
            marker = cl.enqueue_marker(q)
            t0 = time.perf_counter()
            res = None
            for _ in range(n):
                res = call()
            q.finish()
            wall = (time.perf_counter() - t0) / n
            try:  # device span: queue reaching the marker -> last kernel done
                span = (res.event.profile.end - marker.profile.start) * 1e-9 / n
                t = span if span > 0 else wall
            except Exception:  # noqa: BLE001 - no profiling info: wall clock
                t = wall
            best = min(best, t)
            if best_known is not None and best > self.settings.prune * best_known:
                return f"pruned: {best / best_known:.1f}x the best time on {shape.key}"
        return best

    def evaluate(self, prof: Profile, origin: str, *, force: bool = False) -> Candidate | None:
        """Fit, verify and time ``prof`` on every shape; None for a duplicate or past a cap."""
        from .profiles import fit
        prof, _ = fit(prof, self.info)
        try:
            kkey = self._geometry_key(prof)
        except ValueError as exc:
            kkey = ("invalid", str(exc))
        plan_vals = tuple(getattr(prof, k) for k in PLAN_FIELDS) + (prof.max_partitions,)
        key = (kkey, plan_vals)
        if key in self._keys:
            return None
        new_kernel = kkey not in self._kernel_ok
        if not force:
            if new_kernel and self._kernels_tried >= self.settings.max_kernels:
                return None
            if not new_kernel and self._plans_tried >= self.settings.max_plans:
                return None
            if self.over_budget():
                self.stop_reason = self.stop_reason or \
                    f"time budget of {self.settings.budget_s:.0f} s used up"
                return None
            if new_kernel and self._kernel_costs:
                cost = sum(self._kernel_costs) / len(self._kernel_costs)
                if self.elapsed() + 0.75 * cost > self.deadline():
                    # no new kernels; plan-only candidates (no build) may still fit
                    self.kernel_stop = self.kernel_stop or (
                        f"time budget of {self.settings.budget_s:.0f} s: not enough left for "
                        f"another kernel (about {cost:.0f} s each to build, verify and time)")
                    return None
        t_cand = time.perf_counter()
        cand = Candidate(len(self.candidates), prof, origin, kkey)
        self.candidates.append(cand)
        self._keys[key] = cand
        if new_kernel:
            self._kernels_tried += 1
        else:
            self._plans_tried += 1
        label = f"#{cand.id} {_params_text(prof)}"
        if kkey[0] == "invalid":
            cand.status, cand.reason = "skipped", f"not valid on this device: {kkey[1]}"
            self._kernel_ok[kkey] = cand.reason
            self.progress.step(f"{label}: skipped ({cand.reason})")
            return cand
        decs: dict[str, Any] = {}
        if new_kernel:
            self._kernel_ok[kkey] = None
        for m in self.models:
            spec = self.specs[m.name]
            self.progress.update(f"{label}: build + verify {m.name}")
            try:
                dec = self._decoder(spec, prof)
                if new_kernel:
                    dec.build()
                    why = self._verify(dec, spec, m.name)
                    if why:
                        self._kernel_ok[kkey] = why
                decs[m.name] = dec
            except KeyboardInterrupt:
                raise
            except runtime.BuildError as exc:
                self._kernel_ok[kkey] = "build failed: " + _first_line(exc)
            except Exception as exc:  # noqa: BLE001 - any driver error skips the candidate
                self._kernel_ok[kkey] = "failed: " + _first_line(exc)
            if self._kernel_ok[kkey]:
                break
        if self._kernel_ok[kkey]:
            cand.status, cand.reason = "skipped", self._kernel_ok[kkey]
            self.progress.step(f"{label}: skipped ({cand.reason})")
            return cand
        for shape in self.shapes:
            if not force and self.over_budget():
                cand.status = "stopped"
                cand.reason = f"time budget of {self.settings.budget_s:.0f} s used up"
                self.stop_reason = self.stop_reason or cand.reason
                break
            dec = decs[shape.model]
            w = self._workload(shape)
            plan = dec.plan(w.indptr, w.last)
            cand.plans[shape.key] = str(plan)
            mkey = (kkey, shape.key, _plan_sig(plan))
            if mkey in self._measured:
                cand.times[shape.key] = self._measured[mkey]
                cand.reused += 1
                continue
            self.progress.update(f"{label}: {shape.key}")
            t_shape = time.perf_counter()
            try:
                t = self._time(dec, w, plan, shape)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001
                t = "failed: " + _first_line(exc)
            if cand.id == 0:  # confirm() times the default and the winner twice each
                self._reserve += 4 * (time.perf_counter() - t_shape)
            if isinstance(t, str):
                if t.startswith("pruned: "):
                    cand.status, cand.reason = "pruned", t[len("pruned: "):]
                else:
                    cand.status, cand.reason = "skipped", t
                break
            self._measured[mkey] = t
            cand.times[shape.key] = t
            self._best[shape.key] = min(self._best.get(shape.key, math.inf), t)
        else:
            cand.status = "ok"
        if new_kernel:
            self._kernel_costs.append(time.perf_counter() - t_cand)
        self._rescore()
        tail = (f"score {cand.score:.2f}" if cand.score is not None
                else f"{cand.status} ({cand.reason})")
        self.progress.step(f"{label}: {tail}")
        return cand

    def _rescore(self) -> None:
        done = [c for c in self.candidates if c.status == "ok"]
        keys = [s.key for s in self.shapes]
        best = {k: min(c.times[k] for c in done) for k in keys} if done else {}
        for c in self.candidates:
            c.score = sum(c.times[k] / best[k] for k in keys) if c.status == "ok" and keys else None

    def best(self) -> Candidate | None:
        ok = [c for c in self.candidates if c.status == "ok" and c.score is not None]
        return min(ok, key=lambda c: (c.score, c.id)) if ok else None

    # ---- the search
    def _values(self, field_: str, current: Profile) -> list:
        vals = list(GRID[field_])
        cur = getattr(current, field_)
        if field_ == "thread_limit":
            cap = min(int(self.info.get("max_work_group_size") or 256),
                      int((self.info.get("max_work_item_sizes") or [256])[0]))
            vals = [v for v in vals if v <= cap]
        if field_ == "reduction" and not self.limits.subgroup_sizes:
            vals = ["local"]
        if isinstance(cur, (int, float)) and not isinstance(cur, bool) and cur in vals:
            # nearest first: a quick run only reaches the neighbours
            vals.sort(key=lambda v: (abs(math.log2(v) - math.log2(cur)), v))
            if self.settings.quick:
                vals = vals[:3]  # the current value and its two nearest neighbours
        return [v for v in vals if v != cur]

    def search(self) -> None:
        for prof, origin in self.seeds:
            self.evaluate(prof, origin, force=True)
        best = self.best()
        if best is None:
            self.stop_reason = "the default profile could not be timed"
            return
        for _ in range(self.settings.passes):
            before = best.id
            for fld in SEARCH_ORDER:
                current = best.profile
                if fld in ("thread_limit", "use_local_kv", "reduction") and \
                        current.strategy != "tiled":
                    continue
                for value in self._values(fld, current):
                    changes = {fld: value}
                    if fld == "reduction":
                        changes["subgroup_size"] = None
                    self.evaluate(current.with_(**changes), f"{fld}={value}")
                    if self.stop_reason:
                        return
                best = self.best() or best
            if best.id == before:
                break

    def confirm(self) -> None:
        """Time the default and the winner again, interleaved, on every shape.

        The search compares candidates measured minutes apart; on a busy machine that
        noise can crown a loser. The winner is kept only if it is still faster here
        (lower summed relative time over the two); else the default stays.
        """
        best, default = self.best(), self.candidates[0] if self.candidates else None
        self.chosen = best
        if best is None or default is None or default.status != "ok":
            return
        pair = [default] if best is default else [default, best]
        times: dict[int, dict[str, float]] = {c.id: {} for c in pair}
        decs = {c.id: {m.name: self._decoder(self.specs[m.name], c.profile)
                       for m in self.models} for c in pair}
        for shape in self.shapes:
            w = self._workload(shape)
            for _ in range(2):
                for c in pair:
                    self.progress.update(f"confirming #{c.id} on {shape.key}")
                    dec = decs[c.id][shape.model]
                    t = self._time(dec, w, dec.plan(w.indptr, w.last), shape, prune=False)
                    times[c.id][shape.key] = min(times[c.id].get(shape.key, math.inf), t)
        fastest = {k: min(times[c.id][k] for c in pair) for k in times[default.id]}
        scores = {c.id: sum(times[c.id][k] / fastest[k] for k in fastest) for c in pair}
        self.confirmation = {"times_ms": {f"#{i}": {k: v * 1e3 for k, v in t.items()}
                                          for i, t in times.items()},
                             "scores": {f"#{i}": v for i, v in scores.items()}}
        if best is not default and scores[best.id] >= scores[default.id]:
            self.chosen = default
            self.confirmation["kept_default"] = (
                f"#{best.id} won the search (score {best.score:.2f}) but was not faster than "
                f"the default when timed again ({scores[best.id]:.2f} vs "
                f"{scores[default.id]:.2f})")
        self.confirmed_times = times
        self.progress.step(f"confirmed: #{self.chosen.id} "
                           f"({', '.join(f'#{i} {v:.2f}' for i, v in scores.items())})")

    def run(self) -> None:
        try:
            self.search()
            try:
                self.confirm()
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - keep the search's answer
                self.chosen = self.best()
                self.confirmation = {"error": _first_line(exc)}
        finally:
            self.release()


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
        _write_atomic(args.out, json.dumps(_jsonable(rep), indent=2) + "\n")
    if args.json:
        print(json.dumps(_jsonable(rep), indent=2))
    else:
        print(format_report(_jsonable(rep)))
    return rc


__all__ = ["MODELS", "Settings", "Shape", "Tuner", "Check", "compare", "correctness",
           "profile_device", "format_report", "plot_report", "profile_entry", "add_arguments",
           "run"]
