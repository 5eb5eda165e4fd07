"""One decode launch: what a plan fixes of it, and its bound kernels of every build.

Every decode path (:meth:`clattn.BatchDecode.run`, :class:`~clattn.DecodeStep`, the
one-call short path and the cache's step) launches the decode kernel through this
module, which alone:

* plans a batch's split over the device (:func:`make_plan`), within the device's loop
  budget where it has one (:mod:`clattn.loop_budget`);
* derives from a plan the launch sizes, whether the merge is folded into the decode
  launch (:meth:`clattn.opencl_backend.OpenCLBackend.folds`), the split arguments of the
  decode kernel and the arguments of the merge kernel (:class:`PlanLaunch`);
* chooses the build of a launch: with or without the learned-sink epilogue, with or
  without the merge folded in, with or without the cache's append fused in;
* keeps, for a caller that launches again and again, one bound kernel object per build
  (:class:`DecodeLaunch`), on which a launch sets only what changed;
* enqueues through :meth:`~clattn.opencl_backend.OpenCLBackend.decode_then_merge`.

A new build variant is one edit here plus the backend's build.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .loop_budget import decode_partition_rows
from .plan import Plan, row_weight
from .plan import make_plan as plan_split

#: the decode kernel's split arguments of an unsplit launch
UNSPLIT = dict(ws_o=None, ws_s=None, n_ws=0, part_indptr=None, split=0, part_rows=0,
               counters=None)


def make_plan(opencl: Any, chunk: np.ndarray, split: bool | int | None) -> Plan:
    """The split plan of a batch of ``chunk`` rows per sequence on ``opencl``'s device
    (``split`` as :meth:`clattn.BatchDecode.plan`'s; an empty batch is never split)."""
    if not len(chunk):
        split = False
    setup, spec = opencl.setup, opencl.spec
    wg = len(chunk) * spec.num_kv_heads * opencl.decode_geometry.gdz
    cus = int(setup.info.get("max_compute_units") or 1)
    weight = row_weight(spec.group_size, spec.head_dim, spec.head_dim_v)
    budget = setup.limits.loop_budget
    if budget:  # the bounds read the built kernel's geometry (a build may refit it)
        opencl.decode_kernels()
    cap = decode_partition_rows(spec, opencl.decode_geometry, budget,
                                int(chunk.max()) if len(chunk) else 0, spec.page_size,
                                setup.profile.max_partitions)
    return plan_split(chunk, wg, cus, setup.profile, spec.page_size, split=split,
                      weight=weight, max_rows=cap)


@dataclass(frozen=True)
class PlanLaunch:
    """What ``plan`` fixes of a decode launch over ``batch`` sequences.

    ``sizes``: the decode launch's ``(global, local)``; ``fold``: the decode build with
    the merge folded in runs alone; ``table``: the plan's partition table on the device
    (None unsplit); ``split_args``: the decode kernel's split arguments by name;
    ``merge_sizes`` and ``merge_args`` (less ``out``, ``lse`` and the sinks): the merge
    launch, None unless the plan splits and does not fold.
    """

    plan: Plan
    batch: int
    fold: bool
    sizes: tuple
    table: Any
    split_args: dict
    merge_sizes: tuple | None
    merge_args: dict | None

    def launch(self, opencl: Any, queue: Any, waits: list, named: dict,
               sinks: dict) -> tuple:
        """Enqueue the decode (and merge) kernels built for this launch, unbound, with
        every argument in ``named`` besides the split ones (``sinks``: the sink
        arguments, in ``named`` too); returns the events."""
        decode, merge = opencl.decode_kernels(sinks=sinks["sink_logits"] is not None,
                                              fold=self.fold)
        merging = None if self.merge_args is None else (
            merge, *self.merge_sizes,
            dict(self.merge_args, out=named["out"], lse=named["lse"], **sinks))
        return opencl.decode_then_merge(queue, waits,
                                        (decode, *self.sizes, {**named, **self.split_args}),
                                        merging, folded=self.fold)


def plan_launch(opencl: Any, plan: Plan, batch: int, queue: Any) -> PlanLaunch:
    """The :class:`PlanLaunch` of ``plan`` over ``batch`` sequences; the plan's table is
    uploaded on ``queue`` (once per plan,
    :meth:`~clattn.opencl_backend.OpenCLBackend.plan_table`)."""
    opencl.decode_kernels()  # the plain build first: it may refit the geometry sized here
    spec, geom, split = opencl.spec, opencl.decode_geometry, plan.split
    fold = opencl.folds(plan)
    sizes = (geom.global_size(batch, spec.num_kv_heads, plan.num_parts if split else 1),
             geom.local_size())
    if not split:
        return PlanLaunch(plan, batch, fold, sizes, None, UNSPLIT, None, None)
    table = opencl.plan_table(plan, queue)
    ws_o, ws_s = opencl.workspace(plan.n_ws)
    split_args = dict(ws_o=ws_o, ws_s=ws_s, n_ws=plan.n_ws, part_indptr=table, split=1,
                      part_rows=plan.part_rows,
                      counters=opencl.counters(batch) if fold else None)
    merge_sizes = merge_args = None
    if not fold:
        H = spec.num_qo_heads
        merge_sizes = opencl.merge_geometry.sizes(batch * H, spec.head_dim_v)
        merge_args = dict(vin=(ws_o, 0), sv=(ws_s, 0), indptr=table, fixed_k=-1,
                          skip_single=1, n_states=plan.n_ws, N=batch, H=H)
    return PlanLaunch(plan, batch, fold, sizes, table, split_args, merge_sizes, merge_args)


class DecodeLaunch:
    """Bound decode, merge and (for the cache) fused decode-append kernel objects, one
    per build, over arguments kept between launches.

    Parameters
    ----------
    opencl : OpenCLBackend
        The builds, workspace and launch sequence.
    args : dict
        Every argument of the decode kernel besides the split ones (those of operands set
        per launch may be None).
    fused : dict, optional
        The fused kernel's arguments besides ``args`` (the append's, and any of ``args``
        it takes other values of); None: no fused launch.

    Notes
    -----
    A build's objects are bound by the first launch that needs them, with every
    argument set so far (:meth:`set`, :meth:`set_fused`, :meth:`set_plan` and the
    operands of that launch). Launches are serialised on the object's lock.
    """

    def __init__(self, opencl: Any, args: dict, fused: dict | None = None) -> None:
        self.opencl = opencl
        self._args = dict(args, **UNSPLIT)
        self._fused = None if fused is None else dict(fused)
        self._merge: dict = dict(vin=None, sv=None, indptr=None, fixed_k=-1, skip_single=1,
                                 n_states=0, out=None, lse=None, N=0,
                                 H=opencl.spec.num_qo_heads, sink_logits=None, use_sinks=0)
        self._bound: dict = {}  # (sinks, fold) -> [decode, merge, fused] (None until needed)
        #: the plan's launch set by :meth:`set_plan`
        self.plan: PlanLaunch | None = None
        self.lock = threading.Lock()

    # -- arguments -----------------------------------------------------------------
    def set(self, **named: Any) -> None:
        """Set decode arguments (the fused kernel's too) on every bound build."""
        self._args.update(named)
        for decode, _, fused in self._bound.values():
            if decode is not None:
                decode.set(**named)
            if fused:
                fused.set(**named)

    def set_fused(self, **named: Any) -> None:
        """Set the fused kernel's own arguments on every bound build."""
        self._fused.update(named)
        for _, _, fused in self._bound.values():
            if fused:
                fused.set(**named)

    def set_plan(self, launch: PlanLaunch) -> None:
        """Launch by ``launch`` from now on: its split and merge arguments set on every
        bound build."""
        self.plan = launch
        self.set(**launch.split_args)
        if launch.merge_args is not None:
            self._merge.update(launch.merge_args)
            for _, merge, _ in self._bound.values():
                if merge is not None:
                    merge.set(**launch.merge_args)

    # -- builds --------------------------------------------------------------------
    def fuses(self, sinks: bool) -> bool:
        """True when the build the plan launches with (``sinks``) or without learned
        sinks has a fused decode-append form."""
        if self._fused is None:
            return False
        with self.lock:
            return bool(self.kernels(sinks, self.plan.fold, fused=True)[2])

    def kernels(self, sinks: bool, fold: bool, fused: bool = False, merge: bool = False,
                operands: dict | None = None) -> list:
        """``[decode, merge, fused]`` bound objects of the build with (``sinks``) or
        without the learned-sink epilogue and with (``fold``) or without the merge folded
        in; the decode bound now, the merge when ``merge``, the fused form when ``fused``
        (False where the build has none, None until asked for); ``operands``: arguments
        of the launch at hand, bound with the rest."""
        hit = self._bound.get((sinks, fold))
        if hit is None:
            hit = self._bound[sinks, fold] = [None, None, None]
        if hit[0] is None or (merge and hit[1] is None) or (fused and hit[2] is None):
            decode, merge_k = self.opencl.decode_kernels(sinks=sinks, fold=fold)
            args = {**self._args, **(operands or {})}
            if hit[0] is None:
                hit[0] = decode.bind(**args)
            if merge and hit[1] is None:
                hit[1] = merge_k.bind(**self._merge)
            if fused and hit[2] is None and self._fused is not None:
                launcher = self.opencl.fused_decode_kernel(sinks=sinks, fold=fold)
                hit[2] = False if launcher is None else launcher.bind(**{**args, **self._fused})
        return hit

    @property
    def fused(self) -> Any:
        """The fused kernel object of the build without sinks and fold (bound now; None
        where there is none)."""
        with self.lock:
            return self.kernels(False, False, fused=True)[2] or None

    # -- launching -----------------------------------------------------------------
    def launch(self, queue: Any, waits: list, operands: dict, append: dict | None = None,
               queue_orders: bool = False, plan: PlanLaunch | None = None) -> tuple:
        """Enqueue the plan's decode launch (and merge) over ``operands`` (``q``,
        ``pages``, ``out``, ``lse``, ``sink_logits``, ``use_sinks`` and any other
        argument that changes per launch); ``append``: the fused kernel's ``k`` and ``v``
        (:meth:`fuses` said yes); ``queue_orders``: ``queue`` is in order (as
        :meth:`~clattn.opencl_backend.OpenCLBackend.decode_then_merge`); ``plan``: launch
        by this plan from now on (:meth:`set_plan`, under the launch's lock). Returns the
        events."""
        with self.lock:
            if plan is not None and plan is not self.plan:
                self.set_plan(plan)
            pl = self.plan
            merging = pl.merge_args is not None
            decode, merge, fused = self.kernels(operands["sink_logits"] is not None, pl.fold,
                                                append is not None, merging, operands)
            kernel, args = (decode, operands) if append is None else \
                (fused, {**operands, **append})
            return self.opencl.decode_then_merge(
                queue, waits, (kernel.launch, *pl.sizes, args),
                (merge.launch, *pl.merge_sizes,
                 dict(out=operands["out"], lse=operands["lse"],
                      sink_logits=operands["sink_logits"], use_sinks=operands["use_sinks"]))
                if merging else None, queue_orders=queue_orders, folded=pl.fold)
