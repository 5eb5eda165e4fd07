"""Multi-head latent attention (MLA) in its latent (absorbed) form on a ClattnCache.

An MLA model (DeepSeek-V2/V3, MiniCPM3, ...: ``config.kv_lora_rank``) hands the cache
update of each layer its new normalized latents ``c`` ``[B, 1, L, kv_lora_rank]`` and
RoPE'd shared keys ``k_pe`` ``[B, 1, L, qk_rope_head_dim]``, then expands them into
per-head keys and values with ``kv_b_proj`` (``W_UK``, ``W_UV``) and calls the attention
function with those. In the latent form clattn stores one row per token and layer,
``[c | k_pe]``, a single KV head shared by every query head, and attends with absorbed
queries::

    q_lat[h] = [q_nope[h] @ W_UK[h] | q_pe[h]]          (kv_lora_rank + qk_rope wide)
    o_lat[h] = softmax(scale * q_lat[h] . rows) @ rows[:, :kv_lora_rank]
    out[h]   = o_lat[h] @ W_UV[h]^T                      (v_head_dim wide)

which the module's ``o_proj`` then takes as it takes eager's output. The softmax scale
is the module's own (``1/sqrt(qk_nope + qk_rope)`` times yarn's ``mscale**2``). Queries,
RoPE (complex, interleaved or not), ``o_proj`` and anything a model does to its query
stay the model's code: clattn takes over between the attention function's arguments
and its output. docs/transformers.md ("Multi-head latent attention") is the user's page.

The pools store the rows alone: the values are the leading ``kv_lora_rank`` values of each
key row (``AttentionSpec(value_in_key=True)``; appends pass ``v=None``).
"""
from __future__ import annotations

from typing import Any

import torch

from clattn.spec import AttentionSpec

from .hf_errors import UnsupportedFeatureError

__all__ = ["FORMS", "LatentLayer", "caches_latents", "check_form", "latent_attention",
           "latent_spec", "stored_values_per_token"]

#: the forms an MLA model runs in on clattn (``register(mla=...)``/``ClattnCache(mla=...)``)
FORMS = ("latent", "decompressed")

def latent_attention(config: Any) -> bool:
    """Whether ``config`` is multi-head latent attention (``kv_lora_rank``): its cache
    update takes latents, which the model expands into keys and values afterwards."""
    return bool(getattr(config, "kv_lora_rank", None))


def caches_latents(config: Any, cached: tuple) -> bool:
    """Whether what an MLA layer's cache update was given (``cached``) is its latents
    ``[B, 1, L, kv_lora_rank]`` and rope keys ``[B, 1, L, qk_rope_head_dim]`` (transformers
    5), not the expanded per-head keys and values (transformers 4.x caches those)."""
    if len(cached) != 2:
        return False
    c, k_pe = cached
    return c.dim() == 4 and k_pe.dim() == 4 and c.shape[1] == 1 and k_pe.shape[1] == 1 and \
        c.shape[-1] == int(config.kv_lora_rank) and \
        k_pe.shape[-1] == int(config.qk_rope_head_dim)


def check_form(mla: Any) -> str:
    """``mla`` checked: one of :data:`FORMS`."""
    if mla not in FORMS:
        raise ValueError(f"clattn: mla={mla!r}: must be 'latent' (one row [latent | rope key] "
                         f"per token and layer) or 'decompressed' (per-head keys and values)")
    return mla


def latent_spec(**fields: Any) -> AttentionSpec:
    """The :class:`~clattn.AttentionSpec` of a latent-form layer kind (``fields``:
    ``num_kv_heads=1``, ``head_dim=kv_lora_rank + qk_rope_head_dim``,
    ``head_dim_v=kv_lora_rank`` and those of every kind): values read from the key rows."""
    k_fmt, v_fmt = fields.get("k_format"), fields.pop("v_format", None)
    if v_fmt is not None and v_fmt != (k_fmt or fields.get("dtype")):
        raise ValueError(f"clattn: v_format={v_fmt!r}: the latent form of a multi-head latent "
                         f"attention model reads its values from the key rows, stored as "
                         f"k_format={k_fmt!r}; pass the same format (or v_format=None), or "
                         f"mla='decompressed'")
    return AttentionSpec(**fields, value_in_key=True)


def stored_values_per_token(rank: int, rope: int) -> int:
    """Values a latent-form layer stores per token: its one row, ``rank + rope``."""
    return rank + rope


# ------------------------------------------------------------------------------ absorption
class LatentLayer:
    """One MLA attention module's call in the latent form: the absorbed query and the
    rows to append (:meth:`inputs`), then the output up-projection (:meth:`output`).

    Parameters
    ----------
    module : torch.nn.Module
        The model's attention module (its ``kv_b_proj`` holds ``W_UK`` and ``W_UV``).
    config : PretrainedConfig
        The text config: ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
        ``v_head_dim``.
    index : int
        The layer (for messages).
    """

    def __init__(self, module: torch.nn.Module, config: Any, index: int) -> None:
        self.index = index
        self.rank = int(config.kv_lora_rank)
        self.nope = int(config.qk_nope_head_dim)
        self.rope = int(config.qk_rope_head_dim)
        self.dv = int(config.v_head_dim)
        proj = getattr(module, "kv_b_proj", None)
        weight = getattr(proj, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or \
                weight.shape[1] != self.rank or weight.shape[0] % (self.nope + self.dv):
            raise self.refuse("its attention module has no kv_b_proj of shape "
                              "[heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank]")
        if getattr(proj, "bias", None) is not None:
            raise self.refuse("its kv_b_proj has a bias")
        w = weight.detach().view(-1, self.nope + self.dv, self.rank)
        #: ``W_UK [H, nope, rank]`` and ``W_UV [H, v, rank]`` (views of kv_b_proj's weight)
        self.w_uk, self.w_uv = w[:, :self.nope], w[:, self.nope:]
        self.heads = int(w.shape[0])

    def refuse(self, why: str) -> UnsupportedFeatureError:
        """The refusal of this layer's absorption, for the reason ``why``."""
        return UnsupportedFeatureError(
            f"clattn: layer {self.index}: the latent form of multi-head latent attention "
            f"cannot absorb this model's projections ({why}); run it decompressed: "
            f"register(mla='decompressed') or ClattnCache(model, mla='decompressed')")

    def inputs(self, query: torch.Tensor, latent: torch.Tensor,
               k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_lat [B, H, L, rank + rope], rows [B, 1, L, rank + rope], rows' latent
        part [B, 1, L, rank])`` from the module's query ``[B, H, L, nope + rope]`` and the
        cache update's latents ``[B, 1, L, rank]`` and ``k_pe [B, 1, L, rope]``."""
        B, H, L, D = query.shape
        if H != self.heads or D != self.nope + self.rope or \
                tuple(latent.shape) != (B, 1, L, self.rank) or \
                tuple(k_pe.shape) != (B, 1, L, self.rope):
            raise self.refuse(f"query {tuple(query.shape)}, latents {tuple(latent.shape)} and "
                              f"rope keys {tuple(k_pe.shape)} are not [B, {self.heads}, L, "
                              f"{self.nope}+{self.rope}], [B, 1, L, {self.rank}] and "
                              f"[B, 1, L, {self.rope}]")
        f32 = torch.float32  # (an f16 model's absorbed query: summed in f32, then rounded)
        q_nope = torch.matmul(query[..., :self.nope].to(f32), self.w_uk.to(f32))
        q_lat = torch.cat((q_nope.to(query.dtype), query[..., self.nope:]), dim=-1)
        rows = torch.cat((latent, k_pe.to(latent.dtype)), dim=-1)
        return q_lat, rows, rows[..., :self.rank]

    def check_expansion(self, latent: torch.Tensor, k_pe: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor) -> None:
        """Raise unless the module's own expansion of ``latent``/``k_pe`` (the ``key`` and
        ``value`` it gave the attention function) is ``[W_UK c | k_pe]`` and ``W_UV c``
        per head: the layout the absorption assumes (checked once per layer)."""
        c = latent.detach().to(torch.float64)
        k_nope = torch.matmul(c, self.w_uk.to(torch.float64).transpose(-1, -2))
        v = torch.matmul(c, self.w_uv.to(torch.float64).transpose(-1, -2))
        tol = 1e-3 * float(torch.matmul(c.abs(), self.w_uk.abs().to(torch.float64)
                                        .transpose(-1, -2)).max().clamp(min=1e-30))
        tol_v = 1e-3 * float(torch.matmul(c.abs(), self.w_uv.abs().to(torch.float64)
                                          .transpose(-1, -2)).max().clamp(min=1e-30))
        ok = tuple(key.shape[-1:]) == (self.nope + self.rope,) and \
            tuple(value.shape[-1:]) == (self.dv,) and key.shape[1] == self.heads and \
            float((key[..., :self.nope].double() - k_nope).abs().max()) <= tol and \
            float((value.double() - v).abs().max()) <= tol_v and \
            torch.equal(key[..., self.nope:], k_pe.expand(-1, self.heads, -1, -1).to(key.dtype))
        if not ok:
            raise self.refuse("its keys are not [kv_b_proj(c)[nope part] | k_pe] and its "
                              "values kv_b_proj(c)[value part] per head")

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """``out [B, L, H, v]`` from the latent attention output ``o_lat [B, L, H, rank]``."""
        f32 = torch.float32
        w_uv = self.w_uv.to(f32).transpose(-1, -2)                  # [H, rank, v]
        out = torch.matmul(o_lat.transpose(1, 2).to(f32), w_uv)     # [B, H, L, v]
        return out.transpose(1, 2).to(o_lat.dtype)
