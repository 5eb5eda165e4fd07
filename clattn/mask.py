"""Custom attention masks of a prefill (docs/prefill.md, "Custom masks"): packing and reading.

Sequence ``b``'s mask is a boolean matrix ``[n_b, chunk_b]`` (query ``i``, chunk row ``r``;
True: attended), flattened row-major and packed eight bits a byte, least significant bit
first (``numpy.packbits(..., bitorder="little")``); the sequences' segments follow one
another, sequence ``b``'s at bytes ``[mask_indptr[b], mask_indptr[b + 1])``.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .numbers import is_int
from .spec import INDEX_DTYPE, INT32_MAX


def pack_mask(masks: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Pack one boolean mask per sequence into ``(custom_mask, mask_indptr)``.

    Parameters
    ----------
    masks : sequence of numpy.ndarray of bool, shape [n_b, chunk_b]
        Sequence ``b``'s mask: ``masks[b][i, r]`` is True when query ``i`` attends chunk
        row ``r``. ``n_b`` is the sequence's query count, ``chunk_b`` its attended chunk
        (docs/prefill.md).

    Returns
    -------
    custom_mask : numpy.ndarray of uint8, shape [mask_indptr[-1]]
        The packed bits, segment after segment.
    mask_indptr : numpy.ndarray of int32, shape [B + 1]
        Byte offsets of the segments: ``ceil(n_b * chunk_b / 8)`` bytes each.

    Raises
    ------
    TypeError
        A mask that is not a boolean numpy array.
    ValueError
        A mask that is not two-dimensional, or masks of more than 2**31 - 1 bytes.

    Examples
    --------
    >>> import numpy as np, clattn
    >>> bits, indptr = clattn.pack_mask([np.tril(np.ones((3, 5), bool), 2)])
    >>> bits.tolist(), indptr.tolist()
    ([231, 125], [0, 2])
    """
    segs = []
    for b, m in enumerate(masks):
        if not isinstance(m, np.ndarray) or m.dtype != np.bool_:
            raise TypeError(f"masks[{b}]: expected a numpy bool array, got "
                            f"{getattr(m, 'dtype', type(m).__name__)} (use mask.astype(bool))")
        if m.ndim != 2:
            raise ValueError(f"masks[{b}]: expected a 2-d [n_b, chunk_b] matrix, got shape "
                             f"{m.shape}")
        segs.append(np.packbits(m.reshape(-1), bitorder="little"))
    sizes = np.array([len(s) for s in segs], np.int64)
    if sizes.sum() > INT32_MAX:
        raise ValueError(f"masks: {int(sizes.sum())} packed bytes; at most 2**31 - 1: run the "
                         f"batch in parts")
    indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(INDEX_DTYPE)
    bits = np.concatenate(segs) if segs else np.zeros(0, np.uint8)
    return np.ascontiguousarray(bits, dtype=np.uint8), indptr


def tree_mask(parents: Sequence[int], prefix: int) -> np.ndarray:
    """The mask of a draft tree appended after ``prefix`` attended rows.

    Parameters
    ----------
    parents : sequence of int
        Node ``i``'s parent (``-1``: a root); parents come before their children, the
        order in which the nodes are appended to the cache.
    prefix : int
        Chunk rows before the tree (the cached tokens the whole tree attends).

    Returns
    -------
    numpy.ndarray of bool, shape [len(parents), prefix + len(parents)]
        Node ``i`` keeps the prefix, its ancestors and itself: one sequence's matrix for
        :func:`pack_mask`.

    Raises
    ------
    ValueError
        A parent that is not an integer (Python or numpy, not a bool), not an earlier
        node and not -1; a prefix that is not an integer >= 0.
    """
    # Rule: only integers count (0.5 or "3" would silently round or fail raw in numpy)
    if not is_int(prefix) or prefix < 0:
        raise ValueError(f"prefix={prefix!r}: must be an integer >= 0 (the chunk rows "
                         f"before the tree)")
    prefix = int(prefix)
    parents = list(parents)
    n = len(parents)
    m = np.zeros((n, prefix + n), bool)
    m[:, :prefix] = True
    for i, p in enumerate(parents):
        if not is_int(p) or not -1 <= p < i:
            raise ValueError(f"parents[{i}]={p!r}: must be -1 (a root) or an earlier node "
                             f"(0..{i - 1}), an integer; list parents before their children")
        p = int(p)
        m[i, prefix:] = m[p, prefix:] if p >= 0 else False
        m[i, prefix + i] = True
    return m


def unpack_mask(custom_mask: np.ndarray, mask_indptr: np.ndarray, b: int, n: int,
                chunk: int) -> np.ndarray:
    """Sequence ``b``'s ``[n, chunk]`` boolean mask from checked host arrays."""
    seg = custom_mask[int(mask_indptr[b]):int(mask_indptr[b + 1])]
    return np.unpackbits(seg, count=n * chunk, bitorder="little").reshape(n, chunk) \
        .astype(bool)


def check_step_masks(masks: Any, seq_ids: Sequence, lengths: Sequence[int] | None,
                     rope: str | None) -> None:
    """What :meth:`clattn.PagedKVCache.begin` checks of ``masks`` before it reserves a page:
    a cache that rotates nothing (a draft token's position is its depth in the tree, not
    its row), one entry per sequence, each None or a 2-D numpy bool array with one row per
    new token. :func:`step_mask` checks the columns once the step's rows are known."""
    if rope is not None:
        raise ValueError(f"masks: the cache rotates keys (rope={rope!r}) at the positions of "
                         f"their rows, but a draft tree's token sits at its depth; make the "
                         f"cache with rope=None and rotate q and k at the tree's positions")
    if not isinstance(masks, Sequence) or len(masks) != len(seq_ids):
        n = len(masks) if isinstance(masks, Sequence) else type(masks).__name__
        raise ValueError(f"masks: {n} given for a step of {len(seq_ids)} sequences; one "
                         f"[n_b, chunk_b] bool matrix (or None) per sequence")
    for b, m in enumerate(masks):
        n = 1 if lengths is None else lengths[b]
        if m is not None and (not isinstance(m, np.ndarray) or m.dtype != np.bool_ or
                              m.ndim != 2 or m.shape[0] != n):
            raise ValueError(f"masks[{b}]: expected a numpy bool array of {n} rows (the "
                             f"sequence's new tokens) x its attended rows, got "
                             f"{getattr(m, 'dtype', type(m).__name__)} {getattr(m, 'shape', '')}")


def step_mask(runs: Any, n_seqs: int, masks: Sequence[np.ndarray | None]) -> tuple:
    """``(custom_mask, mask_indptr)`` of a cache step whose ``n_seqs`` sequences each
    attend as one prefill run (``runs``: the step's :class:`~clattn.cache_tables.PrefillRuns`,
    or None); ``masks[b]`` is sequence ``b``'s ``[n_b, chunk_b]`` bool matrix or None (every
    row kept). Refuses, naming ``masks``, a step that does not run whole on the prefill
    kernel and a matrix of another shape (their number :func:`check_step_masks` checked)."""
    if runs is None or runs.decode is not None or len(runs.n) != n_seqs:
        raise ValueError("masks: a masked step attends on the prefill kernel alone: every "
                         "sequence must bring two or more tokens and none may have a window "
                         "that has begun to slide (and the cache needs prefill=True)")
    full = []
    for b, m in enumerate(masks):
        want = (int(runs.n[b]), int(runs.chunk[b]))
        if m is None:
            m = np.ones(want, bool)
        if not isinstance(m, np.ndarray) or m.dtype != np.bool_ or m.shape != want:
            raise ValueError(f"masks[{b}]: expected a numpy bool array of shape {want} (the "
                             f"sequence's new tokens x its attended rows, new ones included), "
                             f"got {getattr(m, 'dtype', type(m).__name__)} "
                             f"{getattr(m, 'shape', '')}")
        full.append(m)
    return pack_mask(full)
