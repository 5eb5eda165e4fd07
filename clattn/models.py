"""Attention shapes of real models: the one table the tuner, the tools and the tests read.

Each row is what attention needs of a model (heads, KV heads, head size, logit softcap)
plus its layer count, for timing whole forward passes. ``config`` names the model's raw
Hugging Face config in ``tests/data/models.json``; the tests check that
:meth:`clattn.AttentionSpec.from_hf_config` of that config gives the row's shape.
"""
from __future__ import annotations

from dataclasses import dataclass


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


__all__ = ["MODEL_SHAPES", "ModelShape", "model_shape"]
