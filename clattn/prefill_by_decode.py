"""A prefill run as one decode per query, for devices whose loop budget the prefill kernel's
work units would pass (:mod:`clattn.loop_budget`).

docs/prefill.md defines query ``i`` of a sequence with ``n`` new queries and ``stored``
rows as a decode over the sequence cut after its stored row ``stored - n + i`` (causal;
the whole sequence otherwise), the same window and sinks, its query at RoPE position
``k_pos_offset + chunk - n + i`` (``q_pos + i`` when given). So the batch becomes a decode
batch of one sequence per query, over the same pool; the decode plan splits each within
the budget. The tables are built on the host (device tables are read back, a blocking
copy). A custom mask has no decode form, nor a sequence whose queries straddle the first
long-factor position of longrope RoPE (the prefill takes the long table for all of them,
a decode per query its own): both are refused by name.
"""
from __future__ import annotations

import numpy as np

from .spec import INDEX_DTYPE, AttentionSpec


def first_positions(qo_indptr: np.ndarray, chunk: np.ndarray, q_pos: np.ndarray | None,
                    k_pos_offset: np.ndarray) -> np.ndarray:
    """The RoPE position of each sequence's first query (docs/prefill.md)."""
    if q_pos is not None:
        return np.asarray(q_pos, np.int64)
    n = np.diff(np.asarray(qo_indptr, np.int64))
    return np.asarray(k_pos_offset, np.int64) + np.asarray(chunk, np.int64) - n


def decode_tables(spec: AttentionSpec, qo_indptr: np.ndarray, page_indptr: np.ndarray,
                  page_indices: np.ndarray, last_page_len: np.ndarray,
                  window_offset: np.ndarray | None, sink_size: np.ndarray | None,
                  first_pos: np.ndarray | None, k_pos_offset: np.ndarray | None,
                  causal: bool) -> dict:
    """The host tables of the decode batch of a prefill call's (checked) host tables: one
    sequence per query, in q's order (``last_page_len`` etc. as split out of
    ``length_info``; ``first_pos``: :func:`first_positions` with RoPE, else None)."""
    ps = spec.page_size
    rotary = first_pos is not None
    idx_out: list = []
    indptr, last, wo_out, sink_out, qp_out, kp_out = [0], [], [], [], [], []
    for b in range(len(qo_indptr) - 1):
        n = int(qo_indptr[b + 1] - qo_indptr[b])
        p0, p1 = int(page_indptr[b]), int(page_indptr[b + 1])
        stored = (p1 - p0 - 1) * ps + int(last_page_len[b]) if p1 > p0 else 0
        wo = int(window_offset[b]) if window_offset is not None else 0
        sink = int(sink_size[b]) if sink_size is not None else 0
        first = int(first_pos[b]) if rotary else 0
        for i in range(n):
            st = stored - n + i + 1 if causal else stored
            npg = -(-st // ps)
            idx_out.append(page_indices[p0:p0 + npg])
            indptr.append(indptr[-1] + npg)
            last.append(st - (npg - 1) * ps if npg else 0)
            if window_offset is not None:
                w = min(wo, st)
                wo_out.append(w)
                sink_out.append(min(sink, w))
            if rotary:
                qp_out.append(first + i)
                kp_out.append(int(k_pos_offset[b]))

    def ints(x: list) -> np.ndarray:
        return np.asarray(x, INDEX_DTYPE).reshape(-1)

    t = dict(page_indptr=ints(indptr), last_page_len=ints(last),
             page_indices=np.concatenate(idx_out).astype(INDEX_DTYPE) if idx_out
             else np.zeros(0, INDEX_DTYPE))
    if window_offset is not None:
        t.update(window_offset=ints(wo_out), sink_size=ints(sink_out))
    if rotary:
        t.update(q_pos=ints(qp_out), k_pos_offset=ints(kp_out))
    return t


def straddles(qo_indptr: np.ndarray, first_pos: np.ndarray, long_from: int) -> bool:
    """Whether some sequence's queries (at positions ``first_pos[b] ..``) lie on both sides
    of ``long_from``."""
    n = np.diff(np.asarray(qo_indptr, np.int64))
    first = np.asarray(first_pos, np.int64)
    return bool(np.any((n > 0) & (first < long_from) & (first + n - 1 >= long_from)))
