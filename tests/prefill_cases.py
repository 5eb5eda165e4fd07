"""Ragged prefill batches and their float64 references (tests/test_prefill.py, the Oclgrind
runner's prefill variants).

``naive_prefill`` is ``naive.naive_decode`` run once per query with the causal row limit:
query ``i`` of a sequence with ``n`` new tokens is a decode over the sequence cut after its
stored row ``stored - n + i`` (same window and sinks), its query at RoPE position
``k_pos_offset + chunk - n + i`` (docs/prefill.md), longrope's table chosen by the
sequence's last query. ``fast_oracle`` is a vectorised float64 reference (no RoPE) for
long cases, checked against ``naive_prefill`` by the tests.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
from cases import make_case, oracle_pages
from naive import ScoredLse, longrope_use_long, naive_decode, naive_inv_freq, rope_type_of


def prefill_case(spec, cached, chunks, *, seed=0, window=None, sinks=None, rope=False,
                 pos_offset=None, dtype=None, poison=True):
    """A ragged batch: sequence b holds ``cached[b]`` old tokens and ``chunks[b]`` new ones
    (all stored), queries ``q [sum(chunks), H_qo, D]`` for the new ones. Slots nobody may
    read are NaN (``poison``)."""
    stored = [c + n for c, n in zip(cached, chunks)]
    case = make_case(spec, stored, seed=seed, window=window, sinks=sinks, rope=rope,
                     pos_offset=pos_offset, dtype=dtype, poison=poison)
    rng = np.random.default_rng(seed + 7)
    case["q"] = rng.standard_normal((sum(chunks), spec.num_qo_heads, spec.head_dim)) \
        .astype(case["dtype"])
    case["chunks"] = np.array(chunks, np.int64)
    case["qo_indptr"] = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    case.pop("q_pos", None)
    return case


def run(pre, case, **call):
    """BatchPrefill.run on a case's tables (window and RoPE tables when the case has them)."""
    kw = {k: case[k] for k in ("window_offset", "sink_size") if k in case}
    if call.get("rotary_mode"):
        kw["k_pos_offset"] = case["k_pos_offset"]
    return pre.run(case["q"], case["pages"], case["qo_indptr"], case["page_indptr"],
                   case["page_indices"], case["last_page_len"], **kw, **call)


_ORACLE: dict = {}


def _kept(fn):
    """A reference kept per case content, so that every target of a test shares one
    computation."""
    def wrapper(sc, case, *, causal=True, q_pos=None, mask=None, **call):
        h = hashlib.sha1(repr((fn.__name__, sc.name, causal, sorted(call.items()))).encode())
        for k in sorted(case):
            for x in case[k] if isinstance(case[k], tuple) else (case[k],):  # kv: a pair
                h.update(k.encode() + np.ascontiguousarray(x).tobytes())
        h.update(np.asarray(q_pos).tobytes())
        for m in mask or ():
            h.update(repr(np.shape(m)).encode() + np.ascontiguousarray(m).tobytes())
        h.update(b"mask" if mask is not None else b"")
        key = h.hexdigest()
        if key not in _ORACLE:
            _ORACLE[key] = fn(sc, case, causal=causal, q_pos=q_pos, mask=mask, **call)
        return _ORACLE[key]
    wrapper.__doc__ = fn.__doc__
    return wrapper


@_kept
def naive_prefill(sc, case, *, causal=True, q_pos=None, mask=None, **call):
    """The float64 reference: one naive decode per query over its causal rows (and, with
    ``mask``, a bool ``[n_b, chunk_b]`` matrix per sequence, only the rows it keeps)."""
    ps, o_all, parts = case["page_size"], [], []
    orc = dict(sc.oracle)
    base_fn = orc.pop("inv_freq_fn", None)
    if base_fn is None and call.get("rotary_mode"):
        rs, mpe = orc.get("rope_scaling"), orc.get("max_position_embeddings")
        rd = orc.get("rotary_dim") or sc.spec.head_dim

        def base_fn(pos, rs=rs, mpe=mpe, rd=rd):
            long = rope_type_of(rs) == "longrope" and longrope_use_long(rs, pos, mpe)
            return naive_inv_freq(rd, call.get("rope_theta", 1e4), rs, mpe, long)
    windowed = "window_offset" in case
    for b, n in enumerate(case["chunks"]):
        if n == 0:
            continue
        stored, chunk = int(case["stored"][b]), int(case["rows"][b])
        p0 = int(case["page_indptr"][b])
        first = (int(case["k_pos_offset"][b]) + chunk - n) if "k_pos_offset" in case else 0
        if q_pos is not None:
            first = int(q_pos[b])
        t = dict(indptr=[0], idx=[], last=[], wo=[], sink=[], keep=[])
        for i in range(n):
            st = stored - n + i + 1 if causal else stored
            npg = -(-st // ps)
            t["idx"] += list(case["page_indices"][p0:p0 + npg])
            t["indptr"].append(len(t["idx"]))
            t["last"].append(st - (npg - 1) * ps if npg else 0)
            if windowed:
                wo = min(int(case["window_offset"][b]), st)
                t["wo"].append(wo)
                t["sink"].append(min(int(case["sink_size"][b]), wo))
            if mask is not None:  # the cut sequence's chunk is a prefix of the whole one
                t["keep"].append(np.asarray(mask[b])[i])
        kw = {}
        if mask is not None:
            kw["keep"] = t["keep"]
        if windowed:
            kw.update(window_offset=np.array(t["wo"]), sink_size=np.array(t["sink"]))
        if call.get("rotary_mode"):
            kw.update(q_pos=first + np.arange(n),
                      k_pos_offset=np.full(n, int(case["k_pos_offset"][b])),
                      inv_freq_fn=lambda _pos, f=base_fn, last=first + n - 1: f(last))
        q = case["q"][case["qo_indptr"][b]:case["qo_indptr"][b + 1]]
        parts.append(naive_decode(q, oracle_pages(case), np.array(t["indptr"]),
                                  np.array(t["idx"], np.int32), np.array(t["last"]),
                                  **kw, **orc, **call))
    o_all = np.concatenate([p[0] for p in parts])
    lse = ScoredLse(np.concatenate([np.asarray(p[1]) for p in parts]),
                    **{f: np.concatenate([getattr(p[1], f) for p in parts])
                       for f in ScoredLse.FIELDS})
    return o_all, lse


@_kept
def fast_oracle(sc, case, *, causal=True, q_pos=None, **call):
    """A vectorised float64 reference (causal, no RoPE, no window) for the long cases;
    test_fast_oracle_matches_naive checks it against naive_prefill."""
    assert causal and q_pos is None and not call.get("rotary_mode")
    spec, ps = sc.spec, case["page_size"]
    G, D = spec.group_size, spec.head_dim
    scale = call.get("sm_scale") or 1 / math.sqrt(D)
    cap = sc.oracle.get("softcap")
    outs, lses, sizes = [], [], {f: [] for f in ScoredLse.FIELDS}
    for b, n in enumerate(case["chunks"]):
        stored, p0 = int(case["stored"][b]), int(case["page_indptr"][b])
        offs = np.arange(stored)
        kp, vp = case["kv"] if "kv" in case else (case["pages"][:, 0], case["pages"][:, 1])
        idx = case["page_indices"][p0 + offs // ps]
        k, v = (np.repeat(x[idx, :, offs % ps].astype(np.float64), G, axis=1)
                for x in (kp, vp))                                         # [rows, H, D(_v)]
        q = case["q"][case["qo_indptr"][b]:case["qo_indptr"][b + 1]].astype(np.float64)
        s = np.einsum("qhd,rhd->hqr", q, k) * scale
        if cap:
            s = cap * np.tanh(s / cap)
        mask = np.arange(stored)[None, :] <= (stored - n + np.arange(n))[:, None]
        s = np.where(mask, s, -np.inf)
        m = s.max(-1, keepdims=True)
        w = np.exp(s - m)
        outs.append(np.einsum("hqr,rhd->qhd", w / w.sum(-1, keepdims=True), v))
        lses.append(((m[..., 0] + np.log(w.sum(-1))) / math.log(2)).T)
        sizes["score_mag"].append((np.einsum("qhd,rhd->hqr", np.abs(q), np.abs(k)) * mask)
                                  .max(-1).T * scale / math.log(2))
        sizes["rows"].append(np.broadcast_to(mask.sum(1)[:, None], lses[-1].shape))
        sizes["v_mag"].append((mask[:, :, None] * np.abs(v).max(-1)[None]).max(1))
    return np.concatenate(outs), ScoredLse(np.concatenate(lses),
                                           **{f: np.concatenate(x) for f, x in sizes.items()})
