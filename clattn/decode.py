"""The app-facing decode API: build once per model configuration, run per layer."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import cpu_backend, host_memory
from .codegen import render_decode
from .decode_fast import OneCallPath
from .decode_launch import make_plan as make_decode_plan
from .decode_launch import plan_launch
from .decode_step import DecodeStep
from .device import DeviceSetup, open_backend, warn_notes
from .fit import DecodeGeometry, MergeGeometry
from .loop_budget import plan_within
from .numbers import is_int
from .opencl_backend import OpenCLBackend, sink_epilogue
from .plan import Plan, make_plan
from .profiles.record import Profile
from .result import AttentionResult
from .spec import INDEX_DTYPE, INT32_MAX, LSE_DTYPE, AttentionSpec
from .staging import Call, check_host_call, run_on_host, sink_args, upload_tables
from .validate import (
    check_array,
    check_decode,
    check_sink_logits,
    check_tables,
    chunk_lengths,
    host_copy,
    is_host,
)

_CPU_PROFILE = Profile(name="cpu-backend", strategy="rows")


class BatchDecode:
    """Paged-KV decode attention for one model configuration on one device.

    Parameters
    ----------
    spec : AttentionSpec
        Heads, head_dim, page size, dtype and the compiled-in features (window,
        soft-cap, RoPE scaling).
    device : None, str, pyopencl.Device, pyopencl.Context or pyopencl.CommandQueue
        None: ``PYOPENCL_CTX`` or the default device; a name fragment such as
        ``"pocl"``, ``"intel"``, ``"oclgrind"``, or ``"P:D"`` indices.
    backend : {"auto", "opencl", "cpu"}
        ``"auto"``: OpenCL when a device exists, else the numpy CPU backend with one
        warning.
    profile : None, str, Profile or dict
        None: the registry's profile for the device; a profile name; a
        :class:`~clattn.profiles.Profile`; or a dict of fields over the registry's choice.

    Examples
    --------
    >>> dec = BatchDecode(AttentionSpec(32, 8, 128, dtype="float16"))   # doctest: +SKIP
    >>> plan = dec.plan(page_indptr, last_page_len)                     # doctest: +SKIP
    >>> out, lse, event = dec.run(q, pages, page_indptr, page_indices,
    ...                           last_page_len, plan=plan)             # doctest: +SKIP
    """

    def __init__(self, spec: AttentionSpec, device: Any = None, *, backend: str = "auto",
                 profile: Any = None) -> None:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        self.spec = spec
        self.setup: DeviceSetup | None = open_backend(device, backend, profile)
        self.backend = "opencl" if self.setup else "cpu"
        #: the kernels, tables and workspace on the device (None on the CPU backend)
        self.opencl: OpenCLBackend | None = None
        self._one_call: OneCallPath | None = None  # the short path's kept state (first use)
        if self.setup:
            self.opencl = OpenCLBackend(spec, self.setup)
            warn_notes(self.opencl.decode_notes, stacklevel=2)

    # -- introspection -------------------------------------------------------------
    @property
    def profile(self) -> Profile | None:
        """The fitted profile this decoder runs (None on the CPU backend)."""
        return self.setup.profile if self.setup else None

    @property
    def geometry(self) -> DecodeGeometry:
        """The decode kernel's fitted geometry (refitted if the built kernel allows fewer
        work-items per group than it asked)."""
        return self.opencl.decode_geometry

    @property
    def merge_geometry(self) -> MergeGeometry:
        """The geometry of the kernel that merges split partitions."""
        return self.opencl.merge_geometry

    def source(self, sinks: bool = False) -> str:
        """The OpenCL C of the decode kernel this object runs (rendered for its device's
        profile): for calls with learned sinks (``sinks``) or without."""
        if not self.setup:
            raise RuntimeError("the CPU backend runs numpy code, not OpenCL")
        geom = self.geometry
        return render_decode(self.spec, geom, sinks=sink_epilogue(geom, sinks))

    def empty_pages(self, num_pages: int) -> Any:
        """An uninitialised page pool for this decoder, ``spec.pool_shape(num_pages)``.

        A device array; on a CPU device, one of at least 2 MiB is advised huge pages
        before first use (:mod:`clattn.host_memory`: 1.1-1.3x faster decode on PoCL over
        large pools). On the CPU backend, a numpy array.

        Parameters
        ----------
        num_pages : int
            Pages in the pool (>= 1).

        Returns
        -------
        pyopencl.array.Array or numpy.ndarray
        """
        if not is_int(num_pages) or num_pages < 1:
            raise ValueError(f"num_pages={num_pages!r}: must be an integer >= 1")
        shape = self.spec.pool_shape(int(num_pages))
        if not self.setup:
            return np.empty(shape, self.spec.pool_dtype)
        return host_memory.empty(self.setup.runtime.queue, shape, self.spec.pool_dtype)

    def build(self, sinks: bool = False) -> "BatchDecode":
        """Compile now (otherwise the first run compiles); returns self. ``sinks``: also
        the kernels for calls passing ``sink_logits`` (a model with learned sinks), which
        are otherwise built by the first such call."""
        if self.opencl:
            self.opencl.decode_kernels()
            if sinks:
                self.opencl.decode_kernels(sinks=True)
        return self

    # -- planning ------------------------------------------------------------------
    def plan(self, page_indptr: np.ndarray, last_page_len: np.ndarray | None = None, *,
             length_info: np.ndarray | None = None, window_offset: np.ndarray | None = None,
             sink_size: np.ndarray | None = None, split: bool | int | None = None) -> Plan:
        """Decide split-KV for a batch from its host page table.

        Plan once per decode step and pass the plan to :meth:`run` for every layer.

        Parameters
        ----------
        page_indptr : numpy.ndarray of int32, shape [B + 1]
            Page range of each sequence in ``page_indices``.
        last_page_len : numpy.ndarray of int32, shape [B]
            Slots used in each sequence's last page (0 only for a sequence with no page).
        length_info : numpy.ndarray of int32, shape [B] or [3, B], optional
            The packed form (``last_page_len`` or ``[last_page_len, window_offset,
            sink_size]`` with the window) instead of the three separate tables.
        window_offset, sink_size : numpy.ndarray of int32, shape [B], optional
            With ``spec.sliding_window``: the first stored row of the window and the
            number of leading rows kept as sinks.
        split : None, bool or int
            None: decide from the device's occupancy; False: never split; an int: force
            that many rows per partition.

        Returns
        -------
        Plan
            Immutable; ``str(plan)`` says what was decided and why.
        """
        spec = self.spec
        _check_split(split)
        chunk = chunk_lengths(spec, page_indptr, last_page_len, length_info=length_info,
                              window_offset=window_offset, sink_size=sink_size)
        if not self.setup:
            return make_plan(chunk, 1, 1, _CPU_PROFILE, spec.page_size, split=False)
        return self._make_plan(chunk, split)

    def _make_plan(self, chunk: np.ndarray, split: bool | int | None) -> Plan:
        _check_split(split)
        return make_decode_plan(self.opencl, chunk, split)

    # -- running -------------------------------------------------------------------
    def run(self, q: Any, pages: Any, page_indptr: Any, page_indices: Any,
            last_page_len: Any = None, *, length_info: Any = None, window_offset: Any = None,
            sink_size: Any = None, q_pos: Any = None, k_pos_offset: Any = None,
            rotary_mode: int = 0, rope_scale: float = 1.0, rope_theta: float = 1e4,
            sm_scale: float | None = None, out: Any = None, lse: Any = None,
            plan: Plan | None = None, split: bool | int | None = None, queue: Any = None,
            wait_for: list | None = None, sink_logits: Any = None) -> AttentionResult:
        """Attend one query token per sequence to its paged keys and values.

        All arrays are numpy arrays (copied in, results copied back: the call waits) or
        all ``pyopencl.array.Array``s of this decoder's context (the call returns at once;
        wait on the result's event). Every array may be a view with an offset. Inputs are
        validated before anything is launched; nothing the caller passed is modified
        when a call fails. docs/contract.md states the semantics in full.

        Parameters
        ----------
        q : array of spec.dtype, shape [B, H_qo, D]
            One query per sequence.
        pages : array of spec.dtype, shape [P, 2, H_kv, page_size, D]
            The pool: keys at ``[:, 0]``, values at ``[:, 1]``.
        page_indptr : int32 array, shape [B + 1]
            Sequence ``b`` owns ``page_indices[page_indptr[b]:page_indptr[b + 1]]``.
        page_indices : int32 array, shape [nnz]
            Pool pages, in order, of every sequence.
        last_page_len : int32 array, shape [B]
            Slots used in each sequence's last page.
        length_info : int32 array, shape [B] or [3, B], optional
            Packed ``last_page_len`` (and ``window_offset``, ``sink_size``), instead.
        window_offset, sink_size : int32 arrays, shape [B], optional
            Sliding window (``spec.sliding_window``): rows ``[0, sink_size)`` and
            ``[window_offset, stored)`` are attended, in that order.
        q_pos, k_pos_offset : int32 arrays, shape [B], optional
            RoPE (``rotary_mode=1``): position of the query, and of chunk row 0.
        rotary_mode : {0, 1}
            1 rotates q and the keys in the kernel (keys are stored unrotated).
        rope_scale, rope_theta : float
            Position scale and RoPE base (``spec.rope_scaling`` adds the HF scaling type).
        sm_scale : float, optional
            Score scale; default ``1 / sqrt(D)``.
        out : array of spec.dtype, shape [B, H_qo, D], optional
            Written in place (numpy or device array).
        lse : float32 array, shape [B, H_qo], optional
            Written in place.
        plan : Plan, optional
            From :meth:`plan`; else planned here from host tables (device tables: no split).
        split : None, bool or int
            As in :meth:`plan`, when no plan is given.
        queue : pyopencl.CommandQueue, optional
            Queue to enqueue on (default: the decoder's).
        wait_for : list of pyopencl.Event, optional
            Events to wait for besides those attached to the arrays.
        sink_logits : float32 array, shape [H_qo], optional
            Learned attention sinks (gpt-oss): one logit per query head, natural-log
            units, added to the softmax denominator with no value (docs/contract.md
            section 5). -inf: no sink on that head. Not ``sink_size``.

        Returns
        -------
        AttentionResult
            ``(out, lse, event)``; ``lse`` is base 2 (the sink included); an empty chunk
            gives ``out = 0``, ``lse = -inf`` (with a sink: ``sink * log2(e)``).
            ``.events`` lists every kernel event of the call.
        """
        spec = self.spec
        kw = dict(length_info=length_info, window_offset=window_offset, sink_size=sink_size,
                  q_pos=q_pos, k_pos_offset=k_pos_offset, rotary_mode=rotary_mode,
                  rope_scale=rope_scale, rope_theta=rope_theta, sm_scale=sm_scale)
        if not self.setup:
            _check_split(split)
            check_host_call(plan, Plan, "BatchDecode.plan()", queue, wait_for)
            if plan is not None and hasattr(page_indptr, "shape"):
                _check_plan_batch(plan, page_indptr.shape[0] - 1)
            return AttentionResult(*run_on_host(cpu_backend.batch_decode, spec, (
                q, pages, page_indptr, page_indices, last_page_len),
                dict(kw, sink_logits=sink_logits), out, lse))
        if plan is not None and split is None and queue is None and \
                not self.setup.limits.loop_budget:   # the checked path checks it against one
            if self._one_call is None:
                self._one_call = OneCallPath(spec, self.opencl)
            res = self._one_call.run(q, pages, page_indptr, page_indices, last_page_len,
                                     length_info, window_offset, sink_size, q_pos, k_pos_offset,
                                     rotary_mode, rope_scale, rope_theta, sm_scale, out, lse,
                                     plan, wait_for, sink_logits)
            if res is not None:
                return res
        args = check_decode(spec, q, pages, page_indptr, page_indices, last_page_len,
                            out=out, lse=lse, **kw)
        check_sink_logits(spec, sink_logits)
        B, H, D = args.B, spec.num_qo_heads, spec.head_dim_v   # D: out's width
        plan = self._checked_plan(plan, args, split, page_indptr)
        rt = self.setup.runtime
        call = Call(rt, queue, wait_for)
        named = upload_tables(call, spec, args, page_indptr, page_indices, length_info,
                              window_offset, sink_size, q_pos, k_pos_offset, rotary_mode)
        sinks = sink_args(call, sink_logits)
        named.update(q=call.input("q", q), pages=call.input("pages", pages), **sinks)
        dout = call.output("out", out, (B, H, D), spec.np_dtype)
        dlse = call.output("lse", lse, (B, H), LSE_DTYPE)
        opencl = self.opencl
        launch = plan_launch(opencl, plan, B, call.queue)
        if launch.table is not None:
            call.input("plan", launch.table)
        named.update(out=dout, lse=dlse,
                     **opencl.scalars(rotary_mode, rope_theta, rope_scale, sm_scale))
        events: tuple = ()
        if B > 0:
            events = launch.launch(opencl, call.queue, call.wait_list(), named, sinks)
        o, s = call.finish([dout, dlse], events, host=is_host(q))
        return AttentionResult(o, s, events[-1] if events else None, tuple(events))

    def prepare(self, page_indptr: Any, page_indices: Any, last_page_len: Any = None, *,
                num_pages: int, length_info: Any = None, window_offset: Any = None,
                sink_size: Any = None, q_pos: Any = None, k_pos_offset: Any = None,
                rotary_mode: int = 0, rope_scale: float = 1.0, rope_theta: float = 1e4,
                sm_scale: float | None = None, plan: Plan | None = None,
                split: bool | int | None = None, queue: Any = None) -> DecodeStep:
        """Check and upload one step's tables once; run the step per layer.

        Parameters are those of :meth:`run` less q, the pool and the outputs;
        ``num_pages`` is the size of the pool(s) the step will run over (the page
        indices are checked against it).

        Returns
        -------
        DecodeStep
            ``step.run(q, pages, out=..., lse=...)`` per layer.

        Examples
        --------
        >>> step = dec.prepare(indptr, indices, last, num_pages=P)     # doctest: +SKIP
        >>> for layer in range(32):                                     # doctest: +SKIP
        ...     step.run(q[layer], pools[layer], out=o[layer], lse=s[layer])
        """
        if not self.setup:
            raise RuntimeError("prepare: the CPU backend has no device step; call run()")
        if not is_int(num_pages) or not 0 <= num_pages <= INT32_MAX:
            raise ValueError(f"num_pages={num_pages!r}: the pool size, an int in 0..2**31 - 1")
        spec = self.spec
        check_array("page_indptr", page_indptr, ndim=1, dtypes=(INDEX_DTYPE,))
        B = int(page_indptr.shape[0]) - 1
        args = check_tables(spec, B, int(num_pages), page_indptr, page_indices, last_page_len,
                            length_info=length_info, window_offset=window_offset,
                            sink_size=sink_size, q_pos=q_pos, k_pos_offset=k_pos_offset,
                            rotary_mode=rotary_mode, sm_scale=sm_scale, rope_scale=rope_scale,
                            rope_theta=rope_theta)
        plan = self._checked_plan(plan, args, split, page_indptr)
        call = Call(self.setup.runtime, queue)
        tables = upload_tables(call, spec, args, page_indptr, page_indices, length_info,
                               window_offset, sink_size, q_pos, k_pos_offset, rotary_mode)
        launch = plan_launch(self.opencl, plan, B, call.queue)
        if launch.table is not None:
            call.input("plan", launch.table)
        tables.update(self.opencl.scalars(rotary_mode, rope_theta, rope_scale, sm_scale))
        return DecodeStep(self, args, launch, tables, call.wait_list(), int(num_pages))

    def _checked_plan(self, plan: Plan | None, args: Any, split: bool | int | None,
                      page_indptr: Any) -> Plan:
        """The caller's plan, checked against this call, or a new one. Device tables are
        read back (a blocking copy) only on a device with a loop budget, whose plan must
        know the lengths (:mod:`clattn.loop_budget`); elsewhere they are not split."""
        B = args.B
        _check_split(split)
        if plan is None:
            chunk = args.chunk
            if chunk is None and self.setup.limits.loop_budget:
                chunk = _device_chunk(self.spec, page_indptr, args)
            if chunk is None:
                return self._make_plan(np.zeros(B, np.int64), False)
            return self._make_plan(chunk, split if args.chunk is not None else False)
        if not isinstance(plan, Plan):
            raise TypeError(f"plan: expected a Plan from BatchDecode.plan(), got "
                            f"{type(plan).__name__}")
        _check_plan_batch(plan, B)
        if args.chunk is not None and plan.split and \
                np.any(np.maximum(1, -(-args.chunk // plan.part_rows)) > np.diff(plan.part_indptr)):
            raise ValueError("plan: the page table grew since the plan was made; plan again")
        budget = self.setup.limits.loop_budget
        if budget:
            self.opencl.decode_kernels()   # the bounds read the built kernel's geometry
            chunk = args.chunk if args.chunk is not None else \
                _device_chunk(self.spec, page_indptr, args)
            if not plan_within(self.spec, self.opencl.decode_geometry, budget, plan, chunk):
                raise ValueError(f"plan: a partition of this call would pass the loop budget "
                                 f"of this device ({budget} iterations per work-item, "
                                 f"clattn.loop_budget); plan again for these tables")
        return plan


def _check_plan_batch(plan: Plan, B: int) -> None:
    """``plan`` was made for a batch of ``B`` sequences."""
    if len(plan.part_indptr) != B + 1:
        raise ValueError(f"plan: made for {len(plan.part_indptr) - 1} sequences, the call "
                         f"has {B}; plan again for this batch")


def _check_split(split: Any) -> None:
    """``split``: None, a bool, or rows per partition (an int >= 1)."""
    if split is None or isinstance(split, (bool, np.bool_)):
        return
    if not isinstance(split, (int, np.integer)):
        raise TypeError(f"split={split!r}: None, False, True or rows per partition (an int)")
    if split < 1:
        raise ValueError(f"split={split!r}: rows per partition must be >= 1")


def _device_chunk(spec: AttentionSpec, page_indptr: Any, args: Any) -> np.ndarray:
    """The rows each sequence attends, from device tables copied back to the host."""
    if args.length_info is not None:
        return chunk_lengths(spec, host_copy(page_indptr), None,
                             length_info=host_copy(args.length_info))
    return chunk_lengths(spec, host_copy(page_indptr), host_copy(args.last_page_len),
                         window_offset=host_copy(args.window_offset),
                         sink_size=host_copy(args.sink_size))
