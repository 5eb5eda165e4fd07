"""The CPU fallback: docs/contract.md's semantics in vectorised numpy (f32 accumulation).

This is the product's fallback when no OpenCL device is present, not only a test
oracle. Per sequence it gathers the chunk's rows page-wise and processes them in
blocks, merging block states exactly as the kernels merge partitions.
"""
from __future__ import annotations

import numpy as np

from . import rope as _rope
from .mask import unpack_mask
from .quant import QUANTIZED, quantize, region_views, unpack_pool
from .spec import LOG2E, LSE_DTYPE, AttentionSpec, default_sm_scale
from .validate import (
    check_decode,
    check_merge_k,
    check_merge_pair,
    check_prefill,
    check_sink_logits,
)

BLOCK_ROWS = 4096  # rows gathered at once per sequence (bounds temporary memory)


def chunk_offsets(stored: int, window_offset: int, sink_size: int) -> np.ndarray:
    """Sequence offsets of the attended chunk's rows, in row order (docs/contract.md)."""
    if stored <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(sink_size, dtype=np.int64),
                           np.arange(window_offset, stored, dtype=np.int64)])


def exp_base(m: np.ndarray) -> np.ndarray:
    """The base subtracted from scores before exp2 under running maxima ``m``: ``m``, or 0
    where it is still -inf, so that rows scoring -inf weigh 0 (not exp2(-inf - -inf) = NaN)
    in a block that has seen nothing else; NaN and +inf are kept."""
    return np.where(m == -np.inf, np.float32(0), m).astype(np.float32)


def finish_state(m: np.ndarray, l: np.ndarray, acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` of states ``(m, l, acc)`` that each saw at least one row: broken (NaN)
    where every row scored -inf (``l == 0``), docs/contract.md "Non-finite values"."""
    dead = l == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        o = acc / np.where(dead, np.float32(np.nan), l)[..., None]
        s = np.where(dead, np.float32(np.nan), m + np.log2(np.where(dead, 1, l)))
    return o.astype(np.float32), s.astype(np.float32)


def sink_base2(sink_logits: np.ndarray | None, H: int) -> np.ndarray:
    """Each query head's learned sink in base-2 units (f32, as the kernels form it); -inf
    (no sink) for every head when ``sink_logits`` is None."""
    if sink_logits is None:
        return np.full(H, -np.inf, np.float32)
    return (sink_logits.astype(np.float32) * np.float32(LOG2E)).astype(np.float32)


def add_sink(m: np.ndarray, l: np.ndarray, acc: np.ndarray,
             t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """States ``(m, l, acc)`` with the sink ``t`` (base 2, broadcast against ``m``) as one
    more score of value 0: ``m' = max(m, t)``, ``l' = l 2^(m - m') + 2^(t - m')``, acc
    scaled by ``2^(m - m')``. ``t = -inf`` leaves a state as it is; ``+inf`` breaks it
    (docs/contract.md section 5)."""
    t = np.where(t == np.inf, np.float32(np.nan), t).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        m2 = np.where(np.isnan(m) | np.isnan(t), np.float32(np.nan), np.maximum(m, t))
        alpha = np.where(m == -np.inf, np.float32(0), np.exp2(m - m2)).astype(np.float32)
        w = np.where(t == -np.inf, np.float32(0), np.exp2(t - m2)).astype(np.float32)
        return (m2.astype(np.float32), (l * alpha + w).astype(np.float32),
                (acc * alpha[..., None]).astype(np.float32))


def _apply_softcap(s: np.ndarray, softcap: float | None) -> np.ndarray:
    return s if softcap is None else softcap * np.tanh(s / softcap)


def batch_decode(spec: AttentionSpec, q: np.ndarray, pages: np.ndarray, page_indptr: np.ndarray,
                 page_indices: np.ndarray, last_page_len: np.ndarray | None = None, *,
                 length_info: np.ndarray | None = None, window_offset: np.ndarray | None = None,
                 sink_size: np.ndarray | None = None, q_pos: np.ndarray | None = None,
                 k_pos_offset: np.ndarray | None = None, rotary_mode: int = 0,
                 rope_scale: float = 1.0, rope_theta: float = 1e4,
                 sm_scale: float | None = None, out: np.ndarray | None = None,
                 lse: np.ndarray | None = None,
                 sink_logits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Paged-KV decode attention on the CPU; returns ``(out, lse)`` (lse base 2).
    ``sink_logits`` (float32 ``[H_qo]``) adds a learned attention sink per query head."""
    check_sink_logits(spec, sink_logits)
    args = check_decode(spec, q, pages, page_indptr, page_indices, last_page_len,
                        length_info=length_info, window_offset=window_offset,
                        sink_size=sink_size, q_pos=q_pos, k_pos_offset=k_pos_offset,
                        rotary_mode=rotary_mode, sm_scale=sm_scale, rope_scale=rope_scale,
                        rope_theta=rope_theta, out=out, lse=lse)
    kpages, vpages, page_indices = _kv_pages(spec, pages, page_indices)
    B, H, D = q.shape
    Hkv, G, ps, Dv = spec.num_kv_heads, spec.group_size, spec.page_size, spec.head_dim_v
    scale = (default_sm_scale(D) if sm_scale is None else float(sm_scale))
    res_o = np.zeros((B, H, Dv), dtype=np.float32)
    sink2 = sink_base2(sink_logits, H)
    res_s = np.broadcast_to(sink2, (B, H)).copy()  # an empty chunk: the sink alone
    if rotary_mode == 1:
        scaling = _rope.parse_rope_scaling(spec.rope_scaling, spec.max_position_embeddings)
        inv2, att, long_from = _rope.rope_tables(spec.rotary_dim, float(rope_theta), scaling,
                                                 spec.max_position_embeddings)
    for b in range(B):
        n_rows = int(args.chunk[b])
        if n_rows == 0:
            continue
        p0 = int(page_indptr[b])
        wo = int(args.window_offset[b]) if spec.sliding_window else 0
        sk = int(args.sink_size[b]) if spec.sliding_window else 0
        offs = chunk_offsets(int(args.stored[b]), wo, sk)
        qb = q[b].astype(np.float32).reshape(Hkv, G, D)
        if rotary_mode == 1:
            inv = inv2[1] if int(q_pos[b]) + 1 > long_from else inv2[0]
            qpos = np.array([float(q_pos[b]) * rope_scale])
            qb = _rope.rotate(qb.reshape(H, 1, D).transpose(1, 0, 2), qpos, inv, att,
                              scaling.interleaved)[0].reshape(Hkv, G, D).astype(np.float32)
        m = np.full((Hkv, G), -np.inf, dtype=np.float32)
        l = np.zeros((Hkv, G), dtype=np.float32)
        acc = np.zeros((Hkv, G, Dv), dtype=np.float32)
        for r0 in range(0, n_rows, BLOCK_ROWS):
            o = offs[r0:r0 + BLOCK_ROWS]
            pid = page_indices[p0 + o // ps]
            slot = o % ps
            k = kpages[pid, :, slot, :].astype(np.float32)  # [rows, Hkv, D]
            v = vpages[pid, :, slot, :].astype(np.float32)  # [rows, Hkv, D_v]
            if rotary_mode == 1:
                pos = (int(k_pos_offset[b]) + np.arange(r0, r0 + len(o))) * float(rope_scale)
                k = _rope.rotate(k.transpose(1, 0, 2), pos, inv, att,
                                 scaling.interleaved).astype(np.float32).transpose(1, 0, 2)
            s = np.einsum("hgd,rhd->hgr", qb, k, dtype=np.float32) * np.float32(scale)
            s = _apply_softcap(s, spec.softcap).astype(np.float32) * np.float32(LOG2E)
            m_new = np.maximum(m, s.max(axis=-1))
            base = exp_base(m_new)
            alpha = np.exp2(m - base)  # m=-inf -> 0
            p = np.exp2(s - base[..., None])
            l = l * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + np.einsum("hgr,rhd->hgd", p, v, dtype=np.float32)
            m = m_new
        o, st = finish_state(*add_sink(m, l, acc, sink2.reshape(Hkv, G)))
        res_o[b] = o.reshape(H, Dv)
        res_s[b] = st.reshape(H)
    if out is None:
        out = np.empty((B, H, Dv), dtype=spec.np_dtype)
    if lse is None:
        lse = np.empty((B, H), dtype=LSE_DTYPE)
    out[...] = res_o
    lse[...] = res_s
    return out, lse


QUERY_ROWS = 128  # queries of a sequence scored at once by batch_prefill


def batch_prefill(spec: AttentionSpec, q: np.ndarray, pages: np.ndarray, qo_indptr: np.ndarray,
                  page_indptr: np.ndarray, page_indices: np.ndarray,
                  last_page_len: np.ndarray | None = None, *,
                  length_info: np.ndarray | None = None, window_offset: np.ndarray | None = None,
                  sink_size: np.ndarray | None = None, q_pos: np.ndarray | None = None,
                  k_pos_offset: np.ndarray | None = None, rotary_mode: int = 0,
                  causal: bool = True, rope_scale: float = 1.0, rope_theta: float = 1e4,
                  sm_scale: float | None = None, out: np.ndarray | None = None,
                  lse: np.ndarray | None = None, custom_mask: np.ndarray | None = None,
                  mask_indptr: np.ndarray | None = None,
                  sink_logits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Paged-KV prefill on the CPU (docs/prefill.md); returns ``(out, lse)``, lse base 2.

    Query ``i`` of sequence ``b`` is chunk row ``chunk - n + i``; causal, it attends chunk
    rows ``[0, chunk - n + i]``, else the whole chunk; with ``custom_mask`` only those of
    them its mask keeps (a query keeping none: ``out = 0``, ``lse = -inf``, or its head's
    sink with ``sink_logits``). f32 accumulation, key blocks merged as in
    :func:`batch_decode`, the learned sinks ``sink_logits`` too.
    """
    check_sink_logits(spec, sink_logits)
    args = check_prefill(spec, q, pages, qo_indptr, page_indptr, page_indices, last_page_len,
                         length_info=length_info, window_offset=window_offset,
                         sink_size=sink_size, q_pos=q_pos, k_pos_offset=k_pos_offset,
                         rotary_mode=rotary_mode, causal=causal, sm_scale=sm_scale,
                         rope_scale=rope_scale, rope_theta=rope_theta, out=out, lse=lse,
                         custom_mask=custom_mask, mask_indptr=mask_indptr)
    t = args.tables
    kpages, vpages, page_indices = _kv_pages(spec, pages, page_indices)
    T, H, D = q.shape
    Hkv, G, ps, Dv = spec.num_kv_heads, spec.group_size, spec.page_size, spec.head_dim_v
    scale = np.float32(default_sm_scale(D) if sm_scale is None else float(sm_scale))
    res_o = np.zeros((T, H, Dv), dtype=np.float32)
    sink2 = sink_base2(sink_logits, H)
    res_s = np.broadcast_to(sink2, (T, H)).copy()  # a query that attends nothing: the sink
    if rotary_mode == 1:
        scaling = _rope.parse_rope_scaling(spec.rope_scaling, spec.max_position_embeddings)
        inv2, att, long_from = _rope.rope_tables(spec.rotary_dim, float(rope_theta), scaling,
                                                 spec.max_position_embeddings)
    for b in range(t.B):
        n, chunk, qs = int(args.n_q[b]), int(t.chunk[b]), int(qo_indptr[b])
        if n == 0 or chunk == 0:  # no query, or nothing to attend (not causal): empty rows
            continue
        p0 = int(page_indptr[b])
        offs = chunk_offsets(int(t.stored[b]), int(t.window_offset[b]) if spec.sliding_window
                             else 0, int(t.sink_size[b]) if spec.sliding_window else 0)
        if rotary_mode == 1:
            kpos = int(k_pos_offset[b])
            qpos = kpos + chunk - n if q_pos is None else int(q_pos[b])  # the first query's
            inv = inv2[1] if qpos + n - 1 >= long_from else inv2[0]
        keep = None if custom_mask is None else unpack_mask(custom_mask, mask_indptr, b, n, chunk)
        for i0 in range(0, n, QUERY_ROWS):
            rows_q = np.arange(chunk - n + i0, chunk - n + min(n, i0 + QUERY_ROWS))  # chunk rows
            if not causal:
                rows_q = np.maximum(rows_q, chunk - 1)  # every query sees the whole chunk
            qb = q[qs + i0:qs + i0 + len(rows_q)].astype(np.float32)  # [nq, H, D]
            if rotary_mode == 1:
                qb = _rope.rotate(qb.transpose(1, 0, 2),
                                  (qpos + np.arange(i0, i0 + len(rows_q))) * float(rope_scale),
                                  inv, att, scaling.interleaved)
                qb = qb.astype(np.float32).transpose(1, 0, 2)
            qb = qb.reshape(len(rows_q), Hkv, G, D)
            m = np.full((Hkv, G, len(rows_q)), -np.inf, dtype=np.float32)
            l = np.zeros_like(m)
            acc = np.zeros((Hkv, G, len(rows_q), Dv), dtype=np.float32)
            for r0 in range(0, int(rows_q[-1]) + 1, BLOCK_ROWS):
                o = offs[r0:min(r0 + BLOCK_ROWS, int(rows_q[-1]) + 1)]
                pid = page_indices[p0 + o // ps]
                k = kpages[pid, :, o % ps, :].astype(np.float32)  # [rows, Hkv, D]
                v = vpages[pid, :, o % ps, :].astype(np.float32)  # [rows, Hkv, D_v]
                if rotary_mode == 1:
                    pos = (kpos + np.arange(r0, r0 + len(o))) * float(rope_scale)
                    k = _rope.rotate(k.transpose(1, 0, 2), pos, inv, att,
                                     scaling.interleaved).astype(np.float32).transpose(1, 0, 2)
                s = np.einsum("qhgd,rhd->hgqr", qb, k, dtype=np.float32) * scale
                s = _apply_softcap(s, spec.softcap).astype(np.float32) * np.float32(LOG2E)
                seen = np.arange(r0, r0 + len(o))[None, :] <= rows_q[:, None]  # causal [q, r]
                live = seen[:, 0]  # the block's first row is attended by the query
                if keep is not None:
                    seen = seen & keep[i0:i0 + len(rows_q), r0:r0 + len(o)]
                s = np.where(seen, s, -np.inf)
                m_new = np.where(live, np.maximum(m, s.max(axis=-1)), m)
                base = exp_base(m_new)
                alpha = np.where(live, np.exp2(m - base), 1.0).astype(np.float32)
                p = np.where(seen, np.exp2(s - base[..., None]), 0.0).astype(np.float32)
                l = l * alpha + p.sum(axis=-1)
                pv = np.einsum("hgqr,rhd->hgqd", p, v, dtype=np.float32)
                if not np.isfinite(v).all():  # a masked row's value must not reach (0 * inf)
                    for i, rows in enumerate(seen):
                        pv[:, :, i] = np.einsum("hgr,rhd->hgd", p[:, :, i, rows], v[rows],
                                                dtype=np.float32)
                acc = acc * alpha[..., None] + pv
                m = m_new
            # every query here attends a row ...
            o, st = finish_state(*add_sink(m, l, acc, sink2.reshape(Hkv, G, 1)))
            if keep is not None:  # ... unless its mask keeps none of them: the sink alone
                lim = np.minimum(rows_q, chunk - 1)
                kept = (keep[i0:i0 + len(rows_q)] & (np.arange(chunk)[None, :] <=
                                                     lim[:, None])).any(axis=1)
                o = np.where(kept[:, None], o, np.float32(0))
                st = np.where(kept, st, sink2.reshape(Hkv, G, 1))
            res_o[qs + i0:qs + i0 + len(rows_q)] = o.transpose(2, 0, 1, 3) \
                .reshape(len(rows_q), H, Dv)
            res_s[qs + i0:qs + i0 + len(rows_q)] = st.transpose(2, 0, 1) \
                .reshape(len(rows_q), H)
    if out is None:
        out = np.empty((T, H, Dv), dtype=spec.np_dtype)
    if lse is None:
        lse = np.empty((T, H), dtype=LSE_DTYPE)
    out[...] = res_o
    lse[...] = res_s
    return out, lse


def _kv_pages(spec: AttentionSpec, pool: np.ndarray,
              page_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(keys [n, H_kv, page_size, D], values [n, H_kv, page_size, D_v], table)``: a float
    pool's own K and V views with the table as given; for a byte pool the f32 pages the
    table names, decoded once, and the table renumbered into them (indices out of the
    pool clamp as in the kernels)."""
    if not spec.byte_pool:
        return pool[:, 0], pool[:, 1], page_indices
    idx = np.clip(page_indices.astype(np.int64), 0, max(pool.shape[0] - 1, 0))
    used, renum = np.unique(idx, return_inverse=True)
    if pool.shape[0] == 0:
        used = used[:0]
    k, v = unpack_pool(pool, spec.layout, used)
    return k, v, renum.astype(np.int32).reshape(page_indices.shape)


def _merge_arrays(v: np.ndarray, s: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge states stacked along ``axis`` of s (v has one more trailing dim).

    An empty state (s = -inf) weighs 0 and its v is not read; a NaN or +inf s makes
    the merged state NaN (docs/contract.md, "Non-finite values").
    """
    s = s.astype(np.float32)
    empty = np.isneginf(s)
    with np.errstate(invalid="ignore", over="ignore"):
        m = s.max(axis=axis, keepdims=True)  # NaN propagates
        m_safe = np.where(np.isneginf(m), 0.0, m)
        w = np.where(empty, 0.0, np.exp2(s - m_safe)).astype(np.float32)
        tot = w.sum(axis=axis, keepdims=True)
        wv = np.where(empty[..., None], 0.0, w[..., None] * v.astype(np.float32))
        inv = np.where(tot == 0, 0.0, 1.0 / np.where(tot == 0, 1.0, tot))
        vo = wv.sum(axis=axis) * np.squeeze(inv, axis)[..., None]
        so = np.where(tot > 0, m + np.log2(np.where(tot > 0, tot, 1.0)),
                      np.where(tot == 0, -np.inf, np.nan))
    return vo.astype(np.float32), np.squeeze(so, axis).astype(np.float32)


def merge_state(v: np.ndarray, s: np.ndarray, v_other: np.ndarray,
                s_other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge two attention states; returns new ``(v, s)`` (s base 2, -inf = empty)."""
    check_merge_pair(v, s, v_other, s_other)
    vo, so = _merge_arrays(np.stack([v, v_other], axis=1), np.stack([s, s_other], axis=1), 1)
    return vo.astype(v.dtype), so


def merge_state_(v: np.ndarray, s: np.ndarray, v_other: np.ndarray, s_other: np.ndarray) -> None:
    """In-place ``merge_state``: ``v`` and ``s`` receive the merged state."""
    vo, so = merge_state(v, s, v_other, s_other)
    v[...] = vo
    s[...] = so


def merge_states(v: np.ndarray, s: np.ndarray, out: np.ndarray | None = None,
                 lse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Merge K states at once: ``v [N, K, H, D]``, ``s [N, K, H]`` -> ``[N, H, D]``, ``[N, H]``."""
    check_merge_k(v, s, out, lse)
    if v.shape[1] == 0:  # no states: the empty state
        vo = np.zeros((v.shape[0],) + v.shape[2:], np.float32)
        so = np.full((s.shape[0], s.shape[2]), -np.inf, np.float32)
    else:
        vo, so = _merge_arrays(v, s, 1)
    if out is None:
        out = np.empty(vo.shape, dtype=v.dtype)
    if lse is None:
        lse = np.empty(so.shape, dtype=LSE_DTYPE)
    out[...] = vo
    lse[...] = so
    return out, lse


def merge_varlen(v: np.ndarray, s: np.ndarray, indptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge ragged groups of states: group ``i`` is ``v[indptr[i]:indptr[i+1]]``."""
    outs = []
    for a, b in zip(indptr[:-1], indptr[1:]):
        if b > a:
            outs.append(_merge_arrays(v[a:b][None], s[a:b][None], 1))
        else:
            outs.append((np.zeros((1,) + v.shape[1:], np.float32),
                         np.full((1,) + s.shape[1:], -np.inf, np.float32)))
    if not outs:
        return np.zeros((0,) + v.shape[1:], np.float32), np.zeros((0,) + s.shape[1:], np.float32)
    return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs])


__all__ = ["batch_decode", "batch_prefill", "merge_state", "merge_state_", "merge_states",
           "chunk_offsets"]


# -- the cache's append and page copy (the append program's kernels) ----------------------
def copy_pages(spec: AttentionSpec, pool: np.ndarray, copies: np.ndarray) -> None:
    """The page-copy kernel: for each ``(src, dst, rows)`` of ``copies`` (int32 ``[n,
    3]`` or flat), the first ``rows`` slots of page ``src`` copied into page ``dst`` of
    ``pool`` (keys and values; a byte pool's data and scales)."""
    for src, dst, rows in copies.reshape(-1, 3):
        if not spec.byte_pool:
            pool[dst, :, :, :rows] = pool[src, :, :, :rows]
            continue
        for kind in spec.layout.kinds:
            for view in region_views(pool, spec.layout, kind):
                if view is not None:
                    view[dst, :, :rows] = view[src, :, :rows]


def append_kv(spec: AttentionSpec, pool: np.ndarray, k: np.ndarray, v: np.ndarray | None,
              slots: np.ndarray, copies: np.ndarray, k_pos: np.ndarray | None = None,
              rope: tuple | None = None, rope_scale: float = 1.0) -> None:
    """The page copies (:func:`copy_pages`), then the append kernel: token ``t``'s keys
    ``k[t]`` (``[T, H_kv, D]``) and values ``v[t]`` (``[T, H_kv, D_v]``; None, and only
    the key rows written, when ``spec.value_in_key``) written at pool slot ``slots[t]``
    (``page * page_size + row``), stored as the pool stores them (a byte pool's
    q8_0/q4_0 blocks: a value no block can store is refused before anything is written).

    ``rope``: ``(inverse frequencies per table, attention factor, first long-factor
    position)`` of :func:`clattn.rope.rope_tables`: the keys are rotated first at
    positions ``k_pos * rope_scale`` (the append kernel's ``rope="append"``).
    """
    ps = spec.page_size
    if rope is not None:
        inv, att, long_from = rope
        interleaved = _rope.parse_rope_scaling(spec.rope_scaling,
                                               spec.max_position_embeddings).interleaved
        kf = k.astype(np.float64)
        for tab in (0, 1):
            sel = (k_pos >= long_from) == bool(tab)
            if sel.any():
                kf[sel] = _rope.rotate(kf[sel].transpose(1, 0, 2), k_pos[sel] * rope_scale,
                                       inv[tab], att, interleaved).transpose(1, 0, 2)
        k = kf.astype(np.float32 if spec.byte_pool else spec.np_dtype)
    page, slot = slots // ps, slots % ps
    if not spec.byte_pool:
        copy_pages(spec, pool, copies)
        pool[page, 0, :, slot] = k
        pool[page, 1, :, slot] = v
        return
    kinds = spec.layout.kinds
    rows = [_stored(x, fmt, name) for x, fmt, name in
            ((k, spec.k_format, "k"), (v, spec.v_format, "v"))[:len(kinds)]]  # may refuse
    copy_pages(spec, pool, copies)
    for kind, (data, scales) in enumerate(rows):
        dview, sview = region_views(pool, spec.layout, kind)
        dview[page, :, slot] = data
        if scales is not None:
            sview[page, :, slot] = scales


def _stored(x: np.ndarray, fmt: str, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(data uint8 [..., row_bytes], scales or None)`` of rows ``x`` stored as ``fmt``."""
    if fmt in QUANTIZED:
        return quantize(x, fmt, name)
    return np.ascontiguousarray(x.astype(fmt)).view(np.uint8), None
