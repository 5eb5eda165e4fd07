"""Quantized KV pages (q8_0, q4_0): the formats bit for bit, and decode over them equal
to the float64 oracle run on the dequantized values, on every backend and feature."""
import warnings

import numpy as np
import pytest

import clattn
from clattn import quant
from cases import compare, decode_args, make_case
from naive import naive_decode


def test_q8_rounds_half_to_even_on_the_exact_quotient():
    # amax 127 -> d = 1 exactly: x = k + 0.5 must go to the even neighbour
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2], x[3], x[4] = 127, 2.5, 3.5, -2.5, 0.49999997
    data, d = quant.quantize(x, "q8_0")
    q = data.view(np.int8)
    assert d[0] == 1 and list(q[:5]) == [127, 2, 4, -2, 0]


def test_q4_layout_nibbles_and_sign_of_largest():
    x = np.arange(32, dtype=np.float32) - 16   # largest magnitude -16 -> d = f16(-16/-8) = 2
    data, d = quant.quantize(x, "q4_0")
    assert d[0] == 2
    u = np.empty(32, np.int64)
    u[:16], u[16:] = data & 15, data >> 4  # byte j: value j (low), value j + 16 (high)
    assert list(u[:4]) == [0, 0, 1, 2]  # -16/2 = -8 -> 0; -15/2 = -7.5 -> -8 (even) -> 0
    assert list(u[16:20]) == [8, 8, 9, 10]  # 0 -> 8; 1/2 -> 0 (even) -> 8; 2/2 = 1 -> 9
    back = quant.dequantize(data, d, "q4_0")
    assert np.array_equal(back, (np.clip(np.rint(x / 2) + 8, 0, 15) - 8) * 2)


def test_scale_is_f16_rounded_and_zero_blocks_decode_to_zero():
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.linspace(-1, 1, 32) * 0.3
    for fmt in ("q8_0", "q4_0"):
        data, d = quant.quantize(x, fmt)
        assert d.dtype == np.float16 and (d[1] == 0).all() and d[0, 1] == 0
        back = quant.dequantize(data, d, fmt)
        assert (back[1] == 0).all() and (back[0, 32:] == 0).all()
        err = np.abs(back[0, :32] - x[0, :32]).max()
        # half a step; q4's range [-8, 7] clips the opposite extreme by one step
        assert err <= float(abs(d[0, 0])) * (0.5 if fmt == "q8_0" else 1.0) * (1 + 1e-6)


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
    """Group 4, head_dim 96: the rows kernel adds 3 head_dim chunks of V per pass, and a
    quantized block holds 4 of them: each block's pass count must still fit its codes."""
    spec = clattn.AttentionSpec(16, 4, 96, page_size=16, dtype="float16", k_format="q8_0",
                                v_format=vf)
    args, kw, ref_args = _quant_case(spec, [70, 33], seed=5, rope=False)
    dec = clattn.BatchDecode(spec, where)
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
                                            ("tiled-global", "q8_0", "float16")])
def test_quantized_decode_clean_under_oclgrind(strategy, kf, vf):
    import subprocess
    import sys
    from pathlib import Path

    from test_oclgrind import BENIGN_API, REPORTS, _env
    script = Path(__file__).resolve().parent / "oclgrind_quant.py"
    proc = subprocess.run([sys.executable, str(script), strategy, kf, vf], env=_env(False),
                          capture_output=True, text=True, timeout=300)
    err = BENIGN_API.sub("", proc.stderr)
    found = sorted({r for r in REPORTS if r in err})
    assert not found, f"Oclgrind reported {found}:\n{err[-3000:]}"
    assert proc.returncode == 0, proc.stdout[-1500:] + err[-3000:]
    assert f"CLATTN-OCLGRIND-OK quant {strategy} {kf} {vf}" in proc.stdout
