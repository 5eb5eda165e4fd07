"""A paged KV cache an app can run: a page pool per layer, sequences, and a decode step.

:class:`PagedKVCache` owns, for one model (an :class:`~clattn.AttentionSpec` and a number
of layers) on one device, a pool of pages per layer allocated once, the free-page
accounting, and each sequence's page list. A model step is::

    cache.begin(seq_ids, lengths)          # reserve slots, build and upload the tables once
    for layer in range(num_layers):
        cache.append(layer, k, v)          # the new tokens' keys and values (append kernel)
        out, lse, event = cache.attend(layer, q)
    cache.end()                            # commit the lengths

``begin`` chooses the kernels of the step: the tokens of a prompt chunk run on the
prefill kernel over the cache's own tables (one launch per layer), single tokens on the
decode kernel, a mixed step on both (:func:`clattn.cache_tables.prefill_runs` says which
tokens go where). Sequences are added, removed, forked (the child shares the parent's
pages; the first write into a shared, partly filled page copies it on the device), popped
(speculative decoding rollback) and may keep a sliding window with attention sinks (whole
pages that fall out of the window go back to the pool). docs/cache.md states the semantics; the
page bookkeeping itself is :mod:`clattn.cache_tables`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from . import cpu_backend, host_memory, runtime, signatures, validate
from .cache_tables import CacheFullError, PageTable, PrefillRuns, StepTables, prefill_runs
from .decode import BatchDecode
from .device import warn_notes
from .mask import check_step_masks, step_mask
from .numbers import is_int
from .prefill import make_prefill_plan
from .quant import QUANTIZED, check_quantizable, quantize, region_views
from .result import AttentionResult
from .rope import parse_rope_scaling, rope_tables, rotate
from .spec import INT32_MAX, LSE_DTYPE, AttentionSpec
from .staging import Call
from .validate import check_array, is_host, launchable

__all__ = ["PagedKVCache", "CacheFullError", "CacheStats", "LayerIndexError", "StepError",
           "StepShapeError"]

ROPE_MODES = (None, "attend", "append")


class LayerIndexError(IndexError):
    """A layer index outside ``0 .. num_layers - 1``."""


class StepError(RuntimeError):
    """A step call out of order (append before begin, end before every layer's append, ...)."""


class StepShapeError(ValueError):
    """An append or attend whose arrays disagree with the step that begin() made."""


@dataclass(frozen=True)
class CacheStats:
    """What :meth:`PagedKVCache.stats` reports.

    ``pages_shared``: pages more than one sequence holds (forks); ``pages_reserved``:
    pages taken by the step in progress; ``bytes_per_token``: pool bytes one token takes
    over all layers; ``free_tokens``: the longest context the free pages still hold;
    ``prefill_launches``: attend calls that ran the prefill kernel since the cache was
    made (one per layer of a step with prompt chunks); ``launches``: kernels the cache
    enqueued since it was made (page copies, appends, decode, merge, prefill; 0 on the CPU
    backend), so a step's launches per layer are its difference over ``num_layers``.
    """

    num_pages: int
    page_size: int
    pages_used: int
    pages_free: int
    pages_shared: int
    pages_reserved: int
    sequences: int
    bytes_per_token: int
    pool_bytes: int
    free_tokens: int
    prefill_launches: int = 0
    launches: int = 0

    def __str__(self) -> str:
        return (f"{self.pages_used}/{self.num_pages} pages used ({self.pages_shared} shared, "
                f"{self.pages_reserved} reserved by the step), {self.pages_free} free: "
                f"{self.free_tokens} more tokens at {self.bytes_per_token} bytes per token "
                f"(all layers); {self.sequences} sequences")


class PagedKVCache:
    """Paged KV cache for ``num_layers`` layers of one model on one device.

    Parameters
    ----------
    spec : AttentionSpec
        The model's attention (heads, head_dim, page size, dtype, window, RoPE scaling).
        ``spec.sliding_window`` must be True for sequences with a window.
    num_layers : int
        Layers; each has its own pool ``[num_pages, 2, H_kv, page_size, D]``, or the
        byte pool ``uint8 [num_pages, page_bytes]`` of :mod:`clattn.quant` when
        ``spec.k_format``/``spec.v_format`` store q8_0/q4_0 blocks (quantized on append;
        docs/cache.md, "Quantized pages").
    num_pages : int, optional
        Pages per layer's pool. Exactly one of ``num_pages`` and ``budget_bytes``.
    budget_bytes : int, optional
        Bytes for all the pools together; ``num_pages`` is what fits.
    device, profile, backend
        As in :class:`~clattn.BatchDecode`; ``backend="cpu"`` keeps numpy pools and runs
        the CPU backend through the same API.
    rope : {None, "attend", "append"}
        None: keys are stored as given and nothing is rotated (the app rotates q and k).
        ``"attend"``: keys stored unrotated, q and keys rotated inside the decode kernel
        at chunk positions (``k_pos_offset + row``; windows keep positions contiguous).
        ``"append"``: keys rotated by the append kernel at their absolute positions
        (``pos_offset + token index``); the app rotates q at :attr:`positions`.
    rope_theta, rope_scale, sm_scale
        As in :meth:`~clattn.BatchDecode.run`.
    rollback : int
        Tokens behind each window whose pages are kept, so that :meth:`pop` can take back
        that many tokens of a windowed sequence (speculative decoding); 0 gives back
        every page that falls out of a window at once.
    prefill : bool
        True: the tokens of a prompt chunk attend on the prefill kernel (see
        :meth:`begin`); False: every token on the decode kernel, one causal row each.

    Examples
    --------
    >>> cache = PagedKVCache(spec, 32, num_pages=4096)          # doctest: +SKIP
    >>> cache.add("a"); cache.add("b")                         # doctest: +SKIP
    >>> cache.begin(["a", "b"])                                # doctest: +SKIP
    >>> for layer in range(32):                                # doctest: +SKIP
    ...     cache.append(layer, k[layer], v[layer])
    ...     out = cache.attend(layer, q[layer]).out
    >>> cache.end()                                            # doctest: +SKIP
    """

    def __init__(self, spec: AttentionSpec, num_layers: int, *, num_pages: int | None = None,
                 budget_bytes: int | None = None, device: Any = None, profile: Any = None,
                 backend: str = "auto", rope: str | None = None, rope_theta: float = 1e4,
                 rope_scale: float = 1.0, sm_scale: float | None = None,
                 rollback: int = 0, prefill: bool = True) -> None:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        if not is_int(num_layers) or num_layers < 1:
            raise ValueError(f"num_layers={num_layers!r}: must be a positive integer")
        if rope not in ROPE_MODES:
            raise ValueError(f"rope={rope!r}: allowed {ROPE_MODES}")
        if not isinstance(prefill, (bool, np.bool_)):
            raise TypeError(f"prefill={prefill!r}: must be True or False")
        validate.check_sm_scale(sm_scale)
        validate.check_rope_scalars(rope_theta, rope_scale)
        self.spec = spec
        self.num_layers = int(num_layers)
        self.page_bytes = int(np.prod(spec.pool_shape(1))) * spec.pool_dtype.itemsize
        self.num_pages = _pool_size(num_pages, budget_bytes, self.num_layers, self.page_bytes,
                                    spec.page_size)
        self.rope = rope
        self.rope_theta, self.rope_scale = float(rope_theta), float(rope_scale)
        self.sm_scale = sm_scale
        self.prefill = bool(prefill)
        self.prefill_launches = 0  # attend calls that ran the prefill kernel
        self.launches = 0  # kernels enqueued (device backend)
        self._long_from: int | None = None  # first long-factor position of rope="attend"
        self.decoder = BatchDecode(spec, device, backend=backend, profile=profile)
        self.backend = self.decoder.backend
        if rope is not None:  # checks theta/scale now (the kernel tables are built once)
            self._rope = rope_tables(spec.rotary_dim, self.rope_theta, parse_rope_scaling(
                spec.rope_scaling, spec.max_position_embeddings), spec.max_position_embeddings)
            if rope == "attend":
                self._long_from = int(self._rope[2])
        self.table = PageTable(spec, self.num_pages, _checked_rollback(rollback))
        self._lock = threading.RLock()
        self._step: _StepInProgress | None = None
        self.bytes_uploaded = 0  # bytes the cache sent to the device (tables, k, v, q)
        shape = spec.pool_shape(self.num_pages)
        if self.backend == "cpu":
            self.pools = [np.zeros(shape, spec.pool_dtype) for _ in range(self.num_layers)]
            return
        self._rt = self.decoder.opencl.runtime
        self.geometry = self.decoder.opencl.fit_append()
        cl = runtime.cl()
        size = int(np.prod(shape)) * spec.pool_dtype.itemsize
        limit = int(self._rt.device.max_mem_alloc_size)
        if size > limit:
            raise ValueError(f"num_pages={self.num_pages}: one layer's pool is {size} bytes, "
                             f"more than {self._rt.device.name!r} allocates at once ({limit}); "
                             f"use fewer pages")
        q = self._rt.queue
        self.pools = []
        for _ in range(self.num_layers):
            a = host_memory.empty(q, shape, spec.pool_dtype)
            a.events.append(cl.enqueue_fill_buffer(q, a.base_data, np.uint8(0), 0, size))
            self.pools.append(a)
        if self.prefill:  # fitted now (its notes warned here), built by the first chunk step
            warn_notes(self.decoder.opencl.fit_prefill(), "prefill: ", stacklevel=2)
        self._device = _DeviceKernels(self)

    # -- sequences ------------------------------------------------------------------
    def add(self, seq_id: Hashable, *, window: int | None = None, sink: int = 0,
            pos_offset: int = 0) -> None:
        """Add an empty sequence.

        ``window``: keep only the last ``window`` tokens besides the first ``sink``
        (needs ``spec.sliding_window``); pages wholly between them go back to the pool.
        ``pos_offset``: RoPE position of token 0 (``rope="append"``) or the chunk's
        ``k_pos_offset`` (``rope="attend"``).
        """
        with self._lock:
            self._no_step("add")
            self.table.add(seq_id, window=window, sink=sink, pos_offset=pos_offset)

    def remove(self, seq_id: Hashable) -> None:
        """Remove a sequence; pages no other sequence holds go back to the pool."""
        with self._lock:
            self._no_step("remove")
            self.table.remove(seq_id)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Add ``child`` as a copy of ``parent`` sharing its pages (copied on first write)."""
        with self._lock:
            self._no_step("fork")
            self.table.fork(parent, child)

    def pop(self, seq_id: Hashable, n: int) -> None:
        """Drop the last ``n`` tokens of a sequence (pages emptied go back to the pool)."""
        with self._lock:
            self._no_step("pop")
            self.table.pop(seq_id, n)

    def poppable(self, seq_id: Hashable) -> int:
        """The most tokens :meth:`pop` can take back from the sequence now: all of them,
        or with a window that gave pages back, those whose removal leaves the shorter
        sequence's window on pages still held (``rollback`` sets the margin)."""
        with self._lock:
            return self.table.poppable(seq_id)

    @property
    def rollback(self) -> int:
        """Tokens behind each window whose pages are kept (see the constructor)."""
        return self.table.rollback

    @rollback.setter
    def rollback(self, n: int) -> None:
        # read at each end(): a larger margin keeps more pages from then on, a smaller
        # one gives back the pages behind it then; pages given back never return
        n = _checked_rollback(n)
        with self._lock:
            self.table.rollback = n

    def length(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds (committed; a window's dropped tokens count)."""
        return self.table.seq(seq_id).length

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.table.seqs

    def __len__(self) -> int:
        return len(self.table.seqs)

    @property
    def sequences(self) -> tuple:
        """The sequence ids, in the order they were added."""
        return tuple(self.table.seqs)

    def stats(self) -> CacheStats:
        """Pages used, free, shared and reserved; bytes per token; free tokens."""
        with self._lock:
            t = self.table
            free = len(t.free)
            return CacheStats(
                num_pages=self.num_pages, page_size=self.spec.page_size,
                pages_used=self.num_pages - free, pages_free=free,
                pages_shared=int(np.count_nonzero(t.refcount > 1)),
                pages_reserved=self._step.tables.reserved if self._step else 0,
                sequences=len(t.seqs), bytes_per_token=self.page_bytes * self.num_layers //
                self.spec.page_size, pool_bytes=self.page_bytes * self.num_pages * self.num_layers,
                free_tokens=free * self.spec.page_size, prefill_launches=self.prefill_launches,
                launches=self.launches)

    # -- the step ------------------------------------------------------------------
    def begin(self, seq_ids: Sequence[Hashable], lengths: Sequence[int] | None = None, *,
              masks: Sequence[np.ndarray | None] | None = None) -> None:
        """Start a step: reserve ``lengths[i]`` new slots (default 1) for ``seq_ids[i]``.

        Builds the step's page tables and split plan and uploads them once. Raises
        :class:`CacheFullError` (nothing changed) when the free pages do not suffice.

        The step's kernels (:attr:`step_kernels`) are chosen here: a sequence bringing
        several tokens attends on the prefill kernel for its tokens whose attended rows
        have no gap (no window, or a window that has not begun to slide; a window with
        sinks counts as begun once a row lies between the sinks and the window), in one
        launch per layer for every such chunk of the step; its tokens past the start of
        the slide, and every sequence bringing one token, attend on the decode kernel.
        With ``prefill=False`` every token attends on the decode kernel.

        ``masks`` (tree speculative decoding): per sequence a bool ``[lengths[i],
        chunk_i]`` matrix (or None: all True) over its attended rows, the new tokens
        included, ANDed with the causal rule (docs/prefill.md, "Custom masks"); the step
        must then run on the prefill kernel alone (every sequence brings two or more
        tokens, no window has begun to slide) and the cache rotates nothing (``rope=None``:
        a draft token's position is its depth in the tree, which the app gives).
        :func:`clattn.tree_mask` makes one.
        """
        with self._lock:
            if self._step is not None:
                raise StepError(f"begin: a step over {list(self._step.tables.seq_ids)} is in "
                                f"progress; call end() or cancel() first")
            if masks is not None:
                check_step_masks(masks, seq_ids, lengths, self.rope)
            tables = self.table.reserve(seq_ids, lengths, rope=self.rope)
            try:
                if self.prefill and tables.T > len(tables.lengths):
                    tables.prefill = prefill_runs(tables, self._long_from)
                if masks is not None:
                    tables.mask = step_mask(tables.prefill, len(tables.lengths), masks)
                self._step = _StepInProgress(self, tables)
            except BaseException:
                self.table.release(tables)
                raise

    @property
    def positions(self) -> np.ndarray:
        """RoPE positions of the step's new tokens (int32 ``[T]``), in token order: the
        absolute positions (``rope="append"`` and None) or the in-kernel query positions
        (``rope="attend"``)."""
        step = self._current("positions")
        t = step.tables
        return t.q_pos if self.rope == "attend" else t.k_pos

    @property
    def step_tables(self) -> StepTables | None:
        """The host tables of the step in progress (None between steps), to be read, not
        written: one virtual sequence per new token (the last token of a sequence sees all
        of its rows), as the decode kernel takes them; ``prefill`` holds the runs the
        prefill kernel serves (:class:`~clattn.cache_tables.PrefillRuns`, None when the
        step runs on decode alone)."""
        step = self._step
        return None if step is None else step.tables

    @property
    def step_kernels(self) -> tuple:
        """The kernels the step in progress attends on: ``("decode",)``, ``("prefill",)``
        or, for a step that has both single tokens (or tokens past a window's slide) and
        prompt chunks, ``("decode", "prefill")``."""
        runs = self._current("step_kernels").tables.prefill
        if runs is None:
            return ("decode",)
        return ("prefill",) if runs.decode is None else ("decode", "prefill")

    @property
    def upload_events(self) -> tuple:
        """The events of the table uploads the device may still be reading (empty on the
        CPU backend). pyopencl waits for a copy from host memory when its event is
        dropped: the cache holds them until their buffers are reused."""
        if self.backend == "cpu":
            return ()
        return self._device.upload_events()

    @property
    def num_tokens(self) -> int:
        """New tokens of the step in progress (``T``: the first axis of append/attend)."""
        return self._current("num_tokens").tables.T

    def append(self, layer: int, k: Any, v: Any) -> Any:
        """Write the step's new keys and values ``k, v [T, H_kv, D]`` into ``layer``'s pool.

        ``T`` is the sum of the step's lengths, tokens in ``begin``'s order. numpy or
        device arrays (the call returns at once; the event completes the write).
        Returns the event (None on the CPU backend, and in a step of one token per
        sequence over a float pool, whose write the layer's :meth:`attend` launch does:
        docs/cache.md, "One launch per layer").
        """
        with self._lock:
            step = self._current("append")
            self._layer(layer)
            return step.append(layer, k, v)

    def attend(self, layer: int, q: Any, *, out: Any = None, lse: Any = None,
               sink_logits: Any = None) -> AttentionResult:
        """Attention of the step's new queries ``q [T, H_qo, D]`` over ``layer``'s cache.

        Each new token attends to the sequence up to and including itself (a prompt
        chunk is causal). ``out``/``lse`` as in :meth:`clattn.DecodeStep.run`. The
        kernels are those :meth:`begin` chose (:attr:`step_kernels`); the results are
        the same up to f32 rounding whichever runs. ``sink_logits`` (float32 ``[H_qo]``,
        numpy or device array, optional): the layer's learned attention sinks
        (docs/contract.md section 5); numpy values are uploaded once per layer and kept
        while they stay the same.
        """
        with self._lock:
            step = self._current("attend")
            self._layer(layer)
            return step.attend(layer, q, out, lse, sink_logits)

    def end(self) -> None:
        """Commit the step: the new tokens become part of their sequences; pages that fell
        out of a window go back to the pool."""
        with self._lock:
            step = self._current("end")
            missing = [i for i in range(self.num_layers) if not step.appended[i]]
            if missing:
                raise StepError(f"end: layers {_short(missing)} were not appended this step; "
                                f"append every layer (or cancel())")
            if self.backend != "cpu":
                self._device.flush()
            if step.checks:
                self._device.refused(step.checks)
            self.table.commit(step.tables)
            self._step = None

    def cancel(self) -> None:
        """Abandon the step in progress: its reserved pages go back, lengths unchanged.

        A sequence that copied a shared page for this step keeps its copy (the rows it
        held; the copy is made now for the layers not appended): another holder may
        have written into the shared page already.
        """
        with self._lock:
            step = self._current("cancel")
            if self.backend != "cpu":
                self._device.flush()
            if step.tables.n_copies:
                for layer in range(self.num_layers):
                    if not step.appended[layer]:
                        step.copy_pages(layer)
            self.table.release(step.tables, keep_copies=True)
            self._step = None

    # -- helpers ---------------------------------------------------------------------
    def _no_step(self, what: str) -> None:
        if self._step is not None:
            raise StepError(f"{what}: not allowed while a step is in progress; end() or "
                            f"cancel() it first")

    def _current(self, what: str) -> "_StepInProgress":
        if self._step is None:
            raise StepError(f"{what}: no step in progress; call begin(seq_ids, lengths) first")
        return self._step

    def _layer(self, layer: int) -> None:
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise LayerIndexError(f"layer={layer!r}: the cache has layers 0..{self.num_layers - 1}")


class _StepInProgress:
    """One step: its tables, which layers were appended, and (device) its launches."""

    def __init__(self, cache: PagedKVCache, tables: StepTables) -> None:
        self.cache = cache
        self.tables = tables
        self.appended = [False] * cache.num_layers
        self.checks: dict[int, int] = {}  # layer -> epoch of an append checked on the device
        spec = cache.spec
        self.kv_shape = (tables.T, spec.num_kv_heads, spec.head_dim)
        self.v_shape = (tables.T, spec.num_kv_heads, spec.head_dim_v)
        self.q_shape = (tables.T, spec.num_qo_heads, spec.head_dim)
        self.out_shape = (tables.T, spec.num_qo_heads, spec.head_dim_v)
        if cache.backend != "cpu":
            cache._device.start(tables)

    def _check(self, name: str, a: Any, shape: tuple) -> None:
        try:
            check_array(name, a, shape=shape, dtypes=(self.cache.spec.np_dtype,))
        except ValueError as exc:
            raise StepShapeError(f"{exc}: the step begun for {self.tables.T} new tokens "
                                 f"(lengths {_short(self.tables.lengths)}) takes {name} of "
                                 f"shape {shape}") from None

    def append(self, layer: int, k: Any, v: Any) -> Any:
        cache = self.cache
        dev = cache._device if cache.backend != "cpu" else None
        if dev is None or not (dev.ready(k, self.kv_shape) and dev.ready(v, self.v_shape)):
            self._check("k", k, self.kv_shape)
            self._check("v", v, self.v_shape)
        if dev is None:
            if not (is_host(k) and is_host(v)):
                raise TypeError("append: the CPU backend takes numpy k and v")
            self._append_host(cache.pools[layer], k, v)
            evt = None
        else:
            evt = dev.append(layer, k, v, self.checks)
        self.appended[layer] = True
        return evt

    def copy_pages(self, layer: int) -> None:
        """The step's copy-on-write copies alone, in ``layer``'s pool."""
        if self.cache.backend == "cpu":
            self._copy_host(self.cache.pools[layer])
        else:
            self.cache._device.copy(self.cache.pools[layer])

    def _copy_host(self, pool: np.ndarray) -> None:
        spec = self.cache.spec
        for src, dst, rows in self.tables.copies.reshape(-1, 3):
            if not spec.byte_pool:
                pool[dst, :, :, :rows] = pool[src, :, :, :rows]
                continue
            for kind in (0, 1):
                for view in region_views(pool, spec.layout, kind):
                    if view is not None:
                        view[dst, :, :rows] = view[src, :, :rows]

    def _append_host(self, pool: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """The append and page-copy kernels' semantics in numpy (CPU backend)."""
        t, cache = self.tables, self.cache
        spec, ps = cache.spec, cache.spec.page_size
        if cache.rope == "append":
            inv, att, long_from = cache._rope
            interleaved = parse_rope_scaling(spec.rope_scaling,
                                             spec.max_position_embeddings).interleaved
            kf = k.astype(np.float64)
            for tab in (0, 1):
                sel = (t.k_pos >= long_from) == bool(tab)
                if sel.any():
                    kf[sel] = rotate(kf[sel].transpose(1, 0, 2), t.k_pos[sel] * cache.rope_scale,
                                     inv[tab], att, interleaved).transpose(1, 0, 2)
            k = kf.astype(np.float32 if spec.byte_pool else spec.np_dtype)
        page, slot = t.slots // ps, t.slots % ps
        if not spec.byte_pool:
            self._copy_host(pool)
            pool[page, 0, :, slot] = k
            pool[page, 1, :, slot] = v
            return
        rows = [_stored(x, fmt, name) for x, fmt, name in
                ((k, spec.k_format, "k"), (v, spec.v_format, "v"))]  # may refuse: nothing written
        self._copy_host(pool)
        for kind, (data, scales) in enumerate(rows):
            dview, sview = region_views(pool, spec.layout, kind)
            dview[page, :, slot] = data
            if scales is not None:
                sview[page, :, slot] = scales

    def attend(self, layer: int, q: Any, out: Any, lse: Any,
               sink_logits: Any = None) -> AttentionResult:
        cache, t = self.cache, self.tables
        if not self.appended[layer]:
            raise StepError(f"attend: layer {layer} has not been appended this step; call "
                            f"append({layer}, k, v) first")
        validate.check_sink_logits(cache.spec, sink_logits)
        if cache.backend == "cpu":
            self._check("q", q, self.q_shape)
            if sink_logits is not None and not is_host(sink_logits):
                sink_logits = sink_logits.get()
            if t.prefill is None:
                return AttentionResult(*self._decode_host(layer, q, t, out, lse, sink_logits))
            return self._attend_host(layer, q, t.prefill, out, lse, sink_logits)
        dev = cache._device
        if dev.ready(q, self.q_shape) and out is not None and lse is not None and \
                dev.ready(out, self.out_shape) and dev.ready(lse, self.q_shape[:2], LSE_DTYPE):
            return dev.attend(cache.pools[layer], q, out, lse,
                              sinks=dev.sinks(layer, sink_logits), layer=layer)
        self._check("q", q, self.q_shape)
        self._check_out(out, lse)
        sinks = dev.sinks(layer, sink_logits)
        call = Call(cache._rt)
        dq = call.input("q", q)
        dout = call.output("out", out, self.out_shape, cache.spec.np_dtype)
        dlse = call.output("lse", lse, self.q_shape[:2], LSE_DTYPE)
        res = dev.attend(cache.pools[layer], dq, dout, dlse, call.wait_list(), sinks=sinks,
                         layer=layer)
        o, s = call.finish([dout, dlse], list(res.events), host=is_host(q))
        return AttentionResult(o, s, res.event, res.events)

    def _check_out(self, out: Any, lse: Any) -> None:
        for name, a, shape, dt in (("out", out, self.out_shape, self.cache.spec.np_dtype),
                                   ("lse", lse, self.q_shape[:2], LSE_DTYPE)):
            if a is not None:
                check_array(name, a, shape=shape, dtypes=(dt,), writable=True)

    def _rope_args(self) -> dict:
        cache = self.cache
        return dict(rotary_mode=int(cache.rope == "attend"), rope_scale=cache.rope_scale,
                    rope_theta=cache.rope_theta, sm_scale=cache.sm_scale)

    def _decode_host(self, layer: int, q: np.ndarray, d: Any, out: Any, lse: Any,
                     sink_logits: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The decode kernel's rows on the CPU backend over the decode tables ``d`` (the
        step's, or the rows a prefill view leaves to decode)."""
        t, kw = self.tables, self._rope_args()
        attend_rope = kw["rotary_mode"] == 1
        return cpu_backend.batch_decode(
            self.cache.spec, q, self.cache.pools[layer], d.page_indptr, d.page_indices,
            d.last_page_len, window_offset=d.window_offset, sink_size=d.sink_size,
            q_pos=t.q_pos if attend_rope else None,
            k_pos_offset=t.k_pos_offset if attend_rope else None, out=out, lse=lse,
            sink_logits=sink_logits, **kw)

    def _attend_host(self, layer: int, q: np.ndarray, runs: PrefillRuns, out: Any,
                     lse: Any, sink_logits: np.ndarray | None) -> AttentionResult:
        """The CPU backend's step with prefill runs: the decode rows first (when some are
        left to decode), then each run's rows from the prefill kernel's numpy twin."""
        cache = self.cache
        spec = cache.spec
        self._check_out(out, lse)
        if runs.decode is not None:
            out, lse = self._decode_host(layer, q, runs.decode, out, lse, sink_logits)
        else:
            out = np.empty(self.out_shape, spec.np_dtype) if out is None else out
            lse = np.empty(self.q_shape[:2], LSE_DTYPE) if lse is None else lse
        rows = runs.rows
        kw = self._rope_args()
        po, ps = cpu_backend.batch_prefill(
            spec, np.ascontiguousarray(q[rows]), cache.pools[layer], runs.qo_indptr,
            runs.page_indptr, runs.page_indices, runs.last_page_len,
            window_offset=runs.window_offset, sink_size=runs.sink_size,
            k_pos_offset=runs.k_pos_offset if kw["rotary_mode"] else None,
            custom_mask=None if self.tables.mask is None else self.tables.mask[0],
            mask_indptr=None if self.tables.mask is None else self.tables.mask[1],
            sink_logits=sink_logits, **kw)
        out[rows], lse[rows] = po, ps
        cache.prefill_launches += 1
        return AttentionResult(out, lse)


class _DeviceKernels:
    """The cache's bound kernel objects and its table and staging buffers on the device,
    made once per cache; the kernels, the split workspace and the plans' tables are the
    decoder's :class:`~clattn.opencl_backend.OpenCLBackend`'s.

    Creating and typing a kernel object costs 0.3-1.3 ms on the CPU drivers and a
    pyopencl array view 40 us, so a step sets the new tables (``(buffer, offset)`` pairs
    into one upload) on kernel objects bound when the cache was made; its uploads go
    into a ring of two table buffers, each reused once the launches of the step that
    last used it are done. The split plan is kept while the batch is the same and no
    chunk has grown by a page (a plan made for shorter chunks stays correct: the last
    partition runs to the chunk's end). Where the profile's ``fold_merge`` is on, a split
    step launches the decode builds with the split merge folded in and no merge; unsplit
    steps keep the plain builds (a CPU compiler's code for them can lose speed to the
    mere presence of the fold's, as to the sink epilogue's).
    """

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        spec, dec = cache.spec, cache.decoder
        rt = self.rt = cache._rt
        self.queue = rt.queue
        self.ctx = rt.context
        # on the runtime's in-order queue the launches are ordered by the queue itself: only
        # the caller's arrays bring events to wait for (an out-of-order queue: every one)
        cl = runtime.cl()
        self.in_order = not (self.queue.properties &
                             cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE)
        self.dtype = spec.np_dtype
        opencl = self.opencl = dec.opencl
        self.fold = False  # the step in progress folds its split merge (OpenCLBackend.folds)
        decode, merge = opencl.decode_kernels()  # builds (and may refit the geometry) first
        self.geometry, self.merge_geometry = opencl.decode_geometry, opencl.merge_geometry
        self.scalars = opencl.scalars(int(cache.rope == "attend"), cache.rope_theta,
                                      cache.rope_scale, cache.sm_scale)
        self.decode = decode.bind(**dict.fromkeys(_TABLES + _SPLIT),
                                  num_pages=cache.num_pages, nnz=0, n_ws=0, split=0,
                                  part_rows=0, sink_logits=None, use_sinks=0, **self.scalars)
        self.sink_tables: dict = {}  # layer -> (numpy sink_logits, its device copy)
        self.prefill: Any = None  # the bound prefill kernel, made by the first chunk step
        self.runs: PrefillRuns | None = None
        self.merge = merge.bind(vin=None, sv=None, indptr=None, fixed_k=-1, skip_single=1,
                                n_states=0, out=None, lse=None, N=0, H=spec.num_qo_heads,
                                sink_logits=None, use_sinks=0)
        turns, long_from, att = opencl.rope_buffer(int(cache.rope == "append"), cache.rope_theta,
                                                   cache.rope_scale)
        # byte pools: one flag per layer, set by the check pass to the epoch of an append
        # it refuses (the append then writes nothing); read back by end()
        self.quantized = spec.k_format in QUANTIZED or spec.v_format in QUANTIZED
        self.flags = None
        self.epoch = 0
        if spec.byte_pool:
            self.flags = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, 4 * cache.num_layers)
            cl.enqueue_fill_buffer(self.queue, self.flags, np.int32(0), 0, 4 * cache.num_layers)
        args = dict(k=None, v=None, pages=None, num_pages=cache.num_pages, slots=None,
                    n_tokens=0, k_pos=None, rotary_mode=int(cache.rope == "append"),
                    rope_turns=turns, long_from=long_from, rope_att=att, flags=None, epoch=-1)
        self.append_k = opencl.append_kernel(signatures.APPEND).bind(**args)
        # one-token steps of float pools: each layer's append deferred to its attend, one
        # launch of the decode kernel with the append fused in (signatures.DECODE_APPEND)
        self.fused = self._bind_fused(turns, long_from, att)
        self.fuse = False  # the step in progress defers its appends
        # (decode, merge, fused) bound on each build, by (sinks compiled in, merge folded
        # in): the plain build's above, the others made from them by the first attend that
        # needs them (:meth:`_kernels`)
        self.bound = {(False, False): (self.decode, self.merge, self.fused)}
        self.pending: tuple | None = None  # (layer, k, v, events) of the deferred append
        self.check_k = opencl.append_kernel(signatures.APPEND_CHECK).bind(**args) \
            if self.quantized else None
        self.copy_k = opencl.append_kernel(signatures.PAGE_COPY).bind(
            pages=None, num_pages=cache.num_pages, copies=None, n_copies=0)
        # [buffer, capacity (ints), its step's events, the upload into it]: pyopencl's event
        # of a copy from host memory waits for the copy when it is dropped, so the upload's
        # event is held here until the slot is reused two steps later (dropping it at the
        # first launch made every step wait for the previous one's kernels)
        self.ring = [[None, 0, [], None], [None, 0, [], None]]
        self.ring_at = 0
        self.stage = {"k": [None, 0, []], "v": [None, 0, []]}  # host k/v staging buffers
        self.plan_key: Any = None
        self.plan = self.plan_buf = None
        self.split = False  # the step's decode plan splits

    def _bind_fused(self, turns: Any, long_from: int, att: float) -> Any:
        """The decode kernel with the append fused in, bound (None where the profile's
        ``fuse_append`` is off or :meth:`~clattn.opencl_backend.OpenCLBackend.fused_decode_kernel`
        has none). Its RoPE table and scalars are the append's with ``rope="append"``
        (the decode then rotates nothing), else the decode's."""
        cache = self.cache
        launcher = self.opencl.fused_decode_kernel() if \
            self.opencl.setup.profile.fuse_append else None
        if launcher is None:
            return None
        scalars = dict(self.scalars)
        if cache.rope == "append":
            scalars.update(rope_turns=turns, long_from=long_from, rope_att=att)
        return launcher.bind(**dict.fromkeys(_TABLES + _SPLIT + ("k", "v", "slots", "k_pos")),
                             num_pages=cache.num_pages, nnz=0, n_ws=0, split=0, part_rows=0,
                             sink_logits=None, use_sinks=0,
                             append_rope=int(cache.rope == "append"), **scalars)

    def _kernels(self, sinks: bool, fold: bool = False) -> tuple:
        """``(decode, merge, fused)`` bound objects of the build with (``sinks``) or
        without the learned-sink epilogue, with (``fold``) or without the split merge
        folded in; ``fused`` None where that build has no fused form. Made from the plain
        build's objects, with every argument they hold, by the first call that needs them."""
        hit = self.bound.get((sinks, fold))
        if hit is None:
            decode, merge = self.opencl.decode_kernels(sinks=sinks, fold=fold)
            fused = self.opencl.fused_decode_kernel(sinks=sinks, fold=fold) \
                if self.fused is not None else None
            hit = self.bound[sinks, fold] = (
                self.decode.rebound(decode), self.merge.rebound(merge),
                None if fused is None else self.fused.rebound(fused))
        return hit

    def upload_events(self) -> tuple:
        """The table uploads held in the ring."""
        return tuple(slot[3] for slot in self.ring if slot[3] is not None)

    # -- per step --------------------------------------------------------------------
    def start(self, t: StepTables) -> None:
        """Upload the step's tables (once) and set them on the kernel objects."""
        cl = runtime.cl()
        runs = self.runs = t.prefill
        self.pending = None
        self.fuse = self.fused is not None and runs is None and all(n == 1 for n in t.lengths)
        if runs is not None:  # the unit table travels in the step's one upload
            runs.units = make_prefill_plan(runs.n, runs.chunk, self._prefill_kernel(),
                                           runs.q_start).units
        packed, views = t.packed()
        slot = self.ring[self.ring_at]
        self.ring_at ^= 1
        if slot[1] < len(packed):
            slot[0] = cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY, max(len(packed), 256) * 4)
            slot[1] = max(len(packed), 256)
        upload = cl.enqueue_copy(self.queue, slot[0], packed, is_blocking=False,
                                 wait_for=slot[2] or None)
        self.cache.bytes_uploaded += packed.nbytes
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
        spec = self.cache.spec
        d = t if not pre else t.prefill.decode
        plan = self._plan(t, d)
        H, D = spec.num_qo_heads, spec.head_dim
        ws_o = ws_s = None
        builds = list(self.bound.values())
        self.fold = self.opencl.folds(plan)
        counters = self.opencl.counters(t.T) if self.fold else None
        if plan.split:
            ws_o, ws_s = self.opencl.workspace(plan.n_ws)
            for _, merge, _ in builds:
                merge.set(vin=(ws_o, 0), sv=(ws_s, 0), indptr=self.plan_buf,
                          n_states=plan.n_ws, N=t.T)
            self.merge_sizes = self.merge_geometry.sizes(t.T * H, D)
        attend_rope = self.cache.rope == "attend"
        kernels = [k for decode, _, fused in builds
                   for k in ((decode, fused) if self.fuse else (decode,)) if k is not None]
        for kernel in kernels:  # a fused step attends a layer whose append ran on the decode
            kernel.set(page_indptr=tab[pre + "page_indptr"],
                       page_indices=tab[pre + "page_indices"], nnz=len(d.page_indices),
                       last_page_len=tab[pre + "last_page_len"],
                       window_offset=tab.get(pre + "window_offset"),
                       sink_size=tab.get(pre + "sink_size"),
                       q_pos=tab["q_pos"] if attend_rope else None,
                       k_pos_offset=tab["k_pos_offset"] if attend_rope else None,
                       ws_o=ws_o, ws_s=ws_s, n_ws=plan.n_ws, split=int(plan.split),
                       part_rows=plan.part_rows if plan.split else 0,
                       part_indptr=self.plan_buf if plan.split else None, counters=counters)
        if self.fuse:
            for _, _, fused in builds:
                if fused is not None:
                    fused.set(slots=tab["slots"], k_pos=tab["k_pos"])
        self.split = plan.split
        self.decode_sizes = (self.geometry.global_size(t.T, spec.num_kv_heads,
                                                       plan.num_parts if plan.split else 1),
                             self.geometry.local_size())

    def _start_append(self, t: StepTables, tab: dict) -> None:
        """Set the append (and page-copy) tables."""
        spec = self.cache.spec
        D = spec.head_dim
        self.append_k.set(slots=tab["slots"], n_tokens=t.T, k_pos=tab["k_pos"])
        if self.check_k is not None:
            self.check_k.set(slots=tab["slots"], n_tokens=t.T, k_pos=tab["k_pos"])
        geom = self.cache.geometry
        copy_rows = t.n_copies * 2 * spec.num_kv_heads * spec.page_size
        if spec.byte_pool:  # one work-item per (token, head, kind, block); per copied row
            self.append_sizes = ((t.T * spec.num_kv_heads * spec.layout.row_blocks,), None)
        else:
            self.append_sizes = geom.sizes(t.T * spec.num_kv_heads, D)
        self.n_copies = t.n_copies
        if t.n_copies:
            self.copy_k.set(copies=tab["copies"], n_copies=t.n_copies)
            self.copy_sizes = ((copy_rows,), None) if spec.byte_pool else \
                geom.sizes(copy_rows, D)

    def _prefill_kernel(self) -> int:
        """Bind the prefill kernel (built and fitted at the first step that needs it);
        returns its queries per work unit."""
        opencl = self.opencl
        if self.prefill is None:
            self.prefill = opencl.prefill_kernel().bind(
                **dict.fromkeys(_TABLES + ("units",)), num_pages=self.cache.num_pages,
                total_q=0, nnz=0, q_pos_mode=0, batch=0, n_units=0, causal=1,
                mask=None, mask_indptr=None, mask_bytes=0, use_mask=0, sink_logits=None,
                use_sinks=0, **self.scalars)
        return opencl.prefill_geometry.qb

    def _start_prefill(self, t: StepTables, runs: PrefillRuns, tab: dict) -> None:
        """Set the prefill runs' tables and unit table on the bound prefill kernel."""
        attend_rope = self.cache.rope == "attend"
        n_units = len(runs.units)
        self.prefill.set(page_indptr=tab["prefill.page_indptr"],
                         page_indices=tab["prefill.page_indices"], nnz=len(runs.page_indices),
                         last_page_len=tab["prefill.last_page_len"],
                         window_offset=tab.get("prefill.window_offset"),
                         sink_size=tab.get("prefill.sink_size"),
                         k_pos_offset=tab["prefill.k_pos_offset"] if attend_rope else None,
                         total_q=t.T, batch=len(runs.n), units=tab["prefill.units"],
                         n_units=n_units, **self._mask_args(t.mask))
        geom = self.opencl.prefill_geometry
        self.prefill_sizes = (geom.global_size(n_units, self.cache.spec.num_kv_heads),
                              geom.local_size())

    def _mask_args(self, mask: tuple | None) -> dict:
        """The prefill kernel's mask arguments for the step's packed mask (uploaded)."""
        if mask is None:
            return dict(mask=None, mask_indptr=None, mask_bytes=0, use_mask=0)
        cla = runtime.cl().array
        bits, indptr = (cla.to_device(self.queue, a) for a in mask)
        self.cache.bytes_uploaded += mask[0].nbytes + mask[1].nbytes
        return dict(mask=bits, mask_indptr=indptr, mask_bytes=len(mask[0]), use_mask=1)

    def _plan(self, t: StepTables, d: Any) -> Any:
        """The split plan of the decode tables ``d``: the last one while it still fits
        this batch, else a new one (always a new one for the decode rows of a step with
        prefill runs)."""
        last = self.plan
        key = (t.seq_ids, t.lengths) if d is t else None
        ps = self.cache.spec.page_size
        if last is not None and key is not None and key == self.plan_key and \
                np.all((t.chunk >= last.chunk) & (t.chunk < last.chunk + ps)):
            return last
        plan = self.cache.decoder.plan(d.page_indptr, d.last_page_len,
                                       window_offset=d.window_offset, sink_size=d.sink_size)
        self.plan, self.plan_key = plan, key
        if plan.split:
            self.plan_buf = self.opencl.plan_table(plan, self.queue)
            self.cache.bytes_uploaded += plan.part_indptr.nbytes
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
            self.cache.bytes_uploaded += sink_logits.nbytes
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
        self.cache.bytes_uploaded += a.nbytes
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
        self.cache.launches += 1
        pool.events[:] = [evt]
        self._track(evt)
        return evt

    def append(self, layer: int, k: Any, v: Any, checks: dict) -> Any:
        """Write k, v into layer's pool; a byte pool's device check is recorded in
        ``checks`` (layer -> epoch) for :meth:`refused`."""
        spec = self.cache.spec
        host = self.quantized and is_host(k) and is_host(v)
        # keys rotated by the append kernel: inf/NaN are refused here (a rotation keeps
        # them non-finite), a scale overflow of the rotated block only by the device check
        verified = host and self.cache.rope != "append"
        if host:  # refused here, before anything is uploaded or written
            check_quantizable(k, spec.k_format, "k", scale=verified)
            check_quantizable(v, spec.v_format, "v")
        self.flush()  # the staging buffers hold one layer's k, v at a time
        pool = self.cache.pools[layer]
        (dk, ek), (dv, ev) = (self._device_input(n, a, held=self.fuse)
                              for n, a in (("k", k), ("v", v)))
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
                self.cache.launches += 1
                checks[layer] = self.epoch
        evt = self.append_k.launch(self.queue, *self.append_sizes, waits, k=dk, v=dv, pages=pool,
                                   **extra)
        self.cache.launches += 1
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
    def _defer(self, layer: int, pool: Any, dk: Any, dv: Any, events: list) -> None:
        """Hold layer's append for its attend launch (the page copies run now: the write
        may land in a copy). Returns None: there is no write event yet."""
        if self.n_copies:
            events = [self.copy(pool, events)]
        self.pending = (layer, dk, dv, events)

    def flush(self) -> None:
        """Launch the deferred append on the append kernel (its layer was not attended
        before the next append, end or cancel)."""
        if self.pending is None:
            return
        layer, dk, dv, events = self.pending
        self.pending = None
        pool = self.cache.pools[layer]
        waits = events if self.in_order else self.waits + pool.events + events
        evt = self.append_k.launch(self.queue, *self.append_sizes, waits, k=dk, v=dv,
                                   pages=pool)
        self.cache.launches += 1
        self._written(pool, evt)

    def refused(self, checks: dict) -> None:
        """Raise ValueError when the device check refused an append of ``checks``
        (layer -> epoch): that layer's append wrote nothing."""
        flags = np.empty(self.cache.num_layers, np.int32)
        runtime.cl().enqueue_copy(self.queue, flags, self.flags, is_blocking=True)
        bad = [layer for layer, epoch in sorted(checks.items()) if flags[layer] == epoch]
        if bad:
            spec = self.cache.spec
            raise ValueError(
                f"end: the keys or values appended to layers {_short(bad)} hold inf/NaN, or a "
                f"block whose scale overflows float16, which {spec.k_format} keys / "
                f"{spec.v_format} values cannot store; nothing was written for those layers. "
                f"The step is still open: cancel() it (or append those layers again)")

    def attend(self, pool: Any, q: Any, out: Any, lse: Any, waits: list | None = None,
               sinks: Any = None, *, layer: int = -1) -> AttentionResult:
        """Launch the step's kernels for one layer: decode (with the layer's deferred
        append fused in), prefill, or decode then prefill (the prefill launch writes the
        rows the decode launch left empty); ``sinks``: the layer's learned sinks on the
        device (:meth:`sinks`) or None."""
        waits = waits if waits is not None else q.events + out.events + lse.events
        if sinks is not None and sinks.events:
            waits = waits + list(sinks.events)
        fused = None
        if self.pending is not None and self.pending[0] == layer:
            if self._kernels(sinks is not None, self.fold)[2] is None:
                self.flush()  # that build has no fused form: the append launched first
            else:
                fused = self.pending  # held until its launch is enqueued (a launch that
                waits = waits + fused[3]  # raises leaves it for flush())
        if not self.in_order:
            waits = self.waits + pool.events + waits
        sink_args = dict(sink_logits=sinks, use_sinks=int(sinks is not None))
        if fused is not None:
            evts = self._decode(pool, q, out, lse, waits, sink_args,
                                dict(k=fused[1], v=fused[2]))
            self.pending = None
            self._written(pool, evts[0])
        elif self.runs is None:
            evts = self._decode(pool, q, out, lse, waits, sink_args)
        else:
            evts = ()
            if self.runs.decode is not None:
                evts = self._decode(pool, q, out, lse, waits, sink_args)
                waits = [] if self.in_order else [evts[-1]]
            evts += (self.prefill.launch(self.queue, *self.prefill_sizes, waits, q=q,
                                         pages=pool, out=out, lse=lse, **sink_args),)
            self.cache.prefill_launches += 1
        self.cache.launches += len(evts)
        if not self.in_order:
            pool.events.append(evts[0])  # the next write of the pool waits for this read
            if len(evts) > 1:
                pool.events.append(evts[-1])
        out.events[:] = [evts[-1]]
        lse.events[:] = [evts[-1]]
        self._track(evts[-1])
        return AttentionResult(out, lse, evts[-1], tuple(evts))

    def _decode(self, pool: Any, q: Any, out: Any, lse: Any, waits: list,
                sink_args: dict, append: dict | None = None) -> tuple:
        """The decode kernel (and the merge of a split plan); returns the events.
        ``sink_args``: the learned-sink arguments (the merge adds the sinks to a split);
        ``append``: the deferred append's ``k`` and ``v``, written by the fused kernel."""
        decode, merge, fused = self._kernels(sink_args["sink_logits"] is not None,
                                             self.fold)
        kernel = decode if append is None else fused
        args = dict(q=q, pages=pool, out=out, lse=lse, **sink_args, **(append or {}))
        if self.split:  # the merge of a fold build is in its decode launch
            evts = self.opencl.decode_then_merge(
                self.queue, waits, (kernel.launch, *self.decode_sizes, args),
                None if self.fold else
                (merge.launch, *self.merge_sizes, dict(out=out, lse=lse, **sink_args)),
                queue_orders=self.in_order, folded=self.fold)
        else:  # no workspace to order: the decode kernel alone, on the per-layer path
            evts = (kernel.launch(self.queue, *self.decode_sizes, waits, **args),)
        return evts


#: the table arguments the decode and prefill kernels share, unset until a step sets them
_TABLES = ("q", "pages", "out", "lse", "page_indptr", "page_indices", "last_page_len",
           "window_offset", "sink_size", "q_pos", "k_pos_offset")
#: the decode kernel's split buffers, set by a split step
_SPLIT = ("ws_o", "ws_s", "part_indptr", "counters")


def _stored(x: np.ndarray, fmt: str, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(data uint8 [..., row_bytes], scales or None)`` of rows ``x`` stored as ``fmt``."""
    if fmt in QUANTIZED:
        return quantize(x, fmt, name)
    return np.ascontiguousarray(x.astype(fmt)).view(np.uint8), None


def _checked_rollback(n: Any) -> int:
    if not is_int(n) or n < 0:
        raise ValueError(f"rollback={n!r}: must be an integer >= 0")
    return int(n)


def _short(items: Sequence) -> str:
    items = list(items)
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"


def _pool_size(num_pages: Any, budget_bytes: Any, layers: int, page_bytes: int,
               page_size: int) -> int:
    if (num_pages is None) == (budget_bytes is None):
        raise ValueError("PagedKVCache: give exactly one of num_pages= (pages per layer) and "
                         "budget_bytes= (bytes for every layer's pool)")
    if num_pages is None:
        if not is_int(budget_bytes) or budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes!r}: must be a non-negative integer")
        num_pages = int(budget_bytes) // (layers * page_bytes)
        if num_pages < 1:
            raise ValueError(f"budget_bytes={budget_bytes}: less than one page per layer "
                             f"({layers} x {page_bytes} bytes)")
    if not is_int(num_pages) or num_pages < 1:
        raise ValueError(f"num_pages={num_pages!r}: must be a positive integer")
    if int(num_pages) * page_size > INT32_MAX:
        raise ValueError(f"num_pages={num_pages}: slots (pages x page_size) must stay below "
                         f"2**31")
    return int(num_pages)
