"""The tuner's prefill stage: the prefill kernel's parameters over prefill workloads.

:data:`PREFILL_SPACE` lists the Profile fields the prefill kernels read
(:func:`clattn.fit.prefill_geometry`): floats per vector, keys per block and queries per
work-item for the ``rows`` kernel; the row-group shape, keys per tile and queries per
work-group for ``tiled``. None of them changes a decode kernel, so this stage starts from
the decode stage's winner with the registry's prefill fields (the default, the speedups
are relative to it) and moves them alone. :class:`PrefillTuner` runs the decode stage's
coordinate search (:class:`~clattn.tune.search.CoordinateSearch`) over
:class:`~clattn.tune.workloads.PrefillShape` workloads: every new kernel is verified
against the CPU backend (causal and not, on every model) before it is timed; a candidate's
kernel key is its fitted geometry on every model, so a wish the fit cuts to a geometry
already tried is not built again, and one the device cannot hold is skipped with the
fit's reason. Times are the median kernel event time of a call; the winner is timed
again round-robin with the default and kept only if still faster
(:func:`~clattn.tune.search.confirm_verdict`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from .. import runtime
from ..device_fit import fit_device
from ..fit import Limits, prefill_geometry
from ..prefill import BatchPrefill
from ..profiles.record import Profile
from ..profiles.registry import prefill_text
from .checks import PREFILL_NEW, VERIFY_LENGTHS, check_prefill, decoder, make_prefill_case
from .search import (
    Candidate,
    CoordinateSearch,
    Parameter,
    Progress,
    Settings,
    TimedPair,
    TuningResult,
    fits_work_group,
    median_or_pruned,
)
from .timing import event_seconds, first_line, sample
from .workloads import MODELS, PrefillShape, PrefillWorkload, prefill_shapes_for, spec_for


def _fits_rows_vec(value: int, limits: Limits) -> bool:
    # wider vectors than the platform's compiler builds (PoCL's PyPI build: 8) would only
    # be cut back by the fit, or abort the process if they were not
    return value <= limits.rows_max_vec


#: visited in this order (rows: vectors, key blocks, query tiles; tiled: the row-group
#: shape, then the tiles)
PREFILL_SPACE: tuple[Parameter, ...] = (
    Parameter("prefill_vec", (4, 8, 16), ("rows",), allowed=_fits_rows_vec),
    Parameter("prefill_kb", (4, 8, 16), ("rows",)),
    Parameter("prefill_qb", (2, 4, 8, 16, 32), ("rows",)),
    Parameter("prefill_tc", (4, 8, 16, 32), ("tiled",), allowed=fits_work_group),
    Parameter("prefill_rm", (1, 2, 4, 8), ("tiled",)),
    Parameter("prefill_kb", (16, 32, 64), ("tiled",)),
    Parameter("prefill_qb", (4, 8, 16, 32), ("tiled",)),
)
#: the fields this stage moves (and resets to the registry's for its default)
PREFILL_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(p.field for p in PREFILL_SPACE))
#: the geometry attribute that holds each field's fitted value, per strategy
GEOMETRY_OF = {"rows": {"prefill_vec": "vec", "prefill_kb": "kb", "prefill_qb": "qb"},
               "tiled": {"prefill_tc": "tc", "prefill_rm": "rm", "prefill_kb": "kb",
                         "prefill_qb": "qb"}}


def prefill_params_text(p: Profile) -> str:
    """The prefill fields of a profile on one line (``auto``: derived by the fit)."""
    return f"prefill {p.strategy} {prefill_text(p)}"


def prefill_default(chosen: Profile, builtin: Profile) -> Profile:
    """The prefill stage's default: ``chosen`` (the decode stage's winner) with the prefill
    fields of ``builtin`` (the registry's profile)."""
    return chosen.with_(**{f: getattr(builtin, f) for f in PREFILL_FIELDS})


@dataclass(frozen=True)
class PrefillShapeResult(TimedPair):
    """The default and the chosen profile on one prefill shape (median kernel seconds)."""

    shape: PrefillShape

    @property
    def default_gflops(self) -> float | None:
        """FLOPs / default time, GFLOP/s."""
        return self.per_second(self.shape.flops, self.default_s)

    @property
    def tuned_gflops(self) -> float | None:
        """FLOPs / tuned time, GFLOP/s."""
        return self.per_second(self.shape.flops, self.tuned_s)


class PrefillTuner(CoordinateSearch):
    """Coordinate search over :data:`PREFILL_SPACE`; every candidate verified, then timed.

    Parameters
    ----------
    rt : clattn.runtime.Runtime
    info : dict
        ``clattn.profiles.device_info`` of the device.
    base : Profile
        The default (:func:`prefill_default`; the speedups are relative to it).
    settings : Settings
        ``prefill_points``, ``prefill_max_kernels``, ``passes``, ``reps``, ``target_s``,
        ``prune`` and ``quick`` apply.
    progress : Progress
    budget_s : float
        This stage's wall time (NO_BUDGET: none; the rules:
        :class:`~clattn.tune.search.CoordinateSearch`).
    extra_seeds : iterable of (Profile, origin)
        Further starting candidates (the user's current prefill fields).
    space : tuple of Parameter
    clock : callable
        Seconds from an arbitrary origin (default ``time.perf_counter``).
    """

    #: a few shapes, each on its own small pool: the default is timed on all of them
    default_every_shape = True

    def __init__(self, rt: Any, info: dict, base: Profile, settings: Settings,
                 progress: Progress, budget_s: float,
                 extra_seeds: tuple[tuple[Profile, str], ...] = (),
                 space: tuple[Parameter, ...] = PREFILL_SPACE, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(settings, progress, Limits.from_info(info), space,
                         [(base, "default")] + list(extra_seeds), budget_s, clock=clock)
        self.rt, self.info, self.base = rt, info, base
        self.models = list(MODELS)
        self.specs = {m.name: spec_for(m) for m in self.models}
        self.shapes = prefill_shapes_for(settings.prefill_points, self.models)
        self._keys: dict[Any, Candidate] = {}  # kernel key (fitted geometries) -> candidate
        self._built: dict[int, dict[str, BatchPrefill]] = {}  # ok candidates' prefills
        self._workloads: dict[str, PrefillWorkload] = {}
        self._ref: dict[str, tuple] = {}
        self._kernels_tried = 0

    # ---- fit
    def _kernel_key(self, prof: Profile) -> tuple:
        try:
            return tuple(prefill_geometry(self.specs[m.name], prof, self.limits)
                         for m in self.models)
        except ValueError as exc:
            return ("invalid", str(exc))

    def _resolved(self, prof: Profile) -> Profile:
        """``prof`` with each derived (None) prefill field of its strategy set to the value
        the fit gives it on the first model: the search moves from there."""
        key = self._kernel_key(prof)
        if key[0] == "invalid":
            return prof
        geom = key[0]
        return prof.with_(**{f: getattr(geom, a) for f, a in GEOMETRY_OF[geom.strategy].items()
                             if getattr(prof, f) is None})

    def _workload(self, shape: PrefillShape) -> PrefillWorkload:
        if shape.key not in self._workloads:
            self._workloads[shape.key] = PrefillWorkload(
                self.rt, self.specs[shape.model], shape, seed=len(self._workloads) + 41)
        return self._workloads[shape.key]

    def release(self) -> None:
        """Free every device buffer of the workloads."""
        for w in self._workloads.values():
            w.release()
        self._workloads.clear()
        self._built.clear()

    # ---- one candidate
    def _verify(self, pre: BatchPrefill, name: str) -> str | None:
        """None if ``pre`` agrees with the CPU backend (causal and not), else why not."""
        if name not in self._ref:
            self._ref[name] = make_prefill_case(pre.spec, VERIFY_LENGTHS, PREFILL_NEW, seed=5)
        args, kw = self._ref[name]
        for causal in (True, False):
            chk = check_prefill(name, pre, args, dict(kw, causal=causal))
            if not chk.passed:
                return (f"wrong result on {name}{'' if causal else ' (non-causal)'}: max error "
                        f"{chk.max_abs_err:.3g} ({chk.detail})")
        return None

    def _build(self, cand: Candidate, label: str) -> dict[str, BatchPrefill] | None:
        """A verified prefill per model of the shapes left; None (the candidate skipped,
        with the reason) if the fit refuses it, a build fails or a result is wrong."""
        if cand.kernel_key[0] == "invalid":
            cand.status, cand.reason = "skipped", f"not valid on this device: {cand.kernel_key[1]}"
            return None
        models = list(dict.fromkeys(s.model for s in self.shapes))
        pres: dict[str, BatchPrefill] = {}
        for name in models:
            self.progress.update(f"{label}: build + verify {name}")
            try:
                pre = decoder(self.specs[name], self.rt.device, cand.profile, kind=BatchPrefill)
                why = self._verify(pre, name)
            except KeyboardInterrupt:
                raise
            except runtime.BuildError as exc:
                why = "build failed: " + first_line(exc)
            except Exception as exc:  # noqa: BLE001 - any driver error skips the candidate
                why = "failed: " + first_line(exc)
            if why:
                cand.status, cand.reason = "skipped", why
                return None
            pres[name] = pre
        return pres

    def _time(self, pre: BatchPrefill, w: PrefillWorkload, shape: PrefillShape,
              prune: bool = True) -> float | str:
        """Median kernel seconds per call, or a string saying why the candidate was
        dropped (:func:`~clattn.tune.search.median_or_pruned`)."""
        plan = pre.plan(w.qo, w.indptr, w.last)
        return median_or_pruned(lambda: event_seconds(
            pre.run(*w.args(), out=w.out, lse=w.lse, plan=plan).events),
            self._best.get(shape.key) if prune else None, self.settings, shape.key)

    def _setup_bytes(self, shape: PrefillShape) -> int:
        """The bytes of ``shape``'s own pool if its workload is not set up yet."""
        if shape.key in self._workloads:
            return 0
        spec = self.specs[shape.model]
        per_seq = max(1, -(-(shape.new + shape.cached) // spec.page_size))
        return shape.batch * per_seq * spec.layout.page_bytes

    def _setup(self, shape: PrefillShape) -> None:
        self._workload(shape)

    def _measure(self, cand: Candidate, runner: BatchPrefill, shape: PrefillShape,
                 label: str) -> float | str:
        self.progress.update(f"{label}: {shape.key}")
        return self._time(runner, self._workload(shape), shape)

    def evaluate(self, prof: Profile, origin: str, *, force: bool = False) -> Candidate | None:
        """Fit, verify and time ``prof`` on every shape; None for a geometry already tried
        or past a cap or the budget (then listed in ``not_tried``; ``force``: past the
        caps, the seeds)."""
        prof = fit_device(prof, self.info).profile
        kkey = self._kernel_key(prof)
        if kkey in self._keys:
            return None
        why = ""
        if not force:
            why = (f"the cap of {self.settings.prefill_max_kernels} kernels reached"
                   if self._kernels_tried >= self.settings.prefill_max_kernels
                   else self._budget_refusal(True))
        if why:
            self._not_tried(origin, why)
            return None
        t_cand = self._cost_start()
        cand = Candidate(len(self.candidates), prof, origin, kkey)
        self.candidates.append(cand)
        self._keys[kkey] = cand
        self._kernels_tried += 1
        label = f"#{cand.id} {prefill_params_text(prof)}"
        if force and cand.id and self.over_budget():  # a seed after the default: not built
            cand.status, cand.reason = "stopped", self._used_up()
        else:
            pres = self._build(cand, label)
            if pres is not None:
                self._time_shapes(cand, pres, label)
            if cand.status == "ok":
                self._built[cand.id] = pres
            self._cost_end(t_cand)
        self._rescore()
        tail = (f"score {cand.score:.2f}" if cand.score is not None
                else f"{cand.status} ({cand.reason})")
        self.progress.step(f"prefill {label}: {tail}")
        return cand

    # ---- the end
    def confirm(self) -> None:
        """Time the default and the winner again, round-robin, on every shape (after the
        first, only before :meth:`end`); the winner is kept only if still faster
        (:func:`~clattn.tune.search.confirm_verdict`)."""
        best, default = self.best(), self.candidates[0] if self.candidates else None
        self.chosen = best
        if best is None or default is None or default.status != "ok" or best is default:
            return  # nothing to compare
        pair = (default, best)
        times: dict[int, dict[str, float]] = {c.id: {} for c in pair}
        for shape in self.shapes:
            if times[default.id] and self.elapsed() > self.end():
                break
            w = self._workload(shape)
            calls = {}
            for c in pair:
                pre = self._built[c.id][shape.model]
                plan = pre.plan(w.qo, w.indptr, w.last)
                calls[str(c.id)] = (lambda pre=pre, plan=plan: {"kernel": event_seconds(
                    pre.run(*w.args(), out=w.out, lse=w.lse, plan=plan).events)})
            self.progress.update(f"prefill: confirming #{best.id} on {shape.key}")
            res = sample(calls, warmup=1, min_runs=self.settings.reps, max_runs=200,
                         seconds=self.settings.target_s)
            for c in pair:
                times[c.id][shape.key] = res[str(c.id)]["kernel"].median
        self._settle(best, default, times, "prefill confirmed")

    def result(self) -> TuningResult:
        """What was found so far (``per_shape``: :class:`PrefillShapeResult`)."""
        default = self.candidates[0] if self.candidates else None
        ok = default is not None and default.status == "ok"
        chosen = (self.chosen or self.best()) if ok else None
        per_shape = []
        if chosen is not None:
            conf = self.confirmation.times if self.confirmation else {}
            order = {m.name: i for i, m in enumerate(self.models)}
            for s in sorted(self.shapes, key=lambda s: (order[s.model], s.cached, s.new)):
                per_shape.append(PrefillShapeResult(
                    s, conf.get(default.id, {}).get(s.key, default.times.get(s.key)),
                    conf.get(chosen.id, {}).get(s.key, chosen.times.get(s.key))))
        return TuningResult(self.settings, list(self.shapes), dict(self.skipped_shapes),
                            list(self.candidates), self.elapsed(),
                            self.stop_reason or self.kernel_stop, self.confirmation, chosen,
                            default, per_shape, [], self.budget_s,
                            {k: list(v) for k, v in self.not_tried.items()})


__all__ = ["GEOMETRY_OF", "PREFILL_FIELDS", "PREFILL_SPACE", "PrefillShapeResult",
           "PrefillTuner", "prefill_default", "prefill_params_text"]
