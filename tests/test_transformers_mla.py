"""Models whose values differ in width from their keys, through ``attn_implementation=
"clattn"`` (docs/transformers.md, "Architectures" and "Multi-head latent attention"):
multi-head latent attention (DeepSeek-V2-Lite, DeepSeek-V3 with its interleaved RoPE,
MiniCPM3) in both forms: latent (``mla="latent"``: one row ``[latent | rope key]`` per
token and layer, absorbed queries; tests/test_mla_latent.py has its bound, pool size and
refusals) and decompressed (the model expands its cached latents into per-head keys
``qk_nope + qk_rope`` wide and values ``v_head_dim`` wide; clattn's pages hold those), and
MiMo-V2-Flash (keys 192, values 128, sliding and full layers, learned sinks on the sliding
ones).

The published configs' attention keys (heads, head sizes, latent ranks, RoPE scaling) are
kept; the models are shrunk to 2 layers, hidden size 256 (MiniCPM3 320), a 1024-token
vocabulary, 4 experts, random f32 weights. Greedy generation must give eager attention's
tokens, logits within 1e-4 (as tests/test_transformers.py): one prompt on each device's
own kernels (MiniCPM3's latent form under ``-m slow``) and on the CPU backend, a
left-padded batch of MiMo-V2-Flash (window and sinks) and of DeepSeek-V2-Lite (latent
form) on the devices, DeepSeek-V2-Lite through the GPU (tiled) kernels in both forms.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from conftest import GPU_PROFILE
from test_transformers import NEW_TOKENS, PROMPTS, VOCAB, inputs
from transformers import AutoModelForCausalLM

import clattn.integrations.transformers as cltf
from clattn.integrations.hf_cache import ClattnCache

COMMON = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=VOCAB,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
EXPERTS = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
#: the published configs' attention keys (config.json), experts shrunk
CONFIGS = {
    "DeepSeek-V2-Lite": dict(
        model_type="deepseek_v2", num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_shared_experts=2, first_k_dense_replace=1, topk_group=1, n_group=1,
        max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 0.707, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 4096}, **EXPERTS),
    # 16 of the published 128 heads (the test's time on 2 cores), the rest as published
    "DeepSeek-V3": dict(
        model_type="deepseek_v3", num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_shared_experts=1, first_k_dense_replace=1, topk_group=1, n_group=1,
        rope_interleave=True, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096}, **EXPERTS),
    "MiniCPM3-4B": dict(
        model_type="minicpm3", num_attention_heads=40, num_key_value_heads=40,
        q_lora_rank=768, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, max_position_embeddings=32768,
        hidden_size=320),   # a multiple of the 40 heads (the config's rule)
    # the window shortened so that the prompts and new tokens cross it
    "MiMo-V2-Flash": dict(
        model_type="mimo_v2_flash", num_attention_heads=64, num_key_value_heads=4,
        head_dim=192, v_head_dim=128, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], max_position_embeddings=262144, **EXPERTS),
}
#: (query/key, value) head sizes each model attends with (MLA: decompressed)
WIDTHS = {"DeepSeek-V2-Lite": (192, 128), "DeepSeek-V3": (192, 128), "MiniCPM3-4B": (96, 64),
          "MiMo-V2-Flash": (192, 128)}
#: the multi-head latent attention models, and their (kv_lora_rank, qk_rope_head_dim)
MLA = {n: (c["kv_lora_rank"], c["qk_rope_head_dim"]) for n, c in CONFIGS.items()
       if "kv_lora_rank" in c}
FORMS = [(n, f) for n in CONFIGS for f in (("latent", "decompressed") if n in MLA
                                           else ("latent",))]
#: the forms generated on each device: MiniCPM3's latent form under ``-m slow`` (its rows
#: decode, 40 heads of 288 unrolled, takes Intel's compiler over a minute); by default its
#: integration runs on the CPU backend, its kernel shape on every device in
#: tests/test_value_in_key.py (minicpm3-q4-win) and the latent form on the devices through
#: DeepSeek-V2-Lite and DeepSeek-V3
DEVICE_FORMS = [pytest.param(n, f, marks=pytest.mark.slow)
                if (n, f) == ("MiniCPM3-4B", "latent") else (n, f) for n, f in FORMS]

_MODELS: dict = {}
_EAGER: dict = {}


def model(name: str):
    """The shrunk model (random f32 weights, seeded; learned sinks random), built once."""
    if name not in _MODELS:
        cfg = transformers.AutoConfig.for_model(**{**COMMON, **CONFIGS[name]})
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for layer in m.model.layers:
                sinks = getattr(layer.self_attn, "sinks", None)
                if sinks is not None:
                    sinks.copy_(torch.randn(sinks.shape, generator=g) * 2)
        m.generation_config.pad_token_id = 0
        _MODELS[name] = m
    return _MODELS[name]


def generate(name: str, batch: bool, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(name).generate(**inputs(batch), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True, **kw)


def check_same(name: str, batch: bool, device=None, profile=None,
               backend: str = "auto", mla: str = "latent") -> ClattnCache:
    """Greedy tokens as eager's, logits within 1e-4; the pools' spec has the widths (an
    MLA model's latent form: one KV head of rows kv_lora_rank + rope wide, the values
    kv_lora_rank wide)."""
    if (name, batch) not in _EAGER:
        _EAGER[name, batch] = generate(name, batch)
    ref = _EAGER[name, batch]
    cltf.register(device=device, profile=profile, backend=backend, mla=mla)
    try:
        got = generate(name, batch, attn_implementation="clattn")
    finally:
        cltf.register()
    cache = got.cache
    assert isinstance(cache, ClattnCache)
    diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits))
    assert torch.equal(got.sequences, ref.sequences), f"{name}: tokens differ (logits {diff})"
    assert diff <= 1e-4, f"{name}: logits differ by {diff}"
    latent = name in MLA and mla == "latent"
    assert cache.latent == latent
    for g in cache.groups.values():
        if latent:
            rank, rope = MLA[name]
            assert (g.spec.num_kv_heads, g.spec.head_dim, g.spec.head_dim_v) == \
                (1, rank + rope, rank)
        else:
            assert (g.spec.head_dim, g.spec.head_dim_v) == WIDTHS[name]
    return cache


@pytest.mark.parametrize("name,mla", DEVICE_FORMS)
def test_generate_matches_eager(name, mla, device):
    cache = check_same(name, False, device, mla=mla)
    assert cache.steps["decode"] == len(cache.groups) * (NEW_TOKENS - 1)
    assert cache.steps["prefill"] == len(cache.groups)


@pytest.mark.parametrize("name", ["MiMo-V2-Flash", "DeepSeek-V2-Lite"])
def test_left_padded_batch_matches_eager(device, name):
    """Padding never stored. MiMo-V2-Flash: the window crossed inside the longest prompt
    (its tokens past the slide on the cache's chunk attend), the learned sinks of the
    sliding layers. DeepSeek-V2-Lite: the latent form's rows of three prompts of
    different lengths."""
    cache = check_same(name, True, device)
    assert cache.steps["chunk"] == (1 if name == "MiMo-V2-Flash" else 0)
    lengths = [g.cache.length(r) for g in cache.groups.values() for r in cache.rows]
    stored = [p + NEW_TOKENS - 1 for p in PROMPTS] * len(cache.groups)
    assert lengths == stored   # no padding stored


@pytest.mark.parametrize("name,mla", FORMS)
def test_cpu_backend(name, mla):
    check_same(name, False, backend="cpu", mla=mla)


@pytest.mark.parametrize("mla", ["latent", "decompressed"])
def test_gpu_kernels(device, mla, name="DeepSeek-V2-Lite"):
    """The tiled decode, prefill and append kernels of a GPU profile on the CPU drivers."""
    cache = check_same(name, False, device, profile=GPU_PROFILE, mla=mla)
    assert {g.cache.profile.strategy for g in cache.groups.values()} == {"tiled"}
