"""The architecture sweep's helpers: every causal LM the installed transformers registers,
built tiny from its config class, generating through eager and through clattn.

Discovery is transformers' own: ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model type -> its
``...ForCausalLM`` class). A model type whose config holds a ``text_config`` (a
multimodal wrapper: Gemma-3, Gemma-3n, Llama-4, ...) is swept through its text model type
(:func:`wrapped_text_type`), which the mapping registers too.

The tiny config: the config class's defaults with the sizes of :data:`SIZES` set under
whatever names the class gives them (``attribute_map``), 2 layers (one of each layer type
the default has, where it has several), window and chunk sizes of :data:`WINDOW` where
the class has them, and every per-layer list cut to the layers kept.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 128
WINDOW = 8  # shorter than both prompts: windows slide inside the prompt
#: the sizes every tiny model gets, under the config's own names
SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
#: further size names some classes use for the same things
ALIASES = dict(n_embd=64, d_model=64, n_head=4, n_heads=4, num_heads=4, ffn_dim=128,
               n_inner=128, word_embed_proj_dim=64, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
               n_routed_experts=4, num_experts_per_tok=2, kv_channels=16,
               hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
               global_head_dim=16, laurel_rank=4, rotary_dim=8)
#: the sizes of multi-head latent attention (``kv_lora_rank``; the sweep runs the default
#: latent form: rows of 32 + 8, one KV head; decompressed: keys of nope + rope = 24,
#: values of 16 (unequal widths)
MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16)
LAYERS = 2
MAX_PARAMETERS = 5_000_000  # a tiny model has far fewer: more means a size was not set


class NotTinyError(ValueError):
    """The tiny config still builds a large model (a size under a name not set)."""

PROMPTS = (14, 10)  # tokens of the two prompts (the second left-padded)
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


def causal_lm_types() -> list[str]:
    """Every model type with a causal-LM class in this transformers, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def wrapped_text_type(model_type: str) -> str | None:
    """The text model type of a multimodal wrapper (its config has a ``text_config``);
    None for a model type that is its own text model."""
    cls = CONFIG_MAPPING[model_type]
    sub = getattr(cls, "sub_configs", None) or {}
    text = sub.get("text_config")
    if text is None or not isinstance(text, type):
        return None
    return getattr(text, "model_type", None) or None


def _layer_indices(default: Any) -> list[int]:
    """Which of the default config's layers to keep: the first, and the first of each
    other layer type (2 layers at least)."""
    n = int(getattr(default, "num_hidden_layers", LAYERS) or LAYERS)
    types = getattr(default, "layer_types", None)
    keep = [0]
    if types:
        seen = {types[0]}
        for i, t in enumerate(types):
            if t not in seen:
                seen.add(t)
                keep.append(i)
    while len(keep) < LAYERS and len(keep) < n:
        keep.append(next(i for i in range(n) if i not in keep))
    return sorted(keep)


def tiny_config(model_type: str) -> Any:
    """The model type's config, tiny (see the module's docstring)."""
    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = cls()
    n = int(getattr(default, "num_hidden_layers", LAYERS) or LAYERS)
    keep = _layer_indices(default)
    kw: dict = {}
    for name, value in {**SIZES, **ALIASES}.items():
        if name in cls.attribute_map or hasattr(default, name):
            kw[name] = value
    kw["num_hidden_layers"] = len(keep)
    for name in ("num_layers", "n_layer", "n_layers"):
        if hasattr(default, name) and name not in cls.attribute_map:
            kw[name] = len(keep)
    for name in ("sliding_window", "attention_chunk_size", "window_size"):
        if getattr(default, name, None):
            kw[name] = WINDOW
    for name, value in vars(default).items():  # per-layer lists: the layers kept
        if isinstance(value, (list, tuple)) and len(value) == n and n > 1 and \
                not name.startswith("_"):
            kw[name] = type(value)(value[i] for i in keep)
    if getattr(default, "kv_lora_rank", None):  # multi-head latent attention: its sizes
        kw.update(MLA, num_key_value_heads=SIZES["num_attention_heads"])  # one per head
        if getattr(default, "q_lora_rank", None) is None:
            kw.pop("q_lora_rank")
        if "head_dim" in kw:  # the rotary part's size, where the class names it so
            kw["head_dim"] = MLA["qk_rope_head_dim"]
    if getattr(default, "num_kv_shared_layers", 0):
        kw["num_kv_shared_layers"] = 0  # tests/test_shared_kv.py runs it with sharing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return cls(**kw)
        except Exception:  # noqa: BLE001 - a class that checks its arguments: set after
            cfg = default
            for name, value in kw.items():
                try:
                    setattr(cfg, name, value)
                except Exception:  # noqa: BLE001
                    pass
            return cfg


def tiny_model(model_type: str, attn: str = "eager") -> Any:
    """The tiny model (float32, eval, seeded weights)."""
    cfg = tiny_config(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):  # sized before any memory is spent on it
                size = sum(p.numel() for p in
                           AutoModelForCausalLM.from_config(cfg).parameters())
        except NotImplementedError:  # an older transformers copies data at init: the
            # embedding's size, from the config, stands for the model's
            text = cfg.get_text_config(decoder=True)
            size = int(getattr(text, "vocab_size", 0) or 0) * \
                int(getattr(text, "hidden_size", 0) or 0) * int(text.num_hidden_layers or 1)
        if size > MAX_PARAMETERS:
            raise NotTinyError(f"{model_type}: {size} parameters from the tiny config (a size "
                               f"the config class names otherwise)")
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn,
                                                dtype=torch.float32).eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of two prompts (:data:`PROMPTS` tokens)."""
    n = max(PROMPTS)
    ids = torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, length in enumerate(PROMPTS):
        ids[row, :n - length] = 0
        mask[row, :n - length] = 0
    return ids, mask


# ------------------------------------------------------------------------------ the table
#: why clattn refuses: reason -> (what the refusal's message matches, the docs' words).
#: docs/transformers.md shows :func:`refusal_table` (tests/test_hf_sweep.py checks it)
REASONS = {
    "interface": (r"does not attend through transformers' AttentionInterface|"
                  r"without a single call of clattn's attention",
                  "attention module outside `AttentionInterface` (its own code)"),
    "encoder-decoder": (r"encoder-decoder models", "encoder-decoder (cross-attention)"),
    "not causal": (r"is not causal|is_causal=False", "bidirectional (not causal) attention"),
    "recurrent": (r"layer type '(linear_attention|hybrid|hybrid_sliding|conv|"
                  r"heavily_compressed_attention|indexed_attention)'",
                  "recurrent, linear, convolutional, compressed or indexed layers (layer "
                  "types other than full and sliding attention)"),
    "chunked": (r"layer type 'chunked_attention'", "chunked attention layers"),
    "keys changed": (r"the keys/values given to attention are not the ones",
                     "keys/values changed between the cache update and attention "
                     "(differential attention, mixture of attention heads)"),
    "mask bias": (r"computes with the attention mask",
                  "a bias added through the attention mask (ALiBi, dynamic masks)"),
    "alibi": (r"ALiBi \(config.alibi=True", "ALiBi (`config.alibi=True`)"),
    "window not passed": (r"attends with sliding_window=None, the cache was made for",
                          "a config window the attention module does not pass on"),
}
#: model type -> reason: every refusal the sweep expects from this transformers (a type
#: it does not register is not checked: the table spans the releases the hf extra allows)
REFUSED = {
    **dict.fromkeys(["big_bird", "bloom", "cpmant", "gpt_neo", "gpt_neox_japanese",
                     "megatron-bert", "mpt", "openai-gpt", "rembert", "roformer", "rwkv",
                     "trocr", "xglm", "xlm", "xlnet"], "interface"),
    **dict.fromkeys(["bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian",
                     "mbart", "musicgen", "musicgen_melody", "mvp", "pegasus", "plbart",
                     "prophetnet", "whisper"], "encoder-decoder"),
    **dict.fromkeys(["bert", "bert-generation", "camembert", "data2vec-text", "electra",
                     "ernie", "roberta", "roberta-prelayernorm", "xlm-roberta",
                     "xlm-roberta-xl"], "not causal"),
    **dict.fromkeys(["bamba", "falcon_mamba", "granitemoehybrid", "jamba", "lara_mini",
                     "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid",
                     "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "qwen4_exp_text",
                     "recurrent_gemma", "zamba", "zamba2", "falcon_h1", "zaya",
                     "inkling2_loop_text", "inkling2_text", "inkling_text", "lfm3",
                     "deepseek_v4", "kolibri1_1", "axk2", "bailing_hybrid", "deepseek_v32",
                     "dots3_note_text", "glm_moe_dsa", "hy_v4", "kimi_linear"], "recurrent"),
    "llama4_text": "chunked",
    "diffllama": "keys changed", "jetmoe": "keys changed",
    "doge": "mask bias",
    "moshi": "window not passed",
}
#: model types this sweep cannot build tiny from their config class alone (a size under
#: a name it does not set, a nested config, a required setting): each is a gap of the
#: sweep, not a result; where another test covers the class it says which
NOT_BUILT = {
    "axk1": "attention sizes under names the sweep does not set",
    "beam": "head sizes derived from settings the sweep does not set",
    "blt": "byte-level patcher: sizes in nested configs",
    "cohere_compass_text": "layer types the default config cannot take",
    "dbrx": "nested attention config",
    "dory": "position settings the sweep does not set",
    "dots1": "MoE sizes left None",
    "ergo": "sizes under other names",
    "fuyu": "multimodal sizes",
    "gemma3n_text": "per-layer sizes (tests/test_shared_kv.py builds it, KV sharing on)",
    "gemma4_assistant": "an assistant of a Gemma-4 model",
    "gemma4_text": "per-layer configs (tests/test_shared_kv.py builds it, KV sharing on)",
    "gemma4_unified_assistant": "an assistant of a Gemma-4 model",
    "gemma4_unified_text": "per-layer configs",
    "git": "vision sizes",
    "got_ocr2": "vision sizes",
    "lfm2_moe": "layer lists left None",
    "moss_transcribe_diarize": "audio sizes",
    "phi4_multimodal": "vision and audio sizes",
    "reformer": "needs is_decoder and its own attention settings",
    "roc_bert": "sizes under other names",
    "xlstm": "recurrent state sizes",
    "xmod": "needs a default language",
    # multimodal wrappers whose text model has no causal-LM class of its own
    "emu3": "image-token wrapper (text model emu3_text_model)",
    "mllama": "image wrapper with cross-attention layers (text model mllama_text_model)",
}


def refusal_table() -> str:
    """The markdown table docs/transformers.md shows: each reason, its model types."""
    rows = ["| refused: | model types (this transformers) | the error names |", "|---|---|---|"]
    for key, (_, words) in REASONS.items():
        types = sorted(t for t, why in REFUSED.items() if why == key)
        rows.append(f"| {words} | {', '.join(types) or '(none registered)'} | {key} |")
    return "\n".join(rows)


def run(model_type: str, **where: Any) -> tuple[str, str]:
    """One model type through the sweep: ``("refused", message)`` (an
    ``UnsupportedFeatureError`` at set-up or in generate), ``("exact", "")``, or
    ``("not built", why)`` when the tiny model cannot be built or run eagerly. Any other
    error propagates (a crash); tokens that differ from eager's, a layer whose cache
    layer never saw a token (it skipped clattn) or an eager attention call (a
    RuntimeWarning, made an error here) fail an assertion."""
    import clattn.integrations.transformers as cltf
    from clattn.integrations.hf_cache import ClattnCache, UnsupportedFeatureError, check_config

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            default = CONFIG_MAPPING[model_type]()
        check_config(default)  # encoder-decoder, ALiBi, layer types: before any build
    except UnsupportedFeatureError as exc:
        return "refused", str(exc)
    except Exception:  # noqa: BLE001 - a default the check cannot read: the build tells
        pass
    try:
        m = tiny_model(model_type)
    except Exception as exc:  # noqa: BLE001 - the sweep's gap, reported by name
        return "not built", f"{type(exc).__name__}: {exc}"
    try:
        m.set_attn_implementation("clattn")  # set-up refusals (check_model)
    except UnsupportedFeatureError as exc:
        return "refused", str(exc)
    m.set_attn_implementation("eager")
    ids, mask = prompts()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = m.generate(ids, attention_mask=mask, **GEN)
    except Exception as exc:  # noqa: BLE001
        return "not built", f"eager: {type(exc).__name__}: {exc}"
    cltf.register(page_size=4, **where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", RuntimeWarning)  # the eager fallback's warning
            got = m.generate(ids, attention_mask=mask, attn_implementation="clattn",
                             return_dict_in_generate=True, **GEN)
    except UnsupportedFeatureError as exc:
        return "refused", str(exc)
    finally:
        cltf.register()
    cache = got.past_key_values
    assert isinstance(cache, ClattnCache), f"{model_type}: generate made {type(cache)}"
    skipped = [i for i, layer in enumerate(cache.layers) if layer.get_seq_length() == 0]
    assert not skipped, f"{model_type}: layers {skipped} never reached clattn"
    assert torch.equal(got.sequences, ref), f"{model_type}: clattn's tokens differ from eager's"
    return "exact", ""
