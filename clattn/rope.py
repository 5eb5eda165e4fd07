"""RoPE scaling types -> inverse frequencies, shared by the fallback and the kernels.

``rope_scaling`` follows the keys of a Hugging Face ``config.json``. Everything is
computed in float64 on the host: the fallback rotates with these tables directly,
the kernels get them as (hi, lo) float pairs in *turns per position* so that they
can form the angle of position 100000 without losing precision in f32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from .numbers import is_int, is_positive_finite

#: rope types clattn implements (HF ``rope_type`` values plus GPT-J's pairing)
ROPE_TYPES = ("default", "linear", "llama3", "llama4", "longrope", "yarn", "gptj")
#: types that need the run-time sequence length and are refused
REFUSED_TYPES = {"dynamic": "it rescales with the run-time sequence length; precompute "
                            "positions or use 'linear'/'yarn' instead"}
NEVER = 2**31 - 1  # "long_from" value for types without a long table


@dataclass(frozen=True)
class RopeScaling:
    """A validated, hashable ``rope_scaling``."""

    rope_type: str
    params: tuple  # sorted (key, value) pairs of the original dict

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.params:
            if k == key:
                return v
        return default

    @property
    def interleaved(self) -> bool:
        """GPT-J pairs dims (2i, 2i+1); every other type pairs d with d + rotary_dim/2."""
        return self.rope_type == "gptj"


_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "llama4": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def parse_rope_scaling(scaling: Mapping[str, Any] | None,
                       max_position_embeddings: int | None = None) -> RopeScaling:
    """Validate an HF ``rope_scaling`` dict (None means plain RoPE)."""
    if not scaling:
        return RopeScaling("default", ())
    if not isinstance(scaling, Mapping):
        raise TypeError(f"rope_scaling={scaling!r}: must be a dict (HF config 'rope_scaling') "
                        "or None")
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype in REFUSED_TYPES:
        raise ValueError(f"rope_scaling rope_type={rtype!r} is not supported: "
                         f"{REFUSED_TYPES[rtype]}")
    if rtype not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type={rtype!r} is unknown; allowed: "
                         f"{', '.join(ROPE_TYPES)}")
    missing = [k for k in _REQUIRED.get(rtype, ()) if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {rtype!r} lacks {missing}")
    if rtype == "yarn" and not (scaling.get("original_max_position_embeddings")
                                or max_position_embeddings):
        raise ValueError("rope_scaling of type 'yarn' needs 'original_max_position_embeddings' "
                         "(or the spec's max_position_embeddings)")
    if rtype == "longrope" and not scaling.get("original_max_position_embeddings"):
        raise ValueError("rope_scaling of type 'longrope' needs 'original_max_position_embeddings' "
                         "(HF keeps it at the config's top level: AttentionSpec.from_hf_config "
                         "copies it)")
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        v = scaling.get(key)
        if key in _REQUIRED.get(rtype, ()) and not is_positive_finite(v):
            raise ValueError(f"rope_scaling {key}={v!r} (type {rtype!r}): must be a positive "
                             f"finite number")
    v = scaling.get("attention_factor")
    if v is not None and not is_positive_finite(v):
        raise ValueError(f"rope_scaling attention_factor={v!r} (type {rtype!r}): must be a "
                         f"positive finite number (or absent)")
    for key in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow"):  # 0: as absent (HF)
        v = scaling.get(key)
        if v is not None and v != 0 and not is_positive_finite(v):
            raise ValueError(f"rope_scaling {key}={v!r} (type {rtype!r}): must be a positive "
                             f"finite number (or 0 or absent: the default)")
    orig = scaling.get("original_max_position_embeddings")
    if orig is not None and not (is_int(orig) and orig >= 2):
        raise ValueError(f"rope_scaling original_max_position_embeddings={orig!r}: must be an "
                         f"integer >= 2")
    if rtype == "longrope":
        for key in ("short_factor", "long_factor"):
            v = scaling.get(key)
            if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or \
                    not all(is_positive_finite(x) for x in v):
                raise ValueError(f"rope_scaling {key}={v!r}: must be a list of positive "
                                 f"finite numbers")
    params = tuple(sorted((str(k), _hashable(v)) for k, v in scaling.items()))
    return RopeScaling(rtype, params)


def _llama3(inv: np.ndarray, rs: RopeScaling) -> np.ndarray:
    factor = float(rs.get("factor"))
    lo, hi = float(rs.get("low_freq_factor")), float(rs.get("high_freq_factor"))
    old = float(rs.get("original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / lo, inv / factor, inv)
    with np.errstate(divide="ignore", invalid="ignore"):  # lo == hi: no medium band
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(medium, smoothed, out)


def _yarn(base: float, dim: int, rs: RopeScaling, max_pos: int | None) -> tuple[np.ndarray, float]:
    factor = float(rs.get("factor"))
    orig = float(rs.get("original_max_position_embeddings") or max_pos)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rs.get("attention_factor")
    if att is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast = float(rs.get("beta_fast") or 32)
    beta_slow = float(rs.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extra = 1 - ramp
    inv = (1 / (factor * pos_freqs)) * (1 - extra) + (1 / pos_freqs) * extra
    return inv, float(att)


@lru_cache(maxsize=256)
def rope_tables(rotary_dim: int, rope_theta: float, scaling: RopeScaling,
                max_position_embeddings: int | None = None) -> tuple[np.ndarray, float, int]:
    """Inverse frequencies for one (rotary_dim, theta, scaling).

    Returns ``(inv_freq [2, rotary_dim // 2] float64, attention_factor, long_from)``:
    row 0 is used while ``q_pos + 1 <= long_from``, row 1 after (only longrope has
    two different rows: HF's short/long factor switch at
    ``original_max_position_embeddings``). ``attention_factor`` multiplies the
    rotated vectors (yarn, longrope).
    """
    if not (rope_theta > 0 and math.isfinite(rope_theta)):
        raise ValueError(f"rope_theta={rope_theta!r}: must be a positive finite number")
    dim = rotary_dim
    base_inv = 1.0 / rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    t = scaling.rope_type
    att, long_from = 1.0, NEVER
    if t in ("default", "gptj"):
        inv = base_inv
    elif t == "linear":
        inv = base_inv / float(scaling.get("factor"))
    elif t in ("llama3", "llama4"):
        inv = _llama3(base_inv, scaling)
    elif t == "yarn":
        inv, att = _yarn(rope_theta, dim, scaling, max_position_embeddings)
    elif t == "longrope":
        orig = int(scaling.get("original_max_position_embeddings"))
        short = np.asarray(scaling.get("short_factor"), dtype=np.float64)
        long_ = np.asarray(scaling.get("long_factor"), dtype=np.float64)
        for name, arr in (("short_factor", short), ("long_factor", long_)):
            if arr.shape != (dim // 2,):
                raise ValueError(f"rope_scaling {name} has {arr.size} values; rotary_dim={dim} "
                                 f"needs {dim // 2}")
        att = scaling.get("attention_factor")
        if att is None:
            factor = scaling.get("factor")
            if factor is None:
                factor = (max_position_embeddings or orig) / orig
            factor = float(factor)
            att = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        inv = np.stack([base_inv / short, base_inv / long_])
        return _checked(inv, float(att), orig, scaling, rope_theta)
    else:  # pragma: no cover - parse_rope_scaling refuses the rest
        raise ValueError(t)
    return _checked(np.stack([inv, inv]), float(att), long_from, scaling, rope_theta)


def _checked(inv: np.ndarray, att: float, long_from: int, scaling: RopeScaling,
             rope_theta: float) -> tuple[np.ndarray, float, int]:
    """The tables, once every frequency and the attention factor are positive and finite."""
    if not (np.isfinite(inv).all() and (inv > 0).all() and math.isfinite(att) and att > 0):
        raise ValueError(f"rope_scaling of type {scaling.rope_type!r} with rope_theta="
                         f"{rope_theta!r} gives non-finite or non-positive frequencies or "
                         f"attention factor; check its parameters")
    return inv, att, long_from


def kernel_turns(inv_freq: np.ndarray, rope_scale: float) -> np.ndarray:
    """Turns per position (``rope_scale * inv_freq / 2pi``) split into f32 (hi, lo) pairs."""
    turns = inv_freq * (float(rope_scale) / (2 * math.pi))
    hi = turns.astype(np.float32)
    lo = (turns - hi.astype(np.float64)).astype(np.float32)
    return np.ascontiguousarray(np.stack([hi, lo], axis=-1), dtype=np.float32)


def rotate(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, att: float,
           interleaved: bool) -> np.ndarray:
    """Rotate the first ``2 * len(inv_freq)`` dims of ``x[..., rows, D]`` (float64 math).

    ``pos`` broadcasts against the rows axis (shape ``[rows]``).
    """
    half = inv_freq.shape[-1]
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv_freq  # [rows, half]
    cos, sin = np.cos(ang) * att, np.sin(ang) * att
    y = x.astype(np.float64, copy=True)
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2] = a * cos - b * sin
        y[..., 1:2 * half:2] = b * cos + a * sin
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        y[..., :half] = a * cos - b * sin
        y[..., half:2 * half] = b * cos + a * sin
    return y
