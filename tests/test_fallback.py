"""The CPU backend (clattn.cpu_backend.batch_decode) against the naive float64 oracle.

What every backend shares (real models, shapes, windows, RoPE types, split, long contexts)
runs in test_kernels.py on the ``cpu`` target too; here: what the CPU backend's own code
paths and arguments do (views, out=, length_info, every RoPE scaling variant and partial
rotary dims, group sizes), each against the oracle.
"""
import numpy as np
import pytest
from cases import (
    Scenario,
    compare,
    config_scenario,
    decode_args,
    lse_bound,
    make_case,
    spec_scenario,
)
from model_configs import model
from naive import naive_decode

from clattn.cpu_backend import batch_decode
from clattn.spec import AttentionSpec

DTYPES = ["float32", "float16"]


def _scenario(sc):
    """A Scenario as is; a bare spec only when it carries nothing the oracle must be told."""
    if isinstance(sc, Scenario):
        return sc
    assert sc.rope_scaling is None and sc.softcap is None and sc.rotary_dim == sc.head_dim, \
        "build this spec with cases.spec_scenario: the oracle must not read clattn's spec"
    return Scenario(str(sc), sc)


def check(sc, case, *, what="", use_length_info=False, **call):
    """Run batch_decode and naive_decode on one case; compare; return the library's result."""
    sc = _scenario(sc)
    args, kw = decode_args(case)
    if use_length_info:
        lib_args = args[:4]
        lib_kw = {k: v for k, v in kw.items() if k not in ("window_offset", "sink_size")}
        lib_kw["length_info"] = case["length_info"]
    else:
        lib_args, lib_kw = args, kw
    call = dict(sc.call, **call)
    out, lse = batch_decode(sc.spec, *lib_args, **lib_kw, **call)
    ref_out, ref_lse = naive_decode(*args, **kw, **sc.oracle, **call)
    compare(out, lse, ref_out, ref_lse, sc.spec.dtype, what=what)
    return out, lse


# --------------------------------------------------------------------------- group sizes / pages
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (14, 2), (16, 2)],
                         ids=lambda h: f"g{h[0] // h[1]}")
def test_group_sizes(heads, dtype):
    spec = AttentionSpec(heads[0], heads[1], 32, page_size=16, dtype=dtype)
    case = make_case(spec, [19, 0, 48, 1], seed=heads[0])
    check(spec, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_page_sizes_and_boundaries(ps, dtype):
    spec = AttentionSpec(4, 2, 32, page_size=ps, dtype=dtype)
    lengths = [ps, 2 * ps, ps + 1, 1, 0, 2 * ps + 1, 0]
    case = make_case(spec, lengths, seed=ps)
    out, lse = check(spec, case, what=f"ps={ps}: ")
    assert np.isneginf(lse[4]).all() and np.isneginf(lse[6]).all()
    assert (out[4] == 0).all() and (out[6] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_empty_and_single_token(dtype):
    spec = AttentionSpec(4, 1, 16, page_size=4, dtype=dtype)
    out, lse = check(spec, make_case(spec, [0, 0, 0], seed=1))
    assert np.isneginf(lse).all() and (out == 0).all()
    case = make_case(spec, [1], seed=2)
    out, lse = check(spec, case)
    # one row: out is that row's value for every query head of the group
    v = case["pages"][case["page_indices"][0], 1, 0, 0]
    np.testing.assert_array_equal(out[0], np.broadcast_to(v, out[0].shape))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unshuffled_pool_and_no_spare(dtype):
    spec = AttentionSpec(4, 2, 32, page_size=8, dtype=dtype)
    check(spec, make_case(spec, [9, 24, 3], seed=7, shuffle_pages=False, extra_pages=0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unused_slots_never_read(dtype):
    """Slots beyond last_page_len and spare pages hold NaN: the result must not see them."""
    spec = AttentionSpec(4, 2, 32, page_size=16, dtype=dtype)
    check(spec, make_case(spec, [19, 0, 1, 32, 5], seed=8, poison=True))
    wspec = AttentionSpec(4, 2, 32, page_size=16, dtype=dtype, sliding_window=True)
    check(wspec, make_case(wspec, [19, 40, 33], seed=9, window=[6, 40, 20], sinks=[2, 3, 0],
                           poison=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sm_scale_explicit(dtype):
    spec = AttentionSpec(8, 2, 64, page_size=16, dtype=dtype)
    case = make_case(spec, [30, 7], seed=11)
    check(spec, case, sm_scale=0.05)
    check(spec, case, sm_scale=0.3)


# --------------------------------------------------------------------------- sliding window
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ps", [1, 16])
def test_sliding_window_limits(ps, dtype):
    spec = AttentionSpec(8, 2, 32, page_size=ps, dtype=dtype, sliding_window=True)
    lengths = [40, 40, 40, 40, 0, 17, 33, 1]
    window = [24, 24, 40, 0, 0, 17, 10, 1]
    sinks = [0, 24, 3, 0, 0, 0, 4, 1]
    # rows:  16, 40, 3, 40, 0, 0 (empty), 27, 1
    case = make_case(spec, lengths, seed=21 + ps, window=window, sinks=sinks)
    assert case["rows"].tolist() == [16, 40, 3, 40, 0, 0, 27, 1]
    out, lse = check(spec, case, what=f"window ps={ps}: ")
    assert np.isneginf(lse[4]).all() and np.isneginf(lse[5]).all()
    assert (out[5] == 0).all()
    # sink_size == window_offset and window_offset == 0 both attend to everything
    plain = AttentionSpec(8, 2, 32, page_size=ps, dtype=dtype)
    pout, plse = batch_decode(plain, case["q"], case["pages"], case["page_indptr"],
                              case["page_indices"], case["last_page_len"])
    for b in (1, 3):   # the same rows in the same order: the same bits
        np.testing.assert_array_equal(out[b], pout[b])
        np.testing.assert_array_equal(lse[b], plse[b])


@pytest.mark.parametrize("dtype", DTYPES)
def test_length_info_packing(dtype):
    spec = AttentionSpec(4, 2, 32, page_size=16, dtype=dtype)
    case = make_case(spec, [17, 0, 32, 3], seed=31)
    args, _ = decode_args(case)
    a = batch_decode(spec, *args)
    b = check(spec, case, use_length_info=True)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert case["length_info"].shape == (4,)

    wspec = AttentionSpec(4, 2, 32, page_size=16, dtype=dtype, sliding_window=True)
    case = make_case(wspec, [17, 0, 32, 30], seed=32, window=[5, 0, 32, 12], sinks=[2, 0, 4, 12])
    assert case["length_info"].shape == (3, 4)
    args, kw = decode_args(case)
    a = batch_decode(wspec, *args, **kw)
    b = check(wspec, case, use_length_info=True)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    # a [3, B] view into a bigger buffer (non-zero offset)
    big = np.zeros(13, dtype=np.int32)
    big[1:] = case["length_info"].ravel()
    li = big[1:].reshape(3, 4)
    assert li.base is not None and li.flags.c_contiguous
    c = batch_decode(wspec, *args[:4], length_info=li)
    np.testing.assert_array_equal(a[0], c[0])


# --------------------------------------------------------------------------- RoPE
def model_scenario(name, dtype, *, heads=(4, 2), sliding_window=False):
    """A real model from its raw config, heads shrunk; the oracle reads the same config."""
    m = model(name)
    if (m["num_key_value_heads"] or m["num_attention_heads"]) == m["num_attention_heads"]:
        heads = (heads[0], heads[0])
    return config_scenario(f"{name}-{dtype}", m, heads=heads, dtype=dtype,
                           sliding_window=sliding_window)


def rope_check(sc, case, *, what="", **call):
    return check(sc, case, rotary_mode=1, what=what, **call)


ROPE_MODELS = ["Llama-3.2-1B", "Llama-3.1-8B", "gpt-oss-20b", "Phi-3.5-mini", "GPT-J-6B",
               "Gemma-3-4B", "Qwen2.5-0.5B", "Mistral-7B-v0.1"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ROPE_MODELS)
def test_rope_real_configs(name, dtype):
    sc = model_scenario(name, dtype)
    case = make_case(sc.spec, [21, 0, 16, 3], seed=41, rope=True, pos_offset=[100, 0, 7, 1000])
    rope_check(sc, case, what=f"{name}: ")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_llama3_beyond_original_context(dtype):
    sc = model_scenario("Llama-3.2-1B", dtype)
    case = make_case(sc.spec, [9, 20], seed=42, rope=True, pos_offset=[9000, 20000])
    rope_check(sc, case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_longrope_short_and_long(dtype):
    """Phi-3.5: per sequence, long factors once q_pos + 1 > original_max_position_embeddings."""
    sc = model_scenario("Phi-3.5-mini", dtype)
    # q_pos: 60 (short), 4095 (short: 4096 is not > 4096), 4096 (long), 5000 (long)
    case = make_case(sc.spec, [20, 20, 20, 20], seed=43, rope=True,
                     pos_offset=[40, 4070, 4071, 4900], q_pos=[60, 4095, 4096, 5000])
    out, lse = rope_check(sc, case)
    # the switch is real: with only short factors the long sequences would differ
    short = sc.oracle["inv_freq_fn"](0)
    args, kw = decode_args(case)
    ref_short = naive_decode(*args, **kw, **dict(sc.oracle, inv_freq_fn=lambda pos: short),
                             **sc.call, rotary_mode=1)
    assert np.abs(ref_short[1][2:] - lse[2:]).max() > 1e-3
    assert (np.abs(ref_short[1][:2] - lse[:2]) <= lse_bound(*ref_short)[:2]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_longrope_from_hf_config_near_switch(dtype):
    """The spec built from the Phi-3.5 config (top-level original_max_position_embeddings)."""
    sc = model_scenario("Phi-3.5-mini", dtype)
    case = make_case(sc.spec, [5, 12], seed=44, rope=True, pos_offset=[10, 4090])
    rope_check(sc, case)


LLAMA3_8B = model("Llama-3.1-8B")["rope_scaling"]
EXTRA_ROPE = {
    # llama4 uses llama3's frequency formula (here with Llama-3.1-8B's parameters)
    "llama4": dict(LLAMA3_8B, rope_type="llama4"),
    # Llama-4-style parameters: low_freq_factor == high_freq_factor (empty medium band)
    "llama4-lowhigh": {"rope_type": "llama4", "factor": 16.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    # DeepSeek-V2-Lite's dict (shared/models/models.json; legacy key 'type', mscale pair)
    "yarn-mscale": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                    "type": "yarn"},
    "yarn-mscale-ne": {"rope_type": "yarn", "factor": 16.0, "mscale": 1.0,
                       "mscale_all_dim": 0.5, "original_max_position_embeddings": 4096},
    "yarn-truncate-attn": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                           "original_max_position_embeddings": 2048, "attention_factor": 0.8},
    "yarn-no-orig": {"rope_type": "yarn", "factor": 4.0},
    "linear-type-key": {"type": "linear", "factor": 2.0},
    "longrope-factor": {"rope_type": "longrope", "factor": 4.0,
                        "original_max_position_embeddings": 64,
                        "short_factor": [1.0 + 0.05 * i for i in range(32)],
                        "long_factor": [2.0 + 0.5 * i for i in range(32)]},
    "default-explicit": {"rope_type": "default"},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key", list(EXTRA_ROPE))
def test_rope_more_types(key, dtype):
    """clattn's rope_scaling contract (a dict as the caller gives it) for every variant."""
    sc = spec_scenario(key, 4, 2, 64, page_size=8, dtype=dtype, rope_scaling=EXTRA_ROPE[key],
                       max_position_embeddings=16384)
    case = make_case(sc.spec, [13, 0, 8, 40], seed=45, rope=True, pos_offset=[3, 0, 70, 9000])
    rope_check(sc, case, rope_theta=10000.0 if "llama" not in key else 500000.0,
               what=f"{key}: ")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rd,rs", [(32, None), (16, {"rope_type": "gptj"}),
                                   (48, {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 2048}),
                                   (32, dict(LLAMA3_8B)), (64, None)],
                         ids=["default-32", "gptj-16", "yarn-48", "llama3-32", "full-64"])
def test_rope_partial_rotary(rd, rs, dtype):
    """partial_rotary_factor-style: only the first rotary_dim dims rotate."""
    sc = spec_scenario(f"rd{rd}", 4, 2, 64, page_size=16, dtype=dtype, rope_scaling=rs,
                       rotary_dim=rd, max_position_embeddings=8192)
    case = make_case(sc.spec, [18, 5], seed=46, rope=True)
    rope_check(sc, case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_gptj_interleaved_differs_from_rotate_half(dtype):
    sc = model_scenario("GPT-J-6B", dtype, heads=(4, 4))
    assert sc.spec.rotary_dim == 64 and sc.spec.head_dim == 256
    case = make_case(sc.spec, [12], seed=47, rope=True, pos_offset=[30])
    out, lse = rope_check(sc, case)
    args, kw = decode_args(case)
    half = naive_decode(*args, **kw, **dict(sc.oracle, interleaved=False), **sc.call,
                        rotary_mode=1)
    assert np.abs(half[1] - lse).max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_scale", [0.25, 2.5])
def test_rope_scale(rope_scale, dtype):
    sc = model_scenario("Llama-3.2-1B", dtype)
    case = make_case(sc.spec, [25, 3], seed=48, rope=True, pos_offset=[17, 200])
    rope_check(sc, case, rope_scale=rope_scale)
    plain = AttentionSpec(4, 2, 64, page_size=16, dtype=dtype)
    rope_check(plain, case, rope_theta=10000.0, rope_scale=rope_scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_linear_and_rope_scale(dtype):
    """linear factor 8 and rope_scale 1/8 (the same rotation, test_naive) both match."""
    lin = spec_scenario("linear", 4, 2, 64, page_size=16, dtype=dtype,
                        rope_scaling={"rope_type": "linear", "factor": 8.0})
    plain = AttentionSpec(4, 2, 64, page_size=16, dtype=dtype)
    case = make_case(lin.spec, [30, 9], seed=49, rope=True)
    rope_check(lin, case)
    rope_check(plain, case, rope_scale=0.125)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_with_window_and_sinks(dtype):
    """Keys rotate at chunk-row positions (sinks and window contiguous)."""
    sc = model_scenario("Llama-3.2-1B", dtype, sliding_window=True)
    case = make_case(sc.spec, [40, 40, 20, 0], seed=50, rope=True, window=[30, 40, 4, 0],
                     sinks=[4, 2, 0, 0], pos_offset=[0, 5, 11, 0])
    rope_check(sc, case)


def test_rope_mode0_ignores_positions():
    spec = model_scenario("Llama-3.2-1B", "float32").spec
    case = make_case(spec, [10], seed=51, rope=True)
    args, kw = decode_args(case)
    a = batch_decode(spec, *args, **kw, rotary_mode=0)
    b = batch_decode(spec, *args)
    np.testing.assert_array_equal(a[0], b[0])


# --------------------------------------------------------------------------- views, out=, dtypes
def _offset_view(a, pad_value=0):
    """A contiguous view of a copy of ``a`` that starts one element/row into a larger buffer."""
    big = np.full((a.shape[0] + 1,) + a.shape[1:], pad_value, dtype=a.dtype)
    big[1:] = a
    v = big[1:]
    assert v.flags.c_contiguous and v.base is big
    return v


@pytest.mark.parametrize("dtype", DTYPES)
def test_offset_views(dtype):
    spec = AttentionSpec(8, 2, 32, page_size=8, dtype=dtype, sliding_window=True)
    case = make_case(spec, [20, 0, 9, 31], seed=61, window=[4, 0, 9, 10], sinks=[2, 0, 1, 3],
                     rope=True)
    args, kw = decode_args(case)
    ref = batch_decode(spec, *args, **kw, rotary_mode=1)
    vargs = [_offset_view(a, 7) for a in args]
    vkw = {k: _offset_view(v, 3) for k, v in kw.items()}
    got = batch_decode(spec, *vargs, **vkw, rotary_mode=1)
    np.testing.assert_array_equal(ref[0], got[0])
    np.testing.assert_array_equal(ref[1], got[1])
    out = _offset_view(np.zeros_like(ref[0]))
    lse = _offset_view(np.zeros_like(ref[1]))
    res = batch_decode(spec, *vargs, **vkw, rotary_mode=1, out=out, lse=lse)
    assert res[0] is out and res[1] is lse
    np.testing.assert_array_equal(ref[0], out)
    np.testing.assert_array_equal(ref[1], lse)
    assert (out.base[0] == 0).all() and (lse.base[0] == 0).all()  # nothing written before
    # the whole thing against the oracle too
    case_v = dict(case, q=vargs[0], pages=vargs[1], page_indptr=vargs[2], page_indices=vargs[3],
                  last_page_len=vargs[4], **vkw)
    rope_check(spec, case_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_and_lse_given(dtype):
    spec = AttentionSpec(8, 4, 64, page_size=16, dtype=dtype)
    case = make_case(spec, [33, 0, 2], seed=62)
    args, _ = decode_args(case)
    out = np.full((3, 8, 64), 123, dtype=dtype)
    lse = np.full((3, 8), 123, dtype=np.float32)
    res = batch_decode(spec, *args, out=out, lse=lse)
    assert res[0] is out and res[1] is lse
    ref = naive_decode(*args)
    compare(out, lse, *ref, dtype)
    # only one of them given
    out2 = np.empty_like(out)
    r = batch_decode(spec, *args, out=out2)
    assert r[0] is out2 and r[1].dtype == np.float32
    compare(*r, *ref, dtype)
    lse2 = np.empty_like(lse)
    r = batch_decode(spec, *args, lse=lse2)
    assert r[1] is lse2 and r[0].dtype == np.dtype(dtype)
    compare(*r, *ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_result_types(dtype):
    spec = AttentionSpec(4, 2, 32, page_size=16, dtype=dtype)
    out, lse = batch_decode(spec, *decode_args(make_case(spec, [3, 0], seed=63))[0])
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype) and out.shape == (2, 4, 32)
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32 and lse.shape == (2, 4)


def test_f16_inputs_compared_to_upcast_reference():
    """f16 storage: the oracle sees exactly the f16 values (upcast), the result is f16."""
    spec = AttentionSpec(8, 2, 128, page_size=16, dtype="float16")
    case = make_case(spec, [70, 1, 0, 47], seed=64)
    assert case["q"].dtype == np.float16 and case["pages"].dtype == np.float16
    check(spec, case)
