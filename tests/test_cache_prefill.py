"""PagedKVCache chooses its kernels: prompt chunks on the prefill kernel, single tokens on
decode, mixed steps on both; every attend exact against the float64 oracle on every target.

Each test checks which kernels the step ran (:attr:`PagedKVCache.step_kernels`, the
``prefill_launches`` of :meth:`PagedKVCache.stats` and, on devices, the result's launch
events), so a cache that ran every chunk on the decode kernel fails it; the oracle is
test_cache's: each new token attends its own rows (sinks and window, chunk positions).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from cases import compare
from conftest import Target
from naive import naive_inv_freq, naive_rotate
from test_cache import LLAMA3, SPLIT_EVERY_STEP, History, make_cache, pool_host

import clattn

F32, F16 = "float32", "float16"
DECODE, PREFILL, MIXED = ("decode",), ("prefill",), ("decode", "prefill")

#: longrope switching at position 32 (query position + 1 > 32): short factors 1, long 4
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 32}


def _spec(dtype=F32, head_dim=16, **kw):
    return clattn.AttentionSpec(4, 2, head_dim, page_size=4, dtype=dtype, **kw)


def _rotated(k, positions, theta):
    """float64 keys ``k [T, H, D]`` rotated at ``positions`` (rope="append"'s pool)."""
    inv, af = naive_inv_freq(k.shape[2], theta, None)
    return np.stack([[naive_rotate(k[i, h].astype(np.float64), int(p), inv, af, k.shape[2],
                                   False) for h in range(k.shape[1])]
                     for i, p in enumerate(positions)])


def run_steps(cache, hist, steps, rope=None, seed=0):
    """Run ``steps`` (``(ids, lengths)`` each) on every layer, each attend checked against
    the oracle; returns the kernels each step ran. New ids are added without a window."""
    spec, L = cache.spec, cache.num_layers
    rng = np.random.default_rng(seed)
    H, Hkv, D, dt = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.np_dtype
    kinds = []
    for n_step, (ids, ns) in enumerate(steps):
        for sid in ids:
            if sid not in cache:
                cache.add(sid)
                hist.add(sid)
        launched = cache.stats().prefill_launches
        cache.begin(ids, ns)
        kinds.append(cache.step_kernels)
        T = sum(ns)
        ks = rng.standard_normal((L, T, Hkv, D)).astype(dt)
        vs = rng.standard_normal((L, T, Hkv, D)).astype(dt)
        ks_st, vs_st = hist.stored(ks, 0), hist.stored(vs, 1)
        if rope == "append":  # the pool holds keys rotated at the tokens' positions
            ks_st = np.stack([_rotated(k, cache.positions, cache.rope_theta) for k in ks])
        for layer in range(L):
            q = rng.standard_normal((T, H, D)).astype(dt)
            cache.append(layer, ks[layer], vs[layer])
            res = cache.attend(layer, q)
            if cache.backend != "cpu":
                decode_events = 0 if kinds[-1] == PREFILL else len(res.events) - \
                    ("prefill" in kinds[-1])
                assert len(res.events) == decode_events + ("prefill" in kinds[-1])
                assert decode_events >= ("decode" in kinds[-1])
            ref = hist.oracle(layer, list(zip(ids, ns)), ks_st[layer], vs_st[layer], q,
                              rope == "attend", cache)
            compare(res.out, res.lse, *ref, dt, what=f"step {n_step} {ids} {ns} layer {layer}: ")
        want = L if "prefill" in kinds[-1] else 0
        assert cache.stats().prefill_launches - launched == want, (n_step, kinds[-1])
        cache.end()
        hist.commit(ks_st, vs_st, list(zip(ids, ns)))
    return kinds


@pytest.mark.parametrize("dtype", [F32, F16])
def test_prompts_decode_and_mixed_steps(target, dtype):
    """A prompt alone, two prompts, a mixed step (a decode token, a chunk, a new prompt)
    and a decode step: each on its kernels, every token exact."""
    spec = _spec(dtype)
    cache = make_cache(spec, target, num_pages=64)
    hist = History(spec, 2)
    kinds = run_steps(cache, hist, [
        (["a"], [37]),
        (["b", "c"], [9, 16]),
        (["a", "b", "d"], [1, 5, 12]),
        (["d", "a", "c"], [1, 1, 1]),
        (["c", "a"], [2, 3]),  # the shortest chunk a prefill run takes
    ])
    assert kinds == [PREFILL, PREFILL, MIXED, DECODE, PREFILL]
    assert cache.stats().prefill_launches == 4 * 2


def test_a_chunk_over_a_long_cache_runs_longer_units(device_target):
    """A 40-token chunk over 2100 cached tokens: exact, and on the rows kernel in units of
    qb_long (clattn.prefill.queries_per_unit), where a 2100-token prompt runs units of qb
    (stats().prefill_units counts them)."""
    spec = _spec(F16)
    cache = make_cache(spec, device_target, num_pages=560)
    hist = History(spec, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        g = clattn.BatchPrefill(spec, device_target.device,
                                profile=device_target.profile).geometry
    # the prompt: appended and attended, unchecked (the oracle's per-token copies of 2100
    # rows would take minutes)
    rng = np.random.default_rng(3)
    cache.add("a")
    hist.add("a")
    cache.begin(["a"], [2100])
    kv = rng.standard_normal((2, cache.num_layers, 2100, 2, 16)).astype(F16)
    for layer in range(cache.num_layers):
        cache.append(layer, kv[0, layer], kv[1, layer])
        cache.attend(layer, rng.standard_normal((2100, 4, 16)).astype(F16))
    cache.end()
    hist.commit(kv[0], kv[1], [("a", 2100)])
    before = cache.stats().prefill_units
    assert before == cache.num_layers * -(-2100 // g.qb)
    assert run_steps(cache, hist, [(["a"], [40])], seed=1) == [PREFILL]
    assert g.strategy != "rows" or g.qb_long == 2 * g.qb
    qb = g.qb_long if g.strategy == "rows" else g.qb
    assert cache.stats().prefill_units - before == cache.num_layers * -(-40 // qb)


@pytest.mark.parametrize("rope", [None, "attend"])
def test_window_that_starts_to_slide_inside_a_chunk(target, rope):
    """Windows with sinks: the tokens of a chunk before the window slides attend on the
    prefill kernel, those after it (each its own window) and those of a window that slid
    already on decode; whole pages dropped between steps; exact for every token."""
    spec = _spec(F32, sliding_window=True, rope_scaling=LLAMA3 if rope else None,
                 max_position_embeddings=4096)
    cache = make_cache(spec, target, num_pages=64, rope=rope)
    hist = History(spec, 2)
    for sid, window, sink, pos in (("w", 8, 2, 5), ("x", 8, 0, 0), ("y", 6, 4, 11)):
        cache.add(sid, window=window, sink=sink, pos_offset=pos)
        hist.add(sid, window, sink, pos)
    kinds = run_steps(cache, hist, [
        (["w"], [20]),            # 10 tokens within sinks + window, then 10 sliding
        (["x", "y"], [6, 3]),     # inside their windows: prefill only
        (["w", "x"], [4, 5]),     # w slid already (decode); x: 2 tokens, then it slides
        (["y"], [9]),             # y: 7 gapless tokens (sinks 4 + window 6), then sliding
        (["x", "y", "w"], [1, 1, 1]),
        (["w"], [30]),            # long after pages were given back: every token decodes
    ], rope=rope, seed=1)
    assert kinds == [MIXED, PREFILL, MIXED, MIXED, DECODE, DECODE]
    assert cache.table.seqs["w"].dropped > 0


def test_forks_share_pages_and_copy_on_write(target):
    """Chunks of forks that share a partly filled page: each copies it, then both attend
    on the prefill kernel over their own pages; the parent's rows stay."""
    spec = _spec(F32)
    cache = make_cache(spec, target, num_pages=32)
    hist = History(spec, 2)
    run_steps(cache, hist, [(["p"], [6])], seed=3)
    for child in ("c1", "c2"):
        cache.fork("p", child)
        hist.fork("p", child)
    shared = cache.stats().pages_shared
    assert shared == 2
    kinds = run_steps(cache, hist, [(["c1", "p", "c2"], [3, 5, 1]), (["c2", "c1"], [7, 2])],
                      seed=4)
    assert kinds == [MIXED, PREFILL]


@pytest.mark.parametrize("formats", [("q8_0", "q4_0"), ("q4_0", "float32")])
def test_quantized_pages(target, formats):
    """Byte pools (q8_0/q4_0 blocks): prompt chunks on prefill over the quantized pages,
    windows with sinks and in-kernel RoPE, exact against the dequantized oracle."""
    k_format, v_format = formats
    spec = _spec(F32, head_dim=32, k_format=k_format, v_format=v_format, sliding_window=True,
                 rope_scaling=LLAMA3, max_position_embeddings=4096)
    cache = make_cache(spec, target, num_pages=48, rope="attend")
    hist = History(spec, 2)
    cache.add("w", window=9, sink=3, pos_offset=2)
    hist.add("w", 9, 3, 2)
    kinds = run_steps(cache, hist, [(["a", "w"], [13, 7]), (["w", "a", "b"], [8, 1, 10])],
                      rope="attend", seed=5)
    assert kinds == [PREFILL, MIXED]


def test_rope_append(target):
    """rope="append": the append kernel rotates the keys at their positions, the app's q
    is rotated already; the prefill runs read the rotated keys as decode does."""
    spec = _spec(F32)
    cache = make_cache(spec, target, num_pages=32, rope="append", rope_theta=1e4)
    hist = History(spec, 2)
    cache.add("a", pos_offset=100)
    hist.add("a", pos=100)
    kinds = run_steps(cache, hist, [(["a"], [11]), (["a", "b"], [1, 9]), (["b", "a"], [4, 4])],
                      rope="append", seed=6)
    assert kinds == [PREFILL, MIXED, PREFILL]


def test_longrope_factors_switch_inside_a_chunk(target):
    """rope="attend" with longrope: the decode kernel picks the factors per token by its
    position, the prefill kernel per sequence by its last query; a chunk straddling the
    switch runs as two prefill runs (short, long) and every token gets its own factors."""
    spec = _spec(F32, rope_scaling=LONGROPE, max_position_embeddings=256)
    cache = make_cache(spec, target, num_pages=48, rope="attend")
    hist = History(spec, 2)
    kinds = run_steps(cache, hist, [(["a"], [20]), (["a"], [25]), (["a", "b"], [3, 40])],
                      rope="attend", seed=7)
    assert kinds == [PREFILL, PREFILL, PREFILL]
    cache.begin(["a"], [6])  # positions 48..53: one run, all long
    assert cache.step_tables.prefill.n.tolist() == [6]
    cache.cancel()
    cache.add("c", pos_offset=28)
    cache.begin(["c"], [6])  # query positions 28..33: 31 is the last short one
    assert cache.step_tables.prefill.n.tolist() == [4, 2]
    cache.cancel()


def test_prefill_false_decodes_every_token(target):
    """``prefill=False``: every token on the decode kernel, the same answers."""
    spec = _spec(F32)
    cache = make_cache(spec, target, num_pages=32, prefill=False)
    hist = History(spec, 2)
    kinds = run_steps(cache, hist, [(["a"], [12]), (["a", "b"], [1, 6])], seed=8)
    assert kinds == [DECODE, DECODE] and cache.stats().prefill_launches == 0
    with pytest.raises(TypeError, match="prefill="):
        make_cache(spec, target, num_pages=4, prefill="yes")


def test_out_and_lse_written_in_place(target):
    """A prompt step's attend writes the caller's ``out``/``lse`` (numpy, and device
    arrays on devices) and returns them; wrong ones are refused before any launch."""
    spec = _spec(F32)
    cache = make_cache(spec, target, layers=1, num_pages=16)
    hist = History(spec, 1)
    cache.add("a")
    hist.add("a")
    rng = np.random.default_rng(9)
    cache.begin(["a"], [10])
    assert cache.step_kernels == PREFILL
    k, v = (rng.standard_normal((10, 2, 16)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((10, 4, 16)).astype(np.float32)
    cache.append(0, k, v)
    ref = hist.oracle(0, [("a", 10)], k, v, q, False, cache)
    with pytest.raises(ValueError, match="out"):
        cache.attend(0, q, out=np.empty((10, 4, 8), np.float32))
    assert cache.stats().prefill_launches == 0
    out, lse = np.full((10, 4, 16), np.nan, np.float32), np.full((10, 4), np.nan, np.float32)
    res = cache.attend(0, q, out=out, lse=lse)
    assert res.out is out and res.lse is lse
    compare(out, lse, *ref, F32)
    if not target.is_cpu:
        cl = clattn.runtime.cl()
        queue = cache.pools[0].queue
        dq = cl.array.to_device(queue, q)
        dout, dlse = cl.array.empty(queue, q.shape, np.float32), cl.array.empty(queue, (10, 4),
                                                                               np.float32)
        res = cache.attend(0, dq, out=dout, lse=dlse)
        assert len(res.events) == 1
        compare(dout.get(), dlse.get(), *ref, F32)
    cache.end()


def test_mixed_steps_with_split_decode(device):
    """A device's own profile told to split every decode row into one-page partitions:
    the decode launch and its merge write the decode rows (and empty prefill rows), the
    prefill launch after them the chunks' rows."""
    spec = _spec(F32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache = clattn.PagedKVCache(spec, 2, device=device, profile=SPLIT_EVERY_STEP,
                                    backend="opencl", num_pages=48)
    hist = History(spec, 2)
    kinds = run_steps(cache, hist, [(["a", "b"], [20, 9]), (["a", "b", "c"], [1, 1, 14]),
                                    (["c", "a", "b"], [5, 1, 1])], seed=10)
    assert kinds == [PREFILL, MIXED, MIXED]
    assert cache.step_tables is None
    cache.begin(["a", "c"], [1, 6])
    assert cache.device.plan.split  # the plan of the step's decode rows
    cache.cancel()


def test_append_rotates_the_key_at_long_from_with_the_long_factors(device_target):
    """rope="append" with longrope: a key at exactly ``long_from`` (position 32) takes the
    long factors (``pos >= long_from``), in the append kernel (a chunk over 30..33) and in
    the fused one-token step (a key at 32): the device's pool equals the CPU backend's."""
    spec = _spec(F32, rope_scaling=LONGROPE, max_position_embeddings=256)
    rng = np.random.default_rng(31)
    pools = []
    for target in (device_target, Target("cpu")):
        cache = make_cache(spec, target, layers=1, num_pages=8, rope="append")
        cache.add("a", pos_offset=30)
        cache.add("b", pos_offset=32)
        for ids, ns in ((["a"], [4]), (["b"], [1])):
            cache.begin(ids, ns)
            kv = np.random.default_rng(31 + sum(ns)).standard_normal((2, sum(ns), 2, 16))
            cache.append(0, *kv.astype(np.float32))
            cache.attend(0, rng.standard_normal((sum(ns), 4, 16)).astype(np.float32))
            cache.end()
        pools.append(pool_host(cache, 0))
    np.testing.assert_allclose(pools[0], pools[1], rtol=1e-4, atol=1e-4)
