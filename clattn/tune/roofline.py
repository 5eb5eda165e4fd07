"""The roofline bound of a decode call: the least time its bytes and its multiply-adds
allow on a device with measured ceilings.

A decode call reads every KV row of its chunks once (K and V of every KV head: the pool's
bytes per token, block scales included) plus q, and writes out and lse; for every row and
query head it does ``head_dim + head_dim_v`` multiply-adds (the score, then the weighted
value; ``2 x head_dim`` where values are as wide as keys). Its
time can be no less than the larger of

* memory: bytes moved / the streaming read bandwidth;
* compute: multiply-adds / the f32 multiply-add peak (one multiply-add = 2 FLOPs).

The achieved fraction is that bound over the measured time.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Roofline:
    """The bound of one decode call (``bytes_moved`` bytes, ``fmas`` multiply-adds) on
    ceilings ``read_gbps`` (GB/s) and ``fma_gflops`` (GFLOP/s, None when not measured)."""

    bytes_moved: int
    fmas: int
    read_gbps: float
    fma_gflops: float | None

    @property
    def memory_s(self) -> float:
        """Seconds the bytes take at the read bandwidth."""
        return self.bytes_moved / (self.read_gbps * 1e9)

    @property
    def compute_s(self) -> float | None:
        """Seconds the multiply-adds take at the peak (None without one)."""
        return 2 * self.fmas / (self.fma_gflops * 1e9) if self.fma_gflops else None

    @property
    def bound_s(self) -> float:
        """The roofline time: the larger of the two."""
        return max(self.memory_s, self.compute_s or 0.0)

    @property
    def bound(self) -> str:
        """What bounds the call: ``"memory"`` or ``"compute"``."""
        return "compute" if (self.compute_s or 0.0) > self.memory_s else "memory"

    def fraction(self, seconds: float | None) -> float | None:
        """The bound over a measured time (1.0: at the roofline)."""
        return self.bound_s / seconds if seconds else None


def decode_fmas(batch: int, context: int, num_qo_heads: int, head_dim: int,
                head_dim_v: int | None = None) -> int:
    """Multiply-adds of a decode call over ``context`` rows per sequence (``head_dim_v``:
    the values' width, default ``head_dim``)."""
    return batch * context * num_qo_heads * (head_dim + (head_dim_v or head_dim))


def decode_roofline(*, batch: int, context: int, num_qo_heads: int, head_dim: int,
                    bytes_moved: int, read_gbps: float,
                    fma_gflops: float | None, head_dim_v: int | None = None) -> Roofline:
    """The :class:`Roofline` of a decode call of ``batch`` sequences of ``context`` rows
    that moves ``bytes_moved`` bytes.

    Parameters
    ----------
    batch, context, num_qo_heads, head_dim : int
        The call's shape.
    bytes_moved : int
        KV rows read (with block scales), q read, out and lse written.
    read_gbps : float
        Streaming read bandwidth, GB/s (:func:`clattn.tune.ceilings.read_bandwidth`).
    fma_gflops : float or None
        f32 multiply-add peak, GFLOP/s (:func:`clattn.tune.ceilings.fma_peak`).
    head_dim_v : int, optional
        The values' width (default ``head_dim``).
    """
    if not read_gbps or read_gbps <= 0:
        raise ValueError(f"read_gbps={read_gbps!r}: pass the measured read bandwidth (> 0)")
    fmas = decode_fmas(batch, context, num_qo_heads, head_dim, head_dim_v)
    return Roofline(int(bytes_moved), fmas, float(read_gbps),
                    float(fma_gflops) if fma_gflops else None)


__all__ = ["Roofline", "decode_fmas", "decode_roofline"]
