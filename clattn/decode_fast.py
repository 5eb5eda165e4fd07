"""The short host path of a one-call decode: device arrays, a plan, ``out=``/``lse=`` given.

:meth:`clattn.BatchDecode.run` offers each call to :meth:`OneCallPath.run` first. It
takes the call only when every array is a device array of the decoder's context whose
shape, dtype and layout are exactly what the call needs (checked field by field on the
arrays of this call, every call), the plan was made for the call's batch, no queue is
given and the batch is not empty (``sink_logits``, when given, a float32 device array of
the context too); anything else returns None and the call takes the
checked path, which raises the contract's errors. What is kept between calls:

* the scalars (``rotary_mode``, ``rope_scale``, ``rope_theta``, ``sm_scale``) checked once
  per distinct value and type, with their kernel arguments;
* the last plan's launch (:class:`clattn.decode_launch.PlanLaunch`: sizes, plan table,
  split and merge arguments, whether the merge is folded in);
* one bound decode and merge kernel object per build
  (:class:`clattn.decode_launch.DecodeLaunch`), on which a launch sets only the arguments
  that changed since the last.

Device tables' values are not read on this path, as on the checked path (the kernels
clamp every index they read from them).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .decode_launch import DecodeLaunch, PlanLaunch, plan_launch
from .plan import Plan
from .result import AttentionResult
from .spec import INDEX_DTYPE, INT32_MAX, LSE_DTYPE
from .staging import events_list
from .validate import check_rope_scalars, check_sm_scale, launchable

SCALARS_KEPT = 8  # distinct scalar sets kept (a caller varying rope_scale stays bounded)


class OneCallPath:
    """The kept state of :class:`clattn.BatchDecode`'s short path on one device.

    Parameters
    ----------
    spec : AttentionSpec
        The decoder's spec.
    opencl : OpenCLBackend
        The decoder's kernels, workspace and plan tables.
    """

    def __init__(self, spec: Any, opencl: Any) -> None:
        self.spec = spec
        self.opencl = opencl
        self.ctx = opencl.runtime.context
        self.queue = opencl.runtime.queue
        self.dtype = spec.np_dtype
        self.pool_dtype = spec.pool_dtype
        self.heads = (spec.num_qo_heads, spec.head_dim)
        self.width_v = spec.head_dim_v  # out's and the split states' width
        self._pool_ndim = len(spec.pool_shape(1))
        self._pool_row = spec.pool_shape(1)[1:]
        self._scalars: dict = {}
        self._launch: DecodeLaunch | None = None  # bound by the first call, over its arguments
        self._plan: PlanLaunch | None = None  # the last call's plan
        self._lock = threading.Lock()

    def _ok(self, a: Any, shape: tuple, dtype: Any) -> bool:
        """``a`` is a device array of this context the kernels take as it is."""
        return launchable(a, self.ctx, shape, dtype)

    def _scalar_args(self, rotary_mode: Any, rope_scale: Any, rope_theta: Any,
                     sm_scale: Any) -> dict | None:
        """The kernel's scalar arguments, or None when a value is refused (the checked
        path then says why). Checked once per distinct values and types."""
        key = (rotary_mode.__class__, rotary_mode, rope_scale.__class__, rope_scale,
               rope_theta.__class__, rope_theta, sm_scale.__class__, sm_scale)
        hit = self._scalars.get(key)
        if hit is not None:
            return hit
        if rotary_mode.__class__ is not int or rotary_mode not in (0, 1):
            return None
        try:
            if rotary_mode:
                check_rope_scalars(rope_theta, rope_scale)
            check_sm_scale(sm_scale)
        except (TypeError, ValueError):
            return None
        hit = self.opencl.scalars(rotary_mode, rope_theta, rope_scale, sm_scale)
        with self._lock:
            while len(self._scalars) >= SCALARS_KEPT:
                self._scalars.pop(next(iter(self._scalars)))
            self._scalars[key] = hit
        return hit

    def _tables(self, B: int, page_indptr: Any, page_indices: Any, last_page_len: Any,
                length_info: Any, window_offset: Any, sink_size: Any, q_pos: Any,
                k_pos_offset: Any, rotary_mode: int) -> dict | None:
        """The table arguments by name when every table is a device array of the call's
        batch, else None."""
        ok, idx = self._ok, INDEX_DTYPE
        if not ok(page_indptr, (B + 1,), idx) or not hasattr(page_indices, "base_data") or \
                len(page_indices.shape) != 1 or not ok(page_indices, page_indices.shape, idx):
            return None
        nnz = page_indices.shape[0]
        if nnz * self.spec.page_size > INT32_MAX:
            return None
        window = self.spec.sliding_window
        named = dict(page_indptr=page_indptr, page_indices=page_indices, nnz=nnz,
                     window_offset=None, sink_size=None, q_pos=None, k_pos_offset=None)
        if length_info is not None:
            if last_page_len is not None or window_offset is not None or sink_size is not None \
                    or not ok(length_info, (3, B) if window else (B,), idx) or \
                    length_info.offset % idx.itemsize:
                return None
            if window:  # rows 0, 1 and 2 of the packed [3, B] table, without array views
                buf, first = length_info.base_data, length_info.offset // INDEX_DTYPE.itemsize
                named.update(last_page_len=(buf, first), window_offset=(buf, first + B),
                             sink_size=(buf, first + 2 * B))
            else:
                named["last_page_len"] = length_info
        else:
            if last_page_len is None or not ok(last_page_len, (B,), idx):
                return None
            named["last_page_len"] = last_page_len
            if window:
                if window_offset is None or sink_size is None or \
                        not ok(window_offset, (B,), idx) or not ok(sink_size, (B,), idx):
                    return None
                named.update(window_offset=window_offset, sink_size=sink_size)
            elif window_offset is not None or sink_size is not None:
                return None
        if rotary_mode:
            if q_pos is None or k_pos_offset is None or not ok(q_pos, (B,), idx) or \
                    not ok(k_pos_offset, (B,), idx):
                return None
            named.update(q_pos=q_pos, k_pos_offset=k_pos_offset)
        return named

    def run(self, q: Any, pages: Any, page_indptr: Any, page_indices: Any, last_page_len: Any,
            length_info: Any, window_offset: Any, sink_size: Any, q_pos: Any,
            k_pos_offset: Any, rotary_mode: Any, rope_scale: Any, rope_theta: Any,
            sm_scale: Any, out: Any, lse: Any, plan: Any, wait_for: Any,
            sink_logits: Any = None) -> AttentionResult | None:
        """Launch the call on the short path, or return None (nothing done) when it does
        not qualify; arguments as :meth:`clattn.BatchDecode.run`'s."""
        if plan.__class__ is not Plan or not hasattr(q, "base_data") or len(q.shape) != 3:
            return None
        B = q.shape[0]
        H, D = self.heads
        if B < 1 or len(plan.part_indptr) != B + 1 or not self._ok(q, (B, H, D), self.dtype) \
                or not self._ok(out, (B, H, self.width_v), self.dtype) or \
                not self._ok(lse, (B, H), LSE_DTYPE) or not hasattr(pages, "base_data") or \
                len(pages.shape) != self._pool_ndim or pages.shape[1:] != self._pool_row or \
                not self._ok(pages, pages.shape, self.pool_dtype) or pages.shape[0] > INT32_MAX or \
                (sink_logits is not None and not self._ok(sink_logits, (H,), np.float32)):
            return None
        scalars = self._scalar_args(rotary_mode, rope_scale, rope_theta, sm_scale)
        if scalars is None:
            return None
        named = self._tables(B, page_indptr, page_indices, last_page_len, length_info,
                             window_offset, sink_size, q_pos, k_pos_offset, rotary_mode)
        if named is None:
            return None
        waits = events_list(wait_for, self.opencl.runtime)
        sinks = dict(sink_logits=sink_logits, use_sinks=int(sink_logits is not None))
        named.update(q=q, pages=pages, out=out, lse=lse, num_pages=pages.shape[0], **sinks,
                     **scalars)
        with self._lock:
            launch = self._launch
            if launch is None:
                launch = self._launch = DecodeLaunch(self.opencl, named)
            pl = self._plan
            if pl is None or pl.plan is not plan:
                pl = self._plan = plan_launch(self.opencl, plan, B, self.queue)
        for a in (q, pages, out, lse, page_indptr, page_indices, length_info, last_page_len,
                  window_offset, sink_size, named["q_pos"], named["k_pos_offset"], pl.table,
                  sink_logits):
            if a is not None and a.events:
                waits.extend(a.events)
        events = launch.launch(self.queue, waits, named, plan=pl)
        # the launch waited for every earlier event of out and lse: its last event now
        # stands for all of them (pyopencl's add_event would block on old ones instead)
        out.events[:] = [events[-1]]
        lse.events[:] = [events[-1]]
        return AttentionResult(out, lse, events[-1], events)
