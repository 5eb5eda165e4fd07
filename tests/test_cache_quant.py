"""Quantized pages in the cache: the device quantizer against numpy's, bit for bit, and
what happens to values a format cannot hold.

numpy's quantizer (clattn.quant, itself checked against the format's written rules in
tests/test_quant.py and against the gguf package's in tests/test_ggml_blocks.py) is the
reference: the append kernel must store the same bytes for adversarial blocks (exact ties
of the code rounding and of q4_0's f32 sum, their neighbours a few units away, equal
magnitudes of both signs, zero blocks with either sign, scales that are f16 subnormals,
round to f16 zero or up to the next binade, scales below clattn.quant.TINY_SCALE, the
largest values a scale holds). The randomized cache simulation over
quantized pages is in tests/test_cache.py (SIM_SPECS).
"""
from __future__ import annotations

import numpy as np
import pytest
from naive import naive_inv_freq, naive_rotate
from test_cache import make_cache, pool_host

import clattn
from clattn import quant, runtime

FORMATS = [("q8_0", "q4_0"), ("q4_0", "q8_0")]


def _ties(rng, fmt, n):
    """Blocks whose largest value fixes the scale d exactly and whose others are exact
    ties k + 1/2 of the code grid, or one f32 unit either side of one."""
    out = np.empty((n, 32), np.float32)
    for i in range(n):
        d = np.float32(np.float16(rng.uniform(1e-3, 4.0) * 2.0 ** rng.integers(-12, 8)))
        lim = 127 if fmt == "q8_0" else 8
        m = np.float32(lim * d) * (np.float32(1.0) if fmt == "q8_0" else np.float32(-1.0))
        k = rng.integers(-lim, lim, 31).astype(np.float32)
        tie = ((k + np.float32(0.5)) * d).astype(np.float32)
        nudge = rng.integers(-1, 2, 31)
        tie = np.where(nudge < 0, np.nextafter(tie, np.float32(-np.inf)),
                       np.where(nudge > 0, np.nextafter(tie, np.float32(np.inf)), tie))
        out[i, 0], out[i, 1:] = m, tie
        out[i] = np.roll(out[i], int(rng.integers(32)))
    return out


def _product_ties(rng, fmt, n):
    """Blocks with a power-of-two scale d, so that id = 1 / d is exact and x * id is a
    tie k + 1/2 exactly, or a few f32 units below or above one (for q4_0 the units below
    where x * id + 8.5 rounds up to the next integer in f32)."""
    lim = 127 if fmt == "q8_0" else 8
    out = np.empty((n, 32), np.float32)
    for i in range(n):
        d = np.float32(2.0 ** rng.integers(-20, 8)) * (1 if fmt == "q8_0" else rng.choice([-1, 1]))
        k = rng.integers(-lim, lim, 31).astype(np.float32)
        x = ((k + np.float32(0.5)) * d).astype(np.float32)
        for j, step in enumerate(rng.integers(-4, 3, 31)):
            for _ in range(abs(step)):
                x[j] = np.nextafter(x[j], np.float32(np.inf * step))
        out[i, 0], out[i, 1:] = (lim if fmt == "q8_0" else -8) * d, x
        out[i] = np.roll(out[i], int(rng.integers(32)))
    return out


def adversarial_blocks(fmt, seed=0):
    """float32 [n, 32] blocks that stress every rounding the format makes."""
    rng = np.random.default_rng(seed)
    parts = [_ties(rng, fmt, 48), _product_ties(rng, fmt, 48)]
    # random blocks over many magnitudes, f16-subnormal scales included
    mag = 2.0 ** rng.integers(-30, 16, (48, 1))
    parts.append((rng.standard_normal((48, 32)) * mag).astype(np.float32))
    # the largest magnitude twice, with both signs (q4_0 keeps the first one's sign)
    b = rng.standard_normal((16, 32)).astype(np.float32)
    b[:, 3], b[:, 17] = 5.0, -5.0
    b[8:, 3], b[8:, 17] = -5.0, 5.0
    parts.append(b)
    # zero blocks, a single non-zero, and scales just around an f16 rounding boundary
    z = np.zeros((12, 32), np.float32)
    z[4:8, 9] = np.float32(3e-3)
    z[8:, 0] = np.float32(-0.0)   # signed zeros: a zero block's m is +0 whatever their signs
    z[10:, 5] = np.float32(-0.0)
    parts.append(z)
    edge = rng.standard_normal((16, 32)).astype(np.float32) * 0.1
    lim = 127 if fmt == "q8_0" else 8
    for i in range(16):
        h = np.float16(rng.uniform(0.01, 100))
        mid = (np.float32(h) + np.float32(np.nextafter(h, np.float16(np.inf)))) / 2
        edge[i, i] = np.nextafter(np.float32(mid * lim), np.float32((-1) ** i * np.inf))
    parts.append(edge)
    # the largest values a scale holds, the largest magnitude the format holds
    big = rng.uniform(-1, 1, (6, 32)).astype(np.float32) * np.float32(65000 * lim)
    big[4:, 7] = np.float32(quant.LARGEST[fmt]) * np.float32([1, -1])
    parts.append(big)
    # scales of f16 zero (codes kept), around clattn.quant.TINY_SCALE (zero codes below)
    tiny = rng.standard_normal((8, 32)).astype(np.float32)
    tiny /= np.abs(tiny).max(-1, keepdims=True)
    top = np.float32(quant.TINY_SCALE * (127 if fmt == "q8_0" else 8))
    tiny[:4] *= top * np.float32([0.5, 0.99999, 1, 2])[:, None]
    tiny[4:] *= np.float32([1e-30, 1e-12, 1e-9, 2e-8])[:, None]
    parts.append(tiny)
    return np.concatenate(parts)


def _append_blocks(target, blocks_k, blocks_v, dtype="float32", kf="q8_0", vf="q4_0",
                   device_arrays=False):
    """Write the blocks as tokens of a 1-head, head_dim-64 cache (numpy k/v, or device
    arrays: checked on the device); return its pool."""
    T = len(blocks_k) // 2
    spec = clattn.AttentionSpec(1, 1, 64, page_size=16, dtype=dtype, k_format=kf, v_format=vf)
    cache = make_cache(spec, target, layers=1, num_pages=-(-T // 16))
    cache.add("s")
    cache.begin(["s"], [T])
    k = blocks_k[:2 * T].reshape(T, 1, 64).astype(dtype)
    v = blocks_v[:2 * T].reshape(T, 1, 64).astype(dtype)
    if device_arrays:
        queue = cache.queue
        cache.append(0, *(runtime.cl().array.to_device(queue, a) for a in (k, v)))
    else:
        cache.append(0, k, v)
    cache.end()
    return spec, pool_host(cache, 0), k, v


@pytest.mark.parametrize("kf,vf", FORMATS)
def test_device_quantizer_equals_numpy_bit_for_bit(device_target, kf, vf):
    bk, bv = adversarial_blocks(kf, 1), adversarial_blocks(vf, 2)
    n = min(len(bk), len(bv)) // 2 * 2
    _check_bytes(*_append_blocks(device_target, bk[:n], bv[:n], kf=kf, vf=vf))


def _check_bytes(spec, pool, k, v):
    """The pool holds k and v [T, 1, 64] quantized by numpy, bit for bit."""
    kf, vf = spec.k_format, spec.v_format
    want = quant.pack_pool(_paged(k, spec), _paged(v, spec), spec.layout)
    T = len(k)
    for kind, fmt in ((0, kf), (1, vf)):
        got_d, got_s = quant.region_views(pool, spec.layout, kind)
        want_d, want_s = quant.region_views(want, spec.layout, kind)
        got_d, want_d = (got_d.reshape(-1, got_d.shape[-1])[:T],
                         want_d.reshape(-1, want_d.shape[-1])[:T])
        got_s, want_s = (got_s.reshape(-1, got_s.shape[-1])[:T],
                         want_s.reshape(-1, want_s.shape[-1])[:T])
        bad = np.flatnonzero((got_d != want_d).any(-1) | (got_s.view(np.uint16) !=
                                                          want_s.view(np.uint16)).any(-1))
        assert not len(bad), (f"{fmt}: the device stored other bytes than numpy for "
                              f"{len(bad)} rows, first row {bad[0]}: scales "
                              f"{got_s[bad[0]]} vs {want_s[bad[0]]}")


def _paged(x, spec):
    """[T, H, D] rows as pages [P, H, page_size, D] in token order (zero padded)."""
    T, H, D = x.shape
    ps = spec.page_size
    P = -(-T // ps)
    out = np.zeros((P * ps, H, D), np.float32)
    out[:T] = x
    return out.reshape(P, ps, H, D).transpose(0, 2, 1, 3)


def _top_blocks(fmt, over=False):
    """float32 [8, 32] blocks at the top of ``fmt``'s range: the first value of largest
    magnitude m (both signs) gives an f32 scale in (65504, 65520), which f16 rounds to
    65504, up to the largest such f32; ``over``: a scale of exactly 65520 in half of them
    (f16 rounds it to inf: the block cannot be stored)."""
    lim = np.float32(127 if fmt == "q8_0" else 8)
    top = np.float32(65520) * lim
    m = np.array([65504.25 * lim, 65510 * lim, np.nextafter(top, np.float32(0)),
                  np.nextafter(np.nextafter(top, np.float32(0)), np.float32(0))], np.float32)
    if over:
        m[::2] = top
    m = np.concatenate([m, -m])
    d32 = (np.abs(m) / lim).astype(np.float32)
    assert ((d32 > 65504) & (d32 < 65520) | (over & (d32 == 65520))).all()
    rng = np.random.default_rng(int(lim))
    blocks = (rng.uniform(-1, 1, (8, 32)) * np.abs(m)[:, None]).astype(np.float32)
    blocks[:, 5] = m
    return blocks


@pytest.mark.parametrize("kf,vf", FORMATS)
def test_scales_at_the_top_of_float16(target, kf, vf):
    """Blocks whose f32 scale lies in (65504, 65520) are stored with the f16 scale 65504,
    bit for bit as numpy, from numpy k/v and (device targets) from device arrays, which
    the device checks; a scale of 65520 rounds to f16 inf and is refused either way with
    nothing written."""
    bk, bv = _top_blocks(kf), _top_blocks(vf)
    _check_bytes(*_append_blocks(target, bk, bv, kf=kf, vf=vf))
    if not target.is_cpu:
        _check_bytes(*_append_blocks(target, bk, bv, kf=kf, vf=vf, device_arrays=True))
    for over_k in (True, False):
        blocks = (_top_blocks(kf, True), bv) if over_k else (bk, _top_blocks(vf, True))
        with pytest.raises(ValueError, match=f"^{'k' if over_k else 'v'}: a block's scale "
                                             f"overflows float16"):
            _append_blocks(target, *blocks, kf=kf, vf=vf)
        if not target.is_cpu:
            with pytest.raises(ValueError, match=r"end: .*layers \[0\].*nothing was written"):
                _append_blocks(target, *blocks, kf=kf, vf=vf, device_arrays=True)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_half_inputs_quantize_alike(device_target, dtype):
    """f16 keys and values (what most apps store) through the same quantizer."""
    rng = np.random.default_rng(3)
    b = (rng.standard_normal((64, 32)) * 2.0 ** rng.integers(-6, 6, (64, 1))).astype(dtype)
    spec, pool, k, v = _append_blocks(device_target, b.astype(np.float32), b[::-1].astype(
        np.float32), dtype=dtype)
    want = quant.pack_pool(_paged(k.astype(np.float32), spec), _paged(v.astype(np.float32), spec),
                           spec.layout)
    assert np.array_equal(pool[:len(want)], want)


BAD = [("k", np.inf), ("v", np.nan), ("k", -np.inf), ("v", 1e9)]


@pytest.mark.parametrize("rope", [None, "append"])
@pytest.mark.parametrize("name,value", BAD)
def test_values_a_format_cannot_hold_are_refused_before_anything_is_written(target, name,
                                                                            value, rope):
    """numpy k/v: refused by append, naming the argument; the pool is unchanged and the
    step goes on (a good append of the layer works). Keys rotated by the append kernel
    (rope="append") included: inf/NaN stay non-finite through a rotation."""
    spec = clattn.AttentionSpec(2, 1, 32, page_size=4, dtype="float32", k_format="q8_0",
                                v_format="q4_0")
    cache = make_cache(spec, target, layers=1, num_pages=4, rope=rope)
    cache.add("s", pos_offset=5)
    cache.begin(["s"], [3])
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 1, 32)).astype(np.float32)
    v = rng.standard_normal((3, 1, 32)).astype(np.float32)
    before = pool_host(cache, 0).copy()
    bad = {"k": k.copy(), "v": v.copy()}
    bad[name][1, 0, 7] = value
    kept = {n: a.copy() for n, a in bad.items()}
    with pytest.raises(ValueError, match=rf"^{name}: "):
        cache.append(0, bad["k"], bad["v"])
    assert np.array_equal(pool_host(cache, 0), before), "a refused append wrote"
    for n in bad:
        assert np.array_equal(bad[n], kept[n], equal_nan=True), f"the call changed {n}"
    cache.append(0, k, v)
    q = rng.standard_normal((3, 2, 32)).astype(np.float32)
    out = cache.attend(0, q).out
    assert np.isfinite(out).all()
    cache.end()
    assert cache.length("s") == 3


def test_device_arrays_are_checked_on_the_device(device_target):
    """Device k/v cannot be checked on the host without a wait: the check kernel refuses
    on the device (nothing written for that layer) and end() reports it; the step stays
    open, cancel() frees it, and the cache goes on."""
    spec = clattn.AttentionSpec(2, 1, 32, page_size=4, dtype="float16", k_format="q4_0",
                                v_format="q8_0")
    cache = make_cache(spec, device_target, layers=2, num_pages=6)
    queue = cache.queue
    cl = runtime.cl()
    rng = np.random.default_rng(1)
    good = [rng.standard_normal((2, 1, 32)).astype(np.float16) for _ in range(4)]
    cache.add("s")
    before = [pool_host(cache, i).copy() for i in range(2)]
    cache.begin(["s"], [2])
    bad_v = good[3].copy()
    bad_v[0, 0, 5] = np.inf
    dev = lambda a: cl.array.to_device(queue, a)  # noqa: E731
    cache.append(0, dev(good[0]), dev(good[1]))
    cache.append(1, dev(good[2]), dev(bad_v))
    with pytest.raises(ValueError, match=r"layers \[1\].*nothing was written.*cancel"):
        cache.end()
    assert np.array_equal(pool_host(cache, 1), before[1]), "the refused layer was written"
    assert not np.array_equal(pool_host(cache, 0), before[0]), "the good layer was not"
    cache.cancel()
    assert cache.length("s") == 0
    cache.begin(["s"], [2])
    cache.append(0, dev(good[0]), dev(good[1]))
    cache.append(1, dev(good[2]), dev(good[3]))
    cache.end()  # re-appended good values: no stale refusal
    assert cache.length("s") == 2
    k1 = quant.unpack_pool(pool_host(cache, 1), spec.layout)[0]
    page = cache.table.seqs["s"].pages[0]
    want = quant.dequantize(*quant.quantize(good[2].astype(np.float32), "q4_0"), "q4_0")
    assert np.array_equal(k1[page, :, :2], want.transpose(1, 0, 2))


def test_rope_append_checks_keys_after_their_rotation(target):
    """rope="append" quantizes rotated keys: numpy k holding NaN is refused by append on
    every backend, naming k (a rotation keeps it non-finite), and nothing is written."""
    spec = clattn.AttentionSpec(2, 1, 32, page_size=4, dtype="float32", k_format="q8_0",
                                v_format="q4_0")
    cache = make_cache(spec, target, layers=1, num_pages=2, rope="append", rope_theta=1e4)
    cache.add("s", pos_offset=3)
    cache.begin(["s"], [2])
    k = np.random.default_rng(9).standard_normal((2, 1, 32)).astype(np.float32)
    k[1, 0, 4] = np.nan
    before = pool_host(cache, 0).copy()
    with pytest.raises(ValueError, match="^k: "):
        cache.append(0, k, np.zeros_like(k))
    assert np.array_equal(pool_host(cache, 0), before, equal_nan=True), "a refused append wrote"


@pytest.mark.parametrize("kf,vf", FORMATS)
def test_largest_magnitude_stored_next_float_refused_on_the_device(device_target, kf, vf):
    """Device k/v at the largest magnitude each format holds (clattn.quant.LARGEST, both
    signs): stored as numpy stores them; one f32 unit beyond: the check kernel refuses."""
    spec = clattn.AttentionSpec(1, 1, 32, page_size=4, dtype="float32", k_format=kf,
                                v_format=vf)
    cache = make_cache(spec, device_target, layers=1, num_pages=2)
    cl = runtime.cl()
    dev = lambda a: cl.array.to_device(cache.queue, a)  # noqa: E731
    rng = np.random.default_rng(4)
    k = rng.standard_normal((2, 1, 32)).astype(np.float32)
    v = rng.standard_normal((2, 1, 32)).astype(np.float32)
    top = np.float32([quant.LARGEST[kf], quant.LARGEST[vf]])
    k[0, 0, 3], k[1, 0, 30] = top[0], -top[0]
    v[0, 0, 0], v[1, 0, 17] = -top[1], top[1]
    cache.add("s")
    cache.begin(["s"], [2])
    cache.append(0, dev(k), dev(v))
    cache.end()
    pool = pool_host(cache, 0)
    want = quant.pack_pool(_paged(k, spec), _paged(v, spec), spec.layout)
    page = cache.table.seqs["s"].pages[0]
    for kind in (0, 1):   # the two rows written (numpy's padding rows hold zero blocks)
        (gd, gs), (wd, ws) = (quant.region_views(p, spec.layout, kind) for p in (pool, want))
        assert np.array_equal(gd[page, :, :2], wd[0, :, :2])
        assert np.array_equal(gs[page, :, :2].view(np.uint16), ws[0, :, :2].view(np.uint16))
    for name in ("k", "v"):
        over = {"k": k.copy(), "v": v.copy()}
        x = over[name]
        x[1, 0, 9] = np.nextafter(top[int(name == "v")], np.float32(np.inf)) * (-1) ** (name == "v")
        before = pool_host(cache, 0).copy()
        cache.begin(["s"], [1])
        cache.append(0, dev(over["k"][1:]), dev(over["v"][1:]))
        with pytest.raises(ValueError, match=r"layers \[0\].*scale overflows float16"):
            cache.end()
        cache.cancel()
        assert np.array_equal(pool_host(cache, 0), before), f"a refused {name} was written"


def test_keys_rotated_at_append_then_quantized(target):
    """rope="append" with q8_0 keys: what is stored is the rotated key within half a
    quantization step of its block's f32 scale d32, plus the codes (up to 127) times the
    f16 rounding of that scale (at most 2**-11 of the stored scale)."""
    spec = clattn.AttentionSpec(2, 2, 64, page_size=8, dtype="float32", k_format="q8_0",
                                v_format="q8_0")
    cache = make_cache(spec, target, layers=1, num_pages=4, rope="append", rope_theta=1e4)
    cache.add("s", pos_offset=1000)
    cache.begin(["s"], [11])
    rng = np.random.default_rng(5)
    k = rng.standard_normal((11, 2, 64)).astype(np.float32)
    cache.append(0, k, k)
    pos = cache.positions.copy()
    cache.end()
    pool = pool_host(cache, 0)
    data, scales = quant.region_views(pool, spec.layout, 0)
    kq = quant.dequantize(data, scales, "q8_0")
    pages = cache.table.seqs["s"].pages
    rows = np.concatenate([kq[p] for p in pages[:2]], axis=1)[:, :11]  # [H, T, D]
    sc = np.concatenate([scales[p] for p in pages[:2]], axis=1)[:, :11].astype(np.float64)
    inv, att = naive_inv_freq(64, 1e4, None)
    want = np.array([[naive_rotate(k[t, h], pos[t], inv, att, 64, False) for t in range(11)]
                     for h in range(2)])
    step = np.repeat(sc, 32, axis=-1)
    err = np.abs(rows - want)
    assert (err <= step * (0.5 + 127 * 2.0 ** -11) * (1 + 1e-3) + 1e-6).all(), \
        float((err / step).max())
    assert (err > 0).any()


def test_stats_report_bytes_per_token_per_format(target):
    sizes = {}
    for fmt in ("float16", "q8_0", "q4_0"):
        spec = clattn.AttentionSpec(32, 8, 128, page_size=16, dtype="float16", k_format=fmt,
                                    v_format=fmt)
        cache = make_cache(spec, target, layers=4, num_pages=2)
        sizes[fmt] = cache.stats().bytes_per_token
        assert sizes[fmt] == 4 * 2 * 8 * 128 * quant.bytes_per_value(fmt)
    assert sizes == {"float16": 16384, "q8_0": 8704, "q4_0": 4608}
