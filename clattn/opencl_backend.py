"""One attention spec on one OpenCL device: the device twin of :mod:`clattn.cpu_backend`.

:class:`OpenCLBackend` owns, for one :class:`~clattn.AttentionSpec` on one
:class:`~clattn.device.DeviceSetup`:

* the fitted geometries of the decode, merge, prefill and append kernels;
* every built kernel, each through :meth:`clattn.runtime.Runtime.launcher`;
* the RoPE frequency tables and the scalar arguments the decode and prefill kernels take;
* the split-KV workspace, grown when a plan needs more than any before it, and the
  counters of the decode builds with the merge folded in, grown with the largest batch,
  with the event of their last user that orders every split launch on them;
* the plans' tables on the device;
* the decode-then-merge launch sequence (:meth:`OpenCLBackend.decode_then_merge`).

:class:`~clattn.BatchDecode`, :class:`~clattn.DecodeStep`, :class:`~clattn.BatchPrefill`
and :class:`~clattn.PagedKVCache` hold one and call its public methods.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import numpy as np

from . import runtime, signatures
from .codegen import render_append, render_decode, render_merge, render_prefill
from .device import DeviceSetup, build_fitted
from .device_fit import fit_device
from .fit import (
    DecodeGeometry,
    MergeGeometry,
    PrefillGeometry,
    append_geometry,
    decode_geometry,
    merge_geometry,
    prefill_geometry,
)
from .launch import Launcher
from .plan import Plan
from .rope import kernel_turns, parse_rope_scaling, rope_tables
from .spec import AttentionSpec, default_sm_scale
from .staging import note_allocation

PLANS_KEPT = 8  # plan tables kept on the device per backend
ROPE_KEPT = 16  # RoPE tables kept per backend (a caller varying rope_scale stays bounded)
#: the first long-factor position of a call without RoPE (no row reaches it)
NO_LONG_FROM = 2**31 - 1


class OpenCLBackend:
    """The kernels, tables and workspace of one spec on one device.

    Parameters
    ----------
    spec : AttentionSpec
        The attention every kernel of this backend computes.
    setup : DeviceSetup
        The device's runtime, its fitted profile and its limits (a kernel the driver
        allows fewer work-items per group lowers ``setup.limits``).

    Notes
    -----
    Each geometry is fitted on its first read (:attr:`decode_geometry` with
    :attr:`merge_geometry`, :attr:`prefill_geometry`, :attr:`append_geometry`), so no
    method depends on another having run first; :attr:`decode_notes` and
    :attr:`prefill_notes` are the fits' notes for a caller to show. Building the plain
    decode or the prefill kernel may refit its geometry (:meth:`decode_kernels`). Every
    method may be called from several threads.
    """

    def __init__(self, spec: AttentionSpec, setup: DeviceSetup) -> None:
        self.spec = spec
        self.setup = setup
        self.runtime = setup.runtime
        self._decode_fit: tuple | None = None  # (decode geometry, merge geometry, notes)
        self._prefill_geometry: PrefillGeometry | None = None
        self._append_geometry: MergeGeometry | None = None
        self._lock = threading.Lock()
        # by (sinks compiled in, merge folded in)
        self._decode: dict[tuple[bool, bool], tuple[Launcher, Launcher]] = {}
        self._prefill: Launcher | None = None
        self._fused: dict[tuple[bool, bool], Launcher | bool] = {}  # False: the driver refused it
        self._turns: dict = {}
        self._plan_tables: dict = {}
        self._units: tuple | None = None
        self._ws: tuple | None = None
        self._counters: tuple | None = None  # (ints, buffer) of the folded builds
        self._fold_ok: bool | None = None  # the driver allows the fold build (folds())
        self._ws_last: tuple | None = None  # (event, queue) of the last split launch

    # -- geometries ----------------------------------------------------------------
    def _fitted_decode(self) -> tuple:
        """``(decode geometry, merge geometry, notes)``: the one fit
        (:func:`clattn.device_fit.fit_device`), made by the first read."""
        if self._decode_fit is None:
            spec, setup = self.spec, self.setup
            fit = fit_device(setup.wishes, setup.info, spec, setup.limits)
            self._decode_fit = (fit.geometry, merge_geometry(spec.head_dim_v, spec.dtype,
                                                             setup.profile, setup.limits),
                                fit.notes)
        return self._decode_fit

    @property
    def decode_geometry(self) -> DecodeGeometry:
        """The decode kernel's geometry (refitted by the plain build when the driver
        allows fewer work-items per group)."""
        return self._fitted_decode()[0]

    @decode_geometry.setter
    def decode_geometry(self, geometry: DecodeGeometry) -> None:
        self._decode_fit = (geometry, *self._fitted_decode()[1:])

    @property
    def merge_geometry(self) -> MergeGeometry:
        """The geometry of the kernel that merges split partitions."""
        return self._fitted_decode()[1]

    @property
    def decode_notes(self) -> tuple:
        """Every wish of the profile the decode fit cut, for the device or for the decode
        kernel, with its reason."""
        return self._fitted_decode()[2]

    @property
    def prefill_geometry(self) -> PrefillGeometry:
        """The prefill kernel's geometry (refitted as the decode's by its build)."""
        if self._prefill_geometry is None:
            self._prefill_geometry = prefill_geometry(self.spec, self.setup.profile,
                                                      self.setup.limits)
        return self._prefill_geometry

    @property
    def prefill_notes(self) -> tuple:
        """The prefill kernel's cuts (the device's are ``setup.notes``)."""
        return self.prefill_geometry.notes

    @property
    def append_geometry(self) -> MergeGeometry:
        """The geometry of the KV-cache append and page-copy kernels."""
        if self._append_geometry is None:
            spec, setup = self.spec, self.setup
            self._append_geometry = append_geometry(spec.head_dim, spec.dtype, setup.profile,
                                                    setup.limits)
        return self._append_geometry

    # -- kernels -------------------------------------------------------------------
    def decode_kernels(self, sinks: bool = False, fold: bool = False) -> tuple[Launcher, Launcher]:
        """``(decode, merge)`` for calls with learned sinks (``sinks``) or without, the
        decode with the split merge folded in (``fold``: a split launch of it needs no
        merge launch, :meth:`folds`, :meth:`counters`) or not; built once each. The
        kernels run by calls without sinks carry no sink code where that costs nothing:
        the merge always, and the ``rows`` decode (Intel's CPU compiler loses its best f32
        decode to the epilogue's mere presence); a ``tiled`` decode has one build, with
        the epilogue, for both (:func:`sink_epilogue`). The plain decode is made first: a
        decode kernel the driver allows fewer work-items per group than its geometry asks
        is fitted again to that limit and rebuilt, with one warning
        (:attr:`decode_geometry` then holds the new fit); the other builds take that
        geometry, so every holder of sizes from :attr:`decode_geometry` launches any of
        them (a rows work-group is one work-item; a tiled fold build the driver refuses
        is never launched: :meth:`folds`)."""
        if sinks or fold:
            self.decode_kernels()
        with self._lock:
            hit = self._decode.get((sinks, fold))
            if hit is None:
                rt, spec, setup = self.runtime, self.spec, self.setup

                def build(g: DecodeGeometry) -> Launcher:
                    epilogue = sink_epilogue(g, sinks)
                    return rt.launcher(("decode", spec.key(), g, epilogue, fold),
                                       signatures.DECODE,
                                       lambda: render_decode(spec, g, sinks=epilogue, fold=fold))
                if sinks or fold:  # the geometry the plain build was fitted to
                    decode = build(self.decode_geometry)
                else:
                    decode, self.decode_geometry = build_fitted(
                        setup, self.decode_geometry, build,
                        lambda limits: decode_geometry(spec, setup.profile, limits), "decode")
                mg = self.merge_geometry
                merge = rt.launcher(("merge", spec.head_dim_v, spec.dtype, "float32", mg, sinks),
                                    signatures.MERGE_VARLEN,
                                    lambda: render_merge(spec.head_dim_v, spec.dtype, "float32",
                                                         mg, sinks=sinks))
                hit = self._decode[sinks, fold] = (decode, merge)
            return hit

    def fused_decode_kernel(self, sinks: bool = False, fold: bool = False) -> Launcher | None:
        """The decode kernel with the append fused in (:data:`clattn.signatures.DECODE_APPEND`)
        at the decode geometry, for calls with learned sinks or without and with the split
        merge folded in or not (builds as :meth:`decode_kernels`), built once after
        :meth:`decode_kernels`; None where it does not apply: a byte pool (its append is
        checked first, in a launch of its own), a geometry of several head slices per KV
        head (gdz > 1), or a build the driver allows fewer work-items per group than the
        geometry needs."""
        self.decode_kernels()  # fits the geometry the fused kernel shares
        geom, spec = self.decode_geometry, self.spec
        if spec.byte_pool or geom.gdz > 1:
            return None
        epilogue = sink_epilogue(geom, sinks)
        with self._lock:
            hit = self._fused.get((epilogue, fold))
            if hit is None:
                launcher = self.runtime.launcher(
                    ("decode_append", spec.key(), geom, epilogue, fold), signatures.DECODE_APPEND,
                    lambda: render_decode(spec, geom, fused=True, sinks=epilogue, fold=fold))
                allowed = launcher.work_group_size(self.runtime.device)
                hit = self._fused[epilogue, fold] = (launcher if allowed is None or
                                                     allowed >= geom.threads else False)
            return hit or None

    def prefill_kernel(self) -> Launcher:
        """The prefill kernel, built once; refitted and rebuilt as :meth:`decode_kernels`
        does when the driver allows fewer work-items per group."""
        with self._lock:
            if self._prefill is None:
                rt, spec, setup = self.runtime, self.spec, self.setup
                self._prefill, self._prefill_geometry = build_fitted(
                    setup, self.prefill_geometry,
                    lambda g: rt.launcher(("prefill", spec.key(), g), signatures.PREFILL,
                                          lambda: render_prefill(spec, g)),
                    lambda limits: prefill_geometry(spec, setup.profile, limits), "prefill")
            return self._prefill

    def prefill_kernel_for(self, qb: int) -> tuple[Launcher, PrefillGeometry]:
        """The prefill kernel of plans of ``qb`` queries per unit (the geometry's ``qb``
        or ``qb_long``, as :func:`clattn.prefill.queries_per_unit` chose) and its
        geometry: the fitted one, or the rows kernel built for the longer units, a second
        build made at the first plan that takes them."""
        main = self.prefill_kernel()
        geom = self.prefill_geometry
        if qb == geom.qb:
            return main, geom
        long = replace(geom, qb=qb, qb_long=0)
        spec = self.spec
        return self.runtime.launcher(("prefill", spec.key(), long), signatures.PREFILL,
                                     lambda: render_prefill(spec, long)), long

    def append_kernel(self, table: Any) -> Launcher:
        """The kernel of ``table`` (:data:`~clattn.signatures.APPEND`, ``APPEND_CHECK`` or
        ``PAGE_COPY``) from the append program, built once."""
        spec, geom = self.spec, self.append_geometry
        return self.runtime.launcher(("append", spec.key(), geom), table,
                                     lambda: render_append(spec, geom))

    # -- tables and scalars --------------------------------------------------------
    def rope_buffer(self, rotary_mode: int, theta: float, scale: float) -> tuple[Any, int, float]:
        """``(frequency table buffer, first long-factor position, attention factor)`` of
        RoPE with ``theta`` and ``scale`` (made once, a few kept); without RoPE ``(None,
        NO_LONG_FROM, 1.0)``."""
        if not rotary_mode:
            return None, NO_LONG_FROM, 1.0
        key = (float(theta), float(scale))
        with self._lock:
            hit = self._turns.get(key)
            if hit is None:
                while len(self._turns) >= ROPE_KEPT:
                    self._turns.pop(next(iter(self._turns)))
                cl = runtime.cl()
                spec = self.spec
                scaling = parse_rope_scaling(spec.rope_scaling, spec.max_position_embeddings)
                inv, att, long_from = rope_tables(spec.rotary_dim, float(theta), scaling,
                                                  spec.max_position_embeddings)
                turns = kernel_turns(inv, scale)
                try:
                    buf = cl.Buffer(self.runtime.context,
                                    cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                                    hostbuf=turns)
                except cl.Error as exc:
                    note_allocation(exc, "the RoPE frequency table", turns.nbytes, self.runtime)
                    raise
                hit = self._turns[key] = (buf, int(long_from), float(att))
            return hit

    def scalars(self, rotary_mode: int, rope_theta: float, rope_scale: float,
                sm_scale: float | None) -> dict:
        """The scalar and RoPE-table arguments of the decode and prefill kernels, by name."""
        turns, long_from, att = self.rope_buffer(rotary_mode, rope_theta, rope_scale)
        D = self.spec.head_dim
        return dict(rotary_mode=int(rotary_mode),
                    sm_scale=default_sm_scale(D) if sm_scale is None else float(sm_scale),
                    rope_turns=turns, long_from=long_from, rope_att=att)

    def plan_table(self, plan: Plan, queue: Any) -> Any:
        """The plan's partition table on the device (uploaded once per plan, a few kept)."""
        with self._lock:
            hit = self._plan_tables.get(id(plan))
            if hit is None or hit[0] is not plan:
                try:
                    hit = (plan, runtime.cl().array.to_device(queue, plan.part_indptr))
                except runtime.cl().Error as exc:
                    note_allocation(exc, "the plan's partition table", plan.part_indptr.nbytes,
                                    self.runtime)
                    raise
                self._plan_tables[id(plan)] = hit
                while len(self._plan_tables) > PLANS_KEPT:
                    self._plan_tables.pop(next(iter(self._plan_tables)))
            return hit[1]

    def unit_table(self, plan: Any, queue: Any) -> Any:
        """A prefill plan's unit table on the device: uploaded once for the layers of a
        step (the last plan's is kept)."""
        with self._lock:
            if self._units is None or self._units[0] is not plan:
                try:
                    self._units = (plan, runtime.cl().array.to_device(queue, plan.units))
                except runtime.cl().Error as exc:
                    note_allocation(exc, "the plan's unit table", plan.units.nbytes,
                                    self.runtime)
                    raise
            return self._units[1]

    # -- the split workspace -------------------------------------------------------
    def workspace(self, n_ws: int) -> tuple[Any, Any]:
        """``(partial outputs, partial LSEs)`` buffers for ``n_ws`` split states: the one
        workspace, grown when ``n_ws`` exceeds every earlier request. Every launch that
        uses it goes through :meth:`decode_then_merge`, which orders them on it."""
        with self._lock:
            if self._ws is None or self._ws[0] < n_ws:
                cl = runtime.cl()
                H, D = self.spec.num_qo_heads, self.spec.head_dim_v   # the states' width
                ctx = self.runtime.context
                n = max(n_ws, 1)
                try:
                    self._ws = (n, cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n * H * D * 4),
                                cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n * H * 4))
                except cl.Error as exc:
                    note_allocation(exc, "the split-KV workspace", n * H * (D + 1) * 4,
                                    self.runtime)
                    raise
            return self._ws[1], self._ws[2]

    def folds(self, plan: Plan) -> bool:
        """True when ``plan`` is split and the profile's ``fold_merge`` is on: the call
        launches the decode build with the merge folded in (``fold=True``) alone, with
        :meth:`counters`, through :meth:`decode_then_merge` with ``folded``; and the
        driver allows that build the geometry's work-items per group (else the call keeps
        the merge's own launch; one check covers every fold build: a rows work-group is
        one work-item, and a tiled decode's builds differ only in the fold)."""
        if not (plan.split and self.setup.profile.fold_merge):
            return False
        if self._fold_ok is None:  # a driver may allow the fold build fewer work-items
            decode, _ = self.decode_kernels(fold=True)
            allowed = decode.work_group_size(self.runtime.device)
            self._fold_ok = allowed is None or allowed >= self.decode_geometry.threads
        return self._fold_ok

    def counters(self, batch: int) -> Any:
        """The folded decode builds' counters for a launch of ``batch`` sequences: one int
        per (sequence, KV head, head slice), zero between launches (each launch's last
        partition of a sequence resets its own), made zero and grown with the largest
        batch. Ordered with the workspace by :meth:`decode_then_merge`."""
        geom = self.decode_geometry
        n = max(batch, 1) * self.spec.num_kv_heads * geom.gdz
        with self._lock:
            if self._counters is None or self._counters[0] < n:
                cl = runtime.cl()
                zeros = np.zeros(n, np.int32)
                try:
                    buf = cl.Buffer(self.runtime.context,
                                    cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                    hostbuf=zeros)
                except cl.Error as exc:
                    note_allocation(exc, "the folded merge's counters", zeros.nbytes,
                                    self.runtime)
                    raise
                self._counters = (n, buf)
            return self._counters[1]

    def decode_then_merge(self, queue: Any, waits: list, decode: tuple,
                          merge: tuple | None = None, queue_orders: bool = False,
                          folded: bool = False) -> tuple:
        """Enqueue the decode kernel and, for a split plan, the merge of its partitions
        from the workspace into ``out``/``lse``.

        ``decode`` and ``merge`` are ``(launch, global_size, local_size, args)``: ``launch``
        a :class:`~clattn.launch.Launcher` or a bound kernel's ``launch``, called
        ``launch(queue, global_size, local_size, wait_for, **args)``. ``folded``: a split
        decode of a build with the merge folded in (no ``merge``: it merges itself). A
        split decode (one with ``merge``, or ``folded``) waits for the last user of the
        workspace and counters, except when ``queue_orders`` says ``queue`` is in order
        and that user ran on it. Returns the events, in launch order.
        """
        launch, gsz, lsz, args = decode
        if merge is None and not folded:
            return (launch(queue, gsz, lsz, waits, **args),)
        with self._lock:
            last = self._ws_last
            if last is not None and not (queue_orders and last[1] is queue):
                waits = waits + [last[0]]
            first = launch(queue, gsz, lsz, waits, **args)
            events = (first,)
            if merge is not None:
                launch, gsz, lsz, args = merge
                events += (launch(queue, gsz, lsz, [first], **args),)
            self._ws_last = (events[-1], queue)
        return events


def sink_epilogue(geometry: DecodeGeometry, sinks: bool) -> bool:
    """Whether the decode build for calls with (``sinks``) or without learned sinks has the
    sink epilogue compiled in: with sinks always; without, only a tiled build's (one build
    for both, see :meth:`OpenCLBackend.decode_kernels`); ``geometry``: the decode's."""
    return sinks or geometry.strategy == "tiled"
