"""Speculative decoding through ``attn_implementation="clattn"``: prompt-lookup and
assisted decoding give eager's tokens, sliding-window models included.

A verify forward appends the draft tokens, and ``crop`` takes back the rejected ones. A
window layer gives back the pages that fall out of its window at every step, so it keeps
what transformers asks for with ``activate_past_recording()`` (the tokens appended since
the last crop), and a crop it cannot honour is refused by name before any row changes.
Tiny random-weight models (tests/test_hf_refusals.py's) with windows of 8 and pages of
4 tokens, so that every verify step crosses given-back pages; the drafts of a random
model are mostly rejected, so most steps crop.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from test_hf_refusals import VOCAB, tiny
from transformers import CONFIG_MAPPING

import clattn.integrations.transformers as cltf
from clattn.integrations.hf_cache import ClattnCache

#: the architecture classes that speculative decoding must keep exact: a window on every
#: layer (StarCoder2, Mistral, Qwen2 with use_sliding_window), alternating window and full
#: layers (Gemma-2, Gemma-3, Cohere2, Ministral), full attention only (Llama), multi-head
#: latent attention in the latent form (DeepSeek-V2, DeepSeek-V3)
MODELS = {
    "starcoder2": dict(sliding_window=8),
    "gemma2": dict(head_dim=16, sliding_window=8),
    "llama": {},
    "mistral": dict(sliding_window=8),
    "gemma3_text": dict(head_dim=16, sliding_window=8, sliding_window_pattern=2),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
    "cohere2": dict(sliding_window=8, sliding_window_pattern=2, tie_word_embeddings=False,
                    logit_scale=1.0),  # tied at 1/16: every model repeats a token
    "ministral": dict(head_dim=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"]),
}
#: multi-head latent attention in its latent form (one row [latent | rope key] per token:
#: a crop pops rows), DeepSeek-V3 with its interleaved RoPE
_MLA = dict(kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_group=1, topk_group=1)
MODELS.update(deepseek_v2=_MLA, deepseek_v3=dict(_MLA, rope_interleave=True))
MODELS = {t: extra for t, extra in MODELS.items() if t in CONFIG_MAPPING}  # 4.56: no Ministral
GEN = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)


def prompt() -> torch.Tensor:
    """Repeated n-grams, so that prompt lookup finds drafts."""
    base = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    return torch.cat([base, base, base[:, :4]], 1)


def assistant(model_type: str, attn: str = "eager"):
    """A draft model of other random weights: its drafts of 10 tokens are rejected, most
    of them from their first token, so that crops take back more than a window of 8."""
    a = tiny(model_type, MODELS[model_type], seed=4)
    a.set_attn_implementation(attn)
    # a random model is never confident: without this, drafts stop after one token
    a.generation_config.assistant_confidence_threshold = 0.0
    a.generation_config.num_assistant_tokens = 10
    a.generation_config.num_assistant_tokens_schedule = "constant"
    return a


@pytest.fixture
def crops(monkeypatch):
    """The ``n`` of every ``ClattnCache.crop(-n)`` with ``n > 0``."""
    seen: list = []
    crop = ClattnCache.crop

    def counted(self, tokens_to_remove):
        if tokens_to_remove > 0:  # transformers 4.x: the length to keep
            tokens_to_remove = min(0, tokens_to_remove - self.get_seq_length())
        if tokens_to_remove < 0:
            seen.append(-tokens_to_remove)
        return crop(self, tokens_to_remove)

    monkeypatch.setattr(ClattnCache, "crop", counted)
    return seen


#: each way of drafting: generate's arguments for a model type
DRAFTS = {
    "prompt-lookup": lambda model_type: dict(prompt_lookup_num_tokens=10),
    "assisted": lambda model_type: dict(assistant_model=assistant(model_type)),
    # the draft model on clattn too: its own cache is cropped back to the accepted tokens
    "assisted-by-clattn": lambda model_type: dict(
        assistant_model=assistant(model_type, "clattn")),
}


def generate_both(model_type: str, how: str, **where):
    """Eager's tokens and clattn's output (``where``: register()'s device arguments)."""
    m = tiny(model_type, MODELS[model_type])
    draft = DRAFTS[how](model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Gemma-2's "hybrid" cache_implementation notice
        eager_crop = None
        try:
            ref = m.generate(prompt(), **GEN, **draft)
        except ValueError as exc:  # 4.56's own window layers cannot crop: greedy decoding
            if "Cannot `crop`" not in str(exc):  # is what speculative decoding must give
                raise
            eager_crop = str(exc)
            ref = m.generate(prompt(), **GEN)
        cltf.register(page_size=4, **where)
        try:
            if eager_crop and how == "assisted":  # the eager draft's own cache: as eager
                with pytest.raises(ValueError, match="Cannot `crop`"):
                    m.generate(prompt(), attn_implementation="clattn", **GEN, **draft)
                return ref, None
            got = m.generate(prompt(), attn_implementation="clattn",
                             return_dict_in_generate=True, **GEN, **draft)
        finally:
            cltf.register()
    return ref, got


def check(ref, got, crops) -> None:
    if got is None:  # transformers 4.x refused its own eager draft's crop, as in eager
        return
    assert torch.equal(got.sequences, ref), "speculative decoding on clattn left eager's tokens"
    cache = got.past_key_values
    assert isinstance(cache, ClattnCache)
    assert crops and max(crops) > 8, f"no crop took back more than a window: {crops}"
    n = cache.get_seq_length()  # 4.x leaves a last verify step's tokens in (no crop)
    assert n >= prompt().shape[1] + GEN["max_new_tokens"] - 1
    for w, g in cache.groups.items():
        assert [g.cache.length(r) for r in cache.rows] == [n]
        if w is not None:  # the window gave pages back: what is held is about the window's
            used = g.cache.stats().pages_used
            assert used * 4 < n, f"window {w}: {used} pages held for {n} tokens"


@pytest.mark.parametrize("how", list(DRAFTS))
@pytest.mark.parametrize("model_type", list(MODELS))
def test_speculative_decoding_matches_eager_on_the_cpu_backend(model_type, how, crops):
    check(*generate_both(model_type, how, backend="cpu"), crops)


@pytest.mark.parametrize("how", list(DRAFTS))
@pytest.mark.parametrize("model_type", list(MODELS))
def test_speculative_decoding_matches_eager_on_opencl(device, model_type, how, crops):
    check(*generate_both(model_type, how, device=device, backend="opencl"), crops)


def test_crop_beyond_the_kept_margin_is_refused_by_name():
    """Without past recording a window keeps no margin: a crop past it is refused naming
    the window and the fix, before any row or layer kind changes."""
    from test_transformers import filled_cache

    cache = filled_cache("Gemma-2-2B", torch.randint(3, 1024, (2, 40)))
    before = {w: [g.cache.length(r) for r in cache.rows] for w, g in cache.groups.items()}
    seen = cache.get_seq_length()
    with pytest.raises(ValueError, match=r"crop\(-30\): .*window 16.*activate_past_recording"):
        cache.crop(-30)
    assert {w: [g.cache.length(r) for r in cache.rows]
            for w, g in cache.groups.items()} == before
    assert cache.get_seq_length() == seen
    cache.crop(-2)  # inside the window: no margin needed
    assert cache.get_seq_length() == seen - 2
    assert np.all([g.cache.length(r) == 38 for g in cache.groups.values() for r in cache.rows])


def test_cache_rollback_set_between_steps_keeps_what_pop_takes_back():
    """PagedKVCache: ``rollback`` read at each end(); ``poppable`` says how far pop goes
    (the integration's margin, on the cache itself)."""
    import clattn

    spec = clattn.AttentionSpec(2, 1, 32, page_size=2, dtype="float32", sliding_window=True)
    cache = clattn.PagedKVCache(spec, 1, num_pages=16, backend="cpu")
    cache.add("s", window=4)
    kv = np.zeros((6, 1, 32), np.float32)

    def step(n):
        cache.begin(["s"], [n])
        cache.append(0, kv[:n], kv[:n])
        cache.end()

    step(6)
    step(6)  # 12 tokens, no margin: only what the window of a shorter sequence keeps
    assert cache.poppable("s") == 0 and cache.stats().pages_used == 2  # tokens 8..11
    with pytest.raises(ValueError, match="rollback=-1"):
        cache.rollback = -1
    cache.rollback = 6
    step(6)  # the 6 tokens of this step stay poppable
    assert cache.poppable("s") == 6 and cache.stats().pages_used == 5  # tokens 8..17
    cache.pop("s", 6)
    assert cache.length("s") == 12
    cache.rollback = 0
    step(1)  # the margin's pages go back at the next end()
    assert cache.poppable("s") == 1 and cache.stats().pages_used == 3  # tokens 8..12


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_a_clattn_draft_with_short_drafts_grows_past_its_first_call(model_type):
    """The draft model's ClattnCache is made by its first ``generate`` (prompt + one
    draft) and kept across the drafts that follow: it is sized for the main call's
    length, so that drafts of 2 tokens reach the end of 16 new tokens (a cache sized by
    the first call alone holds 24 tokens here, the full-attention layers need 31)."""
    m = tiny(model_type, MODELS[model_type])
    draft = assistant(model_type, "clattn")
    draft.generation_config.num_assistant_tokens = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = m.generate(prompt(), **GEN)
        cltf.register(page_size=4, backend="cpu")
        try:
            got = m.generate(prompt(), attn_implementation="clattn", assistant_model=draft,
                             **GEN)
        finally:
            cltf.register()
    assert torch.equal(got, ref)
