"""Which transformers architectures run on clattn, and the named refusals of those that
cannot (docs/transformers.md, "Architectures").

Tiny random-weight models are built from configs (2 layers, hidden size 64, a 128-token
vocabulary). Models whose attention module does not call transformers'
``AttentionInterface`` (GPT-Neo, Falcon, Bloom, MPT) would stay on their own attention
whatever ``attn_implementation`` says: asking them for ``"clattn"`` is an
``UnsupportedFeatureError`` naming why, at model creation, ``set_attn_implementation``
and ``generate(attn_implementation=...)``. (Multi-head latent attention runs, decompressed:
tests/test_transformers_mla.py.) Architectures the tests elsewhere do not build
generate eager's tokens on the CPU backend.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import clattn.integrations.transformers as cltf
from clattn.integrations.hf_cache import ClattnCache, UnsupportedFeatureError

VOCAB = 128
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
#: model type -> the config keys it needs besides TINY (its own names for the sizes)
NO_INTERFACE = {
    "gpt_neo": dict(num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                    window_size=8),
    "falcon": {},
    "bloom": dict(n_layer=2, n_head=4),
    "mpt": dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=256),
}
#: architectures that run on clattn and that tests/test_transformers.py does not build
RUNS = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4),       # learned absolute positions
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8),  # partial rotary, pairs
    "gpt_neox": {},                                       # Pythia
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "starcoder2": dict(sliding_window=8),                 # window, biases
}


def tiny(model_type: str, extra: dict, attn: str = "eager", seed: int = 0):
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra})
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn,
                                                dtype=torch.float32).eval()


def prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))


def refused_everywhere(model_type: str, extra: dict, match: str) -> None:
    """"clattn" asked at creation, by set_attn_implementation and by generate: refused
    with ``match``; the eager model is left as it was."""
    with pytest.raises(UnsupportedFeatureError, match=match):
        tiny(model_type, extra, attn="clattn")
    m = tiny(model_type, extra)
    with pytest.raises(UnsupportedFeatureError, match=match):
        m.set_attn_implementation("clattn")
    with pytest.raises(UnsupportedFeatureError, match=match):
        m.generate(prompt(), max_new_tokens=2, attn_implementation="clattn")
    assert m.config._attn_implementation == "eager"
    with torch.no_grad():
        m(prompt())  # still runs, eagerly


@pytest.mark.parametrize("model_type", list(NO_INTERFACE))
def test_models_without_the_attention_interface_are_refused_by_name(model_type):
    refused_everywhere(model_type, NO_INTERFACE[model_type],
                       r"ForCausalLM does not attend through transformers' AttentionInterface")


@pytest.mark.parametrize("model_type", list(RUNS))
def test_more_architectures_generate_eager_tokens(model_type):
    m = tiny(model_type, RUNS[model_type])
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = m.generate(prompt(), **kw)
    cltf.register(backend="cpu")
    try:
        got = m.generate(prompt(), attn_implementation="clattn", return_dict_in_generate=True,
                         **kw)
    finally:
        cltf.register()
    assert isinstance(got.past_key_values, ClattnCache)
    assert got.past_key_values.steps["decode"] == 11
    assert torch.equal(got.sequences, ref)
