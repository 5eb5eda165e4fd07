"""The app-facing prefill API: many query tokens per sequence over the paged cache.

docs/prefill.md states the semantics: query ``i`` of sequence ``b`` is the token at chunk
row ``chunk_b - n_b + i`` (its keys and values already appended to the cache) and attends
chunk rows ``[0, chunk_b - n_b + i]`` (causal, the default) or the whole chunk; every
decode feature applies. A prefill with one
query per sequence is a decode whose query sits at the chunk's last row.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import cpu_backend, runtime
from . import prefill_by_decode as by_decode
from .codegen import render_prefill
from .decode import BatchDecode
from .device import DeviceSetup, open_backend, warn_notes
from .fit import PREFILL_LONG_CACHE, PrefillGeometry
from .loop_budget import prefill_fits
from .opencl_backend import OpenCLBackend
from .profiles.record import Profile
from .result import AttentionResult
from .spec import INDEX_DTYPE, LSE_DTYPE, AttentionSpec
from .staging import Call, check_host_call, run_on_host, sink_args, upload_tables
from .validate import (
    PrefillArgs,
    check_array,
    check_indptr,
    check_prefill,
    check_sink_logits,
    chunk_lengths,
    host_copy,
    is_host,
)


@dataclass(frozen=True)
class PrefillPlan:
    """The work units of one prefill batch: tiles of up to ``queries_per_unit`` queries
    of one sequence, a sequence's tiles together and longest work first (the causal tiles
    near a chunk's end read the most keys), the sequences by their longest tile.
    ``units`` is a read-only int32 ``[n_units, 4]`` table of (sequence, its first query
    in the tile, the sequence's queries, the tile's first row of q): the kernels take the
    split of q from it, so tiles never write the same row; ``n_q`` the queries of each
    sequence."""

    units: np.ndarray
    queries_per_unit: int
    n_q: np.ndarray
    total_q: int
    rows_read: int  # key rows all units read together (0 when the chunks were unknown)

    @property
    def batch(self) -> int:
        return len(self.n_q)

    def __str__(self) -> str:
        read = f", {self.rows_read} key rows read" if self.rows_read else ""
        return (f"{len(self.units)} work units of up to {self.queries_per_unit} queries for "
                f"{self.batch} sequences, {self.total_q} queries{read}")


def _unit_order(seq: np.ndarray, work: np.ndarray, batch: int) -> np.ndarray:
    """The launch order of units of sequences ``seq`` reading ``work`` key rows each.

    A sequence's units stay together, most work first: they read the same keys, so a
    core (or a GPU's L2) keeps them between units; interleaving the sequences of a batch
    of four cost 1.03-1.09x on CPU drivers (tools/RESULTS.md, "Prefill unit order").
    The sequences go in the order of their longest unit, most first, so the launch still
    ends on short units (longest processing time first, taken a sequence at a time).
    """
    longest = np.zeros(batch, np.int64)
    np.maximum.at(longest, seq, work)
    return np.lexsort((-work, seq, -longest[seq]))


def queries_per_unit(geometry: PrefillGeometry, n_q: np.ndarray,
                     chunk: np.ndarray | None) -> int:
    """The queries per work unit of a plan: ``geometry.qb_long`` where the new queries
    follow :data:`clattn.fit.PREFILL_LONG_CACHE` cached rows or more on average and the
    sequences bring enough queries to fill such units (on average one each), else
    ``geometry.qb``. Unknown chunks (no page tables): ``qb``."""
    long = geometry.qb_long
    n_q = np.asarray(n_q, np.int64)
    total = int(n_q.sum())
    if not long or chunk is None or total < long * max(len(n_q), 1):
        return geometry.qb
    cached = np.maximum(np.asarray(chunk, np.int64) - n_q, 0)
    return long if int((n_q * cached).sum()) >= PREFILL_LONG_CACHE * total else geometry.qb


def make_prefill_plan(n_q: np.ndarray, chunk: np.ndarray | None, qb: int,
                      q_start: np.ndarray | None = None) -> PrefillPlan:
    """Cut each sequence's ``n_q[b]`` queries into tiles of ``qb``; with the chunk lengths
    known, order the tiles as :func:`_unit_order` (a sequence's tiles together, most key
    rows first; the sequences by their longest tile). Sequence ``b``'s queries are rows
    ``q_start[b] ..`` of q (default: sequence after sequence)."""
    n_q = np.asarray(n_q, dtype=np.int64)
    b = np.repeat(np.arange(len(n_q)), -(-n_q // qb))
    first = np.concatenate([np.arange(0, n, qb) for n in n_q]) if len(b) else np.zeros(0, np.int64)
    if q_start is None:
        q_start = np.concatenate([[0], np.cumsum(n_q)[:-1]])
    row = (np.asarray(q_start, np.int64)[b] + first) if len(b) else first
    work = np.zeros(len(b), np.int64)
    if chunk is not None and len(b):
        nb = n_q[b]
        work = np.asarray(chunk, np.int64)[b] - nb + first + np.minimum(qb, nb - first)
        order = _unit_order(b, work, len(n_q))
        b, first, row, work = b[order], first[order], row[order], work[order]
    units = np.stack([b, first, n_q[b] if len(b) else b, row], axis=1).astype(np.int32)
    units = np.ascontiguousarray(units.reshape(-1, 4))
    units.setflags(write=False)
    n = n_q.astype(np.int32)
    n.setflags(write=False)
    return PrefillPlan(units, int(qb), n, int(n_q.sum()), int(work.sum()))


class BatchPrefill:
    """Paged-KV prefill (causal by default) for one model configuration on one device.

    Parameters
    ----------
    spec : AttentionSpec
        Heads, head_dim, page size, dtype and the compiled-in features (window,
        soft-cap, RoPE scaling, page formats), as for :class:`~clattn.BatchDecode`.
    device : None, str, pyopencl.Device, pyopencl.Context or pyopencl.CommandQueue
        As for :class:`~clattn.BatchDecode`.
    backend : {"auto", "opencl", "cpu"}
        ``"auto"``: OpenCL when a device exists, else the numpy CPU backend with one
        warning.
    profile : None, str, Profile or dict
        As for :class:`~clattn.BatchDecode`; the profile's strategy picks the kernel
        (``rows`` on CPU drivers, ``tiled`` on GPUs).

    Examples
    --------
    >>> pre = BatchPrefill(AttentionSpec(32, 8, 128, dtype="float16"))     # doctest: +SKIP
    >>> plan = pre.plan(qo_indptr, page_indptr, last_page_len)             # doctest: +SKIP
    >>> out, lse, event = pre.run(q, pages, qo_indptr, page_indptr, page_indices,
    ...                           last_page_len, plan=plan)                # doctest: +SKIP
    """

    def __init__(self, spec: AttentionSpec, device: Any = None, *, backend: str = "auto",
                 profile: Any = None) -> None:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        self.spec = spec
        self.setup: DeviceSetup | None = open_backend(device, backend, profile)
        self.backend = "opencl" if self.setup else "cpu"
        #: the kernel, tables and RoPE tables on the device (None on the CPU backend)
        self.opencl: OpenCLBackend | None = None
        #: the decode that runs a call its units' loops could not (clattn.loop_budget)
        self._decoder: BatchDecode | None = None
        if self.setup:
            self.opencl = OpenCLBackend(spec, self.setup)
            warn_notes(self.setup.notes, stacklevel=2)
            warn_notes(self.opencl.prefill_notes, "prefill: ", stacklevel=2)

    # -- introspection -------------------------------------------------------------
    @property
    def profile(self) -> Profile | None:
        """The fitted profile this object runs (None on the CPU backend)."""
        return self.setup.profile if self.setup else None

    @property
    def geometry(self) -> PrefillGeometry:
        """The prefill kernel's fitted geometry (refitted if the built kernel allows fewer
        work-items per group than it asked)."""
        return self.opencl.prefill_geometry

    def build(self) -> "BatchPrefill":
        """Compile now (otherwise the first run compiles); returns self."""
        if self.opencl:
            self.opencl.prefill_kernel()
        return self

    def source(self) -> str:
        """The OpenCL C this object runs (rendered for its device's profile)."""
        if not self.setup:
            raise RuntimeError("the CPU backend runs numpy code, not OpenCL")
        return render_prefill(self.spec, self.geometry)

    # -- planning ------------------------------------------------------------------
    def plan(self, qo_indptr: np.ndarray, page_indptr: np.ndarray | None = None,
             last_page_len: np.ndarray | None = None, *, length_info: np.ndarray | None = None,
             window_offset: np.ndarray | None = None,
             sink_size: np.ndarray | None = None) -> PrefillPlan:
        """Cut a batch's queries into work units, from its host tables.

        Plan once per step and pass the plan to :meth:`run` for every layer.

        Parameters
        ----------
        qo_indptr : numpy.ndarray of int32, shape [B + 1]
            Queries of each sequence in ``q``: sequence ``b`` owns
            ``q[qo_indptr[b]:qo_indptr[b + 1]]``.
        page_indptr, last_page_len, length_info, window_offset, sink_size : optional
            The page tables as for :meth:`clattn.BatchDecode.plan`: with them the units
            are ordered by the key rows they read, most first, a sequence's units
            together (better balance, and its keys stay in cache between its units).

        Returns
        -------
        PrefillPlan
            Immutable; ``str(plan)`` says how the batch was cut.
        """
        check_array("qo_indptr", qo_indptr, ndim=1, dtypes=(INDEX_DTYPE,))
        if not is_host(qo_indptr):
            raise TypeError("qo_indptr: plan() reads host tables; pass a numpy array")
        check_indptr("qo_indptr", qo_indptr)
        chunk = None
        if page_indptr is not None:
            check_array("page_indptr", page_indptr, ndim=1, dtypes=(INDEX_DTYPE,))
            if len(page_indptr) != len(qo_indptr):
                raise ValueError(f"page_indptr: {len(page_indptr) - 1} sequences, qo_indptr "
                                 f"has {len(qo_indptr) - 1}")
            chunk = chunk_lengths(self.spec, page_indptr, last_page_len,
                                  length_info=length_info, window_offset=window_offset,
                                  sink_size=sink_size)
        n_q = np.diff(qo_indptr.astype(np.int64))
        qb = queries_per_unit(self.geometry, n_q, chunk) if self.setup else 1
        return make_prefill_plan(n_q, chunk, qb)

    def _checked_plan(self, plan: PrefillPlan | None, args: PrefillArgs) -> PrefillPlan:
        """The caller's plan, checked against this call, or a new one."""
        geom = self.geometry
        n_q = args.n_q
        if n_q is None:  # device qo_indptr: its values are needed to cut the batch
            if plan is None:
                n_q = np.diff(args.qo_indptr.get().astype(np.int64))
                if (n_q < 0).any() or int(n_q.sum()) != args.total_q:
                    raise ValueError("qo_indptr: the device table does not split q's "
                                     f"{args.total_q} queries; pass a plan or a valid table")
        if plan is None:
            chunk = args.tables.chunk
            return make_prefill_plan(n_q, chunk, queries_per_unit(geom, n_q, chunk))
        if not isinstance(plan, PrefillPlan):
            raise TypeError(f"plan: expected a PrefillPlan from BatchPrefill.plan(), got "
                            f"{type(plan).__name__}")
        if plan.queries_per_unit not in {geom.qb, geom.qb_long} - {0}:
            takes = f"{geom.qb}" + (f" or {geom.qb_long}" if geom.qb_long else "")
            raise ValueError(f"plan: made for {plan.queries_per_unit} queries per unit, this "
                             f"kernel takes {takes}; plan with this BatchPrefill")
        _check_split(plan, args, n_q)
        return plan

    # -- running -------------------------------------------------------------------
    def run(self, q: Any, pages: Any, qo_indptr: Any, page_indptr: Any, page_indices: Any,
            last_page_len: Any = None, *, length_info: Any = None, window_offset: Any = None,
            sink_size: Any = None, q_pos: Any = None, k_pos_offset: Any = None,
            rotary_mode: int = 0, causal: bool = True, rope_scale: float = 1.0,
            rope_theta: float = 1e4, sm_scale: float | None = None, out: Any = None,
            lse: Any = None, plan: PrefillPlan | None = None, custom_mask: Any = None,
            mask_indptr: Any = None, queue: Any = None, wait_for: list | None = None,
            sink_logits: Any = None) -> AttentionResult:
        """Attend every sequence's new queries (causally) to its paged keys and values.

        Arrays are all numpy (copied in, results copied back: the call waits) or all
        ``pyopencl.array.Array``s of this object's context (the call returns at once;
        wait on the result's event), as for :meth:`clattn.BatchDecode.run`. Inputs are
        validated before anything is launched. docs/prefill.md states the semantics.

        Parameters
        ----------
        q : array of spec.dtype, shape [total_q, H_qo, D]
            The new tokens' queries, sequence after sequence.
        pages : array, shape [P, 2, H_kv, page_size, D] (or a quantized byte pool)
            The pool, the new tokens' keys and values already appended.
        qo_indptr : int32 array, shape [B + 1]
            Sequence ``b`` owns queries ``q[qo_indptr[b]:qo_indptr[b + 1]]`` (``n_b`` of
            them); ``qo_indptr[B] == total_q``.
        page_indptr, page_indices, last_page_len : int32 arrays
            The page tables, as for decode; the stored length counts the new tokens.
        length_info, window_offset, sink_size : int32 arrays, optional
            As for decode. Query ``i`` is chunk row ``chunk_b - n_b + i``: with ``causal``
            the queries are the chunk's last ``n_b`` rows (inside the window, or the
            chunk has no gap).
        q_pos, k_pos_offset : int32 arrays, shape [B], optional
            RoPE (``rotary_mode=1``): chunk row ``r`` is at position ``k_pos_offset[b] +
            r``; query ``i`` at ``q_pos[b] + i``, by default at its own row's position
            (``q_pos[b] = k_pos_offset[b] + chunk_b - n_b``).
        rotary_mode : {0, 1}
            1 rotates q and the keys in the kernel (keys are stored unrotated).
        causal : bool
            True: query ``i`` attends chunk rows ``[0, chunk_b - n_b + i]``. False: every
            query attends the whole chunk (a shared prefix in cascade attention; an
            empty chunk gives ``out = 0``, ``lse = -inf``).
        rope_scale, rope_theta, sm_scale : float
            As for decode.
        out : array of spec.dtype, shape [total_q, H_qo, D], optional
            Written in place (numpy or device array).
        lse : float32 array, shape [total_q, H_qo], optional
            Written in place (base 2).
        plan : PrefillPlan, optional
            From :meth:`plan`: the kernel takes the split of q among the sequences from
            it (a device ``qo_indptr`` is then not read). Else planned here; a device
            ``qo_indptr`` is then read back (a blocking copy).
        custom_mask, mask_indptr : uint8 array [mask_indptr[B]], int32 array [B + 1], optional
            A custom mask (tree speculative decoding), both from
            :func:`clattn.pack_mask`: sequence ``b``'s boolean ``[n_b, chunk_b]`` matrix
            packed little-endian at bytes ``[mask_indptr[b], mask_indptr[b + 1])``. Query
            ``i`` attends chunk row ``r`` iff its bit is set **and** ``causal`` allows the
            row; a query keeping no row gives ``out = 0``, ``lse = -inf``
            (docs/prefill.md, "Custom masks").
        queue : pyopencl.CommandQueue, optional
            Queue to enqueue on (default: this object's).
        wait_for : list of pyopencl.Event, optional
            Events to wait for besides those attached to the arrays.
        sink_logits : float32 array, shape [H_qo], optional
            Learned attention sinks, one logit per query head, as in
            :meth:`clattn.BatchDecode.run`.

        Returns
        -------
        AttentionResult
            ``(out, lse, event)`` with ``.events``; ``out [total_q, H_qo, D]``, ``lse
            [total_q, H_qo]`` (base 2). A causal query attends at least its own row.
        """
        spec = self.spec
        kw = dict(length_info=length_info, window_offset=window_offset, sink_size=sink_size,
                  q_pos=q_pos, k_pos_offset=k_pos_offset, rotary_mode=rotary_mode,
                  causal=causal, rope_scale=rope_scale, rope_theta=rope_theta,
                  sm_scale=sm_scale, custom_mask=custom_mask, mask_indptr=mask_indptr)
        if not self.setup:
            check_host_call(plan, PrefillPlan, "BatchPrefill.plan()", queue, wait_for)
            fn = cpu_backend.batch_prefill if plan is None else \
                functools.partial(_planned_host_prefill, plan)
            return AttentionResult(*run_on_host(fn, spec, (
                q, pages, qo_indptr, page_indptr, page_indices, last_page_len),
                dict(kw, sink_logits=sink_logits), out, lse))
        args = check_prefill(spec, q, pages, qo_indptr, page_indptr, page_indices,
                             last_page_len, out=out, lse=lse, **kw)
        check_sink_logits(spec, sink_logits)
        t = args.tables
        T, H, D = args.total_q, spec.num_qo_heads, spec.head_dim_v   # D: out's width
        plan = self._checked_plan(plan, args)
        if self.setup.limits.loop_budget:
            kw.update(page_indptr=page_indptr, page_indices=page_indices,
                      last_page_len=last_page_len, sink_logits=sink_logits)
            host = self._host_tables(kw)   # device tables read back once
            if not self._fits_budget(plan, host["chunk"], kw):
                return self._run_as_decode(q, pages, qo_indptr, host, kw, out, lse, queue,
                                           wait_for)
        opencl = self.opencl
        call = Call(opencl.runtime, queue, wait_for)
        if not is_host(qo_indptr):  # not read by the kernel (the plan splits q): its context
            call.input("qo_indptr", qo_indptr)  # is checked all the same
        named = upload_tables(call, spec, t, page_indptr, page_indices, length_info,
                              window_offset, sink_size, q_pos, k_pos_offset, rotary_mode)
        dout = call.output("out", out, (T, H, D), spec.np_dtype)
        dlse = call.output("lse", lse, (T, H), LSE_DTYPE)
        n_units = len(plan.units)
        named.update(q=call.input("q", q), pages=call.input("pages", pages),
                     total_q=T, batch=t.B,
                     q_pos_mode=int(bool(rotary_mode) and q_pos is not None), causal=int(causal),
                     mask=call.input("custom_mask", custom_mask),
                     mask_indptr=call.input("mask_indptr", mask_indptr),
                     mask_bytes=0 if custom_mask is None else int(custom_mask.shape[0]),
                     use_mask=int(custom_mask is not None),
                     units=opencl.unit_table(plan, call.queue) if n_units else None,
                     n_units=n_units, out=dout, lse=dlse, **sink_args(call, sink_logits),
                     **opencl.scalars(rotary_mode, rope_theta, rope_scale, sm_scale))
        events: list = []
        if n_units and T:
            kernel, geom = opencl.prefill_kernel_for(plan.queries_per_unit)
            events.append(kernel(call.queue, geom.global_size(n_units, spec.num_kv_heads),
                                 geom.local_size(), call.wait_list(), **named))
        o, s = call.finish([dout, dlse], events, host=is_host(q))
        return AttentionResult(o, s, events[-1] if events else None, tuple(events))

    # -- a device with a loop budget (clattn.loop_budget) ----------------------------
    def _host_tables(self, kw: dict) -> dict:
        """The call's page tables on the host (device ones read back), ``length_info``
        split, with the rows each sequence attends."""
        spec = self.spec
        t = {k: host_copy(kw[k]) for k in ("page_indptr", "page_indices", "last_page_len",
                                                 "window_offset", "sink_size", "q_pos",
                                                 "k_pos_offset", "length_info")}
        info = t.pop("length_info")
        if info is not None:
            if spec.sliding_window:
                t["last_page_len"], t["window_offset"], t["sink_size"] = info
            else:
                t["last_page_len"] = info
        t["chunk"] = chunk_lengths(spec, t["page_indptr"], t["last_page_len"],
                                   window_offset=t["window_offset"], sink_size=t["sink_size"])
        return t

    def _fits_budget(self, plan: PrefillPlan, chunk: np.ndarray, kw: dict) -> bool:
        return prefill_fits(self.spec, self.geometry, self.setup.limits.loop_budget,
                            plan.units, plan.queries_per_unit, chunk,
                            kw["custom_mask"] is not None, bool(kw["causal"]),
                            bool(kw["rotary_mode"]))

    def _run_as_decode(self, q: Any, pages: Any, qo_indptr: Any, t: dict, kw: dict,
                       out: Any, lse: Any, queue: Any, wait_for: list | None) -> AttentionResult:
        """The call as one decode per query (:mod:`clattn.prefill_by_decode`) over its
        host tables ``t`` (:meth:`_host_tables`), refused before anything is launched
        where it has no decode form."""
        budget = self.setup.limits.loop_budget
        why = (f"this device ends a work-item's loops after {budget} iterations "
               f"(clattn.loop_budget), which this prefill's work units would pass")
        if kw["custom_mask"] is not None:
            raise ValueError(f"custom_mask: {why}, and a masked prefill has no decode form; "
                             f"pass shorter chunks or use backend='cpu'")
        qo = host_copy(qo_indptr)
        first = None
        if kw["rotary_mode"]:
            first = by_decode.first_positions(qo, t["chunk"], t["q_pos"], t["k_pos_offset"])
            long_from = self.opencl.rope_buffer(1, kw["rope_theta"], kw["rope_scale"])[1]
            if by_decode.straddles(qo, first, long_from):
                raise ValueError(f"q: {why}, and a sequence's queries straddle position "
                                 f"{long_from}, where RoPE's long factors start (a decode "
                                 f"per query would take each its own table); split the "
                                 f"chunk there or use backend='cpu'")
        tables = by_decode.decode_tables(
            self.spec, qo, t["page_indptr"], t["page_indices"], t["last_page_len"],
            t["window_offset"], t["sink_size"], first, t["k_pos_offset"], kw["causal"])
        if not is_host(q):
            to = queue or self.setup.runtime.queue
            tables = {k: runtime.cl().array.to_device(to, v) for k, v in tables.items()}
        if self._decoder is None:
            self._decoder = BatchDecode(self.spec, self.setup.runtime.queue, backend="opencl",
                                        profile=self.setup.wishes)
        return self._decoder.run(
            q, pages, rotary_mode=kw["rotary_mode"], rope_scale=kw["rope_scale"],
            rope_theta=kw["rope_theta"], sm_scale=kw["sm_scale"], out=out, lse=lse,
            queue=queue, wait_for=wait_for, sink_logits=kw["sink_logits"], **tables)


def _check_split(plan: PrefillPlan, args: PrefillArgs, n_q: np.ndarray | None) -> None:
    """``plan`` cuts this call's q: its batch, its total and (when known on the host) the
    queries of each sequence."""
    if plan.batch != args.tables.B or plan.total_q != args.total_q or \
            (n_q is not None and not np.array_equal(plan.n_q, n_q)):
        raise ValueError(f"plan: made for {plan.batch} sequences and {plan.total_q} "
                         f"queries, another split than this call's; plan again")


def _planned_host_prefill(plan: PrefillPlan, spec: AttentionSpec, *arrays: Any,
                          out: Any = None, lse: Any = None, sink_logits: Any = None,
                          **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """The CPU backend's prefill of a call given a plan: the host computes no units, but
    a plan for another split of q is refused as on a device, before anything is written."""
    args = check_prefill(spec, *arrays, out=out, lse=lse, **kw)
    _check_split(plan, args, args.n_q)
    return cpu_backend.batch_prefill(spec, *arrays, out=out, lse=lse, sink_logits=sink_logits,
                                     **kw)
