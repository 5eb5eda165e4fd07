"""Values read from the key rows (``AttentionSpec.value_in_key``: multi-head latent
attention's absorbed form) against the float64 oracle, whose values are the stored keys'
leading ``head_dim_v`` values: the spec's rules and sizes, decode (split too; windows and
sinks; RoPE on the keys only) and prefill on every target, the cache (forks, copy-on-write,
pops, cancels) and its pool's size, the bad appends.

Shapes are the models' absorbed forms: DeepSeek-V2-Lite (16 query heads over one row of
the 512-value latent and the 64 RoPE'd key dims, ``sm_scale = 1/sqrt(128 + 64)``) and
MiniCPM3 (40 heads, latent 256 + rope 32, ``sm_scale = 1/sqrt(64 + 32)``), plus tiny ones
of two KV heads. Page formats f32, f16, q8_0 and q4_0. Bounds are ``cases.compare``'s.

The split (partitions merged on the device) runs by default on small shapes of every page
format (f32, q8_0, q4_0 with a window) on every device target and on the models' shapes
on the tiled targets; the models' shapes on the rows targets split under ``-m slow``:
Intel's profile folds the merge into a rows decode build of its own, 20-30 s of its
compiler each at these shapes (every head and head_dim chunk unrolled).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from cases import Scenario, compare, decode_args, oracle, spec_scenario
from prefill_cases import naive_prefill, prefill_case, run
from test_cache import make_cache, pool_host, simulate
from test_prefill import get_prefill
from test_widths import case_for

import clattn
from clattn import models, quant

F16, F32 = "float16", "float32"

#: (H_qo, H_kv, D, D_v, page size, dtype, k_format, window, sm_scale)
SHAPES = {
    "deepseek-v2-lite-f16": (16, 1, 576, 512, 16, F16, None, False, 1 / math.sqrt(192)),
    "deepseek-v2-lite-q8": (16, 1, 576, 512, 16, F32, "q8_0", False, 1 / math.sqrt(192)),
    "minicpm3-q4-win": (40, 1, 288, 256, 16, F32, "q4_0", True, 1 / math.sqrt(96 + 32)),
    "tiny-f32-win": (4, 2, 40, 24, 4, F32, None, True, 0.3),   # two KV heads, vectors of 8
}
#: the split's small shapes: one per quantized page format of SHAPES besides f32 (q8_0
#: keys the spec of test_cache_simulation's q8-f16, whose decode build it shares; q4_0 with
#: a window), their decode builds about a second each
SPLIT_SHAPES = {
    "tiny-f32-win": SHAPES["tiny-f32-win"],
    "tiny-q8-f16": (4, 2, 64, 32, 4, F16, "q8_0", False, 0.3),
    "tiny-q4-win": (4, 2, 64, 32, 4, F32, "q4_0", True, 0.3),
}
#: the models' shapes, whose split is a ``slow`` test (SPLIT_SHAPES cover their formats)
MODEL_SHAPES = [k for k in SHAPES if k not in SPLIT_SHAPES]
ALL_SHAPES = {**SHAPES, **SPLIT_SHAPES}


def scenario(key: str) -> Scenario:
    h, kv, d, dv, ps, dt, fmt, win, _ = ALL_SHAPES[key]
    return spec_scenario(key, h, kv, d, head_dim_v=dv, page_size=ps, dtype=dt, k_format=fmt,
                         sliding_window=win, value_in_key=True)



# ---------------------------------------------------------------------------- the spec
def test_spec_rules():
    spec = clattn.AttentionSpec(16, 1, 576, head_dim_v=512, value_in_key=True)
    assert spec.value_in_key and spec.byte_pool and spec.v_format == spec.k_format == F16
    assert spec != clattn.AttentionSpec(16, 1, 576, head_dim_v=512)
    assert hash(spec) != hash(clattn.AttentionSpec(16, 1, 576, head_dim_v=512))
    assert spec.key() != clattn.AttentionSpec(16, 1, 576, head_dim_v=512).key()
    assert "value_in_key" not in clattn.AttentionSpec(16, 1, 576, head_dim_v=512).key()
    same = clattn.AttentionSpec(4, 1, 64, head_dim_v=64, value_in_key=True)   # D_v == D
    assert same.byte_pool and same.key() != clattn.AttentionSpec(4, 1, 64).key()
    assert clattn.AttentionSpec(4, 1, 64, head_dim_v=32, k_format="q8_0", v_format="q8_0",
                                value_in_key=True).v_format == "q8_0"


@pytest.mark.parametrize("kw,needle", [
    (dict(head_dim_v=None), "head_dim_v=None"),
    (dict(head_dim_v=96), "head_dim_v=96.*at most head_dim=64"),
    (dict(head_dim_v=32, v_format=F32), "v_format='float32'.*k_format='float16'"),
    (dict(head_dim_v=32, k_format="q8_0", v_format="q4_0"), "v_format='q4_0'"),
    (dict(head_dim_v=48, k_format="q8_0"), "v_format='q8_0'.*head_dim_v=48"),
])
def test_spec_refusals(kw, needle):
    with pytest.raises(ValueError, match=needle):
        clattn.AttentionSpec(4, 1, 64, value_in_key=True, **kw)


def test_value_in_key_is_a_bool():
    with pytest.raises(TypeError, match="value_in_key"):
        clattn.AttentionSpec(4, 1, 64, head_dim_v=32, value_in_key=1)


def test_sizes_are_the_key_rows_alone():
    """DeepSeek-V2-Lite per layer and token: one row of 576 f16 values (1152 bytes) against
    16 heads of 192-wide keys and 128-wide values decompressed (10240 bytes)."""
    latent = clattn.AttentionSpec(16, 1, 576, head_dim_v=512, value_in_key=True)
    full = clattn.AttentionSpec(16, 16, 192, head_dim_v=128)
    assert (latent.bytes_per_token, full.bytes_per_token) == (1152, 10240)
    cpm = clattn.AttentionSpec(40, 1, 288, head_dim_v=256, value_in_key=True)
    assert cpm.bytes_per_token == 576
    q4 = clattn.AttentionSpec(40, 1, 288, head_dim_v=256, k_format="q4_0", value_in_key=True)
    assert q4.bytes_per_token == 288 * 0.5625
    lay = latent.layout
    assert lay.kinds == (0,) and lay.v_region == 0 and lay.blocks(1) == 0
    assert lay.page_bytes == lay.k_region == 16 * 576 * 2
    assert latent.pool_shape(3) == (3, 16 * 576 * 2) and latent.pool_dtype == np.uint8
    two = clattn.AttentionSpec(4, 2, 64, head_dim_v=32, page_size=4, k_format="q8_0",
                               value_in_key=True).layout
    assert [two.region_offset(kind, h) for kind in (0, 1) for h in (0, 1)] == \
        [0, two.k_region, 0, two.k_region]


def test_pack_unpack_reads_values_from_keys():
    spec = clattn.AttentionSpec(4, 2, 64, head_dim_v=32, page_size=4, k_format="q4_0",
                                value_in_key=True)
    k = np.random.default_rng(0).standard_normal((3, 2, 4, 64)).astype(np.float32)
    pool = quant.pack_pool(k, None, spec.layout)
    dk, dv = quant.unpack_pool(pool, spec.layout)
    np.testing.assert_array_equal(dk, quant.dequantize(*quant.quantize(k, "q4_0"), "q4_0"))
    np.testing.assert_array_equal(dv, dk[..., :32])
    data, scales = quant.region_views(pool, spec.layout, 1)
    assert data.shape == (3, 2, 4, 16) and scales.shape == (3, 2, 4, 1)


# ---------------------------------------------------------------------------- decode
@pytest.mark.parametrize("key", list(SHAPES))
def test_decode(target, get_decoder, key):
    sc = scenario(key)
    sm = SHAPES[key][-1]
    ps = sc.spec.page_size
    dec = get_decoder(sc.spec, target)
    for seed, lengths in enumerate(([0, 1, ps - 1, ps + 1, 3 * ps + 5], [2 * ps, 1])):
        case = case_for(sc, lengths, seed=seed, poison=True)
        args, kw = decode_args(case)
        res = dec.run(*args, **kw, sm_scale=sm)
        assert res.out.shape == (len(lengths), sc.spec.num_qo_heads, sc.spec.head_dim_v)
        compare(res.out, res.lse, *oracle(sc, case, sm_scale=sm), sc.spec.dtype,
                what=f"{sc} {lengths}: ")
    # RoPE in the kernel rotates the keys for the scores; values are read as stored
    case = case_for(sc, [ps + 3, 2], seed=9, rope=True, pos_offset=[70_000, 3])
    args, kw = decode_args(case)
    res = dec.run(*args, **kw, rotary_mode=1, sm_scale=sm)
    compare(res.out, res.lse, *oracle(sc, case, rotary_mode=1, sm_scale=sm), sc.spec.dtype,
            what=f"{sc} rope: ")
    if target.profile is not None and key in MODEL_SHAPES:
        check_split(sc, dec, sm)   # the tiled kernels' split builds in a second or two


def check_split(sc: Scenario, dec: clattn.BatchDecode, sm: float) -> None:
    """Split-KV: partitions of one page, merged on the device, against the oracle."""
    ps = sc.spec.page_size
    case = case_for(sc, [5 * ps + 3, ps, 1], seed=7, poison=True)
    args, kw = decode_args(case)
    res = dec.run(*args, **kw, split=ps, sm_scale=sm)
    compare(res.out, res.lse, *oracle(sc, case, sm_scale=sm), sc.spec.dtype,
            what=f"{sc} split: ")


@pytest.mark.parametrize("key", [*SPLIT_SHAPES, *(pytest.param(k, marks=pytest.mark.slow)
                                                  for k in MODEL_SHAPES)])
def test_decode_split(device_target, get_decoder, key):
    """The split on every device target; the models' shapes under ``-m slow`` (by default
    test_decode splits them on the tiled targets)."""
    sc = scenario(key)
    check_split(sc, get_decoder(sc.spec, device_target), ALL_SHAPES[key][-1])


# ---------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("key", list(SHAPES))
def test_prefill(target, key):
    sc = scenario(key)
    sm = SHAPES[key][-1]
    ps = sc.spec.page_size
    pre = get_prefill(sc.spec, target)
    kw = dict(window=[0, 3, 0], sinks=[0, 1, 0]) if sc.spec.sliding_window else {}
    case = prefill_case(sc.spec, [0, ps + 2, 3], [5, ps + 1, 1], seed=2, **kw)
    res = run(pre, case, sm_scale=sm)
    assert res.out.shape == (len(case["q"]), sc.spec.num_qo_heads, sc.spec.head_dim_v)
    compare(res.out, res.lse, *naive_prefill(sc, case, sm_scale=sm), sc.spec.dtype,
            what=f"{sc}: ")


# ---------------------------------------------------------------------------- the cache
#: the cache's simulations: build keywords and rope mode
CACHE_SPECS = {
    "f32-win-rope": (dict(head_dim=32, head_dim_v=24, dtype=F32, sliding_window=True),
                     "attend"),
    "q8-f16": (dict(head_dim=64, head_dim_v=32, dtype=F16, k_format="q8_0"), None),
}


@pytest.mark.parametrize("variant", list(CACHE_SPECS))
def test_cache_simulation(target, variant):
    """Random steps (prompts, decodes, forks with copy-on-write, pops within the rollback,
    cancels) of a cache that stores only key rows: append k with v=None, every attend
    against the oracle."""
    build, rope = CACHE_SPECS[variant]
    spec = clattn.AttentionSpec(4, 2, page_size=4, value_in_key=True, **build)
    cache = make_cache(spec, target, num_pages=24, rope=rope, rollback=4)
    counts = simulate(cache, 60, seed=2, rope=rope == "attend")
    assert counts["step"] > 20 and counts["chunk"] and counts["cow"] and counts["fork"] and \
        counts["pop"] and counts["cancel"], counts


def test_cache_pool_is_the_key_rows(target):
    """The pool of a cache whose values are in the key rows is exactly its key regions:
    num_pages x H_kv x k_region bytes a layer, and an append writes nothing past them."""
    spec = clattn.AttentionSpec(4, 2, 32, head_dim_v=16, page_size=4, dtype=F32,
                                value_in_key=True)
    cache = make_cache(spec, target, num_pages=6)
    k_only = 6 * 2 * 4 * 32 * 4
    for layer in range(2):
        pool = cache.pools[layer]
        assert pool.dtype == np.uint8 and pool.shape == (6, k_only // 6)
        assert pool.nbytes == k_only
    assert cache.stats().pool_bytes == 2 * k_only
    cache.add("a")
    cache.begin(["a"], [5])
    k = np.random.default_rng(1).standard_normal((5, 2, 32)).astype(np.float32)
    for layer in range(2):
        cache.append(layer, k, None)
        q = np.random.default_rng(layer).standard_normal((5, 4, 32)).astype(np.float32)
        out = cache.attend(layer, q).out
        out = out if isinstance(out, np.ndarray) else out.get()
        assert out.shape == (5, 4, 16)
    cache.end()
    page = cache.table.state("a").pages[0]
    keys, values = quant.unpack_pool(pool_host(cache, 1), spec.layout, [page])
    np.testing.assert_array_equal(keys[0, :, :4], k[:4].transpose(1, 0, 2))
    np.testing.assert_array_equal(values[0, :, :4], k[:4, :, :16].transpose(1, 0, 2))


def test_bad_appends(target):
    spec = clattn.AttentionSpec(4, 2, 32, head_dim_v=16, page_size=4, dtype=F32,
                                value_in_key=True)
    cache = make_cache(spec, target, num_pages=4)
    cache.add("a")
    cache.begin(["a"], [1])
    k = np.zeros((1, 2, 32), np.float32)
    with pytest.raises(ValueError, match=r"^v: .*value_in_key.*pass v=None"):
        cache.append(0, k, np.zeros((1, 2, 16), np.float32))
    cache.cancel()
    plain = make_cache(clattn.AttentionSpec(4, 2, 32, dtype=F32), target, num_pages=4)
    plain.add("a")
    plain.begin(["a"], [1])
    with pytest.raises(ValueError, match=r"^v=None: .*pass v \["):
        plain.append(0, k, None)
    plain.cancel()
    with pytest.raises(ValueError, match="rope='append'.*value_in_key"):
        make_cache(spec, target, num_pages=4, rope="append")


def test_kv_file_without_the_field_loads_as_before(tmp_path):
    """A file written before ``value_in_key`` existed (its spec lacks the field) is a
    file of values of their own."""
    from clattn import cache_store
    spec = clattn.AttentionSpec(4, 2, 32, page_size=4, dtype=F32)
    cache = clattn.PagedKVCache(spec, 1, num_pages=4, backend="cpu")
    cache.add("a")
    cache.begin(["a"], [3])
    cache.append(0, *(np.ones((3, 2, 32), np.float32) for _ in range(2)))
    cache.end()
    path = tmp_path / "old.kv"
    orig = cache_store.SPEC_FIELDS
    try:
        cache_store.SPEC_FIELDS = tuple(f for f in orig if f != "value_in_key")
        cache.save(path)
    finally:
        cache_store.SPEC_FIELDS = orig
    assert "value_in_key" not in cache_store.read_header(path)["spec"]
    other = clattn.PagedKVCache(spec, 1, num_pages=4, backend="cpu")
    assert other.load(path) == ("a",) and other.length("a") == 3
    latent = clattn.PagedKVCache(clattn.AttentionSpec(4, 2, 32, head_dim_v=32, page_size=4,
                                                      dtype=F32, value_in_key=True),
                                 1, num_pages=4, backend="cpu")
    with pytest.raises(clattn.kv_file.KVFileMismatchError, match="page format.*value_in_key"):
        latent.load(path)


@pytest.mark.parametrize("m", models.MLA_SHAPES, ids=lambda m: m.name)
def test_mla_shapes_give_each_forms_spec_and_bytes(m):
    """A model's two cache forms: per head keys of nope + rope and values of v_head_dim, or
    one shared row of latent + rope whose leading latent values are the value."""
    dec, lat = m.spec("decompressed"), m.spec("latent")
    assert (dec.num_kv_heads, dec.head_dim, dec.head_dim_v, dec.value_in_key) == \
        (m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, False)
    assert (lat.num_qo_heads, lat.num_kv_heads, lat.head_dim, lat.head_dim_v) == \
        (m.num_heads, 1, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank)
    assert lat.value_in_key
    assert dec.bytes_per_token == 2 * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim
                                                     + m.v_head_dim)
    assert lat.bytes_per_token == 2 * (m.kv_lora_rank + m.qk_rope_head_dim)
    assert m.sm_scale == 1 / math.sqrt(m.qk_nope_head_dim + m.qk_rope_head_dim)
    with pytest.raises(ValueError, match="form='absorbed'"):
        m.spec("absorbed")


def test_mla_shape_sizes():
    """DeepSeek-V2-Lite's latent form holds 576 values per token and layer against 16 x
    (192 + 128) decompressed (issue 41's figures)."""
    m = models.mla_shape("DeepSeek-V2-Lite")
    assert m.spec("latent").bytes_per_token == 1152
    assert m.spec("decompressed").bytes_per_token == 10240
    with pytest.raises(KeyError, match="DeepSeek-V2-Lite"):
        models.mla_shape("nope")


@pytest.mark.parametrize("m", models.MLA_SHAPES, ids=lambda m: m.name)
def test_one_latent_sequence_is_split_over_the_device(device, m):
    """A latent-form layer is one work-group per sequence unsplit. At 4096 rows its rows'
    work (17-22 reference rows each, clattn.plan.row_weight) pays for the merge under
    every profile, so one sequence is split over the device's compute units (on 2 cores
    the CPU profiles' row threshold alone left one idle: tests/test_plan.py). The plan
    alone: no kernel is built."""
    dec = clattn.BatchDecode(m.spec("latent"), device)
    plan = dec.plan(np.array([0, 256], np.int32), np.array([16], np.int32))
    assert plan.split and plan.num_parts >= 2, plan
