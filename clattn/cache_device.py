"""The KV cache's step on the device: tables, staging, append, copy, decode and prefill.

:class:`CacheDevice` runs the launches of :class:`clattn.PagedKVCache`'s steps on one
:class:`~clattn.opencl_backend.OpenCLBackend`, made from the spec, the backend, the
layers' pools and the cache's RoPE settings (:class:`CacheRope`); the cache keeps the
sequences, the page bookkeeping and the step's order of calls. The decode launch is
:class:`clattn.decode_launch.DecodeLaunch`'s.

Creating and typing a kernel object costs 0.3-1.3 ms on the CPU drivers and a pyopencl
array view 40 us, so a step sets the new tables (``(buffer, offset)`` pairs into one
upload) on kernel objects bound when the cache was made; its uploads go into a ring of
two table buffers, each reused once the launches of the step that last used it are done.
The split plan is kept while the batch is the same and no chunk has grown by a page (a
plan made for shorter chunks stays correct: the last partition runs to the chunk's end).
Where the profile's ``fold_merge`` is on, a split step launches the decode builds with
the split merge folded in and no merge; unsplit steps keep the plain builds (a CPU
compiler's code for them can lose speed to the mere presence of the fold's, as to the
sink epilogue's). On a CPU device with fine-grained SVM, an attend's host q, out and lse
(and a held append's k and v) go through one region of shared memory instead of write and
read commands (:mod:`clattn.shared_io`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import host_memory, runtime, signatures
from .cache_tables import PrefillRuns, StepTables
from .decode_launch import DecodeLaunch, make_plan, plan_launch
from .prefill import make_prefill_plan, queries_per_unit
from .quant import QUANTIZED, check_quantizable
from .result import AttentionResult
from .shared_io import MAX_SHARED_BYTES, SharedRegion, region_bytes, shares_host_memory
from .spec import AttentionSpec
from .staging import Call
from .validate import chunk_lengths, is_host, launchable

#: one write of a held append's host k, v and the layer's host q: each part starts at a
#: multiple of this many elements (the widest vector a kernel loads), as aligned as a
#: buffer's start
PACK_ALIGN = 16
#: the table arguments the decode and prefill kernels share, unset until a step sets them
TABLES = ("q", "pages", "out", "lse", "page_indptr", "page_indices", "last_page_len",
          "window_offset", "sink_size", "q_pos", "k_pos_offset")


@dataclass(frozen=True)
class CacheRope:
    """The cache's RoPE settings: ``mode`` None, ``"attend"`` or ``"append"`` (as
    :class:`clattn.PagedKVCache`'s ``rope``), the base, the position scale and the score
    scale."""

    mode: str | None
    theta: float
    scale: float
    sm_scale: float | None


def device_pools(opencl: Any, spec: AttentionSpec, num_pages: int, num_layers: int) -> list:
    """``num_layers`` zeroed pools of ``num_pages`` pages on ``opencl``'s device; a
    ValueError when one layer's pool is more than the device allocates at once."""
    rt = opencl.runtime
    shape = spec.pool_shape(num_pages)
    size = int(np.prod(shape)) * spec.pool_dtype.itemsize
    limit = int(rt.device.max_mem_alloc_size)
    if size > limit:
        raise ValueError(f"num_pages={num_pages}: one layer's pool is {size} bytes, more than "
                         f"{rt.device.name!r} allocates at once ({limit}); use fewer pages")
    cl, q = runtime.cl(), rt.queue
    pools = []
    for _ in range(num_layers):
        a = host_memory.empty(q, shape, spec.pool_dtype)
        a.events.append(cl.enqueue_fill_buffer(q, a.base_data, np.uint8(0), 0, size))
        pools.append(a)
    return pools


class CacheDevice:
    """The cache's bound kernel objects and its table and staging buffers on the device.

    Parameters
    ----------
    spec : AttentionSpec
        The cache's spec.
    opencl : OpenCLBackend
        The builds, the split workspace and the plans' tables.
    pools : list
        The layers' pools (device arrays), read at each launch (an entry may be replaced).
    num_pages : int
        Pages per pool.
    rope : CacheRope
        The cache's RoPE settings.

    Attributes
    ----------
    bytes_uploaded, launches, prefill_launches, prefill_units : int
        Bytes sent to the device (tables, k, v, q, sinks, masks), kernels enqueued,
        attend calls that ran the prefill kernel, and the work units (tiles of one
        sequence's queries) those launches ran, since it was made.
    """

    def __init__(self, spec: AttentionSpec, opencl: Any, pools: list, num_pages: int,
                 rope: CacheRope) -> None:
        self.spec = spec
        self.pools = pools
        self.rope = rope
        self.opencl = opencl
        self.num_pages = num_pages
        rt = opencl.runtime
        self.queue, self.ctx = rt.queue, rt.context
        self.bytes_uploaded = self.launches = self.prefill_launches = self.prefill_units = 0
        # on the runtime's in-order queue the launches are ordered by the queue itself: only
        # the caller's arrays bring events to wait for (an out-of-order queue: every one)
        cl = runtime.cl()
        self.in_order = not (self.queue.properties &
                             cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE)
        self.dtype = spec.np_dtype
        num_layers = len(pools)
        self.scalars = opencl.scalars(int(rope.mode == "attend"), rope.theta, rope.scale,
                                      rope.sm_scale)
        turns, long_from, att = opencl.rope_buffer(int(rope.mode == "append"), rope.theta,
                                                   rope.scale)
        # one-token steps of float pools: each layer's append deferred to its attend, one
        # launch of the decode kernel with the append fused in (signatures.DECODE_APPEND),
        # whose RoPE table and scalars are the append's with rope="append" (the decode then
        # rotates nothing), else the decode's
        fused = None
        if opencl.setup.profile.fuse_append and opencl.fused_decode_kernel() is not None:
            fused = dict(k=None, v=None, slots=None, k_pos=None,
                         append_rope=int(rope.mode == "append"))
            if rope.mode == "append":
                fused.update(rope_turns=turns, long_from=long_from, rope_att=att)
        self.decode = DecodeLaunch(opencl, dict(
            dict.fromkeys(TABLES), num_pages=num_pages, nnz=0, sink_logits=None, use_sinks=0,
            **self.scalars), fused)
        with self.decode.lock:  # the plain build bound now: the first step only sets tables
            self.decode.kernels(False, False, fused=fused is not None, merge=True)
        self.has_fused = fused is not None
        self.fuse = False  # the step in progress defers its appends
        self.sink_tables: dict = {}  # layer -> (numpy sink_logits, its device copy)
        self.prefill: Any = None  # the bound prefill kernel of the step's units
        self.prefill_geometry: Any = None  # ... and its geometry
        self.prefills: dict = {}  # queries per unit -> (bound prefill kernel, geometry)
        self.runs: PrefillRuns | None = None
        # byte pools: one flag per layer, set by the check pass to the epoch of an append
        # it refuses (the append then writes nothing); read back by end()
        self.quantized = spec.k_format in QUANTIZED or spec.v_format in QUANTIZED
        self.flags = None
        self.epoch = 0
        if spec.byte_pool:
            self.flags = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, 4 * num_layers)
            cl.enqueue_fill_buffer(self.queue, self.flags, np.int32(0), 0, 4 * num_layers)
        args = dict(k=None, v=None, pages=None, num_pages=num_pages, slots=None,
                    n_tokens=0, k_pos=None, rotary_mode=int(rope.mode == "append"),
                    rope_turns=turns, long_from=long_from, rope_att=att, flags=None, epoch=-1)
        self.append_k = opencl.append_kernel(signatures.APPEND).bind(**args)
        # the deferred append: (layer, k, v, events) on the device, or (layer, None, None,
        # events, HeldInputs) while its host k and v wait to go up with the layer's q
        self.pending: tuple | None = None
        self.check_k = opencl.append_kernel(signatures.APPEND_CHECK).bind(**args) \
            if self.quantized else None
        self.copy_k = opencl.append_kernel(signatures.PAGE_COPY).bind(
            pages=None, num_pages=num_pages, copies=None, n_copies=0)
        # [buffer, capacity (ints), its step's events, the upload into it]: pyopencl's event
        # of a copy from host memory waits for the copy when it is dropped, so the upload's
        # event is held here until the slot is reused two steps later (dropping it at the
        # first launch made every step wait for the previous one's kernels)
        self.ring = [[None, 0, [], None], [None, 0, [], None]]
        self.ring_at = 0
        # staging buffers [buffer, bytes, events after which it is free again]: host k, v
        # one write each; "held": a held append's k and v with the layer's q in one write
        self.stage = {"k": [None, 0, []], "v": [None, 0, []], "held": [None, 0, []]}
        # an attend's host q, out and lse (and a held append's k and v) in shared memory,
        # on a CPU device with fine-grained SVM: the launch is the layer's only command
        self.shared = SharedRegion(self.ctx) if shares_host_memory(rt.device) else None
        self.plan_key: Any = None
        self.plan = None

    @property
    def fused(self) -> Any:
        """The plain build's bound decode kernel with the append fused in (None where the
        profile's ``fuse_append`` is off or the build has no fused form)."""
        return self.decode.fused if self.has_fused else None

    @property
    def decode_sizes(self) -> tuple:
        """The step's decode launch ``(global, local)``."""
        return self.decode.plan.sizes

    def upload_events(self) -> tuple:
        """The table uploads held in the ring."""
        return tuple(slot[3] for slot in self.ring if slot[3] is not None)

    # -- per step --------------------------------------------------------------------
    def start(self, t: StepTables) -> None:
        """Upload the step's tables (once) and set them on the kernel objects."""
        cl = runtime.cl()
        runs = self.runs = t.prefill
        self.pending = None
        self.fuse = self.has_fused and runs is None and all(n == 1 for n in t.lengths)
        if runs is not None:  # the unit table travels in the step's one upload
            runs.units = make_prefill_plan(runs.n, runs.chunk, self._prefill_kernel(runs),
                                           runs.q_start).units
        packed, views = t.packed()
        slot = self.ring[self.ring_at]
        self.ring_at ^= 1
        if slot[1] < len(packed):
            slot[0] = cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY, max(len(packed), 256) * 4)
            slot[1] = max(len(packed), 256)
        upload = cl.enqueue_copy(self.queue, slot[0], packed, is_blocking=False,
                                 wait_for=slot[2] or None)
        self.bytes_uploaded += packed.nbytes
        slot[2] = self.events = [upload]  # the step's launches (the last one, in order)
        slot[3] = upload
        self.waits = [] if self.in_order else [upload]
        tab = {name: (slot[0], a) for name, (a, _) in views.items()}
        if runs is not None:
            self._start_prefill(t, runs, tab)
        if runs is None or runs.decode is not None:  # else the decode kernel is not launched
            self._start_decode(t, tab, "" if runs is None else "decode.")
        self._start_append(t, tab)

    def _start_decode(self, t: StepTables, tab: dict, pre: str) -> None:
        """Set the decode tables (``pre`` + name in ``tab``) and the split plan."""
        d = t if not pre else t.prefill.decode
        attend_rope = self.rope.mode == "attend"
        # a fused step attends a layer whose append ran on the decode: both take the tables
        self.decode.set(page_indptr=tab[pre + "page_indptr"],
                        page_indices=tab[pre + "page_indices"], nnz=len(d.page_indices),
                        last_page_len=tab[pre + "last_page_len"],
                        window_offset=tab.get(pre + "window_offset"),
                        sink_size=tab.get(pre + "sink_size"),
                        q_pos=tab["q_pos"] if attend_rope else None,
                        k_pos_offset=tab["k_pos_offset"] if attend_rope else None)
        plan, launch = self._plan(t, d), self.decode.plan
        if launch is None or launch.plan is not plan:  # a kept plan keeps its launch
            self.decode.set_plan(plan_launch(self.opencl, plan, t.T, self.queue))
        if self.fuse:
            self.decode.set_fused(slots=tab["slots"], k_pos=tab["k_pos"])

    def _start_append(self, t: StepTables, tab: dict) -> None:
        """Set the append (and page-copy) tables."""
        spec = self.spec
        D = spec.head_dim
        self.append_k.set(slots=tab["slots"], n_tokens=t.T, k_pos=tab["k_pos"])
        if self.check_k is not None:
            self.check_k.set(slots=tab["slots"], n_tokens=t.T, k_pos=tab["k_pos"])
        geom = self.opencl.append_geometry
        copy_rows = t.n_copies * len(spec.layout.kinds) * spec.num_kv_heads * spec.page_size
        if spec.byte_pool:  # one work-item per (token, head, kind, block); per copied row
            self.append_sizes = ((t.T * spec.num_kv_heads * spec.layout.row_blocks,), None)
        else:
            self.append_sizes = geom.sizes(t.T * spec.num_kv_heads, D)
        self.n_copies = t.n_copies
        if t.n_copies:
            self.copy_k.set(copies=tab["copies"], n_copies=t.n_copies)
            self.copy_sizes = ((copy_rows,), None) if spec.byte_pool else \
                geom.sizes(copy_rows, D)

    def _prefill_kernel(self, runs: PrefillRuns) -> int:
        """Bind the prefill kernel of the runs' units (built and fitted at the first step
        that needs it; clattn.prefill.queries_per_unit picks the units) as
        ``self.prefill``; returns its queries per work unit."""
        qb = queries_per_unit(self.opencl.prefill_geometry, runs.n, runs.chunk)
        bound = self.prefills.get(qb)
        if bound is None:
            kernel, geom = self.opencl.prefill_kernel_for(qb)
            bound = self.prefills[qb] = (kernel.bind(
                **dict.fromkeys(TABLES + ("units",)), num_pages=self.num_pages,
                total_q=0, nnz=0, q_pos_mode=0, batch=0, n_units=0, causal=1,
                mask=None, mask_indptr=None, mask_bytes=0, use_mask=0, sink_logits=None,
                use_sinks=0, **self.scalars), geom)
        self.prefill, self.prefill_geometry = bound
        return qb

    def _start_prefill(self, t: StepTables, runs: PrefillRuns, tab: dict) -> None:
        """Set the prefill runs' tables and unit table on the bound prefill kernel."""
        attend_rope = self.rope.mode == "attend"
        n_units = len(runs.units)
        self.prefill.set(page_indptr=tab["prefill.page_indptr"],
                         page_indices=tab["prefill.page_indices"], nnz=len(runs.page_indices),
                         last_page_len=tab["prefill.last_page_len"],
                         window_offset=tab.get("prefill.window_offset"),
                         sink_size=tab.get("prefill.sink_size"),
                         k_pos_offset=tab["prefill.k_pos_offset"] if attend_rope else None,
                         total_q=t.T, batch=len(runs.n), units=tab["prefill.units"],
                         n_units=n_units, **self._mask_args(t.mask))
        geom = self.prefill_geometry
        self.prefill_sizes = (geom.global_size(n_units, self.spec.num_kv_heads),
                              geom.local_size())

    def _mask_args(self, mask: tuple | None) -> dict:
        """The prefill kernel's mask arguments for the step's packed mask (uploaded)."""
        if mask is None:
            return dict(mask=None, mask_indptr=None, mask_bytes=0, use_mask=0)
        call = Call(self.opencl.runtime, self.queue)
        bits, indptr = call.input("custom_mask", mask[0]), call.input("mask_indptr", mask[1])
        self.bytes_uploaded += mask[0].nbytes + mask[1].nbytes
        return dict(mask=bits, mask_indptr=indptr, mask_bytes=len(mask[0]), use_mask=1)

    def _plan(self, t: StepTables, d: Any) -> Any:
        """The split plan of the decode tables ``d``: the last one while it still fits
        this batch, else a new one (always a new one for the decode rows of a step with
        prefill runs)."""
        last = self.plan
        key = (t.seq_ids, t.lengths) if d is t else None
        ps = self.spec.page_size
        if last is not None and key is not None and key == self.plan_key and \
                np.all((t.chunk >= last.chunk) & (t.chunk < last.chunk + ps)):
            return last
        chunk = chunk_lengths(self.spec, d.page_indptr, d.last_page_len,
                              window_offset=d.window_offset, sink_size=d.sink_size)
        plan = make_plan(self.opencl, chunk, None)
        self.plan, self.plan_key = plan, key
        if plan.split:
            self.bytes_uploaded += plan.part_indptr.nbytes
        return plan

    # -- per layer -------------------------------------------------------------------
    def ready(self, a: Any, shape: tuple, dtype: Any = None) -> bool:
        """True for a device array of the cache's context with the given shape and dtype
        (checked field by field; anything else takes the checked path)."""
        return launchable(a, self.ctx, shape, dtype or self.dtype)

    def sinks(self, layer: int, sink_logits: Any) -> Any:
        """``sink_logits`` (checked) on the device: a device array as it is; a numpy array
        uploaded once for ``layer`` and kept while the layer's values stay the same."""
        if sink_logits is None:
            return None
        if not is_host(sink_logits):
            if sink_logits.context != self.ctx:
                raise ValueError("attend: sink_logits lives in another OpenCL context than "
                                 "the cache's device")
            return sink_logits
        hit = self.sink_tables.get(layer)
        if hit is None or not np.array_equal(hit[0], sink_logits):
            dev = runtime.cl().array.to_device(self.queue, np.ascontiguousarray(sink_logits))
            self.bytes_uploaded += sink_logits.nbytes
            hit = self.sink_tables[layer] = (sink_logits.copy(), dev)
        return hit[1]

    def _device_input(self, name: str, a: Any, held: bool = False) -> tuple[Any, list]:
        """``(buffer or array, events)`` of k or v: a numpy array copied into the cache's
        staging buffer (no new buffer per call); a device array as is, or (``held``: the
        append is held for the layer's attend) copied into the staging buffer now.

        The caller may reuse a numpy ``a`` once ``append`` returns: the upload reads a
        private snapshot taken here, never ``a`` itself (a non-blocking write reads its
        host memory whenever the queue reaches it)."""
        cl = runtime.cl()
        if not is_host(a):
            if a.context != self.ctx:
                raise ValueError(f"append: {name} lives in another OpenCL context than the "
                                 f"cache's device")
            if not held:
                return a, list(a.events)
        else:
            a = np.array(a, order="C", copy=True)
        st = self.stage[name]
        if st[1] < a.nbytes:
            st[0], st[1] = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, a.nbytes), a.nbytes
        if not is_host(a):  # a device-to-device copy, after the array's own writes
            evt = cl.enqueue_copy(self.queue, st[0], a.base_data, byte_count=a.nbytes,
                                  src_offset=a.offset,
                                  wait_for=(st[2] + list(a.events)) or None)
            return (st[0], 0), [evt]
        evt = cl.enqueue_copy(self.queue, st[0], a, is_blocking=False, wait_for=st[2] or None)
        self.bytes_uploaded += a.nbytes
        return (st[0], 0), [evt]

    def _track(self, evt: Any) -> None:
        if self.in_order:
            self.events[:] = [evt]
        else:
            self.events.append(evt)

    def copy(self, pool: Any, waits: list | None = None) -> Any:
        """The step's copy-on-write copies in ``pool``; returns the event."""
        if not self.in_order:
            waits = self.waits + pool.events + (waits or [])
        evt = self.copy_k.launch(self.queue, *self.copy_sizes, waits, pages=pool)
        self.launches += 1
        pool.events[:] = [evt]
        self._track(evt)
        return evt

    def append(self, layer: int, k: Any, v: Any, checks: dict) -> Any:
        """Write k, v into layer's pool; a byte pool's device check is recorded in
        ``checks`` (layer -> epoch) for :meth:`refused`."""
        spec = self.spec
        vik = spec.value_in_key   # v is None: the kernels read no value rows
        host = self.quantized and is_host(k) and (vik or is_host(v))
        # keys rotated by the append kernel: inf/NaN are refused here (a rotation keeps
        # them non-finite), a scale overflow of the rotated block only by the device check
        verified = host and self.rope.mode != "append"
        if host:  # refused here, before anything is uploaded or written
            check_quantizable(k, spec.k_format, "k", scale=verified)
            if not vik:
                check_quantizable(v, spec.v_format, "v")
        self.flush()  # the staging buffers hold one layer's k, v at a time
        pool = self.pools[layer]
        if self.fuse and is_host(k) and (vik or is_host(v)):
            held = HeldInputs.of(k, None if vik else v, self._q_elems(k.shape[0]))
            return self._defer(layer, pool, None, None, [], held)
        dk, ek = self._device_input("k", k, held=self.fuse)
        dv, ev = (dk, []) if vik else self._device_input("v", v, held=self.fuse)
        if self.fuse:
            return self._defer(layer, pool, dk, dv, ek + ev)
        waits = ek + ev if self.in_order else self.waits + pool.events + ek + ev
        if self.n_copies:  # copy-on-write first: the appends may land in the copies
            waits = [self.copy(pool, ek + ev)]
        extra = {}
        if self.flags is not None:
            self.epoch = self.epoch % (2**31 - 2) + 1
            extra = dict(flags=(self.flags, layer), epoch=self.epoch)
            checks.pop(layer, None)
            if self.quantized and not verified:
                waits = [self.check_k.launch(self.queue, *self.append_sizes, waits, k=dk, v=dv,
                                             pages=pool, **extra)]
                self.launches += 1
                checks[layer] = self.epoch
        evt = self.append_k.launch(self.queue, *self.append_sizes, waits, k=dk, v=dv, pages=pool,
                                   **extra)
        self.launches += 1
        self._written(pool, evt)
        return evt

    def _written(self, pool: Any, evt: Any) -> None:
        """Bookkeeping of a launch ``evt`` that wrote the step's rows into ``pool``."""
        pool.events[:] = [evt]
        if not self.in_order:
            for st in self.stage.values():
                st[2] = [evt]  # the staging buffers are free again once this append has run
        self._track(evt)

    # -- the fused append ------------------------------------------------------------
    def _defer(self, layer: int, pool: Any, dk: Any, dv: Any, events: list,
               held: HeldInputs | None = None) -> None:
        """Hold layer's append for its attend launch (the page copies run now: the write
        may land in a copy). Returns None: there is no write event yet."""
        if self.n_copies:
            events = [self.copy(pool, events)]
        self.pending = (layer, dk, dv, events) if held is None else \
            (layer, None, None, events, held)

    def _q_elems(self, tokens: int) -> int:
        """Elements of the step's q."""
        return tokens * self.spec.num_qo_heads * self.spec.head_dim

    def takes_host_q(self, layer: int) -> bool:
        """True when ``layer``'s held append waits for a host q to go up with it."""
        return self.pending is not None and self.pending[0] == layer and len(self.pending) == 5

    def _upload_held(self, q: np.ndarray | None) -> tuple[Any, Any, Any, list]:
        """The held append's k and v (and ``q``, a host array, when given) in one write:
        ``(k, v, q or None, events)`` on the device."""
        layer, _, _, events, held = self.pending
        data = held.with_q(q)
        cl = runtime.cl()
        st = self.stage["held"]
        if st[1] < data.nbytes:
            st[0], st[1] = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, data.nbytes), data.nbytes
        evt = cl.enqueue_copy(self.queue, st[0], data, is_blocking=False, wait_for=st[2] or None)
        self.bytes_uploaded += data.nbytes
        self.pending = (layer, (st[0], 0), (st[0], held.at_v), events + [evt])
        return (st[0], 0), (st[0], held.at_v), (st[0], held.at_q) if q is not None else None, \
            events + [evt]

    def flush(self) -> None:
        """Launch the deferred append on the append kernel (its layer was not attended
        before the next append, end or cancel)."""
        if self.pending is None:
            return
        if self.takes_host_q(self.pending[0]):
            self._upload_held(None)
        layer, dk, dv, events = self.pending
        self.pending = None
        pool = self.pools[layer]
        waits = events if self.in_order else self.waits + pool.events + events
        evt = self.append_k.launch(self.queue, *self.append_sizes, waits, k=dk, v=dv,
                                   pages=pool)
        self.launches += 1
        self._written(pool, evt)

    def refused(self, checks: dict) -> list:
        """The layers of ``checks`` (layer -> epoch) whose append the device check refused
        (those appends wrote nothing)."""
        flags = np.empty(len(self.pools), np.int32)
        runtime.cl().enqueue_copy(self.queue, flags, self.flags, is_blocking=True)
        return [layer for layer, epoch in sorted(checks.items()) if flags[layer] == epoch]

    def _shared_layout(self, layer: int, tokens: int) -> tuple[int, int, int]:
        """Byte offsets of the out and lse parts of the shared region, and the bytes it
        needs, for an attend of ``tokens`` new tokens (inputs first: the layer's held k
        and v with room for q, or q alone)."""
        spec = self.spec
        item = self.dtype.itemsize
        held = self.pending[4].data.nbytes if self.takes_host_q(layer) else 0
        at_out = region_bytes(held or self._q_elems(tokens) * item)
        at_lse = at_out + region_bytes(tokens * spec.num_qo_heads * spec.head_dim_v * item)
        return at_out, at_lse, at_lse + tokens * spec.num_qo_heads * 4

    def shares_host_io(self, layer: int, tokens: int) -> bool:
        """True when ``layer``'s attend of ``tokens`` new tokens with host q, out and lse
        goes through shared memory (:mod:`clattn.shared_io`): no write or read command."""
        return self.shared is not None and \
            self._shared_layout(layer, tokens)[2] <= MAX_SHARED_BYTES

    def attend_host(self, layer: int, q: np.ndarray, out: np.ndarray | None,
                    lse: np.ndarray | None, sinks: Any = None) -> AttentionResult:
        """:meth:`attend` with host ``q`` and host ``out``/``lse`` (None: new arrays)
        through shared memory (:meth:`shares_host_io` said yes): q, and the layer's held
        k and v, copied in; the launch; its wait; out and lse copied out. Returns once
        every launch that read the region is complete (the region's rule); the caller's
        arrays are written only then."""
        spec, dt = self.spec, self.dtype
        T, H = q.shape[0], spec.num_qo_heads
        at_out, at_lse, size = self._shared_layout(layer, T)
        region = self.shared.take(size)
        pending = self.pending
        held = pending[4] if self.takes_host_q(layer) else None
        at_q = held.at_q if held is not None else 0
        inputs = region.view(dt, 0, (at_q + q.size,))
        if held is not None:
            inputs[:at_q] = held.data[:at_q]
            self.pending = (layer, region.operand(dt, 0),
                            region.operand(dt, held.at_v * dt.itemsize), pending[3])
        inputs[at_q:] = q.reshape(-1)
        try:
            res = self.attend(layer, region.operand(dt, at_q * dt.itemsize),
                              region.operand(dt, at_out), region.operand(np.float32, at_lse),
                              waits=[], sinks=sinks)
        except BaseException:
            self.queue.finish()  # whatever it enqueued has stopped using the region
            if self.pending is not None and held is not None:
                self.pending = pending  # still held: a later flush uploads it as before
            raise
        self.bytes_uploaded += inputs.nbytes
        res.event.wait()
        o = region.view(dt, at_out, (T, H, spec.head_dim_v))
        s = region.view(np.float32, at_lse, (T, H))
        if out is None:
            out = o.copy()
        else:
            out[...] = o
        if lse is None:
            lse = s.copy()
        else:
            lse[...] = s
        return AttentionResult(out, lse, res.event, res.events)

    def attend(self, layer: int, q: Any, out: Any, lse: Any, waits: list | None = None,
               sinks: Any = None) -> AttentionResult:
        """Launch the step's kernels for one layer: decode (with the layer's deferred
        append fused in), prefill, or decode then prefill (the prefill launch writes the
        rows the decode launch left empty); ``sinks``: the layer's learned sinks on the
        device (:meth:`sinks`) or None."""
        pool = self.pools[layer]
        if is_host(q):  # a host q goes up with the layer's held k and v (takes_host_q)
            if not self.takes_host_q(layer):
                raise ValueError("attend: a host q is taken only beside a held append")
            _, _, q, _ = self._upload_held(q)
            waits = out.events + lse.events
        else:
            waits = waits if waits is not None else q.events + out.events + lse.events
        if sinks is not None and sinks.events:
            waits = waits + list(sinks.events)
        fused = None
        if self.pending is not None and self.pending[0] == layer:
            if not self.decode.fuses(sinks is not None):
                self.flush()  # that build has no fused form: the append launched first
            else:
                if self.takes_host_q(layer):  # a device q: k and v go up alone
                    self._upload_held(None)
                fused = self.pending  # held until its launch is enqueued (a launch that
                waits = waits + fused[3]  # raises leaves it for flush())
        if not self.in_order:
            waits = self.waits + pool.events + waits
        operands = dict(q=q, pages=pool, out=out, lse=lse, sink_logits=sinks,
                        use_sinks=int(sinks is not None))
        if fused is not None:
            evts = self.decode.launch(self.queue, waits, operands, dict(k=fused[1], v=fused[2]),
                                      queue_orders=self.in_order)
            self.pending = None
            self._written(pool, evts[0])
        elif self.runs is None:
            evts = self.decode.launch(self.queue, waits, operands, queue_orders=self.in_order)
        else:
            evts = ()
            if self.runs.decode is not None:
                evts = self.decode.launch(self.queue, waits, operands,
                                          queue_orders=self.in_order)
                waits = [] if self.in_order else [evts[-1]]
            evts += (self.prefill.launch(self.queue, *self.prefill_sizes, waits, q=q,
                                         pages=pool, out=out, lse=lse, sink_logits=sinks,
                                         use_sinks=int(sinks is not None)),)
            self.prefill_launches += 1
            self.prefill_units += len(self.runs.units)
        self.launches += len(evts)
        if not self.in_order:
            pool.events.append(evts[0])  # the next write of the pool waits for this read
            if len(evts) > 1:
                pool.events.append(evts[-1])
        for a in (out, lse):
            if hasattr(a, "events"):  # device arrays (parts of the shared region: none)
                a.events[:] = [evts[-1]]
        self._track(evts[-1])
        return AttentionResult(out, lse, evts[-1], tuple(evts))


@dataclass(frozen=True)
class HeldInputs:
    """A held append's host k and v, copied (the caller may reuse its arrays once
    ``append`` returns) into one array with room for the layer's q: k at 0, v at
    ``at_v``, q at ``at_q`` (each at a multiple of :data:`PACK_ALIGN` elements)."""

    data: np.ndarray
    at_v: int
    at_q: int

    @staticmethod
    def of(k: np.ndarray, v: np.ndarray | None, q_elems: int) -> "HeldInputs":
        def aligned(n: int) -> int:
            return -(-n // PACK_ALIGN) * PACK_ALIGN

        end_k = aligned(k.size)
        at_v = end_k if v is not None else 0  # v None: the values are in the key rows
        at_q = end_k + (aligned(v.size) if v is not None else 0)
        data = np.empty(at_q + q_elems, k.dtype)
        data[:k.size] = k.reshape(-1)
        if v is not None:
            data[at_v:at_v + v.size] = v.reshape(-1)
        return HeldInputs(data, at_v, at_q)

    def with_q(self, q: np.ndarray | None) -> np.ndarray:
        """The array to write: k and v, and ``q`` when given (copied in here)."""
        if q is None:
            return self.data[:self.at_q]
        self.data[self.at_q:] = q.reshape(-1)
        return self.data


def short(items: Sequence) -> str:
    """``items`` as a list, the first 8 and an ellipsis when longer."""
    items = list(items)
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"
