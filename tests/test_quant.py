"""Quantized KV pages (q8_0, q4_0): the formats bit for bit, and decode over them equal
to the float64 oracle run on the dequantized values, on every backend and feature."""
import warnings

import numpy as np
import pytest
from cases import compare, decode_args, make_case
from naive import naive_decode

import clattn
from clattn import quant


def test_q8_codes_round_the_f32_product_half_away_from_zero():
    # amax 127 -> d = 1 = id: ties k + 1/2 go away from zero
    x = np.zeros(32, np.float32)
    x[:6] = 127, 2.5, 3.5, -2.5, 0.49999997, -0.5
    data, d = quant.quantize(x, "q8_0")
    assert d[0] == 1 and list(data.view(np.int8)[:6]) == [127, 3, 4, -3, 0, -1]
    # amax 381 -> d = 3, id = f32(1/3) = 0.3333333433: x = 28.499998 (x / 3 = 9.4999994,
    # nearest 9) times id rounds to 9.5 in f32, which rounds to 10
    x[:3] = 381, np.float32(28.499998), np.float32(-28.499998)
    data, d = quant.quantize(x, "q8_0")
    assert d[0] == 3 and list(data.view(np.int8)[:3]) == [127, 10, -10]
    near, _ = quant.quantize(x, "q8_0", rounding="nearest")
    assert list(near.view(np.int8)[:3]) == [127, 9, -9]


def _nibbles(data):
    u = np.empty(data.shape[:-1] + (32,), np.int64)
    u[..., :16], u[..., 16:] = data & 15, data >> 4  # byte j: value j (low), j + 16 (high)
    return u


def test_q4_layout_nibbles_sign_of_largest_and_truncation_after_8_5():
    x = np.arange(32, dtype=np.float32) - 16   # largest magnitude -16 -> d = -16/-8 = 2
    data, d = quant.quantize(x, "q4_0")
    assert d[0] == 2
    u = _nibbles(data)
    # code trunc(x / 2 + 8.5): -16 -> 0, -15 -> 1 (-7.5 goes up), -14 -> 1, -13 -> 2
    assert list(u[:4]) == [0, 1, 1, 2]
    # 0 -> 8, 1 -> 9 (0.5 goes up), 2 -> 9, 3 -> 10; 15 -> 16, clamped to 15
    assert list(u[16:20]) == [8, 9, 9, 10] and u[31] == 15
    back = quant.dequantize(data, d, "q4_0")
    assert np.array_equal(back, (np.minimum(np.floor(x / 2 + 8.5), 15) - 8) * 2)
    # the sum x * id + 8.5 is an f32 (unit 2**-20 at 8.5): 0.49999997 + 8.5 rounds to 9
    # (code 9, not 8); 0.4999995 + 8.5 stays below 9 (code 8)
    y = np.zeros(32, np.float32)
    y[0], y[1], y[2] = -8, np.float32(0.49999997), np.float32(0.4999995)
    data, d = quant.quantize(y, "q4_0")
    assert d[0] == 1 and list(_nibbles(data)[:3]) == [0, 9, 8]


def test_scale_is_f16_rounded_and_zero_blocks_decode_to_zero():
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.linspace(-1, 1, 32) * 0.3
    for fmt in ("q8_0", "q4_0"):
        data, d = quant.quantize(x, fmt)
        assert d.dtype == np.float16 and (d[1] == 0).all() and d[0, 1] == 0
        back = quant.dequantize(data, d, fmt)
        assert (back[1] == 0).all() and (back[0, 32:] == 0).all()
        # zero blocks: zero codes; q4_0's scale is +0 / -8 = -0 (ggml's, whatever the
        # sign of the zeros)
        assert (data[1] == (0 if fmt == "q8_0" else 0x88)).all()
        assert (np.signbit(d[1]) == (fmt == "q4_0")).all()
        # half a step of the f32 scale d32, plus the codes times d32's f16 rounding; q4's
        # range [-8, 7] clips the opposite extreme by one step
        d32 = 0.3 / (127 if fmt == "q8_0" else 8)
        err = np.abs(back[0, :32] - x[0, :32]).max()
        qmax = 127 if fmt == "q8_0" else 8
        step = 0.5 if fmt == "q8_0" else 1.0
        assert err <= (step * d32 + qmax * abs(float(d[0, 0]) - d32)) * (1 + 1e-6)


def test_tiny_scales_get_zero_codes_f16_zero_scales_keep_ggml_codes():
    x = np.zeros((3, 32), np.float32)
    x[0, :3] = 2.9e-36, 1e-36, -2e-36   # q8_0: d = 2.9e-36 / 127 < 2**-125: zero codes
    x[1, :3] = 2e-7, 5e-8, -1.5e-7      # d below half f16's least subnormal: scale 0, codes kept
    x[2, :2] = -1.8e-37, 1e-37          # q4_0: d = 1.8e-37 / 8 < 2**-125: zero codes
    data, d = quant.quantize(x, "q8_0")
    assert (d == 0).all() and not data[0].any() and not data[2].any()
    assert list(data[1].view(np.int8)[:3]) == [127, 32, -95]   # 127 * x / 2e-7
    assert (quant.dequantize(data, d, "q8_0") == 0).all()
    data, d = quant.quantize(x, "q4_0")
    assert (d == 0).all() and (data[2] == 0x88).all()
    assert list(_nibbles(data[1])[:3]) == [0, 6, 14]   # d = -2.5e-8: 8.5 - 8 * x / 2e-7


def test_largest_magnitudes_each_format_holds():
    f32 = np.float32
    for fmt, top in quant.LARGEST.items():
        over = np.nextafter(f32(top), f32(np.inf))
        assert over == (65520 * 127 if fmt == "q8_0" else 65520 * 8)
        for sign in (1, -1):
            x = np.zeros(32, np.float32)
            x[5] = sign * f32(top)
            data, d = quant.quantize(x, fmt)
            assert abs(float(d[0])) == 65504
            x[5] = sign * over
            with pytest.raises(ValueError, match=rf"^keys: .*overflows float16 \(\|value\| "
                                                 rf"up to {float(over)!r}\); {fmt} holds "
                                                 rf"\|x\| <= {top!r} "):
                quant.quantize(x, fmt, "keys")


def test_quantize_refuses_unknown_format_and_rounding():
    with pytest.raises(ValueError, match="format 'q5_0'"):
        quant.quantize(np.zeros(32), "q5_0")
    with pytest.raises(ValueError, match="rounding='even'"):
        quant.quantize(np.zeros(32), "q8_0", rounding="even")


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_blocks_are_refused(bad):
    x = np.ones((3, 32), np.float32)
    x[1, 7] = bad
    for fmt in ("q8_0", "q4_0"):
        with pytest.raises(ValueError, match=r"index \(1, 7\) is not finite"):
            quant.quantize(x, fmt, "keys")


def test_bytes_per_value_and_page_layout():
    assert quant.bytes_per_value("q8_0") == 1.0625 and quant.bytes_per_value("q4_0") == 0.5625
    spec = clattn.AttentionSpec(32, 8, 128, page_size=16, k_format="q8_0", v_format="q4_0")
    lay = spec.layout
    assert lay.k_region == 16 * 128 + 16 * 4 * 2 and lay.v_region == 16 * 64 + 16 * 4 * 2
    assert spec.pool_shape(5) == (5, 8 * (lay.k_region + lay.v_region))
    assert spec.bytes_per_token == 8 * 128 * (1.0625 + 0.5625)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        clattn.AttentionSpec(8, 2, 80, k_format="q8_0")
    with pytest.raises(ValueError, match="k_format='q2_k'"):
        clattn.AttentionSpec(8, 2, 64, k_format="q2_k")


def _quant_case(spec, lengths, seed, **kw):
    """A case whose pool is packed in spec's formats; the oracle sees dequantized pages."""
    fspec = clattn.AttentionSpec(spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                                 page_size=spec.page_size, dtype="float32",
                                 sliding_window=spec.sliding_window)
    case = make_case(fspec, lengths, seed=seed, **kw)
    k, v = case["pages"][:, 0], case["pages"][:, 1]
    k = k.copy()
    k[..., 3] *= 8.0  # an outlier channel, as real keys have
    pool = quant.pack_pool(k, v, spec.layout)
    dk, dv = quant.unpack_pool(pool, spec.layout)
    case["pages"] = pool
    case["q"] = case["q"].astype(spec.np_dtype)
    args, kwargs = decode_args(case)
    ref_pages = np.stack([dk, dv], axis=1).astype(np.float64)
    return args, kwargs, (args[0], ref_pages) + tuple(args[2:])


FORMATS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("q4_0", "float16"),
           ("float32", "q8_0")]
WHERE = [("cpu", None), ("pocl", None), ("pocl", "adreno-7xx"), ("intel", None),
         ("intel", "adreno-7xx")]


@pytest.mark.parametrize("where,prof", WHERE)
@pytest.mark.parametrize("kf,vf", FORMATS)
def test_decode_over_quantized_pages(where, prof, kf, vf):
    spec = clattn.AttentionSpec(14, 2, 64, page_size=16, dtype="float16", k_format=kf,
                                v_format=vf, sliding_window=True, softcap=30.0)
    args, kw, ref_args = _quant_case(spec, [1, 45, 0, 130], seed=3, window=[0, 20, 0, 40],
                                     sinks=[0, 3, 0, 4], rope=True)
    kw["rotary_mode"] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dec = clattn.BatchDecode(spec, None if where == "cpu" else where,
                                 backend="cpu" if where == "cpu" else "opencl", profile=prof)
    for split in (False, 16):
        out, lse, _ = dec.run(*args, split=split, **kw) if where != "cpu" else dec.run(*args, **kw)
        ref = naive_decode(*ref_args, softcap=30.0, **kw)
        compare(out, lse, *ref, spec.dtype, what=f"{kf}/{vf} split={split}: ")


@pytest.mark.parametrize("where", ["pocl", "intel"])
@pytest.mark.parametrize("vf", ["q8_0", "q4_0"])
def test_quantized_values_in_passes_that_do_not_divide_a_block(where, vf):
    """Group 4, head_dim 96 at 8 floats per vector: the rows kernel adds 3 head_dim chunks
    of V per pass (16 vector registers), and a quantized block holds 4 of them: each
    block's pass count must still fit its codes."""
    spec = clattn.AttentionSpec(16, 4, 96, page_size=16, dtype="float16", k_format="q8_0",
                                v_format=vf)
    args, kw, ref_args = _quant_case(spec, [70, 33], seed=5, rope=False)
    prof = clattn.Profile(name="rows-vec8", strategy="rows", vec=8, tile_rows=16)
    dec = clattn.BatchDecode(spec, where, profile=prof)
    assert dec.geometry.v_chunks == 3
    out, lse, _ = dec.run(*args, **kw)
    compare(out, lse, *naive_decode(*ref_args, **kw), spec.dtype, what=f"{vf}: ")


@pytest.mark.parametrize("where,prof", WHERE[1:3])
def test_quantized_llama_shape_group_8_f32(where, prof):
    spec = clattn.AttentionSpec(32, 4, 128, page_size=16, dtype="float32", k_format="q4_0",
                                v_format="q8_0")
    args, kw, ref_args = _quant_case(spec, [300, 17], seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dec = clattn.BatchDecode(spec, where, profile=prof)
    out, lse, _ = dec.run(*args, **kw)
    compare(out, lse, *naive_decode(*ref_args, **kw), spec.dtype)


@pytest.mark.oclgrind
@pytest.mark.parametrize("strategy,kf,vf", [("rows", "q8_0", "q4_0"), ("rows", "q4_0", "float16"),
                                            ("tiled", "q4_0", "q8_0"),
                                            ("tiled", "q8_0", "float16")])
def test_quantized_decode_clean_under_oclgrind(strategy, kf, vf):
    import subprocess
    import sys
    from pathlib import Path

    from test_oclgrind import _env, filtered
    script = Path(__file__).resolve().parent / "oclgrind_quant.py"
    proc = subprocess.run([sys.executable, str(script), strategy, kf, vf], env=_env(False),
                          capture_output=True, text=True, timeout=300)
    err, found = filtered(proc)
    assert not found, f"Oclgrind reported {found}:\n{err[-3000:]}"
    assert proc.returncode == 0, proc.stdout[-1500:] + err[-3000:]
    assert f"CLATTN-OCLGRIND-OK quant {strategy} {kf} {vf}" in proc.stdout
