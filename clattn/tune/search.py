"""The tuner: a declarative search space and one generic coordinate-search loop.

The space (:data:`SEARCH_SPACE`) is a list of :class:`Parameter`: a Profile field, the
values tried, the strategies whose kernels read it and the device limit it must respect
(the shape of CLBlast's ``TunerSettings``). :class:`Tuner` visits the parameters in order
from the best profile so far, one field at a time. Every new kernel is verified against
the CPU backend before it is timed; times are kernel time from the profiling events of
each call (decode and merge, host overhead excluded), the median over calls that rotate
over page sets spanning at least 4x the largest cache. Candidates are scored as CLBlast
does: the sum over shapes of ``time / best time for that shape``; the winner is timed again
beside the default and kept only if it is still faster. :class:`CoordinateSearch` holds
what this decode stage shares with the prefill stage (:mod:`clattn.tune.prefill_search`):
the loop, the scores, the budget and the confirmation rule (:func:`confirm_verdict`).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from .. import runtime
from ..decode import BatchDecode
from ..device_fit import fit_device
from ..fit import Limits, decode_geometry, merge_geometry
from ..profiles.record import STRATEGIES, Profile
from .ceilings import host_available_bytes, sizing
from .checks import VERIFY_LENGTHS, check_decode, decoder, make_case
from .timing import event_seconds, first_line, sample
from .workloads import (
    FULL_POINTS,
    MLA_MODELS,
    MLA_POINTS,
    MODELS,
    PREFILL_FULL_POINTS,
    PREFILL_QUICK_POINTS,
    QUICK_POINTS,
    DecodeModel,
    PagePool,
    Shape,
    Workload,
    pool_pages,
    shapes_for,
    spec_for,
)

# -- the search space ----------------------------------------------------------------------


def fits_work_group(value: int, limits: Limits) -> bool:
    """Whether ``value`` work-items fit one work-group and its first dimension."""
    return value <= min(limits.max_work_group_size, limits.max_work_item_sizes[0])


def worth_building_vec(value: int, limits: Limits) -> bool:
    """Whether a ``vec`` candidate is worth a build: at least 4 floats, or the device's
    native width where that is less (a GPU's 1 or 2). Narrower vectors on a CPU driver ran
    3-5x slower than the best, and their kernels unroll head_dim into so many statements
    that PyPI's PoCL took minutes to compile DeepSeek-V2-Lite's latent rows at vec 1
    (LLVM's jump threading; tools/RESULTS.md, "Machine E, a fourth stop")."""
    return value >= min(4, limits.native_float)


def _has_subgroups(value: str, limits: Limits) -> bool:
    return value != "subgroup" or bool(limits.subgroup_sizes)


@dataclass(frozen=True)
class Parameter:
    """One axis of the search space.

    ``field``: the :class:`Profile` field; ``values``: what is tried; ``strategies``: the
    strategies whose kernels read it (elsewhere it is not varied); ``kernel``: whether
    it changes the kernel (a build) or only the split plan; ``allowed(value, limits)``:
    the device constraint, if any; ``resets``: fields set along with it.
    """

    field: str
    values: tuple
    strategies: tuple[str, ...] = STRATEGIES
    kernel: bool = True
    allowed: Callable[[Any, Limits], bool] | None = None
    resets: Mapping[str, Any] = field(default_factory=dict)


#: visited in this order: the cheap plan fields before the other strategy (rarely a win,
#: and its kernels are the slowest to build and to run)
SEARCH_SPACE: tuple[Parameter, ...] = (
    Parameter("vec", (1, 2, 4, 8, 16), allowed=worth_building_vec),
    Parameter("tile_rows", (1, 2, 4, 8, 16)),
    Parameter("wgs_per_cu", (1, 2, 4, 8, 16), kernel=False),
    Parameter("min_partition_rows", (64, 128, 256, 512, 1024, 2048), kernel=False),
    Parameter("strategy", STRATEGIES),
    Parameter("thread_limit", (32, 64, 128, 256, 512, 1024), ("tiled",), allowed=fits_work_group),
    Parameter("reduction", ("local", "subgroup"), ("tiled",), allowed=_has_subgroups,
              resets={"subgroup_size": None}),
)
#: the fields a candidate reports
TUNED_FIELDS = tuple(p.field for p in SEARCH_SPACE) + ("subgroup_size",)
PLAN_FIELDS = tuple(p.field for p in SEARCH_SPACE if not p.kernel) + ("max_partitions",)


def values_to_try(param: Parameter, current: Profile, limits: Limits, quick: bool) -> list:
    """The values of ``param`` to try from ``current``: nearest first; in a quick run
    only the two nearest neighbours; never the current value; [] where it does not apply."""
    if current.strategy not in param.strategies:
        return []
    vals = [v for v in param.values if param.allowed is None or param.allowed(v, limits)]
    cur = getattr(current, param.field)
    vals = [v for v in vals if v != cur]
    if isinstance(cur, int) and not isinstance(cur, bool) and cur > 0:
        vals.sort(key=lambda v: (abs(math.log2(v) - math.log2(cur)), v))
        if quick:
            vals = vals[:2]  # the two nearest neighbours
    return vals


# -- settings and progress -------------------------------------------------------------------
#: ``Settings.budget_s`` that switches the time budget off
NO_BUDGET = math.inf


@dataclass(frozen=True)
class Settings:
    """How hard one run tries (``quick`` or full)."""

    quick: bool
    # the whole run's wall time (clattn.tune.budget: ceilings, correctness checks, both
    # tuning stages with their re-timing); NO_BUDGET (math.inf) switches the clock off:
    # the search stops at its caps alone (max_kernels, max_plans, passes), so what it
    # tries does not depend on the machine's speed (the tests)
    budget_s: float
    points: tuple = FULL_POINTS
    # (batch, context) points of the MLA models (workloads.MLA_MODELS); the full settings
    # (make(False)) time MLA_POINTS, quick ones none (their budget is already tight)
    mla_points: tuple = ()
    max_kernels: int = 40  # distinct kernel configurations (each one compiles)
    max_plans: int = 16  # plan-only variations (no compile)
    passes: int = 2  # coordinate-search passes over the fields
    target_s: float = 0.1  # timed calls per shape last about this long
    reps: int = 5  # at least this many timed calls per shape (the median counts)
    prune: float = 3.0  # a candidate this many times slower than the best on a shape is dropped
    ceiling_target_s: float = 0.25
    ceiling_widths: tuple = (1, 2, 4, 8, 16)  # vector widths of the bandwidth kernels
    # the prefill stage (clattn.tune.prefill_search): its (batch, new, cached) points, its
    # cap on distinct kernels and its share of the tuning time (the decode stage stops at
    # the rest; the prefill stage gets what the run has left, clattn.tune.budget)
    prefill_points: tuple = PREFILL_FULL_POINTS
    prefill_max_kernels: int = 12
    prefill_share: float = 0.3
    # the ceilings' share of budget_s (their working sets are capped to fit it)
    ceiling_share: float = 0.1
    # the share of a stage's budget its workloads' setup (allocating and filling the
    # page pools) may take: pools are shrunk to fit it, never below two page sets
    setup_share: float = 0.25

    @classmethod
    def make(cls, quick: bool, budget: float | None) -> "Settings":
        """The quick (``--quick``) or full settings, with ``budget`` seconds if given."""
        if quick:
            return cls(True, 20.0 if budget is None else budget, QUICK_POINTS, max_kernels=6,
                       max_plans=3, passes=1, target_s=0.03, reps=3, prune=2.5,
                       ceiling_target_s=0.03, ceiling_widths=(4, 8, 16),
                       prefill_points=PREFILL_QUICK_POINTS, prefill_max_kernels=3,
                       ceiling_share=0.15)
        return cls(False, 300.0 if budget is None else budget, mla_points=MLA_POINTS)

    @property
    def mode(self) -> str:
        """``"quick"`` or ``"full"``."""
        return "quick" if self.quick else "full"

    @property
    def decode_budget_s(self) -> float:
        """The decode stage's share of :attr:`budget_s` were all of it tuning time (a
        :class:`Tuner` built without its own budget gets it; NO_BUDGET stays NO_BUDGET)."""
        return self.budget_s * (1.0 - self.prefill_share)


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
        """Seconds since the start."""
        return time.perf_counter() - self.t0

    def _line(self, text: str) -> str:
        n = int(round(min(1.0, self.elapsed() / self.budget) * 20))
        return (f"tuning [{'#' * n}{'.' * (20 - n)}] {self.elapsed():4.0f}/{self.budget:.0f} s  "
                f"{text}")

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
        """Clear the line on a terminal."""
        if self.enabled and self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


def params_text(p: Profile) -> str:
    """The tuned fields of a profile on one line."""
    if p.strategy == "rows":
        return (f"rows vec={p.vec} tile={p.tile_rows} wgs/cu={p.wgs_per_cu} "
                f"minpart={p.min_partition_rows}")
    red = p.reduction + (f"/{p.subgroup_size}" if p.subgroup_size else "")
    return (f"tiled vec={p.vec} tile={p.tile_rows} threads={p.thread_limit} "
            f"{red} wgs/cu={p.wgs_per_cu} "
            f"minpart={p.min_partition_rows}")


# -- results --------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One parameter set tried by the tuner; ``times``: shape key -> median seconds."""

    id: int
    profile: Profile
    origin: str
    kernel_key: Any = field(repr=False, default=None)
    status: str = "pending"  # ok | skipped | pruned | stopped
    reason: str = ""
    times: dict[str, float] = field(default_factory=dict)
    plans: dict[str, str] = field(default_factory=dict)  # shape key -> plan text
    reused: int = 0  # shapes whose time came from an identical earlier launch
    score: float | None = None

    def params(self) -> dict[str, Any]:
        """The tuned fields and their values."""
        return {k: getattr(self.profile, k) for k in TUNED_FIELDS}


@dataclass(frozen=True)
class TimedPair:
    """The default and the chosen profile on one shape of a stage (median kernel seconds)."""

    shape: Any
    default_s: float | None
    tuned_s: float | None

    @property
    def speedup(self) -> float | None:
        """default / tuned time."""
        return self.default_s / self.tuned_s if self.default_s and self.tuned_s else None

    @staticmethod
    def per_second(amount: float, seconds: float | None, unit: float = 1e-9) -> float | None:
        """``amount / seconds`` in ``unit`` (default giga), None for a time not measured."""
        return amount / seconds * unit if seconds else None


@dataclass(frozen=True)
class ShapeResult(TimedPair):
    """The default and the chosen profile on one decode shape (median kernel seconds)."""

    shape: Shape
    plan: str = ""
    page_sets: int = 1  # disjoint page sets the timed calls rotated over

    @property
    def default_gbps(self) -> float | None:
        """Bytes moved / default time, GB/s."""
        return self.per_second(self.shape.bytes_moved, self.default_s)

    @property
    def tuned_gbps(self) -> float | None:
        """Bytes moved / tuned time, GB/s."""
        return self.per_second(self.shape.bytes_moved, self.tuned_s)


@dataclass(frozen=True)
class Confirmation:
    """The default and the winner timed again side by side: shape times and scores."""

    times: dict[int, dict[str, float]] = field(default_factory=dict)
    scores: dict[int, float] = field(default_factory=dict)
    kept_default: str = ""
    error: str = ""


@dataclass
class TuningResult:
    """What a :class:`Tuner` found: every candidate, the chosen one, per-shape times."""

    settings: Settings
    shapes: list[Shape]
    skipped_shapes: dict[str, str]
    candidates: list[Candidate]
    elapsed_s: float
    stopped: str = ""
    confirmation: Confirmation | None = None
    chosen: Candidate | None = None
    default: Candidate | None = None
    per_shape: list[ShapeResult] = field(default_factory=list)
    #: how the pools were sized where memory was short (shrunk cold pools)
    memory_notes: list[str] = field(default_factory=list)
    #: this stage's share of the budget (None: ``settings.budget_s``)
    budget_s: float | None = None
    #: candidates the search did not try: why -> their origins (``vec=4``), e.g. the time
    #: budget used up or a cap on kernels reached
    not_tried: dict[str, list[str]] = field(default_factory=dict)


class _Pruned(Exception):
    """A candidate is too slow on a shape to be worth timing further."""


def median_or_pruned(call: Callable[[], float], best_known: float | None,
                     settings: Settings, shape_key: str) -> float | str:
    """Median kernel seconds of ``call`` (one launch, its event seconds) under ``settings``
    (one warm-up, at least ``reps`` runs, about ``target_s``), or ``"pruned: why"``.

    Pruning rule, with ``best_known`` the best time on the shape so far (None: never
    pruned): a warm-up run slower than 1.5 x ``prune`` x the best (plus 2 ms), or a
    fastest timed run slower than ``prune`` x the best, stops the candidate.
    """
    fastest = [math.inf]

    def observe(_: str, result: Mapping[str, float], warm: bool) -> None:
        if best_known is None:
            return
        t = result["kernel"]
        if warm:
            if t > 1.5 * settings.prune * best_known + 0.002:
                raise _Pruned(f"{t / best_known:.1f}x the best time on {shape_key}")
            return
        fastest[0] = min(fastest[0], t)
        if fastest[0] > settings.prune * best_known:
            raise _Pruned(f"{fastest[0] / best_known:.1f}x the best time on {shape_key}")

    try:
        res = sample({"run": lambda: {"kernel": call()}}, warmup=1, min_runs=settings.reps,
                     max_runs=200, seconds=settings.target_s, observe=observe)
    except _Pruned as why:
        return f"pruned: {why}"
    return res["run"]["kernel"].median


def confirm_verdict(best: Candidate, default: Candidate,
                    times: dict[int, dict[str, float]]) -> tuple[Candidate, Confirmation]:
    """The confirmation rule of both stages: the winner of the search is kept only if its
    summed relative time over the shapes timed again (``times``: candidate id -> shape key
    -> seconds) is lower than the default's; else the default. Returns (chosen, record)."""
    pair = [default] if best is default else [default, best]
    fastest = {k: min(times[c.id][k] for c in pair) for k in times[default.id]}
    scores = {c.id: sum(times[c.id][k] / fastest[k] for k in fastest) for c in pair}
    if best is not default and scores[best.id] >= scores[default.id]:
        return default, Confirmation(times, scores, (
            f"#{best.id} won the search (score {best.score:.2f}) but was not faster than "
            f"the default when timed again ({scores[best.id]:.2f} vs "
            f"{scores[default.id]:.2f})"))
    return best, Confirmation(times, scores)


class CoordinateSearch:
    """What the decode and the prefill stages share: candidates and their scores, the
    budget and its reserve, the loop that times a candidate shape by shape, and the
    coordinate-search loop over a :class:`Parameter` space.

    A subclass gives :meth:`evaluate` (fit, build, verify, then :meth:`_time_shapes`),
    :meth:`_measure` (one shape's median seconds), :meth:`_setup_bytes` and
    :meth:`_setup` (a shape's workload), and :meth:`_resolved` where a field's current
    value is derived.

    Budget rules (``budget_s``, measured on ``clock``): the stage ends at :meth:`end`
    (the budget less what ``hold_s`` keeps for the work after it); no new candidate
    starts past :meth:`deadline` (the end less a reserve for the final re-timing); a
    candidate stops between two shapes once past it; a shape whose workload setup (its
    bytes at the measured fill rate) would run past it is not set up; the re-timing stops
    between two shapes once past the end. The default (the first seed) is always timed on
    its first shape (or on every shape: :attr:`default_every_shape`); the shapes it has no
    time for leave the run. What is left out is said: ``skipped_shapes`` (shape -> why),
    ``not_tried`` (why -> the candidates' origins) and each stopped candidate's reason.

    Parameters
    ----------
    settings : Settings
    progress : Progress
    limits : clattn.fit.Limits
    space : tuple of Parameter
    seeds : list of (Profile, origin)
        Evaluated first, past the caps (the first: the default).
    budget_s : float
        This stage's wall time (NO_BUDGET: none).
    fill_rate : float, optional
        Bytes per second a workload's setup runs at before one is measured (None: a
        first setup is not predicted).
    clock : callable
        Seconds from an arbitrary origin (default ``time.perf_counter``).
    hold_s : callable, optional
        Seconds to keep free at the end of the budget for the work after the stage,
        asked at each decision (it may grow as the stage measures; default: none).
    """

    #: the default is timed on every shape whatever the time (a stage whose shapes are few
    #: and cheap to set up: its speedups then cover every shape); else on its first only
    default_every_shape = False

    def __init__(self, settings: Settings, progress: Progress, limits: Limits,
                 space: tuple[Parameter, ...], seeds: list[tuple[Profile, str]],
                 budget_s: float, *, fill_rate: float | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 hold_s: Callable[[], float] | None = None) -> None:
        self.settings, self.progress, self.limits, self.space = settings, progress, limits, space
        self.hold_s = hold_s or (lambda: 0.0)
        self.seeds = seeds
        self.budget_s = budget_s
        self.fill_rate = fill_rate
        self.clock = clock
        self.shapes: list = []
        self.skipped_shapes: dict[str, str] = {}
        self.not_tried: dict[str, list[str]] = {}
        self.candidates: list[Candidate] = []
        self._best: dict[str, float] = {}  # shape key -> best seconds so far
        self._kernel_costs: list[float] = []  # seconds each new kernel took, setups left out
        self._reserve = 0.0  # seconds kept for confirm(): 4x the default's timing time
        self._setups = [0, 0.0]  # bytes set up, seconds it took
        self._builds = [0, 0.0]  # programs new kernels built, seconds their build + verify took
        self.stop_reason = ""
        self.kernel_stop = ""
        self.chosen: Candidate | None = None
        self.confirmation: Confirmation | None = None
        self.t0 = clock()

    def evaluate(self, prof: Profile, origin: str, *, force: bool = False) -> Candidate | None:
        """Verify and time ``prof``; None for a duplicate or past a cap."""
        raise NotImplementedError

    def _resolved(self, prof: Profile) -> Profile:
        """``prof`` with the current values the search moves from (derived ones filled in)."""
        return prof

    def _setup_bytes(self, shape: Any) -> int:
        """Bytes :meth:`_setup` would allocate and fill for ``shape`` now (0: ready)."""
        return 0

    def _setup(self, shape: Any) -> None:
        """Allocate and fill ``shape``'s workload."""

    def _measure(self, cand: Candidate, runner: Any, shape: Any, label: str) -> float | str:
        """Median seconds of ``runner`` (``cand``'s kernel for ``shape``'s model) on
        ``shape``, or a string saying why the candidate was dropped (``"pruned: ..."``)."""
        raise NotImplementedError

    # ---- bookkeeping
    def elapsed(self) -> float:
        """Seconds since the stage began."""
        return self.clock() - self.t0

    def end(self) -> float:
        """Seconds into the stage when it ends: the budget less what ``hold_s`` keeps."""
        return self.budget_s - max(0.0, self.hold_s())

    def deadline(self) -> float:
        """Seconds into the stage when the search stops: :meth:`end` less the re-timing
        reserve."""
        return self.end() - min(self._reserve, 0.5 * self.budget_s)

    def seconds_per_program(self) -> float | None:
        """Seconds a program of a new kernel took to build and verify, on average (None:
        no new program built yet)."""
        programs, seconds = self._builds
        return seconds / programs if programs else None

    def _note_builds(self, programs: int, seconds: float) -> None:
        """Record ``programs`` built (and verified) by a new kernel in ``seconds``."""
        if programs > 0:
            self._builds = [self._builds[0] + programs, self._builds[1] + seconds]

    def over_budget(self) -> bool:
        """Whether the search is past :meth:`deadline`."""
        return self.elapsed() > self.deadline()

    def _budget_text(self) -> str:
        return f"time budget of {self.budget_s:.0f} s"

    def _used_up(self) -> str:
        """The stop reason once the budget is spent (also recorded as ``stop_reason``)."""
        self.stop_reason = self.stop_reason or f"{self._budget_text()} used up"
        return self.stop_reason

    def setup_seconds(self, nbytes: int) -> float:
        """Seconds a setup of ``nbytes`` should take: at the rate the setups so far ran at,
        else ``fill_rate``; 0 when neither is known."""
        done, secs = self._setups
        rate = done / secs if done and secs > 0 else self.fill_rate
        return nbytes / rate if nbytes and rate else 0.0

    def _budget_refusal(self, new_kernel: bool) -> str:
        """Why the time budget has no room for a non-forced candidate ("" if it has): past
        the deadline, or (a new kernel) not room for about as long as the kernels so far
        took on average."""
        if self.over_budget():
            return self._used_up()
        if new_kernel and self._kernel_costs:
            cost = sum(self._kernel_costs) / len(self._kernel_costs)
            if self.elapsed() + 0.75 * cost > self.deadline():
                # no new kernels; plan-only candidates (no build) may still fit
                self.kernel_stop = self.kernel_stop or (
                    f"{self._budget_text()}: not enough left for another kernel (about "
                    f"{cost:.0f} s each to build, verify and time)")
                return self.kernel_stop
        return ""

    def _not_tried(self, origin: str, why: str) -> None:
        origins = self.not_tried.setdefault(why, [])
        if origin not in origins:
            origins.append(origin)

    def _cost_start(self) -> tuple[float, float]:
        """The clock and the setup seconds so far, when a candidate starts."""
        return self.clock(), self._setups[1]

    def _cost_end(self, start: tuple[float, float]) -> None:
        """Record what a new kernel took from ``start`` (:meth:`_cost_start`), the
        workloads' setup left out (done once, not per kernel)."""
        self._kernel_costs.append(self.clock() - start[0] - (self._setups[1] - start[1]))

    def _rescore(self) -> None:
        done = [c for c in self.candidates if c.status == "ok"]
        keys = [s.key for s in self.shapes]
        best = {k: min(c.times[k] for c in done) for k in keys} if done else {}
        for c in self.candidates:
            c.score = sum(c.times[k] / best[k] for k in keys) if c.status == "ok" and keys else None

    def best(self) -> Candidate | None:
        """The candidate with the lowest score (the earliest on a tie)."""
        ok = [c for c in self.candidates if c.status == "ok" and c.score is not None]
        return min(ok, key=lambda c: (c.score, c.id)) if ok else None

    # ---- one candidate, shape by shape
    def _no_time_for(self, shape: Any, runners: Mapping[str, Any]) -> str:
        """Why ``shape`` cannot be timed now ("" if it can): no kernel for its model (the
        default stopped building), the budget spent, or its setup would run past it."""
        if shape.model not in runners or self.over_budget():
            return self._used_up()
        nbytes = self._setup_bytes(shape)
        need = self.setup_seconds(nbytes)
        left = self.deadline() - self.elapsed()
        if need > left:
            return (f"{self._budget_text()}: setting up its workload ({nbytes >> 20} MiB, "
                    f"about {need:.0f} s) does not fit the {max(left, 0.0):.0f} s left")
        return ""

    def _time_shapes(self, cand: Candidate, runners: Mapping[str, Any], label: str) -> None:
        """Time ``cand`` (``runners``: its kernel per model) on every shape, or stop at the
        first that prunes, fails or has no time (:meth:`_no_time_for`). The default runs
        its first shape (every shape: :attr:`default_every_shape`) whatever the time; a
        shape it has no time for leaves the run (said in ``skipped_shapes``), and the
        others are still tried."""
        for shape in list(self.shapes):
            forced = cand.id == 0 and (self.default_every_shape or not cand.times) \
                and shape.model in runners
            why = "" if forced else self._no_time_for(shape, runners)
            if why and cand.id == 0:
                self.skipped_shapes[shape.key] = f"{why} (the default was not timed on it)"
                self.shapes.remove(shape)
                continue
            if why:
                cand.status, cand.reason = "stopped", why
                self.stop_reason = self.stop_reason or why
                return
            try:
                nbytes = self._setup_bytes(shape)
                if nbytes:
                    self.progress.update(f"{label}: setting up {shape.key} ({nbytes >> 20} MiB)")
                    t_setup = self.clock()
                    self._setup(shape)
                    self._setups = [self._setups[0] + nbytes,
                                    self._setups[1] + self.clock() - t_setup]
                t_shape = self.clock()
                t = self._measure(cand, runners[shape.model], shape, label)
                if cand.id == 0:  # confirm() times the default and the winner twice each
                    self._reserve += 4 * (self.clock() - t_shape)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - any driver error drops the candidate
                t = "failed: " + first_line(exc)
            if isinstance(t, str):
                pruned = t.startswith("pruned: ")
                cand.status = "pruned" if pruned else "skipped"
                cand.reason = t[len("pruned: "):] if pruned else t
                return
            cand.times[shape.key] = t
            self._best[shape.key] = min(self._best.get(shape.key, math.inf), t)
        cand.status = "ok"

    # ---- the search
    def search(self) -> None:
        """The seeds, then passes over the search space from the best so far; once the
        budget is spent, the values left in the pass are listed in ``not_tried``."""
        for prof, origin in self.seeds:
            self.evaluate(prof, origin, force=True)
        best = self.best()
        if best is None:
            self.stop_reason = self.stop_reason or "the default profile could not be timed"
            return
        for _ in range(self.settings.passes):
            before = best.id
            for param in self.space:
                current = best.profile
                for value in values_to_try(param, self._resolved(current), self.limits,
                                           self.settings.quick):
                    origin = f"{param.field}={value}"
                    if self.stop_reason:
                        self._not_tried(origin, self.stop_reason)
                        continue
                    self.evaluate(current.with_(**{param.field: value, **param.resets}), origin)
                best = self.best() or best
            if self.stop_reason or best.id == before:
                break

    def confirm(self) -> None:
        """Time the default and the search's winner again (:meth:`_settle` decides)."""
        raise NotImplementedError

    def result(self) -> TuningResult:
        """What was found so far, as typed data."""
        raise NotImplementedError

    def release(self) -> None:
        """Free the device buffers of the workloads."""
        raise NotImplementedError

    def _settle(self, best: Candidate, default: Candidate, times: dict[int, dict[str, float]],
                label: str) -> None:
        """Choose between ``best`` and ``default`` timed again (:func:`confirm_verdict`)."""
        self.chosen, self.confirmation = confirm_verdict(best, default, times)
        scores = ", ".join(f"#{i} {v:.2f}" for i, v in self.confirmation.scores.items())
        self.progress.step(f"{label}: #{self.chosen.id} ({scores})")

    def run(self) -> TuningResult:
        """Search, confirm, free the workloads; the result."""
        try:
            self.search()
            try:
                self.confirm()
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - keep the search's answer
                self.chosen = self.best()
                self.confirmation = Confirmation(error=first_line(exc))
            return self.result()
        finally:
            self.release()


# -- the search ------------------------------------------------------------------------------
def total_bytes(need: Mapping[str, tuple[int, int]], cold: int, sets: int) -> int:
    """Bytes of the pools ``need`` (model -> (pages of its largest set, page bytes)) with
    ``cold`` bytes wished per pool and at least ``sets`` page sets each."""
    return sum(max(pool_pages(n, b, cold), sets * n) * b for n, b in need.values())


def largest_cold(need: Mapping[str, tuple[int, int]], cold: int, room: int, sets: int) -> int:
    """The largest per-pool wish up to ``cold`` (to 1 MiB) whose pools
    (:func:`total_bytes`) fit ``room`` bytes; 0 when none does."""
    lo, hi = 0, cold
    while hi - lo > (1 << 20):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total_bytes(need, mid, sets) <= room else (lo, mid)
    return lo


class Tuner(CoordinateSearch):
    """Coordinate search over :data:`SEARCH_SPACE`; every candidate verified, then timed.

    Parameters
    ----------
    rt : clattn.runtime.Runtime
    info : dict
        ``clattn.profiles.device_info`` of the device.
    base : Profile
        The default (first candidate; the speedups are relative to it).
    settings : Settings
    progress : Progress
    extra_seeds : iterable of (Profile, origin)
        Further starting candidates (the user's current profile).
    space : tuple of Parameter
        The search space.
    budget_s : float, optional
        This stage's wall time (default ``settings.decode_budget_s``).
    fill_rate : float, optional
        Bytes per second the device fills a new buffer at
        (:func:`~clattn.tune.ceilings.fill_rate`): with a budget, the pools are shrunk so
        that filling them takes at most ``settings.setup_share`` of it.
    clock : callable
        Seconds from an arbitrary origin (default ``time.perf_counter``).
    hold_s : callable, optional
        Seconds to keep free at the end of the budget (:class:`CoordinateSearch`).
    """

    def __init__(self, rt: Any, info: dict, base: Profile, settings: Settings,
                 progress: Progress, extra_seeds: Iterable[tuple[Profile, str]] = (),
                 space: tuple[Parameter, ...] = SEARCH_SPACE, *,
                 budget_s: float | None = None, fill_rate: float | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 hold_s: Callable[[], float] | None = None) -> None:
        super().__init__(settings, progress, Limits.from_info(info), space,
                         [(base, "default")] + list(extra_seeds),
                         settings.decode_budget_s if budget_s is None else budget_s,
                         fill_rate=fill_rate, clock=clock, hold_s=hold_s)
        self.rt, self.info = rt, info
        self.models = [DecodeModel.of(m) for m in MODELS] + \
            (list(MLA_MODELS) if settings.mla_points else [])
        self.specs = {m.name: spec_for(m) for m in self.models}
        self._sm_scale = {m.name: m.sm_scale for m in self.models}
        self.cold_bytes = sizing(rt.device).working_set_bytes
        self.memory_notes: list[str] = []
        self._pool_pages: dict[str, int] = {}
        self.shapes = self._fit_shapes(shapes_for(settings.points, MODELS, settings.mla_points))
        self.base = base
        self._keys: dict[tuple, Candidate] = {}
        self._kernel_ok: dict[Any, str | None] = {}  # kernel key -> None (verified) or reason
        self._measured: dict[tuple, float] = {}  # (kernel key, shape, plan sig) -> seconds
        self._pools: dict[str, PagePool] = {}
        self._workloads: dict[str, Workload] = {}
        self._ref: dict[str, tuple] = {}
        self._kernels_tried = 0
        self._plans_tried = 0

    # ---- memory: one pool per model, past every cache where memory allows
    def _room(self) -> int:
        """Bytes all pools may take: half the device's global memory and, for a CPU device
        (its buffers are host memory; PoCL reports a global memory that follows the host's
        free memory), half the host memory available now. 0: unknown."""
        room = int(self.info.get("global_mem_size_bytes") or 0) // 2
        if int(getattr(self.rt.device, "type", 0) or 0) & runtime.cl().device_type.CPU:
            host = host_available_bytes() // 2
            room = min(room, host) if room and host else (room or host)
        return room

    def _fit_shapes(self, shapes: list[Shape]) -> list[Shape]:
        """Keep every shape whose page set fits, then size each model's pool: one page set
        of its largest shape, grown toward :attr:`cold_bytes` (past every cache) as far as
        the room allows, every model's pool shrunk alike before any shape is dropped.
        Shapes are dropped only when their page sets alone do not fit (largest first), and
        each drop is said in ``skipped_shapes``. With a time budget the pools are also
        shrunk alike until filling them fits :meth:`_time_room` (never below two page
        sets each); each shrink is said in ``memory_notes``."""
        max_alloc = int(self.info.get("max_mem_alloc_size_bytes") or 0)
        room = self._room()
        keep = []
        for s in shapes:
            if max_alloc and s.pages_bytes > max_alloc:
                self.skipped_shapes[s.key] = (f"KV pool {s.pages_bytes >> 20} MiB > max allocation "
                                              f"{max_alloc >> 20} MiB")
            else:
                keep.append(s)

        def sets(kept: list[Shape]) -> dict[str, tuple[int, int]]:
            out: dict[str, tuple[int, int]] = {}  # model -> (set pages, page bytes)
            for s in kept:
                out[s.model] = (max(out.get(s.model, (0, 0))[0], s.num_pages), s.page_bytes)
            return out

        while room and keep and sum(n * b for n, b in sets(keep).values()) > room:
            big = max(keep, key=lambda s: (s.pages_bytes, s.key))
            keep.remove(big)
            self.skipped_shapes[big.key] = (
                f"its pages ({big.pages_bytes >> 20} MiB) and the other shapes' do not fit "
                f"the {room >> 20} MiB this device and host can hold")
        need = sets(keep)
        cold = min(self.cold_bytes, max_alloc) if max_alloc else self.cold_bytes

        # pools shrunk for time keep two page sets each (the calls rotate) where memory
        # allows; for memory, one
        two = total_bytes(need, 0, 2)
        floor_sets = 2 if (not room or two <= room) and \
            (not max_alloc or all(2 * n * b <= max_alloc for n, b in need.values())) else 1
        wish = cold
        if room and total_bytes(need, cold, 1) > room:
            cold = largest_cold(need, cold, room, 1)
            self.memory_notes.append(
                f"pools shrunk to {cold >> 20} MiB each (wanted {wish >> 20} MiB, past every "
                f"cache) to fit the {room >> 20} MiB this device and host can hold: timings "
                f"of small shapes may include cached reads")
        time_room = self._time_room()
        if time_room and total_bytes(need, cold, floor_sets) > time_room:
            cold = largest_cold(need, cold, time_room, floor_sets)
            self.memory_notes.append(
                f"pools shrunk to {cold >> 20} MiB each (wanted {wish >> 20} MiB, past every "
                f"cache) so that filling them takes at most "
                f"{self.settings.setup_share:.0%} of the {self._budget_text()} at the "
                f"{self.fill_rate / 1e6:.0f} MB/s this device fills memory: timings of "
                f"small shapes may include cached reads")
        else:
            floor_sets = 1
        self._pool_pages = {m: max(pool_pages(n, b, cold), floor_sets * n)
                            for m, (n, b) in need.items()}
        return keep

    def _time_room(self) -> int:
        """Bytes the pools may take to fill in ``settings.setup_share`` of the budget at
        ``fill_rate`` (0: no limit, without a budget or a rate)."""
        if not self.fill_rate or not math.isfinite(self.budget_s):
            return 0
        return max(1, int(self.fill_rate * self.settings.setup_share * self.budget_s))

    def _workload(self, shape: Shape) -> Workload:
        if shape.model not in self._pools:
            self._pools[shape.model] = PagePool(self.rt, self.specs[shape.model],
                                                self._pool_pages[shape.model],
                                                seed=len(self._pools) + 11)
        if shape.key not in self._workloads:
            self._workloads[shape.key] = Workload(self.rt, self._pools[shape.model], shape.batch,
                                                  shape.context, seed=len(self._workloads) + 31,
                                                  sm_scale=shape.sm_scale)
        return self._workloads[shape.key]

    def release(self) -> None:
        """Free every device buffer of the workloads."""
        for w in self._workloads.values():
            w.release()
        for p in self._pools.values():
            p.release()
        self._workloads.clear()
        self._pools.clear()

    # ---- bookkeeping
    def _kernel_key(self, prof: Profile) -> tuple:
        try:
            return tuple(g for m in self.models for g in (
                decode_geometry(self.specs[m.name], prof, self.limits),
                merge_geometry(self.specs[m.name].head_dim_v, self.specs[m.name].dtype, prof,
                               self.limits)))
        except ValueError as exc:
            return ("invalid", str(exc))

    # ---- one candidate
    def _decoder(self, spec: Any, prof: Profile) -> BatchDecode:
        return decoder(spec, self.rt.device, prof, build=False)

    def _verify(self, dec: BatchDecode, name: str) -> str | None:
        """None if ``dec`` agrees with the CPU backend (split and not), else why not."""
        if name not in self._ref:
            args, kw = make_case(dec.spec, VERIFY_LENGTHS, seed=5)
            self._ref[name] = args, {**kw, "sm_scale": self._sm_scale[name]}
        args, kw = self._ref[name]
        for split in (None, 2 * dec.spec.page_size):
            chk = check_decode(name, dec, args, kw, split=split)
            if not chk.passed:
                return (f"wrong result on {name}{' (split)' if split else ''}: max error "
                        f"{chk.max_abs_err:.3g} ({chk.detail})")
        return None

    def _time(self, dec: BatchDecode, w: Workload, plan: Any, shape: Shape,
              prune: bool = True) -> float | str:
        """Median kernel seconds per call (events of the decode and its merge), or a
        string saying why the candidate was dropped."""
        def call() -> float:
            res = dec.run(*w.args(), **w.kw, plan=plan, out=w.out, lse=w.lse)
            return event_seconds(getattr(res, "events", (res.event,)))

        return median_or_pruned(call, self._best.get(shape.key) if prune else None,
                                self.settings, shape.key)

    def _refusal(self, new_kernel: bool) -> str:
        """Why a non-forced candidate is not tried ("" if it is): a cap or the budget."""
        if new_kernel and self._kernels_tried >= self.settings.max_kernels:
            return f"the cap of {self.settings.max_kernels} kernels reached"
        if not new_kernel and self._plans_tried >= self.settings.max_plans:
            return f"the cap of {self.settings.max_plans} plan variations reached"
        return self._budget_refusal(new_kernel)

    def _build(self, cand: Candidate, new_kernel: bool,
               label: str) -> dict[str, BatchDecode] | None:
        """A decoder per model (new kernels built and verified); None if the kernel failed."""
        kkey = cand.kernel_key
        if kkey[0] == "invalid":
            self._kernel_ok[kkey] = f"not valid on this device: {kkey[1]}"
        decs: dict[str, BatchDecode] = {}
        if new_kernel and kkey[0] != "invalid":
            self._kernel_ok[kkey] = None
        # the models of the shapes left, the first shape's first: a candidate stops
        # building between two models once the budget is spent (the default's shapes of
        # models it did not build are dropped by _time_shapes; another candidate stops
        # there), so a slow compiler holds the budget by one model's kernel at most
        first = {}
        for shape in self.shapes:
            first.setdefault(shape.model, len(first))
        models = sorted((m for m in self.models if m.name in first), key=lambda m: first[m.name])
        for m in models:
            if self._kernel_ok[kkey] or (decs and self.over_budget()):
                break
            self.progress.update(f"{label}: build + verify {m.name}")
            t_build, built = self.clock(), self.rt.programs_built
            try:
                dec = self._decoder(self.specs[m.name], cand.profile)
                if new_kernel:
                    self._kernel_ok[kkey] = self._verify(dec.build(), m.name)
                    self._note_builds(self.rt.programs_built - built, self.clock() - t_build)
                decs[m.name] = dec
            except KeyboardInterrupt:
                raise
            except runtime.BuildError as exc:
                self._kernel_ok[kkey] = "build failed: " + first_line(exc)
            except Exception as exc:  # noqa: BLE001 - any driver error skips the candidate
                self._kernel_ok[kkey] = "failed: " + first_line(exc)
        if self._kernel_ok[kkey]:
            cand.status, cand.reason = "skipped", self._kernel_ok[kkey]
            return None
        if cand.id and len(decs) < len(models):  # stopped between two models: not verified
            del self._kernel_ok[kkey]
            cand.status, cand.reason = "stopped", self._used_up()
            return None
        return decs

    def _setup_bytes(self, shape: Shape) -> int:
        """The pool's bytes if ``shape``'s model has none yet (a workload's tables are small)."""
        if shape.model in self._pools:
            return 0
        return self._pool_pages[shape.model] * self.specs[shape.model].layout.page_bytes

    def _setup(self, shape: Shape) -> None:
        self._workload(shape)

    def _measure(self, cand: Candidate, runner: BatchDecode, shape: Shape,
                 label: str) -> float | str:
        """Median seconds of ``cand`` on ``shape`` (an identical earlier launch reused)."""
        w = self._workload(shape)
        plan = runner.plan(w.indptr, w.last)
        cand.plans[shape.key] = str(plan)
        mkey = (cand.kernel_key, shape.key,
                (plan.part_rows, plan.num_parts) if plan.split else (0, 1))
        if mkey in self._measured:
            cand.reused += 1
            return self._measured[mkey]
        self.progress.update(f"{label}: {shape.key}")
        t = self._time(runner, w, plan, shape)
        if not isinstance(t, str):
            self._measured[mkey] = t
        return t

    def evaluate(self, prof: Profile, origin: str, *, force: bool = False) -> Candidate | None:
        """Fit, verify and time ``prof`` on every shape; None for a duplicate or past a cap
        or the budget (then listed in ``not_tried``).

        ``force``: past the caps and the budget (the seeds).
        """
        prof = fit_device(prof, self.info).profile
        kkey = self._kernel_key(prof)
        key = (kkey, tuple(getattr(prof, k) for k in PLAN_FIELDS))
        if key in self._keys:
            return None
        new_kernel = kkey not in self._kernel_ok
        why = "" if force else self._refusal(new_kernel)
        if why:
            self._not_tried(origin, why)
            return None
        t_cand = self._cost_start()
        cand = Candidate(len(self.candidates), prof, origin, kkey)
        self.candidates.append(cand)
        self._keys[key] = cand
        if force and cand.id and self.over_budget():  # a seed after the default: not built
            cand.status, cand.reason = "stopped", self._used_up()
            return cand
        if new_kernel:
            self._kernels_tried += 1
        else:
            self._plans_tried += 1
        label = f"#{cand.id} {params_text(prof)}"
        decs = self._build(cand, new_kernel, label)
        if decs is not None:
            self._time_shapes(cand, decs, label)
        if new_kernel:
            self._cost_end(t_cand)
        self._rescore()
        tail = (f"score {cand.score:.2f}" if cand.score is not None
                else f"{cand.status} ({cand.reason})")
        self.progress.step(f"{label}: {tail}")
        return cand

    def confirm(self) -> None:
        """Time the default and the winner again, interleaved, on every shape.

        The search compares candidates measured minutes apart; on a busy machine that
        noise can crown a loser. The winner is kept only if it is still faster here
        (lower summed relative time over the shapes timed again); else the default
        stays. Shapes after the first are timed again only before :meth:`end`.
        """
        best, default = self.best(), self.candidates[0] if self.candidates else None
        self.chosen = best
        if best is None or default is None or default.status != "ok":
            return
        if best is default and self.elapsed() > self.end():
            return  # nothing to compare, and no time left to time the default again
        pair = [default] if best is default else [default, best]
        times: dict[int, dict[str, float]] = {c.id: {} for c in pair}
        decs = {c.id: {m.name: self._decoder(self.specs[m.name], c.profile)
                       for m in self.models} for c in pair}
        for shape in self.shapes:
            if times[default.id] and self.elapsed() > self.end():
                break
            w = self._workload(shape)
            for _ in range(2):
                for c in pair:
                    self.progress.update(f"confirming #{c.id} on {shape.key}")
                    dec = decs[c.id][shape.model]
                    t = self._time(dec, w, dec.plan(w.indptr, w.last), shape, prune=False)
                    times[c.id][shape.key] = min(times[c.id].get(shape.key, math.inf), t)
        self._settle(best, default, times, "confirmed")

    def result(self) -> TuningResult:
        """What was found so far, as typed data."""
        default = self.candidates[0] if self.candidates else None
        chosen = self.chosen or self.best()
        per_shape = []
        if chosen is not None and default is not None and default.status == "ok":
            conf = self.confirmation.times if self.confirmation else {}
            order = {m.name: i for i, m in enumerate(self.models)}
            for s in sorted(self.shapes, key=lambda s: (order[s.model], s.context, s.batch)):
                per_shape.append(ShapeResult(
                    s, conf.get(default.id, {}).get(s.key, default.times.get(s.key)),
                    conf.get(chosen.id, {}).get(s.key, chosen.times.get(s.key)),
                    chosen.plans.get(s.key, ""),
                    self._workloads[s.key].n_sets if s.key in self._workloads else 1))
        return TuningResult(self.settings, list(self.shapes), dict(self.skipped_shapes),
                            list(self.candidates), self.elapsed(),
                            self.stop_reason or self.kernel_stop, self.confirmation,
                            chosen if default is not None and default.status == "ok" else None,
                            default, per_shape, list(self.memory_notes), self.budget_s,
                            {k: list(v) for k, v in self.not_tried.items()})


__all__ = ["Candidate", "Confirmation", "CoordinateSearch", "NO_BUDGET", "Parameter", "Progress",
           "SEARCH_SPACE", "Settings", "ShapeResult", "TUNED_FIELDS", "TimedPair", "Tuner",
           "TuningResult", "confirm_verdict", "fits_work_group", "median_or_pruned",
           "params_text", "values_to_try"]
