"""Hugging Face transformers drives clattn (issue 11): ``attn_implementation="clattn"``.

Models are built from the published architecture configs (written out below), shrunk to
2 layers, hidden size 256, a 1024-token vocabulary and random f32 weights; head counts,
head_dim, GQA, scaling, soft-capping and sliding windows stay as published (the windows of
Gemma-2 and Mistral shortened so that the tests cross them). Greedy generation on each
OpenCL device must give eager attention's tokens, logits within 1e-4: one prompt, and a
left-padded batch of three prompts of different lengths. gpt-oss (learned attention sinks,
set to random values of std SINK_STD; 4 experts) also runs through the GPU kernels and the
CPU backend, its logits within a bound derived from the f32 sums (_reordered_sum_bound).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import transformers
from conftest import GPU_PROFILE
from transformers import AutoModelForCausalLM

import clattn.integrations.transformers as cltf
from clattn.integrations.hf_cache import ClattnCache, UnsupportedFeatureError, layer_windows

# the published config.json of each model (architecture keys)
CONFIGS = {
    "Llama-3.2-1B": {
        "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "vocab_size": 128256},
    "Qwen2.5-0.5B": {
        "model_type": "qwen2", "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "use_mrope": False,
        "use_sliding_window": False, "vocab_size": 151936},
    "Gemma-2-2B": {
        "model_type": "gemma2", "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
        "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
        "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "vocab_size": 256000},
    "Mistral-7B-v0.1": {
        "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000},
    "Phi-3-mini-4k": {
        "model_type": "phi3", "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
        "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
        "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
        "vocab_size": 32064},
}
# gpt-oss-20b: learned attention sinks (s_aux), sliding and full layers alternating, yarn
# RoPE, attention biases, a mixture of experts (shrunk below: 4 experts, 2 per token)
CONFIGS["gpt-oss-20b"] = {
    "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088}
#: per-model keys shrunk beyond the common ones (gpt-oss: a smaller mixture of experts)
SHRINK = {"gpt-oss-20b": dict(num_local_experts=4, num_experts_per_tok=2, experts_per_token=2)}
#: std of the learned attention sinks set on gpt-oss (HF initialises them near 0, where
#: they would weigh like one more row of score 0; these outweigh or vanish against rows)
SINK_STD = 2.0
# Gemma-2-27B: the 2B's config but for these keys; query_pre_attn_scalar 144 != head_dim
# 128, so its scaling is not 1/sqrt(head_dim)
CONFIGS["Gemma-2-27B"] = {**CONFIGS["Gemma-2-2B"], "head_dim": 128, "hidden_size": 4608,
                          "intermediate_size": 36864, "num_attention_heads": 32,
                          "num_hidden_layers": 46, "num_key_value_heads": 16,
                          "query_pre_attn_scalar": 144}
#: windows shortened so that a 10-token prompt and 32 new tokens cross them (and the
#: batch's 20-token prompt crosses them inside the prompt)
WINDOWS = {"Gemma-2-2B": 16, "Gemma-2-27B": 16, "Mistral-7B-v0.1": 12, "gpt-oss-20b": 12}
#: q and k projections scaled up where the config soft-caps scores, so that the scores reach
#: the cap (random weights give scores far below 50, where the cap changes nothing)
SOFTCAP_GAIN = 12.0
VOCAB = 1024
NEW_TOKENS = 32
PROMPTS = (5, 11, 20)  # the batch's prompt lengths (left padded)


def shrink(name: str, layers: int = 2) -> dict:
    """The published config with ``layers`` layers, hidden 256, a small vocabulary (special
    token ids inside it) and the explicit head_dim of the published model."""
    cfg = dict(CONFIGS[name])
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.update(num_hidden_layers=layers, hidden_size=256, intermediate_size=512, vocab_size=VOCAB,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name in WINDOWS:
        cfg["sliding_window"] = WINDOWS[name]
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:layers]
    cfg.update(SHRINK.get(name, {}))
    return cfg


_MODELS: dict = {}
_EAGER: dict = {}


def model(name: str, layers: int = 2):
    """The model with ``layers`` layers (random f32 weights, seeded), built once."""
    if (name, layers) not in _MODELS:
        cfg = transformers.AutoConfig.for_model(**shrink(name, layers))
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             dtype=torch.float32).eval()
        if getattr(cfg, "attn_logit_softcapping", None):
            with torch.no_grad():
                for layer in m.model.layers:
                    layer.self_attn.q_proj.weight.mul_(SOFTCAP_GAIN)
                    layer.self_attn.k_proj.weight.mul_(SOFTCAP_GAIN)
        sinks = [layer.self_attn.sinks for layer in m.model.layers
                 if hasattr(layer.self_attn, "sinks")]
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for s in sinks:
                s.copy_(torch.randn(s.shape, generator=g) * SINK_STD)
        m.generation_config.pad_token_id = 0
        _MODELS[name, layers] = m
    return _MODELS[name, layers]


def inputs(batch: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    if not batch:
        return {"input_ids": torch.randint(3, VOCAB, (1, 10), generator=g)}
    n = max(PROMPTS)
    ids = torch.zeros(len(PROMPTS), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, n - p:] = torch.randint(3, VOCAB, (p,), generator=g)
        mask[i, n - p:] = 1
    return {"input_ids": ids, "attention_mask": mask}


def run(name: str, batch: bool, layers: int = 2, **kw):
    m = model(name, layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Gemma-2's "hybrid" cache_implementation notice
        return m.generate(**inputs(batch), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True,
                          **kw)


def eager(name: str, batch: bool):
    if (name, batch) not in _EAGER:
        _EAGER[name, batch] = run(name, batch)
    return _EAGER[name, batch]


def check_same(name: str, batch: bool, device, profile=None, *, backend="auto",
               derived=False) -> ClattnCache:
    """Greedy tokens as eager's, logits within 1e-4 (and, ``derived``, within
    :func:`_reordered_sum_bound` of the model's layers)."""
    cltf.register(device=device, profile=profile, backend=backend)
    try:
        got = run(name, batch, attn_implementation="clattn")
    finally:
        cltf.register()
    ref = eager(name, batch)
    assert model(name).config._attn_implementation == "eager"  # restored after the call
    cache = got.cache
    assert isinstance(cache, ClattnCache)
    diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits))
    assert len(got.logits) == NEW_TOKENS
    assert torch.equal(got.sequences, ref.sequences), f"{name}: tokens differ (logits {diff})"
    assert diff <= 1e-4, f"{name}: logits differ by {diff}"
    if derived:
        bound = _reordered_sum_bound(name, ref.logits, layers=len(model(name).model.layers))
        assert diff <= bound, f"{name}: logits differ by {diff} > {bound}"
    return cache


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_matches_eager(name, device):
    cache = check_same(name, False, device)
    kinds = len(set(layer_windows(model(name).config)))  # sliding and full layers: 2
    assert cache.steps["prefill"] == kinds
    assert cache.steps["decode"] == kinds * (NEW_TOKENS - 1)
    assert len(cache.groups) == kinds
    # the pools hold every token, or the window's pages once it slides
    for w, g in cache.groups.items():
        used = g.cache.stats().pages_used
        held = 10 + NEW_TOKENS - 1 if w is None else w + g.spec.page_size
        assert used <= -(-held // g.spec.page_size) + 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_left_padded_batch_matches_eager(name, device):
    cache = check_same(name, True, device)
    assert cache.batch_size == len(PROMPTS)
    windowed = [w for w in cache.groups if w is not None and w < max(PROMPTS)]
    # a window crossed inside the 20-token prompt runs on the cache's chunk attend
    assert cache.steps["chunk"] == len(windowed)
    lengths = [g.cache.length(r) for g in cache.groups.values() for r in cache.rows]
    assert lengths == [p + NEW_TOKENS - 1 for p in PROMPTS] * len(cache.groups)  # no pads stored


def test_gpu_kernels_through_transformers(device, name="Gemma-2-2B"):
    """The GPU strategy (tiled decode, prefill and append kernels of a GPU profile) on the
    CPU drivers, through the same integration: prefill, chunk and decode steps."""
    cache = check_same(name, True, device, profile=GPU_PROFILE)
    assert {g.cache.profile.strategy for g in cache.groups.values()} == {"tiled"}
    assert cache.steps["prefill"] >= 1 and cache.steps["decode"] >= NEW_TOKENS - 1


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
def test_gpt_oss_sinks_gpu_kernels_and_cpu_backend(device, batch, name="gpt-oss-20b"):
    """gpt-oss's learned attention sinks (s_aux, random of std SINK_STD per layer) through
    the GPU strategy (tiled decode, merge, prefill) on each device and through the numpy
    backend: eager's tokens, logits within the derived bound."""
    cache = check_same(name, batch, device, profile=GPU_PROFILE, derived=True)
    assert {g.cache.profile.strategy for g in cache.groups.values()} == {"tiled"}
    assert set(cache.groups) == {None, WINDOWS[name]}
    check_same(name, batch, None, backend="cpu", derived=True)
    check_same(name, batch, device, derived=True)  # the device's own (rows) kernels


def test_cpu_backend_and_chunk_prompts():
    """The numpy backend through the same path; prompts on the cache's chunk attend."""
    cltf.register(backend="cpu", prefill=False)
    try:
        got = run("Qwen2.5-0.5B", True, attn_implementation="clattn")
    finally:
        cltf.register()
    ref = eager("Qwen2.5-0.5B", True)
    assert torch.equal(got.sequences, ref.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits)) <= 1e-4
    assert got.cache.steps["chunk"] == 1 and got.cache.steps["prefill"] == 0


def test_quantized_caches_through_transformers(device):
    """q4_0 keys and q8_0 values (quantized on append on the device; prefill, window chunk
    and decode over the byte pools) give the tokens and logits of the numpy backend's
    quantizer and decode, and keep 32 greedy tokens close to eager f32 on a model that
    tolerates the 4-bit keys (tools/quant_error.py reports all five configs).

    One layer: its keys and values come from torch alone, the same on both backends, so
    both store the same codes and their logits differ by the order of f32 sums only. (With
    a second layer, the first layer's last-bit differences reach the second layer's keys,
    and a key on a rounding boundary of the 4-bit grid takes the neighbouring code on one
    backend: a difference of a whole code step that no bound on rounding covers.)"""
    for name, batch, path in (("Mistral-7B-v0.1", True, "chunk"), ("Llama-3.2-1B", False,
                                                                     "prefill")):
        got = {}
        for backend in ("cpu", "opencl"):
            cltf.register(device=device, backend=backend, k_format="q4_0", v_format="q8_0")
            try:
                got[backend] = run(name, batch, layers=1, attn_implementation="clattn")
            finally:
                cltf.register()
        dev, cpu = got["opencl"], got["cpu"]
        assert torch.equal(dev.sequences, cpu.sequences), name
        assert all(g.spec.byte_pool for g in dev.cache.groups.values())
        assert dev.cache.steps[path] == 1 and dev.cache.steps["decode"] == NEW_TOKENS - 1
        diff = max(float((a - b).abs().max()) for a, b in zip(dev.logits, cpu.logits))
        assert diff <= _reordered_sum_bound(name, cpu.logits), f"{name}: logits differ by {diff}"
        ref = run(name, batch, layers=1)
        diff = max(float((a - b).abs().max()) for a, b in zip(dev.logits, ref.logits))
        assert diff < 1.0, f"{name}: quantization should stay within reason: {diff}"


def _reordered_sum_bound(name: str, logits, layers: int = 1) -> float:
    """How far two f32 evaluations of a model of ``layers`` layers may differ when only the
    order of the attention's sums differs: each attention output is within 2 (n + 1 + D) u
    of its largest value (u = 2**-24; n rows, a learned sink's term and D products in a
    dot, both sides), and a layer's output projection, MLP and head map a relative change
    of its attention's output, or of its input, to at most 16x that change of the logits'
    scale (weights of std 0.02 on hidden 256: each matrix's spectral norm is below 1; 16
    covers the norms' and residual's gains): layer k's error reaches the logits through
    the layers after it, 16 ** (layers - k + 1) in all."""
    cfg = shrink(name, 1)
    n = max(PROMPTS) + NEW_TOKENS
    scale = max(float(x.abs().max()) for x in logits)
    gain = sum(16 ** k for k in range(1, layers + 1))
    return gain * 2 * (n + 1 + cfg["head_dim"]) * 2.0 ** -24 * max(scale, 1.0)


def test_explicit_cache_and_forward_without_cache():
    m = model("Llama-3.2-1B")
    ids = inputs(False)["input_ids"]
    m.set_attn_implementation("clattn")
    try:
        cache = ClattnCache(m, backend="cpu", max_cache_len=64)
        out = m.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
        assert out.shape[1] == ids.shape[1] + 4 and cache.get_seq_length() == ids.shape[1] + 3
        with torch.no_grad(), pytest.warns(RuntimeWarning, match="no ClattnCache"):
            plain = m(ids, use_cache=False).logits
        m.set_attn_implementation("eager")
        with torch.no_grad():
            assert torch.allclose(plain, m(ids, use_cache=False).logits, atol=1e-5)
    finally:
        m.set_attn_implementation("eager")


def filled_cache(name: str, ids: torch.Tensor) -> ClattnCache:
    """A CPU-backend ClattnCache after one forward of ``name``'s model over ``ids``."""
    m = model(name)
    m.set_attn_implementation("clattn")
    try:
        cache = ClattnCache(m, backend="cpu", max_cache_len=64)
        with torch.no_grad():  # transformers 4.x names the argument past_key_values
            m(ids, **{CACHE_ARG: cache}, use_cache=True)
    finally:
        m.set_attn_implementation("eager")
    return cache


#: the name a model's forward takes the cache by in the installed transformers
CACHE_ARG = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


def test_reorder_and_crop_share_pages():
    cache = filled_cache("Llama-3.2-1B", torch.randint(3, VOCAB, (2, 20)))
    g = cache.groups[None].cache
    used = g.stats().pages_used
    cache.reorder_cache(torch.tensor([1, 1]))  # both rows become row 1: forks
    assert g.stats().pages_used < used and g.stats().pages_shared > 0
    cache.crop(-3)
    assert [g.length(r) for r in cache.rows] == [17, 17] and cache.get_seq_length() == 17
    cache.reset()
    assert g.stats().pages_used == 0 and cache.get_seq_length() == 0


def test_beam_search_reorders_by_forks():
    m = model("Gemma-2-2B")
    kw = dict(inputs(True), max_new_tokens=8, num_beams=3, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = m.generate(**kw)
        cltf.register(backend="cpu")
        try:
            assert torch.equal(m.generate(**kw, attn_implementation="clattn"), ref)
        finally:
            cltf.register()


def test_cache_needs_clattn_attention():
    m = model("Llama-3.2-1B")  # attends eagerly: it would see the new keys only
    with torch.no_grad(), pytest.raises(RuntimeError, match="needs attn_implementation"):
        m(inputs(False)["input_ids"], cache=ClattnCache(m, backend="cpu"), use_cache=True)


def test_refusals_name_the_feature():
    m = model("Mistral-7B-v0.1")
    m.set_attn_implementation("clattn")
    try:
        ids = torch.randint(3, VOCAB, (2, 6))
        right = torch.ones_like(ids)
        right[0, 4:] = 0  # right padding with a sliding window
        cache = ClattnCache(m, backend="cpu")
        with torch.no_grad(), pytest.raises(UnsupportedFeatureError, match="pad on the left"):
            m(ids, attention_mask=right, cache=cache, use_cache=True)
        with torch.no_grad(), pytest.raises(RuntimeError, match="stopped at an error"):
            m(ids, cache=cache, use_cache=True)  # positions and tokens no longer agree
        cache.reset()
        with torch.no_grad():
            m(ids, cache=cache, use_cache=True)
        assert cache.get_seq_length() == 6 and cache.stats()["window 12"].pages_used == 2
        with torch.no_grad(), pytest.raises(UnsupportedFeatureError, match="4D attention mask"):
            m(ids, attention_mask=torch.zeros(2, 1, 6, 6), cache=ClattnCache(m, backend="cpu"),
              use_cache=True)
        with pytest.raises(UnsupportedFeatureError, match="bfloat16"):
            with torch.no_grad():
                m.to(torch.bfloat16)(ids, cache=ClattnCache(m, backend="cpu"), use_cache=True)
    finally:
        m.to(torch.float32).set_attn_implementation("eager")
    cfg = transformers.AutoConfig.for_model(**shrink("Llama-3.2-1B"))
    cfg.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(UnsupportedFeatureError, match="chunked_attention"):
        layer_windows(cfg)


def _forwards(name, steps, pads=(), **cache_kw):
    """Forwards of a batch of 2 over one cache: ``steps[i]`` new tokens each, positions
    ``pads`` (row, position) padding. Returns, per forward, the largest |logit - eager|
    over the positions that are not padding (None when all are), eager running the same
    forwards over a DynamicCache; raises what clattn raises."""
    m = model(name)
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, VOCAB, (2, n), generator=g) for n in steps]

    def run_all(cache):
        outs, mask = [], torch.ones(2, 0, dtype=torch.long)
        with torch.no_grad():
            for x in ids:
                new = torch.ones_like(x)
                for r, pos in pads:
                    if 0 <= pos - mask.shape[1] < x.shape[1]:
                        new[r, pos - mask.shape[1]] = 0
                mask = torch.cat([mask, new], 1)
                outs.append((m(x, attention_mask=mask, cache=cache, use_cache=True).logits,
                             new.bool()))
        return outs

    ref = run_all(transformers.DynamicCache(config=m.config))
    m.set_attn_implementation("clattn")
    try:
        cache = ClattnCache(m, **cache_kw)
        got = run_all(cache)
    finally:
        m.set_attn_implementation("eager")
    return [float((a - b)[keep].abs().max()) if keep.any() else None
            for (a, keep), (b, _) in zip(got, ref)], cache


def test_later_forwards_of_several_tokens_and_padding_match_eager(device):
    """Forwards after the prompt that add several tokens (assisted decoding, prompts in
    chunks), across the windows, and, without windows, a later position that is padding
    in one row or in every row: the logits of every position that is not padding are
    eager's within 1e-4."""
    for name, steps, pads in (("Mistral-7B-v0.1", [8, 3, 1, 5, 1], ()),
                              ("Llama-3.2-1B", [8, 2, 1, 1], [(1, 8), (0, 10), (1, 10)])):
        diffs, cache = _forwards(name, steps, pads, device=device, max_cache_len=64)
        assert all(d is None or d <= 1e-4 for d in diffs), (name, diffs)
        stored = [sum(steps) - sum(r == row for r, _ in pads) for row in (0, 1)]
        assert cache.get_seq_length() == sum(steps)
        for g in cache.groups.values():  # padding is not stored
            assert [g.cache.length(r) for r in cache.rows] == stored, name


def test_assisted_decoding_crops_across_windows(device, name="Gemma-2-2B"):
    """Prompt-lookup (assisted) decoding past the sliding windows: every verification
    forward adds several tokens and crop() takes the rejected ones back, including
    tokens whose window has moved on; tokens and logits are eager's."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 40, (1, 6), generator=g).repeat(1, 5)  # candidates to look up
    kw = dict(input_ids=ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3,
              output_logits=True, return_dict_in_generate=True)
    m = model(name)
    ref = m.generate(**kw)
    cltf.register(device=device)
    try:
        got = m.generate(**kw, attn_implementation="clattn")
    finally:
        cltf.register()
    assert torch.equal(got.sequences, ref.sequences), name
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits)) <= 1e-4
    assert got.cache.steps["chunk"] + got.cache.steps["prefill"] > len(got.cache.groups)


def test_padding_in_a_later_forward_refused_with_windows(device):
    """A sliding-window model, batch of 2, 8 tokens, then a forward in which row 1's new
    position is padding: refused ("pad on the left": the window would count the padding
    eager skips), nothing stored for it; the cache works again after reset()."""
    m = model("Mistral-7B-v0.1")
    m.set_attn_implementation("clattn")
    try:
        cache = ClattnCache(m, device=device)
        ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
        mask = torch.ones_like(ids)
        mask[1, 8] = 0
        with torch.no_grad():
            m(ids[:, :8], attention_mask=mask[:, :8], cache=cache, use_cache=True)
            with pytest.raises(UnsupportedFeatureError, match="pad on the left"):
                m(ids[:, 8:], attention_mask=mask, cache=cache, use_cache=True)
        g = cache.groups[12].cache
        assert [g.length(r) for r in cache.rows] == [8, 8], "the refused forward stored tokens"
        cache.reset()
        with torch.no_grad():
            m(ids, cache=cache, use_cache=True)
        assert cache.get_seq_length() == 9
    finally:
        m.set_attn_implementation("eager")


def test_mask_pattern_check():
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        sliding_window_causal_mask_function,
    )

    def check(fn, window):
        cltf.mask(1, 1, 1, mask_function=fn).check_pattern(window, 0)

    check(causal_mask_function, None)
    check(sliding_window_causal_mask_function(7), 7)
    for fn, window in ((sliding_window_causal_mask_function(8), 7),
                       (bidirectional_mask_function, None),
                       (causal_mask_function, 7)):
        with pytest.raises(UnsupportedFeatureError, match="mask pattern"):
            check(fn, window)


def test_token_views_do_not_copy():
    """q/k/v in transformers' layout ([B, L, H, D] memory seen as [B, H, L, D]) reach the
    device from a numpy view of the torch tensor: the upload is the only copy."""
    from clattn.integrations.hf_cache import GroupForward

    x = torch.randn(3, 1, 8, 64).transpose(1, 2)  # a decode step's q
    assert np.shares_memory(cltf._tokens(x, GroupForward()), x.numpy())
