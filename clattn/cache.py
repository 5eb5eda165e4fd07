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

import os
import threading
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from . import cache_store, cpu_backend, validate
from .cache_device import CacheDevice, CacheRope, device_pools, short
from .cache_tables import CacheFullError, PageTable, PrefillRuns, StepTables, prefill_runs
from .device import open_backend, warn_notes
from .loop_budget import prefill_fits
from .mask import check_step_masks, step_mask
from .numbers import is_int
from .opencl_backend import OpenCLBackend
from .prefill import make_prefill_plan, queries_per_unit
from .result import AttentionResult
from .rope import parse_rope_scaling, rope_tables
from .spec import INT32_MAX, LSE_DTYPE, AttentionSpec
from .staging import Call
from .validate import check_array, is_host

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
    made (one per layer of a step with prompt chunks), ``prefill_units`` the work units
    (tiles of one sequence's queries) they ran (0 on the CPU backend: the plan of
    :func:`clattn.prefill.queries_per_unit` cuts a step's chunks over long caches into
    fewer, larger units); ``launches``: kernels the cache
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
    prefill_units: int = 0

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
        docs/cache.md, "Quantized pages"), the values are of another width, or they are
        read from the key rows (``spec.value_in_key``: key regions only; append ``v=None``).
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
        (``pos_offset + token index``); the app rotates q at :attr:`positions`. Not with
        ``spec.value_in_key`` (it would rotate the values stored in the key rows).
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
        if rope == "append" and spec.value_in_key:
            raise ValueError("rope='append': the spec reads values from the key rows "
                             "(value_in_key), which a rotation at append would rotate too; "
                             "rotate the keys' RoPE part yourself (rope=None) or use "
                             "rope='attend'")
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
        self._host_prefill_launches = 0  # attend calls of the CPU backend's prefill
        self._long_from: int | None = None  # first long-factor position of rope="attend"
        #: ``(inverse frequencies, attention factor, first long-factor position)`` of the
        #: cache's RoPE (None without)
        self.rope_freqs: tuple | None = None
        if rope is not None:  # checks theta/scale now (the kernel tables are built once)
            self.rope_freqs = rope_tables(spec.rotary_dim, self.rope_theta, parse_rope_scaling(
                spec.rope_scaling, spec.max_position_embeddings), spec.max_position_embeddings)
            if rope == "attend":
                self._long_from = int(self.rope_freqs[2])
        setup = open_backend(device, backend, profile)
        self.backend = "opencl" if setup else "cpu"
        #: the kernels, tables and workspace on the device (None on the CPU backend)
        self.opencl: OpenCLBackend | None = None
        self.table = PageTable(spec, self.num_pages, _checked_rollback(rollback))
        self._lock = threading.RLock()
        self._step: _StepInProgress | None = None
        self._device: CacheDevice | None = None
        if not setup:
            self.pools = [np.zeros(spec.pool_shape(self.num_pages), spec.pool_dtype)
                          for _ in range(self.num_layers)]
            return
        self.opencl = OpenCLBackend(spec, setup)
        warn_notes(self.opencl.decode_notes, stacklevel=2)
        self.geometry = self.opencl.append_geometry
        self.pools = device_pools(self.opencl, spec, self.num_pages, self.num_layers)
        if self.prefill:  # fitted now (its notes warned here), built by the first chunk step
            warn_notes(self.opencl.prefill_notes, "prefill: ", stacklevel=2)
        self._device = CacheDevice(spec, self.opencl, self.pools, self.num_pages, CacheRope(
            rope, self.rope_theta, self.rope_scale, sm_scale))

    # -- the device ------------------------------------------------------------------
    @property
    def profile(self) -> Any:
        """The fitted profile the cache's kernels run (None on the CPU backend)."""
        return self.opencl.setup.profile if self.opencl else None

    @property
    def runtime(self) -> Any:
        """The device's :class:`clattn.runtime.Runtime` (its ``queue`` and ``context``);
        None on the CPU backend."""
        return self.opencl.runtime if self.opencl else None

    @property
    def queue(self) -> Any:
        """The command queue the cache enqueues on (None on the CPU backend)."""
        return self.opencl.runtime.queue if self.opencl else None

    @property
    def device(self) -> CacheDevice | None:
        """The step's launches on the device (:class:`clattn.cache_device.CacheDevice`;
        None on the CPU backend)."""
        return self._device

    @property
    def bytes_uploaded(self) -> int:
        """Bytes the cache sent to the device (tables, k, v, q, sinks, masks)."""
        return self._device.bytes_uploaded if self._device else 0

    @property
    def launches(self) -> int:
        """Kernels the cache enqueued since it was made (0 on the CPU backend)."""
        return self._device.launches if self._device else 0

    @property
    def prefill_launches(self) -> int:
        """Attend calls that ran the prefill kernel since the cache was made."""
        return self._device.prefill_launches if self._device else self._host_prefill_launches

    @property
    def prefill_units(self) -> int:
        """Work units the prefill launches ran since the cache was made (0 on the CPU
        backend)."""
        return self._device.prefill_units if self._device else 0

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
                launches=self.launches,
                prefill_units=self.prefill_units)

    # -- sequences on storage (clattn.cache_store, format: clattn.kv_file) -------------
    def save(self, path: str | os.PathLike[str], seq_ids: Sequence[Hashable] | None = None,
             *, extra: dict | None = None) -> int:
        """Write sequences to a KV file (docs/kv_file.md), atomically.

        Parameters
        ----------
        path : path-like
            The file (replaced once the new one is complete).
        seq_ids : sequence of ids, optional
            The sequences (default: all); ids of str, int, bool, None or tuples of them.
            Pages they share are written once.
        extra : dict, optional
            JSON-able fields kept with them (:func:`clattn.cache_store.read_header`).

        Returns
        -------
        int
            The file's size in bytes.
        """
        with self._lock:
            self._no_step("save")
            return cache_store.save(self, path, seq_ids, extra)

    def load(self, path: str | os.PathLike[str],
             new_ids: Sequence[Hashable] | None = None) -> tuple:
        """Add the sequences of a KV file, their pages taken from the free ones.

        Parameters
        ----------
        path : path-like
            A file :meth:`save` wrote, for a cache of the same spec (page formats
            included), layer count and RoPE mode, on any device or backend.
        new_ids : sequence of ids, optional
            Ids to load the file's sequences under, in the file's order.

        Returns
        -------
        tuple
            The ids of the sequences added.

        Raises
        ------
        clattn.kv_file.KVFileError
            ``KVFileCorruptError`` (truncated, a byte changed, not a KV file),
            ``KVFileVersionError`` (a newer format), ``KVFileMismatchError`` (another
            spec, page format, layer count or RoPE mode).
        DuplicateSequenceError
            An id the cache holds.
        CacheFullError
            Too few free pages.

        Every refusal leaves the cache, its pools and its sequences as they were.
        """
        with self._lock:
            self._no_step("load")
            return cache_store.load(self, path, new_ids)

    def offload(self, path: str | os.PathLike[str], seq_ids: Sequence[Hashable]) -> int:
        """:meth:`save` the sequences, then remove them (their pages go back to the pool);
        :meth:`restore` brings them back. Returns the file's bytes."""
        ids = list(seq_ids)
        with self._lock:
            size = self.save(path, ids)
            for seq_id in ids:
                self.table.remove(seq_id)
            return size

    def restore(self, path: str | os.PathLike[str],
                new_ids: Sequence[Hashable] | None = None) -> tuple:
        """Bring back sequences :meth:`offload` wrote (as :meth:`load`)."""
        return self.load(path, new_ids)

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
                # the step's own checks first (the errors a call without masks gets), on
                # seq_ids and lengths read once (a generator works as without masks)
                seq_ids, lengths, _ = self.table.check_step(seq_ids, lengths)
                check_step_masks(masks, seq_ids, lengths, self.rope)
            tables = self.table.reserve(seq_ids, lengths, rope=self.rope)
            try:
                if self.prefill and tables.T > len(tables.lengths):
                    tables.prefill = self._budgeted(prefill_runs(tables, self._long_from),
                                                    masks is not None)
                if masks is not None:
                    tables.mask = step_mask(tables.prefill, len(tables.lengths), masks)
                self._step = _StepInProgress(self, tables)
            except BaseException:
                self.table.release(tables)
                raise

    def _budgeted(self, runs: PrefillRuns | None, masked: bool) -> PrefillRuns | None:
        """The step's prefill runs, or None where their units would pass the device's loop
        budget (:mod:`clattn.loop_budget`): every token then runs on the decode kernel,
        whose plan keeps within it. A masked step, which needs the prefill kernel, is
        refused there."""
        budget = self.opencl.setup.limits.loop_budget if self.opencl else 0
        if runs is None or not budget:
            return runs
        geom = self.opencl.prefill_geometry
        qb = queries_per_unit(geom, runs.n, runs.chunk)
        units = make_prefill_plan(runs.n, runs.chunk, qb).units
        if prefill_fits(self.spec, geom, budget, units, qb, runs.chunk, masked,
                        rotary=self.rope == "attend"):
            return runs
        if masked:
            raise ValueError(f"masks: this device ends a work-item's loops after {budget} "
                             f"iterations (clattn.loop_budget), which the masked step's "
                             f"prefill units would pass; begin steps of fewer tokens over "
                             f"shorter sequences, or use backend='cpu'")
        return None

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
        return () if self._device is None else self._device.upload_events()

    @property
    def num_tokens(self) -> int:
        """New tokens of the step in progress (``T``: the first axis of append/attend)."""
        return self._current("num_tokens").tables.T

    def append(self, layer: int, k: Any, v: Any = None) -> Any:
        """Write the step's new keys ``k [T, H_kv, D]`` and values ``v [T, H_kv, D_v]``
        into ``layer``'s pool.

        ``T`` is the sum of the step's lengths, tokens in ``begin``'s order. numpy or
        device arrays (the call returns at once; the event completes the write). With
        ``spec.value_in_key`` the values are the key rows' leading ``D_v`` values: ``v``
        must be None (only the key rows are written).
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
                raise StepError(f"end: layers {short(missing)} were not appended this step; "
                                f"append every layer (or cancel())")
            step.flush()
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
            if self._device is not None:
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
        self.dev = cache.device
        if self.dev is not None:
            self.dev.start(tables)

    def _check(self, name: str, a: Any, shape: tuple) -> None:
        try:
            check_array(name, a, shape=shape, dtypes=(self.cache.spec.np_dtype,))
        except ValueError as exc:
            raise StepShapeError(f"{exc}: the step begun for {self.tables.T} new tokens "
                                 f"(lengths {short(self.tables.lengths)}) takes {name} of "
                                 f"shape {shape}") from None

    def append(self, layer: int, k: Any, v: Any) -> Any:
        cache, dev, t = self.cache, self.dev, self.tables
        vik = cache.spec.value_in_key
        validate.check_value_arg(cache.spec, v)
        if dev is None or not (dev.ready(k, self.kv_shape) and
                               (vik or dev.ready(v, self.v_shape))):
            self._check("k", k, self.kv_shape)
            if not vik:
                self._check("v", v, self.v_shape)
        if dev is None:
            if not (is_host(k) and (vik or is_host(v))):
                raise TypeError("append: the CPU backend takes numpy k and v")
            rope = cache.rope == "append"
            cpu_backend.append_kv(cache.spec, cache.pools[layer], k, v, t.slots, t.copies,
                                  k_pos=t.k_pos, rope=cache.rope_freqs if rope else None,
                                  rope_scale=cache.rope_scale)
            evt = None
        else:
            evt = dev.append(layer, k, v, self.checks)
        self.appended[layer] = True
        return evt

    def copy_pages(self, layer: int) -> None:
        """The step's copy-on-write copies alone, in ``layer``'s pool."""
        if self.dev is None:
            cpu_backend.copy_pages(self.cache.spec, self.cache.pools[layer], self.tables.copies)
        else:
            self.dev.copy(self.cache.pools[layer])

    def flush(self) -> None:
        """Launch an append held for its layer's attend, then raise ValueError when the
        device check refused an append of the step (that layer's append wrote nothing)."""
        if self.dev is None:
            return
        self.dev.flush()
        bad = self.dev.refused(self.checks) if self.checks else []
        if bad:
            spec = self.cache.spec
            raise ValueError(
                f"end: the keys or values appended to layers {short(bad)} hold inf/NaN, or a "
                f"block whose scale overflows float16, which {spec.k_format} keys / "
                f"{spec.v_format} values cannot store; nothing was written for those layers. "
                f"The step is still open: cancel() it (or append those layers again)")

    def attend(self, layer: int, q: Any, out: Any, lse: Any,
               sink_logits: Any = None) -> AttentionResult:
        cache, t, dev = self.cache, self.tables, self.dev
        if not self.appended[layer]:
            raise StepError(f"attend: layer {layer} has not been appended this step; call "
                            f"append({layer}, k, v) first")
        validate.check_sink_logits(cache.spec, sink_logits)
        if dev is None:
            self._check("q", q, self.q_shape)
            if sink_logits is not None and not is_host(sink_logits):
                sink_logits = sink_logits.get()
            if t.prefill is None:
                return AttentionResult(*self._decode_host(layer, q, t, out, lse, sink_logits))
            return self._attend_host(layer, q, t.prefill, out, lse, sink_logits)
        on_device = out is not None and lse is not None and \
            dev.ready(out, self.out_shape) and dev.ready(lse, self.q_shape[:2], LSE_DTYPE)
        if on_device and dev.ready(q, self.q_shape):
            return dev.attend(layer, q, out, lse, sinks=dev.sinks(layer, sink_logits))
        if is_host(q) and (out is None or is_host(out)) and (lse is None or is_host(lse)) \
                and dev.shares_host_io(layer, t.T):
            # host q, out and lse in shared memory: the launch is the only command
            self._check("q", q, self.q_shape)
            self._check_out(out, lse)
            return dev.attend_host(layer, q, out, lse, sinks=dev.sinks(layer, sink_logits))
        if on_device and is_host(q) and dev.takes_host_q(layer):
            # the layer's held host k and v go up with q in one write (docs/cache.md)
            self._check("q", q, self.q_shape)
            return dev.attend(layer, q, out, lse, sinks=dev.sinks(layer, sink_logits))
        self._check("q", q, self.q_shape)
        self._check_out(out, lse)
        sinks = dev.sinks(layer, sink_logits)
        call = Call(cache.runtime)
        dq = call.input("q", q)
        dout = call.output("out", out, self.out_shape, cache.spec.np_dtype)
        dlse = call.output("lse", lse, self.q_shape[:2], LSE_DTYPE)
        res = dev.attend(layer, dq, dout, dlse, call.wait_list(), sinks=sinks)
        # results as the given out and lse are (device arrays: at once), else as q is
        o, s = call.finish([dout, dlse], list(res.events), host=is_host(q) and not on_device)
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
        cache._host_prefill_launches += 1
        return AttentionResult(out, lse)


def _checked_rollback(n: Any) -> int:
    if not is_int(n) or n < 0:
        raise ValueError(f"rollback={n!r}: must be an integer >= 0")
    return int(n)


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
