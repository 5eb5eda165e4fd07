"""How Hugging Face transformers reads a model's ``config.json`` for decode attention.

This is the tests' own reading of raw HF config dicts, written from transformers'
modelling code (``modeling_rope_utils``, ``masking_utils`` and the model files), not from
clattn: nothing here imports clattn, and nothing here is handed clattn's parse of a
config. ``read_config(cfg)`` gives an :class:`HFAttention`; ``HFAttention.oracle_kwargs()``
turns it into keyword arguments of ``naive.naive_decode`` so that the float64 oracle
decodes exactly what the model would, and the tests compare that with clattn's
``AttentionSpec.from_hf_config`` run through a backend.

The reading, field by field (transformers' behaviour in brackets):

* heads: ``num_attention_heads`` (``n_head``); ``num_key_value_heads`` missing or null
  means one KV head per query head [every config class's default].
* ``head_dim``: the config's ``head_dim`` when set, else ``hidden_size // num_attention_heads``
  (``n_embd`` for GPT-J) [``getattr(config, "head_dim", None) or hidden // heads``].
* rotated dims: ``rotary_dim`` (GPT-J, CodeGen) when set; else ``rotary_pct`` (GPT-NeoX) or
  ``partial_rotary_factor`` (Phi, StableLM, ...) times head_dim, rounded down
  [``int(head_dim * partial_rotary_factor)``]; else all of head_dim.
* pairing: GPT-J/CodeGen rotate adjacent pairs (2i, 2i+1) [``rotate_every_two`` with
  ``repeat_interleave``d sin/cos]; Llama-4 too [complex multiply of ``reshape(..., -1, 2)``];
  every other model pairs d with d + rotary_dim/2 [``rotate_half``].
* base: ``rope_theta``; missing or null means 10000 [the config classes' default; GPT-J's
  ``create_sinusoidal_positions`` hard-codes 10000].
* ``rope_scaling`` (``rope_type``, legacy ``type``; Phi-3's legacy "su" is longrope):
  ``linear`` divides every frequency by ``factor``; ``llama3`` bends the low and medium
  frequencies; ``yarn`` blends interpolated and extrapolated frequencies over a
  correction range and scales cos/sin by an attention factor, and when the dict names
  ``original_max_position_embeddings`` its factor is ``max_position_embeddings`` / that
  [transformers >= 4.48: "DeepSeek-V3 ... use the ratio"]; ``longrope`` divides by
  ``short_factor`` or ``long_factor`` (long once ``max(position) + 1`` exceeds the *top-level*
  ``original_max_position_embeddings``) and derives its attention factor from
  ``max_position_embeddings / original_max_position_embeddings``; ``dynamic`` depends on
  the run-time length and is refused here. ``llama4`` is not a transformers rope type
  (Llama-4 configs say ``llama3``); it is read as llama3's formula, as clattn documents.
* softmax scale: ``query_pre_attn_scalar ** -0.5`` (Gemma 2/3), else ``head_dim ** -0.5``.
* soft-cap: ``attn_logit_softcapping`` (Gemma 2): ``cap * tanh(score / cap)`` after scaling.
* sliding window: ``sliding_window`` keys per query (the newest included) [``masking_utils``:
  ``kv_idx > q_idx - sliding_window``]; ``use_sliding_window: false`` switches it off, and
  Qwen2/Qwen3-family configs need it true [their config classes default it to False].
  Models that alternate sliding and global layers (Gemma 2/3, gpt-oss) have one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
from naive import naive_inv_freq

DEFAULT_ROPE_THETA = 10000.0
#: model types whose rotation pairs adjacent dims (2i, 2i + 1)
INTERLEAVED_MODEL_TYPES = ("gptj", "codegen", "llama4", "llama4_text")
#: model types whose config classes switch the sliding window off unless asked
WINDOW_OPT_IN_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
#: legacy rope type names -> transformers' current ones
_LEGACY_TYPES = {"su": "longrope"}


def _model_type(cfg: Mapping[str, Any]) -> str:
    # the fixture flattens multimodal configs: "gemma3 (text_config.model_type gemma3_text)"
    return str(cfg.get("model_type") or "").split(" ")[0]


@dataclass(frozen=True)
class HFAttention:
    """The attention of one model as transformers runs it (one decode step)."""

    name: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    rope_theta: float
    rope_type: str
    #: the parameters transformers' rope init function uses, resolved (factor, original
    #: context, attention factor, ...); ``rope_scaling`` in naive.naive_inv_freq's terms
    rope_params: dict = field(default_factory=dict)
    sm_scale: float = 0.0
    softcap: float | None = None
    sliding_window: int | None = None
    max_position_embeddings: int | None = None
    #: longrope: positions whose q_pos + 1 exceed this use long_factor
    long_after: int | None = None

    def inv_freq(self, q_pos: int) -> tuple[np.ndarray, float]:
        """``(inv_freq [rotary_dim // 2] float64, attention_factor)`` for a query at ``q_pos``."""
        use_long = self.long_after is not None and int(q_pos) + 1 > self.long_after
        return naive_inv_freq(self.rotary_dim, self.rope_theta, self.rope_params,
                              self.max_position_embeddings, use_long)

    def oracle_kwargs(self) -> dict:
        """Keyword arguments of ``naive.naive_decode`` that decode like this model.

        (``sm_scale`` and ``rope_theta`` are call-time values of clattn's API: see
        :meth:`call_kwargs`.)
        """
        return dict(rotary_dim=self.rotary_dim, interleaved=self.interleaved,
                    inv_freq_fn=self.inv_freq, softcap=self.softcap)

    def call_kwargs(self) -> dict:
        """The run-time scalars a caller passes with RoPE on: theta and the softmax scale."""
        return dict(rope_theta=self.rope_theta, sm_scale=self.sm_scale)

    def window_offset(self, stored: int) -> int:
        """window_offset of a decode step over ``stored`` keys (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, int(stored) - int(self.sliding_window))


def _rotary_dim(cfg: Mapping[str, Any], head_dim: int) -> int:
    if cfg.get("rotary_dim") is not None:
        return int(cfg["rotary_dim"])
    for key in ("rotary_pct", "partial_rotary_factor"):
        if cfg.get(key) is not None:
            return int(head_dim * float(cfg[key]))
    return head_dim


def _rope(cfg: Mapping[str, Any], max_pos: int | None) -> tuple[str, dict, int | None]:
    """(rope type, parameters for naive_inv_freq, longrope switch point)."""
    rs = cfg.get("rope_scaling")
    if not rs:
        return "default", {}, None
    rs = dict(rs)
    rtype = rs.get("rope_type", rs.get("type")) or "default"
    rtype = _LEGACY_TYPES.get(rtype, rtype)
    params = {k: v for k, v in rs.items() if k not in ("type", "rope_type")}
    params["rope_type"] = "llama3" if rtype == "llama4" else rtype
    if rtype == "dynamic":
        raise ValueError("dynamic RoPE depends on the run-time sequence length")
    if rtype == "yarn":
        orig = params.get("original_max_position_embeddings")
        if orig is not None and max_pos is not None:
            params["factor"] = float(max_pos) / float(orig)
        elif orig is None:
            params["original_max_position_embeddings"] = max_pos
        return rtype, params, None
    if rtype == "longrope":
        top = cfg.get("original_max_position_embeddings")
        if top:
            orig, factor = int(top), float(max_pos) / float(top)
        else:
            orig, factor = int(max_pos), params.get("factor")
        params["original_max_position_embeddings"] = orig
        if params.get("attention_factor") is None:
            if factor is None or factor <= 1.0:
                params["attention_factor"] = 1.0
            else:
                params["attention_factor"] = math.sqrt(1.0 + math.log(factor) / math.log(orig))
        return rtype, params, orig
    if rtype not in ("default", "linear", "llama3", "llama4"):
        raise ValueError(f"rope type {rtype!r}: not read by this oracle")
    return rtype, params, None


def read_config(cfg: Mapping[str, Any]) -> HFAttention:
    """Read a raw HF ``config.json`` dict (or a fixture record with the same keys)."""
    h = int(cfg.get("num_attention_heads") or cfg["n_head"])
    kv = int(cfg.get("num_key_value_heads") or h)
    hidden = cfg.get("hidden_size") or cfg.get("n_embd")
    head_dim = int(cfg.get("head_dim") or int(hidden) // h)
    max_pos = cfg.get("max_position_embeddings") or cfg.get("n_positions")
    mtype = _model_type(cfg)
    rtype, params, long_after = _rope(cfg, max_pos)
    qs = cfg.get("query_pre_attn_scalar")
    sm_scale = float(qs) ** -0.5 if qs is not None else float(head_dim) ** -0.5
    cap = cfg.get("attn_logit_softcapping")
    window = cfg.get("sliding_window")
    use = cfg.get("use_sliding_window")
    if use is False or (use is None and mtype in WINDOW_OPT_IN_MODEL_TYPES):
        window = None
    return HFAttention(
        name=str(cfg.get("name", mtype)), num_qo_heads=h, num_kv_heads=kv, head_dim=head_dim,
        rotary_dim=_rotary_dim(cfg, head_dim), interleaved=mtype in INTERLEAVED_MODEL_TYPES,
        rope_theta=float(cfg.get("rope_theta") or DEFAULT_ROPE_THETA), rope_type=rtype,
        rope_params=params, sm_scale=sm_scale, softcap=None if cap is None else float(cap),
        sliding_window=None if not window else int(window),
        max_position_embeddings=None if max_pos is None else int(max_pos),
        long_after=long_after)


def shrink(cfg: Mapping[str, Any], num_qo_heads: int, num_kv_heads: int) -> dict:
    """The same config with fewer heads (head_dim kept), for small test decodes."""
    head_dim = read_config(cfg).head_dim
    return dict(cfg, num_attention_heads=num_qo_heads, num_key_value_heads=num_kv_heads,
                head_dim=head_dim)


__all__ = ["HFAttention", "read_config", "shrink", "DEFAULT_ROPE_THETA"]
