"""clattn's q8_0/q4_0 blocks against llama.cpp's, as the gguf package's quantizer (its
numpy port of ggml's reference ``quantize_row_q8_0_ref``/``quantize_row_q4_0_ref``) writes
them: the same codes and scales bit for bit once clattn's separate code and scale regions
are interleaved into ggml's blocks (clattn.quant.to_ggml_blocks), on Gaussian blocks and
on the adversarial blocks of tests/test_cache_quant.py (exact ties, the largest values,
zero and tiny blocks). Two documented differences are checked as such: blocks whose f32
scale is below clattn.quant.TINY_SCALE (clattn stores zero codes; both decode to zeros),
and q4_0 zero blocks led by -0 (the gguf port takes the scale's sign from the first value,
ggml's C from +0, as clattn does).
"""
from __future__ import annotations

import numpy as np
import pytest
from test_cache_quant import adversarial_blocks

from clattn import quant

gguf = pytest.importorskip("gguf", reason="the gguf package (the test extra) is the reference")
from gguf import GGMLQuantizationType, quants  # noqa: E402

QTYPE = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
FORMATS = list(QTYPE)


def _blocks(fmt: str) -> np.ndarray:
    rng = np.random.default_rng(11)
    gauss = rng.standard_normal((20000, 32)).astype(np.float32)
    return np.concatenate([gauss, adversarial_blocks(fmt, 5), adversarial_blocks(fmt, 6)])


def _tiny(x: np.ndarray, fmt: str) -> np.ndarray:
    """Blocks whose f32 scale ``f32(amax / 127)`` or ``amax / 8`` is non-zero but below
    TINY_SCALE."""
    amax = np.abs(x).max(-1)
    d = amax / np.float32(127 if fmt == "q8_0" else 8)
    return (d > 0) & (d < np.float32(quant.TINY_SCALE))


@pytest.mark.parametrize("fmt", FORMATS)
def test_codes_and_scales_equal_gguf_bit_for_bit(fmt):
    x = _blocks(fmt)
    with np.errstate(all="ignore"):   # gguf's reciprocal of the tiny scales overflows
        want = quants.quantize(x, QTYPE[fmt])
    data, scales = quant.quantize(x, fmt)
    got = quant.to_ggml_blocks(data, scales, fmt)
    assert got.shape == want.shape == (len(x), 34 if fmt == "q8_0" else 18)
    tiny = _tiny(x, fmt)
    neg_zero = (x == 0).all(-1) & np.signbit(x[:, 0]) if fmt == "q4_0" else np.zeros(len(x), bool)
    assert tiny.sum() >= 4 and (fmt == "q8_0" or neg_zero.sum() >= 4)
    same = ~tiny & ~neg_zero
    bad = np.flatnonzero((got != want).any(-1) & same)
    assert not len(bad), (f"{fmt}: {len(bad)} of {same.sum()} blocks differ from gguf's, "
                          f"first {bad[0]}: {got[bad[0]]} vs {want[bad[0]]}")
    # the Gaussian blocks alone: 20000 compared, ties of the code grid among them
    assert same[:20000].all()
    # tiny scales: the same f16 scale in both, a zero of the sign of d; clattn's codes
    # the zero code
    assert (got[tiny, :2] == want[tiny, :2]).all() and not (got[tiny, :2] & [255, 127]).any()
    assert (got[tiny, 2:] == (0 if fmt == "q8_0" else 0x88)).all()
    # q4_0 zero blocks led by -0: ggml's scale -0 (0x8000) against the port's +0
    assert (got[neg_zero, :2] == [0, 0x80]).all() and (want[neg_zero, :2] == 0).all()
    assert (got[neg_zero, 2:] == want[neg_zero, 2:]).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_equal_gguf_dequantized(fmt):
    x = _blocks(fmt)
    with np.errstate(all="ignore"):
        want = quants.dequantize(quants.quantize(x, QTYPE[fmt]), QTYPE[fmt])
    got = quant.dequantize(*quant.quantize(x, fmt), fmt)
    # every block's values, tiny ones included (zeros); the sign of a zero aside
    assert np.array_equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_beyond_the_largest_gguf_stores_an_infinite_scale_clattn_refuses(fmt):
    x = np.zeros((1, 32), np.float32)
    x[0, 4] = np.float32(quant.LARGEST[fmt])
    assert np.isfinite(quants.dequantize(quants.quantize(x, QTYPE[fmt]), QTYPE[fmt])).all()
    x[0, 4] = np.nextafter(x[0, 4], np.float32(np.inf))
    with np.errstate(all="ignore"):
        want = quants.quantize(x, QTYPE[fmt])
    assert np.isinf(want[0, :2].view(np.float16)[0])
    with pytest.raises(ValueError, match="overflows float16"):
        quant.quantize(x, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ggml_block_layout_round_trip(fmt):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5, 96)).astype(np.float32)
    data, scales = quant.quantize(x, fmt)
    blocks = quant.to_ggml_blocks(data, scales, fmt)
    cb = 32 if fmt == "q8_0" else 16
    assert blocks.shape == (3, 5, 3 * (2 + cb)) and blocks.dtype == np.uint8
    # block b of a row: its f16 scale little-endian, then its code bytes unchanged
    b = blocks.reshape(3, 5, 3, 2 + cb)
    assert np.array_equal(b[..., 0].astype(np.uint16) | (b[..., 1].astype(np.uint16) << 8),
                          scales.view(np.uint16))
    assert np.array_equal(b[..., 2:].reshape(data.shape), data)
    d2, s2 = quant.from_ggml_blocks(blocks, fmt)
    assert np.array_equal(d2, data) and np.array_equal(s2.view(np.uint16), scales.view(np.uint16))
    assert s2.dtype == np.float16 and d2.dtype == np.uint8


def test_ggml_block_helpers_refuse_bad_input():
    data, scales = quant.quantize(np.ones((2, 64), np.float32), "q8_0")
    with pytest.raises(ValueError, match="fmt='float16'"):
        quant.to_ggml_blocks(data, scales, "float16")
    with pytest.raises(ValueError, match=r"data \(2, 64\) and scales \(2, 1\)"):
        quant.to_ggml_blocks(data, scales[:, :1], "q8_0")
    with pytest.raises(ValueError, match="uint8 codes and float16 scales"):
        quant.to_ggml_blocks(data, scales.astype(np.float32), "q8_0")
    with pytest.raises(ValueError, match="whole 18-byte q4_0 blocks"):
        quant.from_ggml_blocks(np.zeros((2, 20), np.uint8), "q4_0")
    with pytest.raises(ValueError, match="fmt='q5_0'"):
        quant.from_ggml_blocks(np.zeros((2, 22), np.uint8), "q5_0")
