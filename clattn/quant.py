"""Storage formats of the KV pages: f16/f32, and 8-bit or 4-bit blocks of 32 with an f16 scale.

Quantized formats (docs/contract.md, "Quantized pages"), per block of 32 values of one
row along head_dim:

* ``q8_0``: ``d = f16(amax / 127)``, ``q = clamp(rint(x / d), -127, 127)`` as int8;
  the value is ``q * d``. 1.0625 bytes per value.
* ``q4_0``: ``m`` is the value of largest magnitude (its sign kept), ``d = f16(m / -8)``,
  ``q = clamp(rint(x / d) + 8, 0, 15)``; byte ``j`` of a block holds values ``j`` (low
  nibble) and ``j + 16`` (high nibble), as llama.cpp's q4_0, so a load of up to 16 bytes
  and one shift give consecutive values; the value is ``(q - 8) * d``. 0.5625 bytes per
  value.

``rint`` rounds half to even on the exact quotient; an all-zero block has ``d = 0`` and
decodes to zeros; a block with inf or NaN cannot be quantized (ValueError, nothing written).
Dequantized values are exact products in f32, so every backend reads the same numbers.

Pool layout when K or V is quantized: ``uint8 [P, page_bytes]``; a page holds the keys
of KV heads 0..H_kv-1, then their values; the region of one (kind, head) is the
``page_size`` data rows (``row_bytes`` each, 16-byte aligned), then, for quantized
kinds, their ``page_size x head_dim / 32`` f16 scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # values per quantized block
#: storage formats of the K and V pages
KV_FORMATS = ("float16", "float32", "q8_0", "q4_0")
QUANTIZED = ("q8_0", "q4_0")
_FLOAT_BYTES = {"float16": 2, "float32": 4}


def row_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one row's data (scales apart)."""
    if fmt in _FLOAT_BYTES:
        return head_dim * _FLOAT_BYTES[fmt]
    return head_dim if fmt == "q8_0" else head_dim // 2


def bytes_per_value(fmt: str) -> float:
    """Storage per value, scales included (2, 4, 1.0625 or 0.5625)."""
    if fmt in _FLOAT_BYTES:
        return float(_FLOAT_BYTES[fmt])
    return row_bytes(fmt, BLOCK) / BLOCK + 2 / BLOCK


@dataclass(frozen=True)
class PageLayout:
    """Byte layout of one page of a pool whose K or V pages are quantized."""

    k_format: str
    v_format: str
    num_kv_heads: int
    page_size: int
    head_dim: int

    def region_bytes(self, fmt: str) -> int:
        """Bytes of one (kind, head) region: data rows, then scales (16-byte aligned)."""
        data = self.page_size * row_bytes(fmt, self.head_dim)
        scales = self.page_size * (self.head_dim // BLOCK) * 2 if fmt in QUANTIZED else 0
        return -(-(data + scales) // 16) * 16

    @property
    def k_region(self) -> int:
        return self.region_bytes(self.k_format)

    @property
    def v_region(self) -> int:
        return self.region_bytes(self.v_format)

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * (self.k_region + self.v_region)

    def region_offset(self, kind: int, head: int) -> int:
        """Byte offset of a (kind 0 = K / 1 = V, head) region inside its page."""
        return kind * self.num_kv_heads * self.k_region + head * \
            (self.k_region if kind == 0 else self.v_region)


def _check_finite(x: np.ndarray, what: str) -> None:
    if not np.isfinite(x).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
        raise ValueError(f"{what}: value {x[idx]!r} at index {idx} is not finite; quantized "
                         f"pages hold finite values only (nothing was written)")


def _scales(x: np.ndarray, fmt: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(blocks [..., D/32, 32] f32, scales f16 [..., D/32])`` of finite rows ``x``;
    ValueError naming ``what`` for inf/NaN or a scale beyond f16."""
    _check_finite(x, what)
    D = x.shape[-1]
    blocks = x.reshape(x.shape[:-1] + (D // BLOCK, BLOCK))
    amax_i = np.argmax(np.abs(blocks), axis=-1)
    m = np.take_along_axis(blocks, amax_i[..., None], axis=-1)[..., 0]
    with np.errstate(over="ignore"):
        if fmt == "q8_0":
            d = (np.abs(m) / np.float32(127)).astype(np.float32).astype(np.float16)
        else:
            d = (m / np.float32(-8)).astype(np.float32).astype(np.float16)
    if not np.isfinite(d).all():
        # f16 rounds 65520 and above to inf: the limit is 65520 x 127 (an f32 integer; the
        # f32 below it divides to less than 65520) or 65520 x 8 (an exact division)
        div = 127 if fmt == "q8_0" else 8
        raise ValueError(f"{what}: a block's scale overflows float16 (|value| up to "
                         f"{float(np.abs(m).max()):.9g}); {fmt} holds |x| < {65520 * div} "
                         f"(65520 x {div}) (nothing was written)")
    return blocks, d


def check_quantizable(x: np.ndarray, fmt: str, what: str = "values", *,
                      scale: bool = True) -> None:
    """Raise ValueError (naming ``what``) when rows ``x [..., D]`` cannot be stored as
    ``fmt``: a value inf or NaN, or (``scale``) a block whose scale overflows f16. Float
    formats hold anything. ``scale=False`` checks only what a rotation keeps: values
    rotated before they are stored stay non-finite if they were, but their blocks'
    magnitudes change."""
    if fmt in QUANTIZED:
        x = np.asarray(x, dtype=np.float32)
        if scale:
            _scales(x, fmt, what)
        else:
            _check_finite(x, what)


def quantize(x: np.ndarray, fmt: str, what: str = "values") -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows ``x [..., D]`` (D a multiple of 32) to ``(data uint8 [..., row_bytes],
    scales float16 [..., D / 32])``."""
    if fmt not in QUANTIZED:
        raise ValueError(f"format {fmt!r}: quantize takes {QUANTIZED}")
    x = np.asarray(x, dtype=np.float32)
    blocks, d = _scales(x, fmt, what)
    d32 = d.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d32 != 0, np.rint(blocks.astype(np.float64) / np.where(d32 != 0, d32, 1)), 0)
    if fmt == "q8_0":
        data = np.clip(q, -127, 127).astype(np.int8).view(np.uint8)
    else:
        u = np.clip(q + 8, 0, 15).astype(np.uint8)
        data = (u[..., :BLOCK // 2] | (u[..., BLOCK // 2:] << 4)).astype(np.uint8)
    return data.reshape(x.shape[:-1] + (-1,)), d


def dequantize(data: np.ndarray, scales: np.ndarray, fmt: str) -> np.ndarray:
    """Inverse of :func:`quantize`: float32 ``[..., D]``."""
    nb = scales.shape[-1]
    if fmt == "q8_0":
        q = data.view(np.int8).astype(np.float32).reshape(data.shape[:-1] + (nb, BLOCK))
    else:
        b = data.reshape(data.shape[:-1] + (nb, BLOCK // 2))
        q = np.empty(b.shape[:-1] + (BLOCK,), np.float32)
        q[..., :BLOCK // 2] = (b & 15).astype(np.float32) - 8
        q[..., BLOCK // 2:] = (b >> 4).astype(np.float32) - 8
    out = q * scales.astype(np.float32)[..., None]
    return out.reshape(out.shape[:-2] + (nb * BLOCK,))


def region_views(pool: np.ndarray, layout: PageLayout, kind: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Views ``(data uint8 [P, H_kv, page_size, row_bytes], scales f16 [P, H_kv,
    page_size, D/32] or None)`` of the K (``kind`` 0) or V (1) regions of a byte pool."""
    fmt = layout.k_format if kind == 0 else layout.v_format
    P = pool.shape[0]
    H, ps, D = layout.num_kv_heads, layout.page_size, layout.head_dim
    reg = layout.region_bytes(fmt)
    start = layout.region_offset(kind, 0)
    regions = pool[:, start:start + H * reg].reshape(P, H, reg)
    rb = row_bytes(fmt, D)
    data = regions[:, :, :ps * rb].reshape(P, H, ps, rb)
    if fmt not in QUANTIZED:
        return data, None
    sc = regions[:, :, ps * rb:ps * rb + ps * (D // BLOCK) * 2]
    return data, sc.reshape(P, H, ps * (D // BLOCK) * 2).view(np.float16).reshape(
        P, H, ps, D // BLOCK)


def pack_pool(k: np.ndarray, v: np.ndarray, layout: PageLayout) -> np.ndarray:
    """A byte pool from float keys and values ``[P, H_kv, page_size, D]``."""
    P = k.shape[0]
    pool = np.zeros((P, layout.page_bytes), np.uint8)
    for kind, x in ((0, k), (1, v)):
        fmt = layout.k_format if kind == 0 else layout.v_format
        data, sc = region_views(pool, layout, kind)
        if fmt in QUANTIZED:
            qd, qs = quantize(x, fmt, "keys" if kind == 0 else "values")
            data[...], sc[...] = qd, qs
        else:
            data[...] = np.ascontiguousarray(x.astype(fmt)).view(np.uint8).reshape(data.shape)
    return pool


def unpack_pool(pool: np.ndarray, layout: PageLayout,
                pages: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Float32 ``(k, v) [n, H_kv, page_size, D]`` of the given pages (default: all)."""
    sel = pool if pages is None else pool[np.asarray(pages)]
    out = []
    for kind in (0, 1):
        fmt = layout.k_format if kind == 0 else layout.v_format
        data, sc = region_views(np.ascontiguousarray(sel), layout, kind)
        if fmt in QUANTIZED:
            out.append(dequantize(data, sc, fmt))
        else:
            out.append(np.ascontiguousarray(data).view(np.dtype(fmt)).astype(np.float32))
    return out[0], out[1]
