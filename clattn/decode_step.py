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

from .decode_launch import DecodeLaunch, PlanLaunch
from .result import AttentionResult
from .spec import LSE_DTYPE
from .staging import Call, events_list, sink_args
from .validate import DecodeArgs, check_operands, check_sink_logits, is_host, launchable


class DecodeStep:
    """One batch's decode tables on the device; :meth:`run` attends one layer.

    Made by :meth:`clattn.BatchDecode.prepare`. A step may be run from several threads
    (launches are serialised on it); split steps order their launches on the decoder's
    workspace (:meth:`clattn.opencl_backend.OpenCLBackend.decode_then_merge`), in one
    launch per layer where the profile folds the merge in
    (:meth:`~clattn.opencl_backend.OpenCLBackend.folds`).
    """

    def __init__(self, dec: Any, args: DecodeArgs, launch: PlanLaunch, tables: dict,
                 events: list, num_pages: int) -> None:
        self.decoder = dec
        self.plan = launch.plan
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
        self._launch = DecodeLaunch(opencl, dict(q=None, pages=None, out=None, lse=None,
                                                 sink_logits=None, use_sinks=0, **tables))
        self._launch.set_plan(launch)
        with self._launch.lock:  # the plain build bound now: the first run only launches
            self._launch.kernels(False, launch.fold, merge=launch.merge_args is not None)

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
                events = self._launch.launch(call.queue, call.wait_list(*self._table_events),
                                             operands)
                self._table_events = []  # once a launch waited for them (it may raise)
        o, s = call.finish([dout, dlse], events, host=is_host(q))
        return AttentionResult(o, s, events[-1] if events else None, tuple(events))

    def _run_fast(self, q: Any, pages: Any, out: Any, lse: Any, wait_for: list | None,
                  sink_logits: Any) -> AttentionResult:
        """The per-layer path: device operands already checked, outputs given
        (``sink_logits`` None or a checked device array)."""
        waits = events_list(wait_for, self._rt)
        if sink_logits is not None and sink_logits.context != self._rt.context:
            raise ValueError("sink_logits: lives in another OpenCL context than the step's "
                             "device; create it in that device's context")
        for a in (q, pages, out, lse, sink_logits):
            if a is not None and a.events:
                waits.extend(a.events)
        sinks = dict(sink_logits=sink_logits, use_sinks=int(sink_logits is not None))
        operands = dict(q=q, pages=pages, out=out, lse=lse, **sinks)
        with self._lock:
            waits.extend(self._table_events)
            events = self._launch.launch(self._rt.queue, waits, operands)
            self._table_events = []  # once a launch waited for them (it may raise)
        # the launch waited for every earlier event of out and lse: its last event now
        # stands for all of them (pyopencl's add_event would block on old ones instead)
        out.events[:] = [events[-1]]
        lse.events[:] = [events[-1]]
        return AttentionResult(out, lse, events[-1], events)
