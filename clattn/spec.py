"""The attention configuration: the one home of shape rules and defaults.

Validation, kernel rendering and the CPU fallback all read :class:`AttentionSpec`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .numbers import is_int, is_number, is_positive_finite  # noqa: F401 - also spec's names
from .quant import BLOCK, KV_FORMATS, QUANTIZED, PageLayout, bytes_per_value
from .rope import parse_rope_scaling, rope_tables

#: storage dtypes clattn accepts for q, pages and out (accumulation is always f32)
DTYPES = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}
#: the dtype of every index table
INDEX_DTYPE = np.dtype(np.int32)
#: the dtype of log-sum-exp states
LSE_DTYPE = np.dtype(np.float32)
#: default RoPE base when a call does not give one
DEFAULT_ROPE_THETA = 10000.0
#: the largest row, position or value index the kernels' 32-bit ints hold
INT32_MAX = 2**31 - 1


LOG2E = 1.4426950408889634


#: model types whose configs carry ``sliding_window`` with ``use_sliding_window`` false by default
_WINDOW_OFF_BY_DEFAULT = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def default_sm_scale(head_dim: int) -> float:
    """`sm_scale` when the caller passes None: 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True)
class AttentionSpec:
    """What one decode kernel is built for (everything fixed at build time).

    ``dtype`` is the storage of q and out (and of the pages unless told otherwise);
    ``k_format``/``v_format`` store the keys/values of the pages as ``"float16"``,
    ``"float32"``, ``"q8_0"`` or ``"q4_0"`` (:mod:`clattn.quant`; default: ``dtype``).
    ``rope_scaling`` is a Hugging Face ``rope_scaling`` dict (or None); it and
    ``rotary_dim`` only matter when a call passes ``rotary_mode=1``. ``head_dim`` is the
    width of queries and keys, ``head_dim_v`` of values and of the output (default:
    ``head_dim``); unequal widths make the pool a byte pool (:mod:`clattn.quant`'s layout).

    ``value_in_key=True`` stores one row per token and KV head: a token's value is the
    first ``head_dim_v`` values of its stored key row (``head_dim_v <= head_dim``, given
    explicitly; ``v_format`` is ``k_format``), and the pool, a byte pool, holds key regions
    only. This is the absorbed form of multi-head latent attention (DeepSeek-V2/V3,
    MiniCPM3): each row is the compressed latent (``kv_lora_rank`` values, the value part)
    then the RoPE'd key part (``qk_rope_head_dim``); the caller absorbs the key
    up-projection into the query and the value up-projection into the output, uses one KV
    head for all query heads, and passes ``sm_scale`` itself
    (``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``, not the default
    ``1/sqrt(head_dim)``). Appends then take ``v=None``.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "float16"
    sliding_window: bool = False
    rope_scaling: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    rotary_dim: int | None = None
    softcap: float | None = None
    max_position_embeddings: int | None = None
    k_format: str | None = None
    v_format: str | None = None
    head_dim_v: int | None = None
    value_in_key: bool = False
    _rope_key: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.value_in_key, (bool, np.bool_)):
            raise TypeError(f"value_in_key={self.value_in_key!r}: must be True or False")
        object.__setattr__(self, "value_in_key", bool(self.value_in_key))
        if self.head_dim_v is None and self.value_in_key:
            raise ValueError("head_dim_v=None: value_in_key=True reads each value from the "
                             "first head_dim_v values of its key row; give head_dim_v (MLA: "
                             "kv_lora_rank)")
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        for name in ("num_qo_heads", "num_kv_heads", "head_dim", "head_dim_v", "page_size"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
            object.__setattr__(self, name, int(v))
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads={self.num_qo_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}: GQA needs an integer group size")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: must be even (RoPE pairs dims)")
        if self.value_in_key and self.head_dim_v > self.head_dim:
            raise ValueError(f"head_dim_v={self.head_dim_v}: value_in_key=True reads the values "
                             f"from the key rows, so head_dim_v must be at most "
                             f"head_dim={self.head_dim}")
        page_values = self.num_kv_heads * self.page_size * (self.head_dim + self.head_dim_v)
        widest = max(self.head_dim, self.head_dim_v)
        if page_values > INT32_MAX or self.num_qo_heads * widest > INT32_MAX:
            raise ValueError(
                f"page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, num_qo_heads="
                f"{self.num_qo_heads}, head_dim={self.head_dim}, head_dim_v={self.head_dim_v}: "
                f"a page's values (num_kv_heads x page_size x (head_dim + head_dim_v)) and a "
                f"token's query and output values must each stay below 2**31 (the kernels "
                f"index them with 32-bit ints)")
        try:
            dt = str(np.dtype(self.dtype)) if self.dtype is not None else None
        except TypeError:  # a name numpy does not know (e.g. "bfloat16")
            dt = None
        if dt not in DTYPES:
            raise TypeError(f"dtype={self.dtype!r}: must be one of {sorted(DTYPES)}")
        object.__setattr__(self, "dtype", dt)
        if not isinstance(self.sliding_window, (bool, np.bool_)):
            raise TypeError(f"sliding_window={self.sliding_window!r}: must be True or False")
        object.__setattr__(self, "sliding_window", bool(self.sliding_window))
        if self.value_in_key:
            k_fmt = dt if self.k_format is None else self.k_format
            if self.v_format is not None and self.v_format != k_fmt:
                raise ValueError(f"v_format={self.v_format!r}: value_in_key=True stores the "
                                 f"values in the key rows, as k_format={k_fmt!r}; pass "
                                 f"v_format=None")
            object.__setattr__(self, "v_format", k_fmt)
        for name, wname in (("k_format", "head_dim"), ("v_format", "head_dim_v")):
            fmt = dt if getattr(self, name) is None else getattr(self, name)
            width = getattr(self, wname)
            if fmt not in KV_FORMATS:
                raise ValueError(f"{name}={fmt!r}: must be one of {list(KV_FORMATS)}")
            if fmt in QUANTIZED and width % BLOCK:
                raise ValueError(f"{name}={fmt!r}: quantized blocks are {BLOCK} values along "
                                 f"the row; {wname}={width} is not a multiple of {BLOCK}")
            object.__setattr__(self, name, fmt)
        rd = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if not isinstance(rd, (int, np.integer)) or rd < 2 or rd % 2 or rd > self.head_dim:
            raise ValueError(
                f"rotary_dim={self.rotary_dim!r}: must be an even integer in "
                f"[2, head_dim={self.head_dim}]")
        object.__setattr__(self, "rotary_dim", int(rd))
        if self.softcap is not None:
            if not is_positive_finite(self.softcap):
                raise ValueError(f"softcap={self.softcap!r}: must be a positive finite number "
                                 f"or None")
            object.__setattr__(self, "softcap", float(self.softcap))
        mpe = self.max_position_embeddings
        if mpe is not None:
            if not is_int(mpe) or mpe < 1:
                raise ValueError(f"max_position_embeddings={mpe!r}: must be a positive integer "
                                 f"or None")
            object.__setattr__(self, "max_position_embeddings", int(mpe))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Mapping):
            raise TypeError(f"rope_scaling={self.rope_scaling!r}: must be a dict (HF config "
                            f"'rope_scaling') or None")
        scaling = dict(self.rope_scaling) if self.rope_scaling else None
        object.__setattr__(self, "rope_scaling", scaling)
        # validates the scaling dict now (raises on unknown or dynamic types); the parsed,
        # hashable form is what equality and hashing compare
        key = parse_rope_scaling(scaling, self.max_position_embeddings)
        object.__setattr__(self, "_rope_key", key)
        # the tables at the usual base: list lengths and every derived value checked now,
        # not at the first call with rotary_mode=1
        try:
            rope_tables(self.rotary_dim, DEFAULT_ROPE_THETA, key, self.max_position_embeddings)
        except (ValueError, TypeError, ArithmeticError) as exc:
            raise ValueError(f"rope_scaling={scaling!r}: {exc}") from None

    def __hash__(self) -> int:  # rope_scaling is a dict: hash its frozen form instead
        return hash((self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                     self.dtype, self.sliding_window, self._rope_key, self.rotary_dim,
                     self.softcap, self.max_position_embeddings, self.k_format, self.v_format,
                     self.head_dim_v, self.value_in_key))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AttentionSpec) and hash(self) == hash(other) and \
            self._rope_key == other._rope_key

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    @property
    def split_widths(self) -> bool:
        """True when values are not as wide as keys (``head_dim_v != head_dim``)."""
        return self.head_dim_v != self.head_dim

    @property
    def byte_pool(self) -> bool:
        """True when the pool is a byte array: K and V not both stored as ``dtype``, of
        unequal widths (``[P, 2, H_kv, page_size, D]`` holds one width), or the values
        read from the key rows (pages of key regions only)."""
        return not (self.k_format == self.dtype and self.v_format == self.dtype) or \
            self.split_widths or self.value_in_key

    @property
    def layout(self) -> PageLayout:
        """Byte layout of a page of a byte pool."""
        return PageLayout(self.k_format, self.v_format, self.num_kv_heads, self.page_size,
                          self.head_dim, self.head_dim_v, self.value_in_key)

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of a pool of ``num_pages`` pages (its dtype: :attr:`pool_dtype`)."""
        if self.byte_pool:
            return (num_pages, self.layout.page_bytes)
        return (num_pages, 2, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def pool_dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.byte_pool else self.np_dtype

    @property
    def bytes_per_token(self) -> float:
        """Pool bytes one token takes per layer (K and V, every KV head, scales included;
        the K rows alone when :attr:`value_in_key`)."""
        v_bytes = 0.0 if self.value_in_key else self.head_dim_v * bytes_per_value(self.v_format)
        return self.num_kv_heads * (self.head_dim * bytes_per_value(self.k_format) + v_bytes)

    def key(self) -> str:
        """A stable text key (for caches and kernel names); ``head_dim_v`` enters it only
        where it differs from ``head_dim`` or the values are read from the key rows, and
        ``value_in_key`` only when set."""
        fields = [self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                  self.dtype, self.sliding_window, self.rope_scaling, self.rotary_dim,
                  self.softcap, self.max_position_embeddings, self.k_format, self.v_format]
        if self.split_widths or self.value_in_key:
            fields.append(self.head_dim_v)
        if self.value_in_key:
            fields.append("value_in_key")
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, page_size: int = 16,
                       dtype: str = "float16",
                       sliding_window: bool | None = None) -> "AttentionSpec":
        """Build a spec from a Hugging Face ``config.json`` dict.

        Reads heads, ``head_dim`` (or hidden_size / heads), ``v_head_dim``, ``rope_scaling``,
        ``partial_rotary_factor``/``rotary_dim`` and ``attn_logit_softcapping``.
        ``sliding_window`` defaults to whether the config declares a window. Multi-head
        latent attention (DeepSeek-V2/V3, MiniCPM3: the config has ``qk_nope_head_dim``) is
        read in its decompressed form: queries and keys ``qk_nope_head_dim +
        qk_rope_head_dim`` wide, values ``v_head_dim``; its RoPE'd dims are the trailing
        ``qk_rope_head_dim``, which the in-kernel RoPE does not cover (such a model rotates
        q and k itself and calls with ``rotary_mode=0``), so ``rotary_dim`` is left at its
        default.
        """
        h = config.get("num_attention_heads", config.get("n_head"))
        kv = config.get("num_key_value_heads") or h
        hdv = config.get("v_head_dim")
        if config.get("qk_nope_head_dim") is not None:  # MLA, decompressed
            hd = config["qk_nope_head_dim"] + config.get("qk_rope_head_dim", 0)
        else:
            hd = config.get("head_dim") or (config.get("hidden_size", config.get("n_embd")) // h)
        rd = config.get("rotary_dim")
        frac = config.get("partial_rotary_factor", config.get("rotary_pct"))  # NeoX: rotary_pct
        if rd is None and frac is not None:
            rd = int(hd * float(frac))
        scaling = config.get("rope_scaling")
        if config.get("model_type") == "gptj" and not scaling:
            scaling = {"rope_type": "gptj"}
        scaling = dict(scaling) if scaling else None
        if scaling is not None and "original_max_position_embeddings" not in scaling and \
                config.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        if sliding_window is None:  # Qwen's configs keep a window size that is off by default
            default_on = config.get("model_type") not in _WINDOW_OFF_BY_DEFAULT
            use = config.get("use_sliding_window")
            sliding_window = bool(config.get("sliding_window")) and \
                (default_on if use is None else bool(use))
        return cls(num_qo_heads=h, num_kv_heads=kv, head_dim=hd, head_dim_v=hdv,
                   page_size=page_size,
                   dtype=dtype, sliding_window=sliding_window, rope_scaling=scaling,
                   rotary_dim=rd, softcap=config.get("attn_logit_softcapping"),
                   max_position_embeddings=config.get("max_position_embeddings",
                                                      config.get("n_positions")))
