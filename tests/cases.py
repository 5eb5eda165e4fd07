"""Random paged-KV decode inputs and the comparison rule used by clattn's tests.

Only numpy here (and duck-typed ``spec`` attributes), so the helpers work for the
CPU fallback and the OpenCL kernels alike.
"""
from __future__ import annotations

import numpy as np

#: absolute/relative tolerance per storage dtype (the contract of the tests)
TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3}


def _per_seq(value, B, name):
    if value is None:
        return None
    if np.isscalar(value):
        return [int(value)] * B
    value = [int(v) for v in value]
    if len(value) != B:
        raise ValueError(f"{name}: {len(value)} values for {B} sequences")
    return value


def make_case(spec, lengths, *, seed=0, page_size=None, window=None, sinks=None, rope=False,
              shuffle_pages=True, extra_pages=3, dtype=None, pos_offset=None, q_pos=None,
              poison=False):
    """A random decode batch for ``spec`` with per-sequence stored lengths ``lengths``.

    Returns a dict with ``q [B, H_qo, D]``, ``pages [P, 2, H_kv, page_size, D]`` (values
    ~N(0, 1), dtype ``dtype`` or the spec's), int32 ``page_indptr``, ``page_indices`` and
    ``last_page_len`` (0 for a sequence that owns no page), plus ``stored`` (the lengths)
    and ``rows`` (the attended chunk length per sequence).

    The pool holds the sequences' pages shuffled (``shuffle_pages``) among
    ``extra_pages`` spare pages nobody owns.

    Sliding window: ``window`` is the window_offset, an int (clipped to each length) or
    a per-sequence list (used as is); ``sinks`` is sink_size, an int (clipped to each
    window_offset, default 0) or a list.  Adds ``window_offset``, ``sink_size`` and
    ``length_info`` ([3, B]); in plain mode ``length_info`` is last_page_len.

    RoPE (``rope=True``): ``k_pos_offset`` is ``pos_offset`` (int or list; default random
    in [0, 40)) and ``q_pos`` defaults to ``k_pos_offset + rows`` (the next position).

    ``poison=True`` fills every slot nobody may read (spare pages, the tail of each last
    page) with NaN, so reading out of range shows up as NaN.
    """
    rng = np.random.default_rng(seed)
    ps = int(page_size or spec.page_size)
    dt = np.dtype(dtype) if dtype is not None else np.dtype(spec.dtype)
    B = len(lengths)
    lengths = [int(n) for n in lengths]
    npages = [(n + ps - 1) // ps for n in lengths]
    total = sum(npages)
    P = total + int(extra_pages)
    H_qo, H_kv, D = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim

    q = rng.standard_normal((B, H_qo, D)).astype(dt)
    pages = rng.standard_normal((P, 2, H_kv, ps, D)).astype(dt)
    pool = rng.permutation(P) if shuffle_pages else np.arange(P)
    page_indptr = np.zeros(B + 1, dtype=np.int32)
    page_indptr[1:] = np.cumsum(npages)
    page_indices = pool[:total].astype(np.int32)
    last_page_len = np.array([n - (k - 1) * ps if k else 0 for n, k in zip(lengths, npages)],
                             dtype=np.int32)
    if poison:
        used = np.zeros((P, ps), dtype=bool)
        for b in range(B):
            for o in range(lengths[b]):
                used[page_indices[page_indptr[b] + o // ps], o % ps] = True
        for p in range(P):
            for slot in range(ps):
                if not used[p, slot]:
                    pages[p, :, :, slot, :] = np.nan

    case = dict(q=q, pages=pages, page_indptr=page_indptr, page_indices=page_indices,
                last_page_len=last_page_len, stored=np.array(lengths, dtype=np.int32),
                page_size=ps, dtype=dt)
    rows = list(lengths)
    if window is not None or sinks is not None:
        if window is None:
            window = 0
        if np.isscalar(window):
            wo = [min(int(window), n) for n in lengths]
        else:
            wo = _per_seq(window, B, "window")
        if sinks is None:
            ss = [0] * B
        elif np.isscalar(sinks):
            ss = [min(int(sinks), w) for w in wo]
        else:
            ss = _per_seq(sinks, B, "sinks")
        case["window_offset"] = np.array(wo, dtype=np.int32)
        case["sink_size"] = np.array(ss, dtype=np.int32)
        case["length_info"] = np.stack([last_page_len, case["window_offset"],
                                        case["sink_size"]]).astype(np.int32)
        rows = [n - w + s for n, w, s in zip(lengths, wo, ss)]
    else:
        case["length_info"] = last_page_len.copy()
    case["rows"] = np.array(rows, dtype=np.int32)
    if rope:
        if pos_offset is None:
            kpo = [int(v) for v in rng.integers(0, 40, size=B)]
        else:
            kpo = _per_seq(pos_offset, B, "pos_offset")
        case["k_pos_offset"] = np.array(kpo, dtype=np.int32)
        if q_pos is None:
            case["q_pos"] = np.array([k + r for k, r in zip(kpo, rows)], dtype=np.int32)
        else:
            case["q_pos"] = np.array(_per_seq(q_pos, B, "q_pos"), dtype=np.int32)
    return case


def decode_args(case, *, window=None, rope=None):
    """Positional args and keyword args of ``batch_decode`` for a case (without ``spec``)."""
    args = (case["q"], case["pages"], case["page_indptr"], case["page_indices"],
            case["last_page_len"])
    kw = {}
    if (window is None and "window_offset" in case) or window:
        kw["window_offset"] = case["window_offset"]
        kw["sink_size"] = case["sink_size"]
    if (rope is None and "q_pos" in case) or rope:
        kw["q_pos"] = case["q_pos"]
        kw["k_pos_offset"] = case["k_pos_offset"]
    return args, kw


def naive_kwargs(spec):
    """The build-time parts of ``spec`` as keyword arguments of ``naive.naive_decode``."""
    return dict(rope_scaling=spec.rope_scaling, rotary_dim=spec.rotary_dim, softcap=spec.softcap,
                max_position_embeddings=spec.max_position_embeddings)


def compare(out, lse, ref_out, ref_lse, dtype, tol=None, what=""):
    """Assert (out, lse) matches the float64 reference.

    ``out`` must have dtype ``dtype`` and ``lse`` float32; ``-inf`` in the reference lse
    must be matched exactly (and only there); no NaN anywhere; everything else within
    atol = rtol = ``tol`` (default 1e-5 for float32 storage, 2e-3 for float16).
    """
    dtype = np.dtype(dtype)
    if tol is None:
        tol = TOLERANCE[dtype]
    out = np.asarray(out)
    lse = np.asarray(lse)
    ref_out = np.asarray(ref_out, dtype=np.float64)
    ref_lse = np.asarray(ref_lse, dtype=np.float64)
    assert out.shape == ref_out.shape, f"{what}out shape {out.shape} != {ref_out.shape}"
    assert lse.shape == ref_lse.shape, f"{what}lse shape {lse.shape} != {ref_lse.shape}"
    assert out.dtype == dtype, f"{what}out dtype {out.dtype} != {dtype}"
    assert lse.dtype == np.float32, f"{what}lse dtype {lse.dtype} != float32"
    o = out.astype(np.float64)
    l = lse.astype(np.float64)
    assert not np.isnan(o).any(), f"{what}NaN in out at {np.argwhere(np.isnan(o))[:5].tolist()}"
    assert not np.isnan(l).any(), f"{what}NaN in lse at {np.argwhere(np.isnan(l))[:5].tolist()}"
    ref_empty = np.isneginf(ref_lse)
    got_empty = np.isneginf(l)
    assert (ref_empty == got_empty).all(), (
        f"{what}lse -inf mismatch at {np.argwhere(ref_empty != got_empty)[:5].tolist()}: "
        f"got {l[ref_empty != got_empty][:5]}, want {ref_lse[ref_empty != got_empty][:5]}")
    np.testing.assert_allclose(l[~ref_empty], ref_lse[~ref_empty], rtol=tol, atol=tol,
                               err_msg=f"{what}lse")
    np.testing.assert_allclose(o, ref_out, rtol=tol, atol=tol, err_msg=f"{what}out")


def rope_angle_tol(dtype, max_pos, tol=None):
    """A tolerance that also allows float32 RoPE angles at position ``max_pos``.

    An f32 angle ``pos * inv_freq`` carries an absolute error of about ulp(pos) / 2; at large
    positions that dominates (HF itself computes the angles in f32).
    """
    base = TOLERANCE[np.dtype(dtype)] if tol is None else tol
    angle_err = float(np.spacing(np.float32(max(max_pos, 1))))
    return max(base, 8 * angle_err)


__all__ = ["make_case", "compare", "decode_args", "naive_kwargs", "rope_angle_tol", "TOLERANCE"]


def merge_cases(rng, N, H, D, dtype, K=3):
    """Random states for merge tests, with empty (-inf) sides in every pattern.

    Returns ``(v, s, v_other, s_other)`` for a pairwise merge (one side empty, both sides
    empty) and ``(vk, sk)`` for a K-way merge (all empty, some empty).
    """
    v = rng.standard_normal((N, H, D)).astype(dtype)
    s = (rng.standard_normal((N, H)) * 4).astype(np.float32)
    vo = rng.standard_normal((N, H, D)).astype(dtype)
    so = (rng.standard_normal((N, H)) * 4).astype(np.float32)
    s[0, 0] = so[1, 1] = -np.inf
    s[2, :] = so[2, :] = -np.inf
    vk = rng.standard_normal((N, K, H, D)).astype(dtype)
    sk = (rng.standard_normal((N, K, H)) * 4).astype(np.float32)
    sk[0] = -np.inf
    sk[1, :2] = -np.inf
    return (v, s, vo, so), (vk, sk)
