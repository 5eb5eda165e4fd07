"""Attention shapes of real models: the one table the tuner, the tools and the tests read.

Each row is what attention needs of a model (heads, KV heads, head size, logit softcap)
plus its layer count, for timing whole forward passes. ``config`` names the model's raw
Hugging Face config in ``tests/data/models.json``; the tests check that
:meth:`clattn.AttentionSpec.from_hf_config` of that config gives the row's shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import AttentionSpec


@dataclass(frozen=True)
class ModelShape:
    """One model's attention shape.

    Attributes
    ----------
    name : str
        Name shown in benchmark and tuner tables.
    num_qo_heads, num_kv_heads, head_dim : int
        Query heads, KV heads, and the size of one head.
    layers : int
        Decoder layers (a forward pass runs attention this many times).
    softcap : float or None
        Attention logit softcap, None when the model has none.
    config : str
        Name of the model's raw config in ``tests/data/models.json`` (same attention shape).
    """

    name: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    layers: int
    softcap: float | None
    config: str


#: the benchmark's models: GQA-4 at head_dim 64 and 128, GQA-7, head_dim 256 with a
#: softcap, and group size 1 at head_dim 96
MODEL_SHAPES: tuple[ModelShape, ...] = (
    ModelShape("Llama-3.2-1B", 32, 8, 64, 16, None, "Llama-3.2-1B"),
    ModelShape("Llama-3-8B", 32, 8, 128, 32, None, "Llama-3.1-8B"),
    ModelShape("Qwen2.5-0.5B", 14, 2, 64, 24, None, "Qwen2.5-0.5B"),
    ModelShape("Gemma-2-2B", 8, 4, 256, 26, 50.0, "Gemma-2-2B"),
    ModelShape("Phi-3-mini", 32, 32, 96, 32, None, "Phi-3-mini-4k"),
)


@dataclass(frozen=True)
class MLAShape:
    """One multi-head latent attention model's attention (DeepSeek-V2/V3, MiniCPM3).

    Its two cache forms: decompressed (per head, keys ``qk_nope_head_dim +
    qk_rope_head_dim`` wide and values ``v_head_dim`` wide) and latent (one row per token
    shared by every head: the compressed latent, ``kv_lora_rank`` values, then the RoPE'd
    key part; the value is the latent part of the same row).

    Attributes
    ----------
    name : str
        Name shown in benchmark tables.
    num_heads : int
        Query heads (and KV heads of the decompressed form).
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim : int
        The config's sizes of the same names.
    layers : int
        Decoder layers.
    """

    name: str
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    layers: int

    @property
    def sm_scale(self) -> float:
        """The model's softmax scale, 1/sqrt(qk_nope + qk_rope), in both forms."""
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

    def spec(self, form: str, *, dtype: str = "float16", page_size: int = 16,
             kv_format: str | None = None) -> AttentionSpec:
        """The :class:`~clattn.AttentionSpec` of ``form`` (``"latent"`` or
        ``"decompressed"``); ``kv_format`` stores the pages (default ``dtype``)."""
        if form == "decompressed":
            return AttentionSpec(self.num_heads, self.num_heads,
                                 self.qk_nope_head_dim + self.qk_rope_head_dim,
                                 head_dim_v=self.v_head_dim, page_size=page_size, dtype=dtype,
                                 k_format=kv_format, v_format=kv_format)
        if form == "latent":
            return AttentionSpec(self.num_heads, 1, self.kv_lora_rank + self.qk_rope_head_dim,
                                 head_dim_v=self.kv_lora_rank, value_in_key=True,
                                 page_size=page_size, dtype=dtype, k_format=kv_format)
        raise ValueError(f"form={form!r}: must be 'latent' or 'decompressed'")


#: multi-head latent attention models (sizes from their Hugging Face configs)
MLA_SHAPES: tuple[MLAShape, ...] = (
    MLAShape("DeepSeek-V2-Lite", 16, 512, 128, 64, 128, 27),
    MLAShape("MiniCPM3-4B", 40, 256, 64, 32, 64, 62),
)


def mla_shape(name: str) -> MLAShape:
    """The row of :data:`MLA_SHAPES` named ``name`` (KeyError listing the names)."""
    for m in MLA_SHAPES:
        if m.name == name:
            return m
    raise KeyError(f"no MLA model {name!r}; known: {', '.join(m.name for m in MLA_SHAPES)}")


def model_shape(name: str) -> ModelShape:
    """The row of :data:`MODEL_SHAPES` named ``name``.

    Raises
    ------
    KeyError
        When no row has that name (the message lists the names).
    """
    for m in MODEL_SHAPES:
        if m.name == name:
            return m
    raise KeyError(f"no model {name!r}; known: {', '.join(m.name for m in MODEL_SHAPES)}")


__all__ = ["MLA_SHAPES", "MLAShape", "MODEL_SHAPES", "ModelShape", "mla_shape", "model_shape"]
