"""The ``clattn profile`` search: representative decode workloads and a coordinate tuner.

:class:`Tuner` varies the Profile fields over :data:`MODELS` at a few (batch, context)
points, verifies each new kernel against the CPU fallback (:mod:`clattn.checks`), times it,
and scores candidates as CLBlast does (the sum over shapes of ``time / best time``).
"""
from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from . import reference, runtime
from .profiles.record import Profile

# -- the workload model ----------------------------------------------------------------------


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

def _first_line(exc: BaseException, n: int = 160) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(exc).__name__
    return line if len(line) <= n else line[: n - 3] + "..."


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


# -- the search ----------------------------------------------------------------------------

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
        from .checks import VERIFY_LENGTHS, compare, make_case
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


__all__ = ["MODELS", "Model", "Settings", "Shape", "shapes_for", "Candidate", "Tuner",
           "Progress", "TUNED_FIELDS"]
