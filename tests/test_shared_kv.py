"""Layers that share another layer's keys and values (``num_kv_shared_layers``: Gemma-3n,
Gemma-4) on clattn.

The last ``num_kv_shared_layers`` layers compute queries only and attend the keys and
values the last earlier layer of their type stored. A ``ClattnCache`` gives them no pool:
they attend their source layer's pool in the same step, so the memory is counted once.
Tiny random-weight models (window 8, pages of 4 tokens, a left-padded batch of two
prompts longer than the window) give eager's tokens on the CPU backend and each OpenCL
device, without a single eager attention call.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from test_hf_refusals import VOCAB, tiny
from transformers import CONFIG_MAPPING

import clattn.integrations.transformers as cltf
from clattn.integrations.hf_cache import ClattnCache, shared_kv_sources

ALTERNATING = ["sliding_attention", "full_attention"]
#: model type -> its tiny config (besides test_hf_refusals.TINY): windows, KV sharing on
MODELS = {
    "gemma3n_text": dict(num_hidden_layers=6, num_kv_shared_layers=2, head_dim=16,
                         sliding_window=8, layer_types=ALTERNATING * 3,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                         laurel_rank=4, altup_num_inputs=2, intermediate_size=64,
                         activation_sparsity_pattern=[0.0] * 6),
    # Gemma-4 runs its shared layers on the prompt's last position only (a sliced mask)
    "gemma4_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, head_dim=16,
                        global_head_dim=16, sliding_window=8, layer_types=ALTERNATING * 2,
                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                        intermediate_size=64),
}
#: those this transformers has (Gemma-4 came after 4.56): never a skip, which CI fails
PRESENT = [t for t in MODELS if t in CONFIG_MAPPING]
GEN = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 14 and 10 tokens, left-padded."""
    ids = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0
    return ids, mask


def generate_both(model_type: str, **where):
    m = tiny(model_type, MODELS[model_type])
    ids, mask = batch()
    ref = m.generate(ids, attention_mask=mask, **GEN)
    cltf.register(page_size=4, **where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no eager attention anywhere
            got = m.generate(ids, attention_mask=mask, attn_implementation="clattn",
                             return_dict_in_generate=True, **GEN)
    finally:
        cltf.register()
    return m, ref, got


def check(m, ref, got) -> None:
    assert torch.equal(got.sequences, ref)
    cache = got.past_key_values
    assert isinstance(cache, ClattnCache)
    cfg = m.config
    shared = cfg.num_kv_shared_layers
    assert len(cache.sources) == shared
    # pools only for the layers that store: what the shared layers attend is counted once
    assert sum(g.cache.num_layers for g in cache.groups.values()) == \
        cfg.num_hidden_layers - shared
    assert sorted(i for g in cache.groups.values() for i in g.members) == \
        list(range(cfg.num_hidden_layers))
    assert set(cache.groups) == {8, None}
    assert cache.steps["decode"] == 2 * (GEN["max_new_tokens"] - 1)  # one per layer kind
    for i, src in cache.sources.items():
        assert cache.layers[i].get_seq_length() == cache.layers[src].get_seq_length() > 0


@pytest.mark.parametrize("model_type", PRESENT)
def test_shared_kv_layers_match_eager_on_the_cpu_backend(model_type):
    check(*generate_both(model_type, backend="cpu"))


@pytest.mark.parametrize("model_type", PRESENT)
def test_shared_kv_layers_match_eager_on_opencl(device, model_type):
    check(*generate_both(model_type, device=device, backend="opencl"))


def test_shared_kv_sources_follow_the_layer_types():
    """Each shared layer attends the last earlier layer of its own type (transformers'
    rule); a type no earlier layer has is refused by name."""
    from types import SimpleNamespace as NS

    from clattn.integrations.hf_cache import UnsupportedFeatureError

    cfg = NS(num_hidden_layers=6, num_kv_shared_layers=2, layer_types=ALTERNATING * 3)
    assert shared_kv_sources(cfg) == {4: 2, 5: 3}
    assert shared_kv_sources(NS(num_hidden_layers=4, num_kv_shared_layers=0)) == {}
    odd = NS(num_hidden_layers=3, num_kv_shared_layers=1,
             layer_types=["sliding_attention"] * 2 + ["full_attention"])
    with pytest.raises(UnsupportedFeatureError, match="layer 2 shares .* there is none"):
        shared_kv_sources(odd)
