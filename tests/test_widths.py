"""Keys and values of different widths (``AttentionSpec.head_dim_v``) against the float64
oracle: the spec's rules, the byte pool's layout, ``from_hf_config`` for the MLA models
(decompressed) and MiMo-V2-Flash, decode (split and merged too) and prefill on every
target.

Shapes are the models': DeepSeek-V2-Lite (16 heads, q/k 192 = nope 128 + rope 64, v 128)
and MiniCPM3 (q/k 96 = 64 + 32, v 64), plus the edge widths (values wider than keys, a
value width that is no power of two). Bounds are
``cases.compare``'s. One build per (spec, target): few specs, many cases each.
"""
from __future__ import annotations

import numpy as np
import pytest
from cases import compare, decode_args, make_case, oracle, spec_scenario
from prefill_cases import naive_prefill, prefill_case, run
from test_cache import make_cache, simulate
from test_prefill import get_prefill

import clattn
from clattn import quant
from clattn.cpu_backend import merge_state

F16, F32 = "float16", "float32"

#: the model configs' attention fields (their config.json values)
DEEPSEEK_V2_LITE = dict(model_type="deepseek_v2", num_attention_heads=16,
                        num_key_value_heads=16, hidden_size=2048, head_dim=64,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        kv_lora_rank=512, q_lora_rank=None, max_position_embeddings=163840,
                        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32,
                                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                                      "original_max_position_embeddings": 4096})
MINICPM3 = dict(model_type="minicpm3", num_attention_heads=40, num_key_value_heads=40,
                hidden_size=2560, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                kv_lora_rank=256, q_lora_rank=768, max_position_embeddings=32768)
MIMO_V2_FLASH = dict(model_type="mimo_v2_flash", num_attention_heads=64,
                     num_key_value_heads=4, hidden_size=4096, head_dim=192, v_head_dim=128,
                     max_position_embeddings=262144)

#: the decode/prefill scenarios: (H_qo, H_kv, D, D_v, page size, dtype, window)
SHAPES = {
    "deepseek-v2-lite": (16, 16, 192, 128, 16, F16, False),
    "minicpm3-win": (4, 4, 96, 64, 16, F32, True),
    "wide-v-g4": (8, 2, 64, 160, 8, F32, False),     # values wider than keys, group 4
    "odd-v": (4, 2, 64, 36, 4, F16, False),          # no power of two: vectors of 4
}


def scenario(key):
    h, kv, d, dv, ps, dt, win = SHAPES[key]
    return spec_scenario(key, h, kv, d, head_dim_v=dv, page_size=ps, dtype=dt,
                         sliding_window=win)


def case_for(sc, lengths, **kw):
    if sc.spec.sliding_window:
        kw.setdefault("window", [min(5, n) for n in lengths])
        kw.setdefault("sinks", [min(2, n) for n in lengths])
    return make_case(sc.spec, lengths, **kw)


# ---------------------------------------------------------------------------- the spec
def test_default_width_is_head_dim():
    spec = clattn.AttentionSpec(8, 2, 64)
    assert spec.head_dim_v == 64 and not spec.split_widths and not spec.byte_pool
    assert spec.pool_shape(3) == (3, 2, 2, 16, 64)
    assert spec.key() == clattn.AttentionSpec(8, 2, 64, head_dim_v=64).key()
    assert spec == clattn.AttentionSpec(8, 2, 64, head_dim_v=64)
    assert spec != clattn.AttentionSpec(8, 2, 64, head_dim_v=32)


@pytest.mark.parametrize("bad", [0, -64, 1.5, "64", True])
def test_head_dim_v_refused(bad):
    with pytest.raises(ValueError, match="head_dim_v"):
        clattn.AttentionSpec(8, 2, 64, head_dim_v=bad)


def test_quantized_value_width_must_hold_blocks():
    with pytest.raises(ValueError, match="v_format='q8_0'.*head_dim_v=48"):
        clattn.AttentionSpec(8, 2, 64, head_dim_v=48, v_format="q8_0")
    with pytest.raises(ValueError, match="k_format='q4_0'.*head_dim=48"):
        clattn.AttentionSpec(8, 2, 48, head_dim_v=64, k_format="q4_0")
    clattn.AttentionSpec(8, 2, 48, head_dim_v=64, v_format="q4_0")   # only V quantized


def test_byte_pool_layout_of_unequal_widths():
    """K regions ``head_dim`` wide, then V regions ``head_dim_v`` wide, each padded to 16
    bytes; quantized formats per region."""
    spec = clattn.AttentionSpec(16, 16, 192, head_dim_v=128, page_size=16)
    lay = spec.layout
    assert spec.byte_pool and spec.pool_dtype == np.uint8
    assert (lay.k_region, lay.v_region) == (16 * 192 * 2, 16 * 128 * 2)
    assert spec.pool_shape(2) == (2, 16 * (16 * 192 * 2 + 16 * 128 * 2))
    assert spec.bytes_per_token == 16 * (192 + 128) * 2
    q = clattn.AttentionSpec(4, 2, 96, head_dim_v=64, page_size=16, k_format="q8_0",
                             v_format="q4_0")
    assert q.layout.k_region == 16 * 96 + 16 * 3 * 2
    assert q.layout.v_region == 16 * 32 + 16 * 2 * 2
    assert q.bytes_per_token == 2 * (96 * 1.0625 + 64 * 0.5625)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 2, 16, 96)).astype(np.float32)
    v = rng.standard_normal((3, 2, 16, 64)).astype(np.float32)
    dk, dv = quant.unpack_pool(quant.pack_pool(k, v, q.layout), q.layout)
    assert dk.shape == k.shape and dv.shape == v.shape
    np.testing.assert_array_equal(dk, quant.dequantize(*quant.quantize(k, "q8_0"), "q8_0"))
    np.testing.assert_array_equal(dv, quant.dequantize(*quant.quantize(v, "q4_0"), "q4_0"))


def test_from_hf_config_mla_and_mimo():
    ds = clattn.AttentionSpec.from_hf_config(DEEPSEEK_V2_LITE)
    assert (ds.num_qo_heads, ds.num_kv_heads, ds.head_dim, ds.head_dim_v) == (16, 16, 192, 128)
    cpm = clattn.AttentionSpec.from_hf_config(MINICPM3)
    assert (cpm.num_qo_heads, cpm.head_dim, cpm.head_dim_v) == (40, 96, 64)
    mimo = clattn.AttentionSpec.from_hf_config(MIMO_V2_FLASH)
    assert (mimo.num_qo_heads, mimo.num_kv_heads, mimo.head_dim, mimo.head_dim_v) == \
        (64, 4, 192, 128)
    plain = clattn.AttentionSpec.from_hf_config(dict(num_attention_heads=8, hidden_size=512))
    assert plain.head_dim_v == plain.head_dim == 64


# ---------------------------------------------------------------------------- decode
@pytest.mark.parametrize("key", list(SHAPES))
def test_decode(target, get_decoder, key):
    sc = scenario(key)
    ps = sc.spec.page_size
    dec = get_decoder(sc.spec, target)
    for seed, lengths in enumerate(([0, 1, ps - 1, ps + 1, 3 * ps + 5], [2 * ps, 1])):
        case = case_for(sc, lengths, seed=seed, poison=True)
        args, kw = decode_args(case)
        res = dec.run(*args, **kw)
        assert res.out.shape == (len(lengths), sc.spec.num_qo_heads, sc.spec.head_dim_v)
        compare(res.out, res.lse, *oracle(sc, case), sc.spec.dtype, what=f"{sc} {lengths}: ")
    # RoPE in the kernel: the keys' leading rotary dims rotate, the values never
    case = case_for(sc, [ps + 3, 2], seed=9, rope=True, pos_offset=[70_000, 3])
    args, kw = decode_args(case)
    res = dec.run(*args, **kw, rotary_mode=1)
    compare(res.out, res.lse, *oracle(sc, case, rotary_mode=1), sc.spec.dtype,
            what=f"{sc} rope: ")
    if not target.is_cpu:   # split-KV: partitions of one page, merged on the device
        case = case_for(sc, [5 * ps + 3, ps, 1], seed=7, poison=True)
        args, kw = decode_args(case)
        res = dec.run(*args, **kw, split=ps)
        compare(res.out, res.lse, *oracle(sc, case), sc.spec.dtype, what=f"{sc} split: ")


def test_decode_halves_merge_to_whole():
    """Split-KV's identity with states as wide as V: the two halves of a chunk, attended
    apart and merged, give the whole chunk's result."""
    sc = scenario("wide-v-g4")
    ps = sc.spec.page_size
    whole = case_for(sc, [4 * ps], seed=3)
    halves = []
    for first in (True, False):
        part = dict(whole)
        n = whole["page_indptr"][1]
        idx = whole["page_indices"][:n // 2] if first else whole["page_indices"][n // 2:]
        part.update(page_indices=idx.astype(np.int32),
                    page_indptr=np.array([0, len(idx)], np.int32),
                    last_page_len=np.array([ps], np.int32))
        args, kw = decode_args(part)
        out, lse = clattn.cpu_backend.batch_decode(sc.spec, *args, **kw)
        halves.append((out, lse))
    v, s = merge_state(halves[0][0], halves[0][1], halves[1][0], halves[1][1])
    assert v.shape == (1, 8, 160)
    ref = oracle(sc, whole)
    compare(v, s, ref[0], ref[1], F32, what="merged halves: ")


def test_quantized_regions_of_unequal_widths():
    """q8_0 keys 192 wide, q4_0 values 128 wide: the cpu backend reads the pool as the
    oracle reads its dequantized rows."""
    spec = clattn.AttentionSpec(4, 2, 192, head_dim_v=128, page_size=16, dtype=F32,
                                k_format="q8_0", v_format="q4_0")
    sc = spec_scenario("q-widths", 4, 2, 192, head_dim_v=128, page_size=16, dtype=F32,
                       k_format="q8_0", v_format="q4_0")
    case = make_case(spec, [0, 1, 40], seed=4)
    args, kw = decode_args(case)
    out, lse = clattn.cpu_backend.batch_decode(spec, *args, **kw)
    compare(out, lse, *oracle(sc, case), F32, what="quantized widths: ")


def test_output_of_the_wrong_width_refused():
    sc = scenario("minicpm3-win")
    case = case_for(sc, [3], seed=1)
    args, kw = decode_args(case)
    bad = np.zeros((1, 4, 96), np.float32)
    with pytest.raises(ValueError, match="out"):
        clattn.cpu_backend.batch_decode(sc.spec, *args, **kw, out=bad)


# ---------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("key", list(SHAPES))
def test_prefill(target, key):
    sc = scenario(key)
    ps = sc.spec.page_size
    pre = get_prefill(sc.spec, target)
    kw = {}
    if sc.spec.sliding_window:
        kw = dict(window=[0, 3, 0], sinks=[0, 1, 0])
    case = prefill_case(sc.spec, [0, ps + 2, 3], [5, ps + 1, 1], seed=2, **kw)
    res = run(pre, case)
    assert res.out.shape == (len(case["q"]), sc.spec.num_qo_heads, sc.spec.head_dim_v)
    compare(res.out, res.lse, *naive_prefill(sc, case), sc.spec.dtype, what=f"{sc}: ")


# ---------------------------------------------------------------------------- the cache
#: the cache's simulations: (build keywords, rope mode): values wider, narrower, quantized
CACHE_SPECS = {
    "f16-wide-v": (dict(head_dim=32, head_dim_v=64, dtype=F16), None),
    "f32-narrow-v-rope": (dict(head_dim=32, head_dim_v=16, dtype=F32, sliding_window=True),
                          "attend"),
    "q8-k-q4-v": (dict(head_dim=64, head_dim_v=32, dtype=F32, k_format="q8_0",
                       v_format="q4_0"), None),
}


@pytest.mark.parametrize("variant", list(CACHE_SPECS))
def test_cache_simulation(target, variant):
    """Random steps (prompts, decodes, forks, pops, cancels) of a PagedKVCache whose values
    differ in width from its keys: append k [T, H_kv, D], v [T, H_kv, D_v], attend to
    out [T, H_qo, D_v], every attend against the oracle."""
    build, rope = CACHE_SPECS[variant]
    spec = clattn.AttentionSpec(4, 2, page_size=4, **build)
    cache = make_cache(spec, target, num_pages=24, rope=rope)
    counts = simulate(cache, 60, seed=5, rope=rope == "attend")
    assert counts["step"] > 20 and counts["chunk"], counts
