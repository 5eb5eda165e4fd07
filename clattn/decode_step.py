"""A prepared decode step: tables checked and uploaded once, run once per layer.

A model's decode step attends every layer over the same page tables; only q and the
layer's pages change. :meth:`clattn.BatchDecode.prepare` checks the tables, plans the
split and uploads what is on the host once; :meth:`DecodeStep.run` then checks q, the
pool and the outputs, sets the few arguments that change and enqueues: a host path of
a few microseconds plus the driver's enqueue.
"""
from __future__ import annotations

import threading
from typing import Any

from .plan import Plan
from .result import AttentionResult
from .spec import LSE_DTYPE
from .staging import Call, events_list
from .validate import DecodeArgs, check_operands, check_sink_logits, is_host, launchable


class DecodeStep:
    """One batch's decode tables on the device; :meth:`run` attends one layer.

    Made by :meth:`clattn.BatchDecode.prepare`. A step may be run from several threads
    (launches are serialised on it); split steps order their launches on the decoder's
    workspace (:meth:`clattn.opencl_backend.OpenCLBackend.decode_then_merge`), in one
    launch per layer where the profile folds the merge in
    (:meth:`~clattn.opencl_backend.OpenCLBackend.folds`).
    """

    def __init__(self, dec: Any, args: DecodeArgs, plan: Plan, tables: dict,
                 events: list, num_pages: int) -> None:
        self.decoder = dec
        self.plan = plan
        self.batch = args.B
        self.num_pages = num_pages
        spec = dec.spec
        opencl = self._opencl = dec.opencl
        self._rt = opencl.runtime
        self._shapes = ((args.B, spec.num_qo_heads, spec.head_dim), spec.pool_shape(num_pages),
                        (args.B, spec.num_qo_heads), (args.B, spec.num_qo_heads, spec.head_dim_v))
        self._dtype = spec.np_dtype
        self._pool_dtype = spec.pool_dtype
        self._table_events = list(events)  # uploads of the tables: waited for once
        self._lock = threading.Lock()
        fold = self._fold = opencl.folds(plan)
        decode, merge = opencl.decode_kernels(fold=fold)
        H, D = spec.num_qo_heads, spec.head_dim_v   # D: the states' width
        ws = opencl.workspace(plan.n_ws) if plan.split else (None, None)
        geom = opencl.decode_geometry
        self._sizes = (geom.global_size(args.B, spec.num_kv_heads,
                                        plan.num_parts if plan.split else 1),
                       geom.local_size())
        unset = dict(q=None, pages=None, out=None, lse=None, sink_logits=None, use_sinks=0)
        self._decode = decode.bind(**unset, **tables, ws_o=ws[0], ws_s=ws[1],
                                   n_ws=plan.n_ws, split=int(plan.split),
                                   part_rows=plan.part_rows if plan.split else 0,
                                   counters=opencl.counters(args.B) if fold else None)
        self._merge = None
        if plan.split and not fold:
            self._merge_sizes = opencl.merge_geometry.sizes(args.B * H, D)
            self._merge = merge.bind(vin=(ws[0], 0), sv=(ws[1], 0), indptr=tables["part_indptr"],
                                     fixed_k=-1, skip_single=1, n_states=plan.n_ws,
                                     out=None, lse=None, N=args.B, H=H, sink_logits=None,
                                     use_sinks=0)
        # the bound kernels of the build with the learned-sink epilogue: made by the first
        # run with sink_logits, from these (:meth:`_kernels`)
        self._with_sinks: tuple | None = None

    def _kernels(self, sinks: bool) -> tuple:
        """``(decode, merge)`` bound objects of the build with (``sinks``) or without the
        learned-sink epilogue (call under the step's lock)."""
        if not sinks:
            return self._decode, self._merge
        if self._with_sinks is None:
            decode, merge = self._opencl.decode_kernels(sinks=True, fold=self._fold)
            self._with_sinks = (self._decode.rebound(decode),
                                None if self._merge is None else self._merge.rebound(merge))
        return self._with_sinks

    def _fast_ok(self, q: Any, pages: Any, out: Any, lse: Any) -> bool:
        """True when every operand is a device array of this context with the right
        shape, dtype and layout (checked field by field, no error text built)."""
        ctx = self._rt.context
        for a, shape, dt in ((q, self._shapes[0], self._dtype),
                             (pages, self._shapes[1], self._pool_dtype),
                             (out, self._shapes[3], self._dtype),
                             (lse, self._shapes[2], LSE_DTYPE)):
            if a is not None and not launchable(a, ctx, shape, dt):
                return False
        return True

    def run(self, q: Any, pages: Any, *, out: Any = None, lse: Any = None, queue: Any = None,
            wait_for: list | None = None, sink_logits: Any = None) -> AttentionResult:
        """Attend one layer: ``q [B, H_qo, D]`` over ``pages [P, 2, H_kv, page_size, D]``.

        Arrays as in :meth:`clattn.BatchDecode.run` (numpy in and out, or device arrays
        of the decoder's context); ``pages`` must have the pool size the step was
        prepared for. Pass ``out=``/``lse=`` device arrays to keep the host path short.
        ``sink_logits`` (float32 ``[H_qo]``, optional): this layer's learned attention
        sinks, as in :meth:`clattn.BatchDecode.run`.

        Returns
        -------
        AttentionResult
            ``(out, lse, event)`` with ``.events``.
        """
        spec = self.decoder.spec
        check_sink_logits(spec, sink_logits)
        if not self._fast_ok(q, pages, out, lse):
            check_operands(spec, q, pages, out, lse, batch=self.batch, num_pages=self.num_pages)
        elif out is not None and lse is not None and queue is None and self.batch > 0 \
                and (sink_logits is None or not is_host(sink_logits)):
            return self._run_fast(q, pages, out, lse, wait_for, sink_logits)
        call = Call(self._rt, queue, wait_for)
        sinks = sink_args(call, sink_logits)
        dq, dpages = call.input("q", q), call.input("pages", pages)
        dout = call.output("out", out, self._shapes[3], self._dtype)
        dlse = call.output("lse", lse, self._shapes[2], LSE_DTYPE)
        events: tuple = ()
        if self.batch > 0:
            operands = dict(q=dq, pages=dpages, out=dout, lse=dlse, **sinks)
            with self._lock:
                decode, merge = self._kernels(sink_logits is not None)
                merging = None if merge is None else \
                    (merge.launch, *self._merge_sizes, dict(out=dout, lse=dlse, **sinks))
                events = self._opencl.decode_then_merge(
                    call.queue, call.wait_list(*self._table_events),
                    (decode.launch, *self._sizes, operands), merging, folded=self._fold)
                self._table_events = []  # once a launch waited for them (it may raise)
        o, s = call.finish([dout, dlse], events, host=is_host(q))
        return AttentionResult(o, s, events[-1] if events else None, tuple(events))

    def _run_fast(self, q: Any, pages: Any, out: Any, lse: Any, wait_for: list | None,
                  sink_logits: Any) -> AttentionResult:
        """The per-layer path: device operands already checked, outputs given
        (``sink_logits`` None or a checked device array)."""
        waits = events_list(wait_for)
        if sink_logits is not None and sink_logits.context != self._rt.context:
            raise ValueError("sink_logits: lives in another OpenCL context than the step's "
                             "device; create it in that device's context")
        for a in (q, pages, out, lse, sink_logits):
            if a is not None and a.events:
                waits.extend(a.events)
        sinks = dict(sink_logits=sink_logits, use_sinks=int(sink_logits is not None))
        operands = dict(q=q, pages=pages, out=out, lse=lse, **sinks)
        with self._lock:
            decode, merge = self._kernels(sink_logits is not None)
            merging = None if merge is None else \
                (merge.launch, *self._merge_sizes, dict(out=out, lse=lse, **sinks))
            waits.extend(self._table_events)
            events = self._opencl.decode_then_merge(
                self._rt.queue, waits, (decode.launch, *self._sizes, operands), merging,
                folded=self._fold)
            self._table_events = []  # once a launch waited for them (it may raise)
        # the launch waited for every earlier event of out and lse: its last event now
        # stands for all of them (pyopencl's add_event would block on old ones instead)
        out.events[:] = [events[-1]]
        lse.events[:] = [events[-1]]
        return AttentionResult(out, lse, events[-1], events)


def sink_args(call: Call, sink_logits: Any) -> dict:
    """The learned-sink arguments of the decode, merge and prefill kernels, by name
    (``sink_logits`` on the device, or None and the flag off)."""
    return dict(sink_logits=call.input("sink_logits", sink_logits),
                use_sinks=int(sink_logits is not None))


def upload_tables(call: Call, spec: Any, args: DecodeArgs, page_indptr: Any, page_indices: Any,
                  length_info: Any, window_offset: Any, sink_size: Any, q_pos: Any,
                  k_pos_offset: Any, rotary_mode: int) -> dict:
    """The decode kernel's table arguments by name, on the device."""
    named = dict(page_indptr=call.input("page_indptr", page_indptr),
                 page_indices=call.input("page_indices", page_indices),
                 num_pages=args.num_pages, nnz=args.nnz,
                 window_offset=None, sink_size=None, q_pos=None, k_pos_offset=None)
    if length_info is not None:
        packed = call.input("length_info", length_info)
        named["last_page_len"] = packed[0] if spec.sliding_window else packed
        if spec.sliding_window:  # rows 1 and 2 of the packed [3, B] table
            named["window_offset"], named["sink_size"] = packed[1], packed[2]
    else:
        named["last_page_len"] = call.input("last_page_len", args.last_page_len)
        if spec.sliding_window:
            named["window_offset"] = call.input("window_offset", window_offset)
            named["sink_size"] = call.input("sink_size", sink_size)
    if rotary_mode:
        named["q_pos"] = call.input("q_pos", q_pos)
        named["k_pos_offset"] = call.input("k_pos_offset", k_pos_offset)
    return named
