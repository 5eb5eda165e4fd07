"""Phi-3-family longrope models stay on clattn across the switch of rotary factors.

A longrope model rotates with its short factors while the sequence is at most
``original_max_position_embeddings`` long and with its long factors after; when the
sequence reaches the switch, its generate code drops the cache and recomputes every
position with the long factors. The integration resets the ClattnCache and gives it back,
so that the recompute and every later step run on clattn: each test asserts eager's tokens,
logits within 1e-4 (tests/test_transformers.py's bound), one restart, a step on clattn for
every generated token (the cache's step counters) and no eager-fallback warning.

Tiny random-weight models of the published Phi-3.5-mini, Phi-4-mini and Phi-3.5-MoE attention
(head_dim, GQA ratio, partial rotary factor, the window, the ratio of
``max_position_embeddings`` to ``original_max_position_embeddings``) with fewer heads, the
switch shortened to 16 positions and factors of the published shape (short near 1, long up
to 60), so that prompts of 10 and 24 tokens with 16 new tokens start below and above it.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import clattn.integrations.transformers as cltf
from clattn.integrations.hf_cache import ClattnCache

ORIGINAL = 16  # original_max_position_embeddings, shortened from 4096
VOCAB = 512
NEW_TOKENS = 16
PROMPTS = (10, 24)  # below and above the switch
BOUND = 1e-4  # f32 logits, as tests/test_transformers.py


def _factors(n: int) -> dict:
    """Short factors near 1 and long ones rising to 60, as the published lists run."""
    return {"short_factor": [1.0 + 0.05 * i for i in range(n)],
            "long_factor": [60.0 ** (i / (n - 1)) for i in range(n)]}


# the published attention keys, with fewer heads (head_dim, the q/kv ratio, partial rotary
# factor and the window kept) and the switch at ORIGINAL (max_position_embeddings keeps the
# published ratio of 32, so the attention factor is the published one)
CONFIGS = {
    "Phi-3.5-mini": dict(num_attention_heads=4, num_key_value_heads=4, hidden_size=4 * 96,
                         sliding_window=262144, partial_rotary_factor=1.0, rotary=96),
    "Phi-4-mini": dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=3 * 128,
                       sliding_window=262144, partial_rotary_factor=0.75, rotary=96,
                       tie_word_embeddings=True),
    # PhiMoE reads the switch from the rope parameters and scales cos/sin by its mscales;
    # no window (its attention does not pass the config's window: refused by name)
    "Phi-3.5-MoE": dict(model_type="phimoe", num_attention_heads=4, num_key_value_heads=1,
                        hidden_size=4 * 128, sliding_window=None, partial_rotary_factor=1.0,
                        rotary=128, num_local_experts=4, num_experts_per_tok=2,
                        rope={"short_mscale": 1.243163121016122,
                              "long_mscale": 1.243163121016122}),
}
_MODELS: dict = {}
_EAGER: dict = {}


def model(name: str):
    """The tiny model (2 layers, random f32 weights, seeded), built once."""
    if name not in _MODELS:
        c = dict(CONFIGS[name])
        rotary = c.pop("rotary")
        rope = {"rope_type": "longrope", "partial_rotary_factor": c["partial_rotary_factor"],
                "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
                **_factors(rotary // 2), **c.pop("rope", {})}
        cfg = transformers.AutoConfig.for_model(
            c.pop("model_type", "phi3"), vocab_size=VOCAB, intermediate_size=512,
            num_hidden_layers=2,
            max_position_embeddings=32 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
            rope_scaling=rope, pad_token_id=0, bos_token_id=1, eos_token_id=2, **c)
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             dtype=torch.float32).eval()
        m.generation_config.pad_token_id = 0
        _MODELS[name] = m
    return _MODELS[name]


def prompt(n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))


GEN = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}


def generate(m, ids: torch.Tensor, new: int, **kw):
    """Greedy ``new`` tokens; fails on clattn's eager-fallback warning."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = m.generate(ids, max_new_tokens=new, min_new_tokens=new, **GEN, **kw)
    fallback = [str(w.message) for w in seen if "no ClattnCache" in str(w.message)]
    assert not fallback, f"attention fell back to eager: {fallback[0]}"
    return out


def where(target) -> dict:
    """The ClattnCache options of a backend of conftest's ``target`` fixture."""
    if target.is_cpu:
        return {"backend": "cpu"}
    return {"device": target.device, "profile": target.profile}


def same(got, ref) -> None:
    diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits))
    assert len(got.logits) == len(ref.logits)
    assert torch.equal(got.sequences, ref.sequences), f"tokens differ (logits by {diff})"
    assert diff <= BOUND, f"logits differ by {diff}"


def on_clattn(cache, restarts: int, prompts: int, forwards: int, pads=None) -> None:
    """Every one of ``forwards`` forwards ran on clattn: ``prompts`` prompt steps (the
    first, and each recompute after a restart), a decode step for each other one (one
    layer kind: every layer has the same window or none), and each row stores its
    positions but its ``pads`` padding ones, once."""
    assert isinstance(cache, ClattnCache)
    assert cache.restarts == restarts
    assert cache.steps["prefill"] + cache.steps["chunk"] == prompts
    assert cache.steps["decode"] == forwards - prompts
    pads = [0] * len(cache.rows) if pads is None else pads
    assert [cache.get_seq_length() - p for p in pads] == \
        [g.cache.length(r) for g in cache.groups.values() for r in cache.rows]


@pytest.mark.parametrize("length", PROMPTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_crosses_the_switch_on_clattn(name, length, target):
    m = model(name)
    ids = prompt(length)
    if (name, length) not in _EAGER:
        _EAGER[name, length] = generate(m, ids, NEW_TOKENS)
    ref = _EAGER[name, length]
    cltf.register(**where(target))
    try:
        got = generate(m, ids, NEW_TOKENS, attn_implementation="clattn")
    finally:
        cltf.register()
    same(got, ref)
    # a prompt past the switch is dropped at once (a restart of the empty cache): one
    # prompt step; a prompt below it gets a second prompt step at the switch
    on_clattn(got.cache, 1, 2 if length <= ORIGINAL else 1, NEW_TOKENS)
    assert got.cache.get_seq_length() == length + NEW_TOKENS - 1


def test_passed_cache_kept_across_turns(target, name="Phi-4-mini"):
    """A ClattnCache the caller passes: a first turn below the switch, a second turn that
    crosses it; the caller's cache object is reset, refilled and returned."""
    m = model(name)
    first, second = 4, 8
    ref1 = generate(m, prompt(6), first, cache=DynamicCache(config=m.config))
    ids2 = torch.cat([ref1.sequences, prompt(3)], 1)  # 13 tokens: the switch comes at 17
    ref2 = generate(m, ids2, second, cache=ref1.cache)
    m.set_attn_implementation("clattn")
    try:
        cache = ClattnCache(m, max_cache_len=64, **where(target))
        got1 = generate(m, prompt(6), first, cache=cache)
        same(got1, ref1)
        assert got1.cache is cache and cache.restarts == 0
        got2 = generate(m, ids2, second, cache=cache)
    finally:
        m.set_attn_implementation("eager")
    same(got2, ref2)
    assert got2.cache is cache
    assert cache.get_seq_length() == ids2.shape[1] + second - 1
    # turn 1: a prompt step and 3 decode steps; turn 2: the new prompt tokens, 3 decode
    # steps to the switch, the recompute, 4 decode steps after it
    on_clattn(cache, 1, 3, first + second)


def _batch() -> dict:
    """Three left-padded prompts of 5, 9 and 12 tokens."""
    g = torch.Generator().manual_seed(5)
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate((5, 9, 12)):
        ids[i, 12 - p:] = torch.randint(3, VOCAB, (p,), generator=g)
        mask[i, 12 - p:] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _repeats() -> dict:
    """A prompt of repeated n-grams, so that prompt lookup finds drafts."""
    base = prompt(5)
    return {"input_ids": torch.cat([base, base, base[:, :3]], 1), "prompt_lookup_num_tokens": 4}


@pytest.mark.parametrize("case", ["left-padded batch", "beam search", "prompt lookup"])
def test_batches_beams_and_drafts_cross_the_switch(case, target, name="Phi-4-mini"):
    """Every row of a left-padded batch, beams (rows re-mapped by forks before the
    switch) and prompt lookup (whose crops bring the sequence back below the switch, so
    that the model drops the cache again, as eager's) recompute on clattn."""
    m = model(name)
    kw = {"left-padded batch": _batch(),
          "beam search": {"input_ids": prompt(9), "num_beams": 3},
          "prompt lookup": _repeats()}[case]
    new = 12
    ids = kw.pop("input_ids")
    ref = generate(m, ids, new, **kw)
    cltf.register(**where(target))
    try:
        got = generate(m, ids, new, attn_implementation="clattn", **kw)
    finally:
        cltf.register()
    same(got, ref)
    if case == "prompt lookup":  # how many forwards depends on the drafts accepted
        assert got.cache.restarts >= 1
        assert got.cache.get_seq_length() >= ids.shape[1] + new - 1
    else:
        mask = kw.get("attention_mask")
        pads = None if mask is None else (mask == 0).sum(1).tolist()
        on_clattn(got.cache, 1, 2, new, pads)
