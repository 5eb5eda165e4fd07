"""Which transformers architectures run on clattn, and the named refusals of those that
cannot (docs/transformers.md, "Architectures"; tests/test_hf_sweep.py sweeps every
architecture the installed transformers registers).

Tiny random-weight models are built from configs (2 layers, hidden size 64, a 128-token
vocabulary). Models whose attention module does not call transformers'
``AttentionInterface`` (GPT-Neo, Bloom, MPT) would stay on their own attention
whatever ``attn_implementation`` says: asking them for ``"clattn"`` is an
``UnsupportedFeatureError`` naming why, at model creation, ``set_attn_implementation``
and ``generate(attn_implementation=...)``. (Multi-head latent attention runs, in the
latent and the decompressed form: tests/test_transformers_mla.py.) Architectures the
tests elsewhere do not build generate eager's tokens on the CPU backend.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import clattn.integrations.transformers as cltf
from clattn.integrations.hf_cache import ClattnCache, UnsupportedFeatureError

# one intra-op thread: the tiny models' matmuls are microseconds of work, and a thread
# pool that waits for busy cores (a shared CI machine) makes them 10-20x slower
torch.set_num_threads(1)

VOCAB = 128
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
#: model type -> the config keys it needs besides TINY (its own names for the sizes)
NO_INTERFACE = {
    "gpt_neo": dict(num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                    window_size=8),
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
    "falcon": {},                                         # RoPE (alibi=False)
}
#: model type -> (config keys, the feature the refusal names): refused at set-up, or at
#: the first forward where only the forward shows it
NAMED = {
    "falcon": (dict(alibi=True), r"ALiBi \(config.alibi=True"),
    "minimax": ({}, r"layer type 'linear_attention'"),
    "diffllama": ({}, r"differential attention as in DiffLlama"),
    "jetmoe": (dict(kv_channels=16, num_local_experts=4, num_experts_per_tok=2),
               r"JetMoE's mixture of attention heads"),
    "doge": ({}, r"computes with the attention mask .*Doge's dynamic mask"),
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


#: classes that build their own 4D mask in transformers 4.x: refused by name there
OWN_MASK_BEFORE_5 = {"opt"}
INTERFACE = r"ForCausalLM does not attend through transformers' AttentionInterface"


def uses_interface(model) -> bool:
    """Whether the installed transformers' class of ``model`` attends through the
    ``AttentionInterface`` (older releases had their own modules for some: 4.56's
    Falcon, GPT-J, DiffLlama, JetMoE), else its refusal is the interface's."""
    can = getattr(type(model), "_can_set_attn_implementation", None)
    return can is None or can()


@pytest.mark.parametrize("model_type", list(RUNS))
def test_more_architectures_generate_eager_tokens(model_type):
    m = tiny(model_type, RUNS[model_type])
    if not uses_interface(m):
        refused_everywhere(model_type, RUNS[model_type], INTERFACE)
        return
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = m.generate(prompt(), **kw)
    cltf.register(backend="cpu")
    try:
        if model_type in OWN_MASK_BEFORE_5 and transformers.__version__ < "5":
            with pytest.raises(UnsupportedFeatureError, match="a prepared 4D attention mask"):
                m.generate(prompt(), attn_implementation="clattn", **kw)
            return
        got = m.generate(prompt(), attn_implementation="clattn", return_dict_in_generate=True,
                         **kw)
    finally:
        cltf.register()
    assert isinstance(got.past_key_values, ClattnCache)
    assert got.past_key_values.steps["decode"] == 11
    assert torch.equal(got.sequences, ref)


@pytest.mark.parametrize("model_type", list(NAMED))
def test_alibi_linear_and_differential_attention_are_refused_by_name(model_type):
    """Never a crash and never a silent eager run: an ``UnsupportedFeatureError`` naming
    the feature, at set-up where the config shows it (ALiBi, layer types), else at the
    first forward (the forward changes the keys or computes with the mask)."""
    extra, match = NAMED[model_type]
    m = tiny(model_type, extra)
    if not uses_interface(m):
        match = INTERFACE
    with pytest.raises(UnsupportedFeatureError, match=match):
        m.set_attn_implementation("clattn")
        cltf.register(backend="cpu")
        try:
            m.generate(prompt(), max_new_tokens=2, do_sample=False, pad_token_id=0)
        finally:
            cltf.register()
