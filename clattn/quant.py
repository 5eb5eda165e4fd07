"""Storage formats of the KV pages: f16/f32, and 8-bit or 4-bit blocks of 32 with an f16 scale.

Quantized formats (docs/contract.md, "Quantized pages"), per block of 32 values of one
row along head_dim, computed as ggml's reference quantizer (llama.cpp's
``quantize_row_q8_0_ref``/``quantize_row_q4_0_ref``) computes them, every step an f32
operation rounded to nearest even:

* ``q8_0``: ``d = amax / 127`` (``amax`` the largest magnitude), ``id = 1 / d``, code
  ``q = round_half_away(x * id)`` as int8 (in [-127, 127]); the stored scale is
  ``f16(d)`` and the value ``q * f16(d)``. 1.0625 bytes per value.
* ``q4_0``: ``m`` is the first value of largest magnitude (its sign kept; ``+0`` when
  every value is zero), ``d = m / -8``, ``id = 1 / d``, code
  ``q = min(15, trunc(x * id + 8.5))`` (in [0, 15]); byte ``j`` of a block holds values
  ``j`` (low nibble) and ``j + 16`` (high nibble), as llama.cpp's q4_0, so a load of up
  to 16 bytes and one shift give consecutive values; the stored scale is ``f16(d)`` and
  the value ``(q - 8) * f16(d)``. 0.5625 bytes per value.

A block whose f32 scale ``d`` is below :data:`TINY_SCALE` in magnitude (zero blocks
included) takes ``id = 0``: every code is the zero code (0, or 8 for q4_0). Such a block
decodes to zeros whatever its codes, since its f16 scale is 0; ggml computes its codes
from the tiny ``d`` itself, so this is where clattn's codes may differ from ggml's (the
largest magnitude below 2.98e-36 for q8_0, 1.88e-37 for q4_0: never for f16 inputs).
A block with inf or NaN, or whose f16 scale overflows (``|d| >= 65520``), cannot be
quantized (ValueError, nothing written). Dequantized values are exact products in f32,
so every backend reads the same numbers. :func:`to_ggml_blocks` and
:func:`from_ggml_blocks` convert to and from ggml's interleaved blocks.

Pool layout when K or V is quantized, or when keys and values differ in width (``head_dim``
for K, ``head_dim_v`` for V): ``uint8 [P, page_bytes]``; a page holds the keys of KV
heads 0..H_kv-1, then their values (none when the values are in the key rows:
``PageLayout.value_in_key``); the region of one (kind, head) is the ``page_size``
data rows of its kind's width (``row_bytes`` each), then, for quantized kinds, their
``page_size x width / 32`` f16 scales, the region padded to a multiple of 16 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # values per quantized block
#: storage formats of the K and V pages
KV_FORMATS = ("float16", "float32", "q8_0", "q4_0")
QUANTIZED = ("q8_0", "q4_0")
_FLOAT_BYTES = {"float16": 2, "float32": 4}
#: code roundings :func:`quantize` offers (the cache stores ``"ggml"``)
ROUNDINGS = ("ggml", "nearest")
#: a block whose f32 scale is below this in magnitude gets the zero codes
TINY_SCALE = 2.0 ** -125
#: the f32 scales from this magnitude on round to inf in f16 (65504 + half its unit)
SCALE_LIMIT = 65520.0
#: the largest magnitude a block may hold: the largest f32 ``a`` with
#: ``f32(a / 127) < 65520`` (q8_0: ``a / 127`` below 65520 - 2**-9, the midpoint that
#: rounds to 65520, so ``a < 8321039.75``; f32's unit there is 0.5) and with
#: ``a / 8 < 65520`` (q4_0: 65520 * 8 less one f32 unit there, 2**-5)
LARGEST = {"q8_0": 8321039.5, "q4_0": 524159.96875}


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
    """Byte layout of one page of a byte pool (K or V quantized, or of unequal widths).

    ``head_dim`` is the width of a key row, ``head_dim_v`` of a value row (None: the same).
    ``value_in_key``: a value row is the first ``head_dim_v`` values of its key row (the
    page holds key regions only; a V address is its K address, K's row stride and scale
    layout).
    """

    k_format: str
    v_format: str
    num_kv_heads: int
    page_size: int
    head_dim: int
    head_dim_v: int | None = None
    value_in_key: bool = False

    @property
    def kinds(self) -> tuple[int, ...]:
        """The kinds a page stores: (0, 1), or (0,) when the values are in the key rows."""
        return (0,) if self.value_in_key else (0, 1)

    def width(self, kind: int) -> int:
        """Values per row of kind 0 (K) or 1 (V)."""
        return self.head_dim if kind == 0 or self.head_dim_v is None else self.head_dim_v

    def format(self, kind: int) -> str:
        """Storage format of kind 0 (K) or 1 (V)."""
        return self.k_format if kind == 0 else self.v_format

    def blocks(self, kind: int) -> int:
        """Blocks of up to 32 values a row of kind 0 (K) or 1 (V) is written in (the
        append's work items; a float row's last block may be shorter; no V blocks when the
        values are in the key rows)."""
        if kind not in self.kinds:
            return 0
        return -(-self.width(kind) // BLOCK)

    @property
    def row_blocks(self) -> int:
        """Blocks of a token's K and V rows of one head: :meth:`blocks` of both kinds."""
        return self.blocks(0) + self.blocks(1)

    def region_bytes(self, fmt: str, width: int | None = None) -> int:
        """Bytes of one region of ``fmt`` rows ``width`` values wide (default ``head_dim``):
        data rows, then scales (16-byte aligned)."""
        width = self.head_dim if width is None else width
        data = self.page_size * row_bytes(fmt, width)
        scales = self.page_size * (width // BLOCK) * 2 if fmt in QUANTIZED else 0
        return -(-(data + scales) // 16) * 16

    @property
    def k_region(self) -> int:
        return self.region_bytes(self.k_format, self.width(0))

    @property
    def v_region(self) -> int:
        return self.region_bytes(self.v_format, self.width(1)) if 1 in self.kinds else 0

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * (self.k_region + self.v_region)

    def region_offset(self, kind: int, head: int) -> int:
        """Byte offset of a (kind 0 = K / 1 = V, head) region inside its page (V: K's when
        the values are in the key rows)."""
        if kind not in self.kinds:
            kind = 0
        return kind * self.num_kv_heads * self.k_region + head * \
            (self.k_region if kind == 0 else self.v_region)


def _check_finite(x: np.ndarray, what: str) -> None:
    if not np.isfinite(x).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
        raise ValueError(f"{what}: value {x[idx]!r} at index {idx} is not finite; quantized "
                         f"pages hold finite values only (nothing was written)")


def _scales(x: np.ndarray, fmt: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(blocks [..., D/32, 32] f32, d [..., D/32] f32)`` of finite rows ``x``: the
    blocks' f32 scales before their f16 rounding; ValueError naming ``what`` for inf/NaN
    or a scale beyond f16."""
    _check_finite(x, what)
    D = x.shape[-1]
    blocks = x.reshape(x.shape[:-1] + (D // BLOCK, BLOCK))
    amax_i = np.argmax(np.abs(blocks), axis=-1)
    m = np.take_along_axis(blocks, amax_i[..., None], axis=-1)[..., 0]
    if fmt == "q8_0":
        d = np.abs(m) / np.float32(127)
    else:
        # the first value of largest magnitude, +0 when all are zero (so d = -0)
        d = np.where(m == 0, np.float32(0), m) / np.float32(-8)
    d = d.astype(np.float32)
    if (np.abs(d) >= SCALE_LIMIT).any():
        raise ValueError(f"{what}: a block's scale overflows float16 (|value| up to "
                         f"{float(np.abs(m).max())!r}); {fmt} holds |x| <= "
                         f"{LARGEST[fmt]!r} (nothing was written)")
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


def quantize(x: np.ndarray, fmt: str, what: str = "values", *,
             rounding: str = "ggml") -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows of 32-value blocks.

    Parameters
    ----------
    x : array_like [..., D]
        Rows to quantize (converted to float32); ``D`` a multiple of 32.
    fmt : {"q8_0", "q4_0"}
        The format.
    what : str
        The name error messages give ``x``.
    rounding : {"ggml", "nearest"}
        ``"ggml"`` (default; what the cache stores): ggml's reference quantizer, bit for
        bit (module docstring). ``"nearest"``: each code the one nearest to ``x / f16(d)``
        on the stored scale (half to even on the exact quotient, clamped to the code
        range); the same scales, codes that are never farther from ``x``. numpy only:
        no cache stores it.

    Returns
    -------
    data : ndarray uint8 [..., row_bytes]
        The codes (q8_0: int8 bytes; q4_0: byte ``j`` of a block holds values ``j`` and
        ``j + 16`` in its low and high nibble).
    scales : ndarray float16 [..., D / 32]
        The blocks' f16 scales.

    Raises
    ------
    ValueError
        ``fmt`` or ``rounding`` unknown; a value inf or NaN, or a block whose f16 scale
        overflows (the message names ``what``).
    """
    if fmt not in QUANTIZED:
        raise ValueError(f"format {fmt!r}: quantize takes {QUANTIZED}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: quantize takes {ROUNDINGS}")
    x = np.asarray(x, dtype=np.float32)
    blocks, d32 = _scales(x, fmt, what)
    d = d32.astype(np.float16)
    if rounding == "ggml":
        live = np.abs(d32) >= np.float32(TINY_SCALE)
        inv = np.where(live, np.float32(1) / np.where(live, d32, 1), 0).astype(np.float32)
        p = blocks * inv[..., None]                      # f32, rounded once
        if fmt == "q8_0":   # half away from zero (C's roundf), exact in f64
            q = np.copysign(np.floor(np.abs(p.astype(np.float64)) + 0.5), p)
        else:               # f32 sum, then truncation: codes 0..16, 16 clamped
            q = np.minimum(np.trunc(p + np.float32(8.5)), 15) - 8
    else:
        d64 = d.astype(np.float64)[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(d64 != 0,
                         np.rint(blocks.astype(np.float64) / np.where(d64 != 0, d64, 1)), 0)
        q = np.clip(q, -127, 127) if fmt == "q8_0" else np.clip(q, -8, 7)
    if fmt == "q8_0":
        data = q.astype(np.int8).view(np.uint8)
    else:
        u = (q + 8).astype(np.uint8)
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


def _block_codes(fmt: str) -> int:
    """Code bytes of one block of ``fmt`` (ValueError for a format without blocks)."""
    if fmt not in QUANTIZED:
        raise ValueError(f"fmt={fmt!r}: ggml blocks exist for {QUANTIZED}")
    return row_bytes(fmt, BLOCK)


def to_ggml_blocks(data: np.ndarray, scales: np.ndarray, fmt: str) -> np.ndarray:
    """Interleave clattn's codes and scales into ggml's block layout.

    ggml stores each block as its f16 scale (2 bytes, little-endian) followed by its
    codes (32 bytes for q8_0, 16 for q4_0; the codes themselves are the same bytes in
    both layouts), the blocks of a row one after another: ``block_q8_0`` and
    ``block_q4_0``, 34 and 18 bytes.

    Parameters
    ----------
    data : ndarray uint8 [..., row_bytes]
        Codes as :func:`quantize` or :func:`region_views` give them.
    scales : ndarray float16 [..., D / 32]
        The rows' block scales.
    fmt : {"q8_0", "q4_0"}
        The format.

    Returns
    -------
    ndarray uint8 [..., D / 32 * (2 + code bytes)]
        The rows as ggml stores them (what ``gguf.quants.quantize`` returns).

    Raises
    ------
    ValueError
        ``fmt`` is not quantized, or the shapes of ``data`` and ``scales`` disagree.
    """
    cb = _block_codes(fmt)
    data, scales = np.asarray(data), np.asarray(scales)
    if data.dtype != np.uint8 or scales.dtype != np.float16:
        raise ValueError(f"data ({data.dtype}) and scales ({scales.dtype}): uint8 codes "
                         f"and float16 scales expected")
    nb = scales.shape[-1] if scales.ndim else 0
    if data.shape[:-1] != scales.shape[:-1] or data.shape[-1] != nb * cb:
        raise ValueError(f"data {data.shape} and scales {scales.shape}: {fmt} rows of "
                         f"{nb} blocks hold {nb * cb} code bytes")
    out = np.empty(scales.shape + (2 + cb,), np.uint8)
    out[..., :2] = scales.astype("<f2").view(np.uint8).reshape(scales.shape + (2,))
    out[..., 2:] = data.reshape(scales.shape + (cb,))
    return out.reshape(scales.shape[:-1] + (nb * (2 + cb),))


def from_ggml_blocks(blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`to_ggml_blocks`.

    Parameters
    ----------
    blocks : ndarray uint8 [..., n * (2 + code bytes)]
        Rows of ggml ``block_q8_0`` (34 bytes) or ``block_q4_0`` (18 bytes) blocks.
    fmt : {"q8_0", "q4_0"}
        The format.

    Returns
    -------
    data : ndarray uint8 [..., n * code bytes]
    scales : ndarray float16 [..., n]

    Raises
    ------
    ValueError
        ``fmt`` is not quantized, or a row is not a whole number of blocks.
    """
    cb = _block_codes(fmt)
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim == 0 or blocks.shape[-1] % (2 + cb):
        raise ValueError(f"blocks {blocks.dtype} {blocks.shape}: uint8 rows of whole "
                         f"{2 + cb}-byte {fmt} blocks expected")
    nb = blocks.shape[-1] // (2 + cb)
    b = blocks.reshape(blocks.shape[:-1] + (nb, 2 + cb))
    scales = np.ascontiguousarray(b[..., :2]).view("<f2")[..., 0].astype(np.float16)
    data = np.ascontiguousarray(b[..., 2:]).reshape(blocks.shape[:-1] + (nb * cb,))
    return data, scales


def region_views(pool: np.ndarray, layout: PageLayout,
                 kind: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Views ``(data uint8 [P, H_kv, page_size, row_bytes], scales f16 [P, H_kv,
    page_size, D/32] or None)`` of the K (``kind`` 0) or V (1) regions of a byte pool
    (``D`` the kind's width; V of a layout whose values are in the key rows: the leading
    ``D_v`` values of the K rows, whose blocks are whole)."""
    if kind not in layout.kinds:
        data, sc = region_views(pool, layout, 0)
        fmt, Dv = layout.format(1), layout.width(1)
        return data[..., :row_bytes(fmt, Dv)], None if sc is None else sc[..., :Dv // BLOCK]
    fmt = layout.format(kind)
    P = pool.shape[0]
    H, ps, D = layout.num_kv_heads, layout.page_size, layout.width(kind)
    reg = layout.region_bytes(fmt, D)
    start = layout.region_offset(kind, 0)
    regions = pool[:, start:start + H * reg].reshape(P, H, reg)
    rb = row_bytes(fmt, D)
    data = regions[:, :, :ps * rb].reshape(P, H, ps, rb)
    if fmt not in QUANTIZED:
        return data, None
    sc = regions[:, :, ps * rb:ps * rb + ps * (D // BLOCK) * 2]
    return data, sc.reshape(P, H, ps * (D // BLOCK) * 2).view(np.float16).reshape(
        P, H, ps, D // BLOCK)


def pack_pool(k: np.ndarray, v: np.ndarray | None, layout: PageLayout) -> np.ndarray:
    """A byte pool from float keys ``[P, H_kv, page_size, D]`` and values ``[P, H_kv,
    page_size, D_v]`` (``D``, ``D_v``: the layout's widths; ``v`` None, and not read,
    when the layout's values are in the key rows)."""
    P = k.shape[0]
    pool = np.zeros((P, layout.page_bytes), np.uint8)
    for kind, x in ((0, k), (1, v))[:len(layout.kinds)]:
        fmt = layout.format(kind)
        data, sc = region_views(pool, layout, kind)
        if fmt in QUANTIZED:
            qd, qs = quantize(x, fmt, "keys" if kind == 0 else "values")
            data[...], sc[...] = qd, qs
        else:
            data[...] = np.ascontiguousarray(x.astype(fmt)).view(np.uint8).reshape(data.shape)
    return pool


def unpack_pool(pool: np.ndarray, layout: PageLayout,
                pages: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Float32 ``k [n, H_kv, page_size, D]`` and ``v [n, H_kv, page_size, D_v]`` of the
    given pages (default: all; ``v`` a view of ``k``'s leading ``D_v`` values when the
    layout's values are in the key rows)."""
    sel = pool if pages is None else pool[np.asarray(pages)]
    out = []
    for kind in (0, 1):
        if kind not in layout.kinds:
            out.append(out[0][..., :layout.width(1)])
            continue
        fmt = layout.format(kind)
        data, sc = region_views(np.ascontiguousarray(sel), layout, kind)
        if fmt in QUANTIZED:
            out.append(dequantize(data, sc, fmt))
        else:
            out.append(np.ascontiguousarray(data).view(np.dtype(fmt)).astype(np.float32))
    return out[0], out[1]
