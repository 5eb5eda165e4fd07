"""Random paged-KV decode inputs, the scenarios tests run, and the one comparison rule.

Only numpy at import (clattn is imported where a spec is built), so the helpers serve the
CPU backend, the OpenCL kernels and the Oclgrind runner alike.

The tolerance table (``TOLERANCE``) is the only place a tolerance is written down. Every
bound is in units of f32 rounding, scaled by what the float64 oracle reports about each
(sequence, head) it computed (``naive.ScoredLse``): ``S``, the largest sum of
|q_d k_d| * |sm_scale| * log2(e) over the attended rows (the size of the numbers a score's
f32 dot product adds up), ``n``, the number of rows attended, and ``V``, the largest |v|
element among them:

* lse (f32 for every storage dtype): a max score, wrong by about eps * S; plus the log of
  a sum of n terms, about eps * sqrt(n); stored in f32, eps * |lse|.
* out, f32: a few roundings per weight (exp2, the division; 4 eps), each weight carries its
  score's error (eps * S, relative), the weighted sum of n rows adds about eps * sqrt(n),
  all times the largest |v|; plus one spacing of f32 subnormals (2^-149), which relative
  bounds miss: a result below 2^-126 is rounded to a multiple of it (a merge of states
  whose values are 1e-45 gives 7e-46, stored as 0).
* out, f16: the f32 result above, rounded once to nearest: within half an f16 ulp of the
  exact value plus the f32 bound (a result rounded toward zero is up to a whole ulp off).

Measured on PoCL, Intel's runtime and the CPU backend (rows and tiled kernels, page sizes
16/128, group 1/4/7, head_dim 64-128, 32k rows, scores scaled up to x40) the worst errors
are 0.14 of the lse bound and 0.1 of the out bound (without its constant term).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

F32_EPS = 2.0 ** -23

#: the contract of the tests: coefficients of eps in each bound (see the module docstring)
TOLERANCE = {
    # |lse - ref| <= eps * (const + score * S + rows * sqrt(n) + value * |ref|)
    "lse": dict(const=4.0, score=4.0, rows=4.0, value=4.0),
    # |out - ref| <= eps * V * (const + score * S + rows * sqrt(n))      (f32 storage)
    "out": dict(const=4.0, score=1.0, rows=1.0),
    # ... + f32_subnormal_ulp * 2**-149                                 (f32 storage)
    "f32_subnormal_ulp": 1.0,
    # |out - ref| <= f16_rounding_ulp * ulp16(ref) + the f32 bound       (f16 storage)
    "f16_rounding_ulp": 0.5,
}


def _sizes(ref_out, ref_lse):
    """(S, n, V) per (sequence, head) from an oracle lse (naive.ScoredLse), or defaults:
    no scores, one row, V = the largest |ref_out| (merges, derived arrays)."""
    shape = np.shape(ref_lse)
    got = [getattr(ref_lse, f, None) for f in ("score_mag", "rows", "v_mag")]
    if any(g is None or np.shape(g) != shape for g in got):
        v = np.abs(np.asarray(ref_out, dtype=np.float64))
        vmax = v.max(axis=-1) if v.ndim and v.shape[-1] else np.zeros(shape)
        return np.zeros(shape), np.ones(shape), np.maximum(vmax, 1.0)
    return tuple(np.asarray(g, dtype=np.float64) for g in got)


def lse_bound(ref_out, ref_lse):
    """Allowed |lse - ref_lse| per element."""
    S, n, _ = _sizes(ref_out, ref_lse)
    t = TOLERANCE["lse"]
    mag = np.where(np.isfinite(ref_lse), np.abs(np.asarray(ref_lse, dtype=np.float64)), 0.0)
    return F32_EPS * (t["const"] + t["score"] * S + t["rows"] * np.sqrt(n) + t["value"] * mag)


def out_bound(ref_out, ref_lse, dtype):
    """Allowed |out - ref_out| per element, for storage ``dtype``."""
    S, n, V = _sizes(ref_out, ref_lse)
    t = TOLERANCE["out"]
    f32 = (F32_EPS * V * (t["const"] + t["score"] * S + t["rows"] * np.sqrt(n))
           + TOLERANCE["f32_subnormal_ulp"] * 2.0 ** -149)[..., None]
    if np.dtype(dtype) == np.float32:
        return np.broadcast_to(f32, np.shape(ref_out))
    return TOLERANCE["f16_rounding_ulp"] * f16_ulp(ref_out) + f32


def f16_ulp(x):
    """The spacing of f16 numbers in the binade of |x| (2**-24 below the normal range)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.where(a >= 2.0 ** -14, 2.0 ** (e - 10), 2.0 ** -24)


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

    A spec whose values differ in width from its keys (``head_dim_v``), or are read from
    them (``value_in_key``), gets its byte pool in ``pages`` and, for the oracle, the
    float keys ``[P, H_kv, page_size, D]`` and values ``[P, H_kv, page_size, D_v]`` as
    stored, in ``kv`` (``value_in_key``: the keys' leading ``D_v`` values; quantized
    formats stored as the pool stores them, their unread rows poisoned through a NaN
    block scale).
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
    if spec.value_in_key:
        pages = [rng.standard_normal((P, H_kv, ps, D)).astype(dt)]
    elif spec.split_widths:
        pages = [rng.standard_normal((P, H_kv, ps, w)).astype(dt)
                 for w in (D, spec.head_dim_v)]
    else:
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
                if not used[p, slot] and isinstance(pages, list):
                    for x in pages:
                        x[p, :, slot, :] = np.nan
                elif not used[p, slot]:
                    pages[p, :, :, slot, :] = np.nan
    kv = None
    if isinstance(pages, list):
        from clattn import quant

        unread = np.nonzero(np.isnan(pages[0][:, 0, :, 0]))   # (pages, slots) poisoned
        lay = spec.layout
        quantized = [kind for kind in lay.kinds if lay.format(kind) in quant.QUANTIZED]
        if quantized:
            for x in pages:
                x[unread[0], :, unread[1]] = 0.0
        pages = quant.pack_pool(pages[0], pages[1] if len(pages) > 1 else None, lay)
        for kind in quantized:   # a NaN block scale: every value of the row NaN
            quant.region_views(pages, lay, kind)[1][unread[0], :, unread[1]] = np.nan
        kv = quant.unpack_pool(pages, spec.layout)
    case = dict(q=q, pages=pages, page_indptr=page_indptr, page_indices=page_indices,
                last_page_len=last_page_len, stored=np.array(lengths, dtype=np.int32),
                page_size=ps, dtype=dt)
    if kv is not None:
        case["kv"] = kv
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


def compare(out, lse, ref_out, ref_lse, dtype, what=""):
    """Assert (out, lse) matches the float64 reference within ``TOLERANCE``.

    ``out`` must have dtype ``dtype`` and ``lse`` float32; ``-inf`` in the reference lse
    must be matched exactly (and only there, where ``out`` must be 0); no NaN anywhere.
    """
    dtype = np.dtype(dtype)
    out = np.asarray(out)
    lse = np.asarray(lse)
    assert out.shape == np.shape(ref_out), f"{what}out shape {out.shape} != {np.shape(ref_out)}"
    assert lse.shape == np.shape(ref_lse), f"{what}lse shape {lse.shape} != {np.shape(ref_lse)}"
    assert out.dtype == dtype, f"{what}out dtype {out.dtype} != {dtype}"
    assert lse.dtype == np.float32, f"{what}lse dtype {lse.dtype} != float32"
    o = out.astype(np.float64)
    l = lse.astype(np.float64)
    ro = np.asarray(ref_out, dtype=np.float64)
    rl = np.asarray(ref_lse, dtype=np.float64)
    assert not np.isnan(o).any(), f"{what}NaN in out at {np.argwhere(np.isnan(o))[:5].tolist()}"
    assert not np.isnan(l).any(), f"{what}NaN in lse at {np.argwhere(np.isnan(l))[:5].tolist()}"
    ref_empty = np.isneginf(rl)
    got_empty = np.isneginf(l)
    assert (ref_empty == got_empty).all(), (
        f"{what}lse -inf mismatch at {np.argwhere(ref_empty != got_empty)[:5].tolist()}: "
        f"got {l[ref_empty != got_empty][:5]}, want {rl[ref_empty != got_empty][:5]}")
    _within(l, rl, lse_bound(ref_out, ref_lse), f"{what}lse")
    _within(o, ro, out_bound(ref_out, ref_lse, dtype), f"{what}out ({dtype})")


def _within(got, want, bound, what):
    with np.errstate(invalid="ignore"):     # inf - inf where both are -inf (empty lse)
        err = np.abs(got - want)
    bad = ~(err <= bound)
    bad &= ~((got == want) & np.isinf(want))      # -inf (lse) or inf (merges) exactly
    if bad.any():
        idx = np.argwhere(bad)[:5]
        worst = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(bound, 1e-300), 0)),
                                 err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements beyond the bound of TOLERANCE; "
            f"first at {idx.tolist()}; worst at {list(worst)}: got {got[worst]!r}, "
            f"want {want[worst]!r}, error {err[worst]:.3g} > bound {bound[worst]:.3g}")


# ---------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    """What a test decodes: the library's spec, and what the oracle is told about the same
    model, both from one source (the test's own build keywords, or a raw HF config read by
    ``hf_oracle``, never the spec clattn made of it)."""

    name: str
    spec: Any
    #: naive_decode keywords fixed when the model is built (RoPE type, rotary dims, soft-cap)
    oracle: dict = field(default_factory=dict)
    #: run-time keywords a caller of this model passes (rope_theta, sm_scale)
    call: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name


def spec_scenario(name, num_qo_heads, num_kv_heads, head_dim, **build):
    """A scenario for ``AttentionSpec(num_qo_heads, num_kv_heads, head_dim, **build)``."""
    from clattn import AttentionSpec

    spec = AttentionSpec(num_qo_heads, num_kv_heads, head_dim, **build)
    oracle = {k: build[k] for k in ("rope_scaling", "rotary_dim", "softcap",
                                    "max_position_embeddings") if build.get(k) is not None}
    return Scenario(name, spec, oracle)


def config_scenario(name, cfg, *, heads=None, dtype="float16", page_size=16,
                    sliding_window=None):
    """A scenario for ``AttentionSpec.from_hf_config(cfg)``; ``heads=(H_qo, H_kv)`` shrinks
    the model (head_dim kept) for small decodes."""
    from hf_oracle import read_config, shrink

    from clattn import AttentionSpec

    if heads is not None:
        cfg = shrink(cfg, *heads)
    spec = AttentionSpec.from_hf_config(cfg, page_size=page_size, dtype=dtype,
                                        sliding_window=sliding_window)
    att = read_config(cfg)
    return Scenario(name, spec, att.oracle_kwargs(), att.call_kwargs())


def oracle(sc, case, **call):
    """The float64 reference of ``case`` under scenario ``sc`` (``call``: run-time keywords)."""
    from naive import naive_decode

    args, kw = decode_args(case)
    args = (args[0], oracle_pages(case)) + args[2:]
    return naive_decode(*args, **kw, **sc.oracle, **dict(sc.call, **call))


def oracle_pages(case):
    """The pages as ``naive_decode`` takes them: the pool, or ``(keys, values)`` of a case
    whose values differ in width from its keys."""
    return case["kv"] if "kv" in case else case["pages"]


__all__ = ["make_case", "compare", "decode_args", "Scenario", "spec_scenario", "config_scenario",
           "oracle", "TOLERANCE", "lse_bound", "out_bound"]


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
