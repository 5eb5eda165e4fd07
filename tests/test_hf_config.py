"""What ``AttentionSpec.from_hf_config`` must make of every model in tests/data/models.json.

The expected values below were written by hand from each raw config and transformers'
semantics (see tests/hf_oracle.py); the oracle's own reading must agree with them, and so
must clattn's. A behavioural check then decodes with the spec clattn builds from the raw
config (CPU backend, RoPE on, positions past the original context) against the float64
oracle fed the same raw config: no clattn parse reaches the oracle's side.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from cases import compare, decode_args, make_case
from hf_oracle import read_config, shrink
from model_configs import model, model_names
from naive import naive_decode

from clattn import AttentionSpec
from clattn.cpu_backend import batch_decode

L3 = "llama3"
# name: (H_qo, H_kv, head_dim, rotary_dim, interleaved, rope type as clattn spells it,
#        rope_theta, softcap, sliding window (keys) or None, max_position_embeddings,
#        sm_scale when not 1/sqrt(head_dim))
EXPECTED = {
    "Llama-3.2-1B": (32, 8, 64, 64, False, L3, 500000.0, None, None, 131072, None),
    "Llama-3.2-3B": (24, 8, 128, 128, False, L3, 500000.0, None, None, 131072, None),
    "Llama-3.1-8B": (32, 8, 128, 128, False, L3, 500000.0, None, None, 131072, None),
    # Qwen2.5: sliding_window is set but use_sliding_window is false
    "Qwen2.5-0.5B": (14, 2, 64, 64, False, "default", 1e6, None, None, 32768, None),
    "Qwen2.5-1.5B": (12, 2, 128, 128, False, "default", 10000.0, None, None, 32768, None),
    "Qwen2.5-3B": (16, 2, 128, 128, False, "default", 1e6, None, None, 32768, None),
    "Qwen2.5-7B": (28, 4, 128, 128, False, "default", 1e6, None, None, 131072, None),
    "Qwen3-0.6B": (16, 8, 128, 128, False, "default", 1e6, None, None, 40960, None),
    "Qwen3-1.7B": (16, 8, 128, 128, False, "default", 1e6, None, None, 40960, None),
    "Qwen3-4B": (32, 8, 128, 128, False, "default", 1e6, None, None, 40960, None),
    "Gemma-2-2B": (8, 4, 256, 256, False, "default", 10000.0, 50.0, 4096, 8192, 256 ** -0.5),
    "Gemma-2-9B": (16, 8, 256, 256, False, "default", 10000.0, 50.0, 4096, 8192, 256 ** -0.5),
    "Gemma-3-1B": (4, 1, 256, 256, False, "default", 1e6, None, 512, 32768, 256 ** -0.5),
    "Gemma-3-4B": (8, 4, 256, 256, False, "linear", 1e6, None, 1024, 131072, 256 ** -0.5),
    "Phi-3-mini-4k": (32, 32, 96, 96, False, "default", 10000.0, None, 2047, 4096, None),
    "Phi-3.5-mini": (32, 32, 96, 96, False, "longrope", 10000.0, None, 262144, 131072, None),
    "Mistral-7B-v0.1": (32, 8, 128, 128, False, "default", 10000.0, None, 4096, 32768, None),
    "SmolLM2-135M": (9, 3, 64, 64, False, "default", 100000.0, None, None, 8192, None),
    "SmolLM2-360M": (15, 5, 64, 64, False, "default", 100000.0, None, None, 8192, None),
    "SmolLM2-1.7B": (32, 32, 64, 64, False, "default", 130000.0, None, None, 8192, None),
    "TinyLlama-1.1B": (32, 4, 64, 64, False, "default", 10000.0, None, None, 2048, None),
    "MiniCPM-2B": (36, 36, 64, 64, False, "default", 10000.0, None, None, 4096, None),
    # GPT-J: 64 of 256 dims rotate, adjacent pairs (clattn spells that rope_type "gptj")
    "GPT-J-6B": (16, 16, 256, 64, True, "gptj", 10000.0, None, None, 2048, None),
    "gpt-oss-20b": (64, 8, 64, 64, False, "yarn", 150000.0, None, 128, 131072, None),
}
FIELDS = ("num_qo_heads", "num_kv_heads", "head_dim", "rotary_dim", "interleaved", "rope_type",
          "rope_theta", "softcap", "sliding_window", "max_position_embeddings", "sm_scale")


def expected(name: str) -> dict:
    want = dict(zip(FIELDS, EXPECTED[name]))
    if want["sm_scale"] is None:
        want["sm_scale"] = want["head_dim"] ** -0.5
    return want


def _clattn_rope_type(spec: AttentionSpec) -> str:
    rs = spec.rope_scaling or {}
    return str(rs.get("rope_type", rs.get("type")) or "default")


def test_every_fixture_model_has_expectations():
    assert sorted(EXPECTED) == sorted(model_names())


@pytest.mark.parametrize("name", list(EXPECTED))
def test_oracle_reads_the_raw_config_as_written_down(name):
    att = read_config(model(name))
    want = expected(name)
    got = {f: getattr(att, f) for f in FIELDS if f != "rope_type"}
    got["rope_type"] = "gptj" if att.interleaved and att.rope_type == "default" else att.rope_type
    assert got == pytest.approx(want), name


@pytest.mark.parametrize("name", list(EXPECTED))
def test_from_hf_config_pins(name):
    """The spec clattn builds from the raw config: every build-time field."""
    want = expected(name)
    spec = AttentionSpec.from_hf_config(model(name), page_size=16, dtype="float32")
    got = dict(num_qo_heads=spec.num_qo_heads, num_kv_heads=spec.num_kv_heads,
               head_dim=spec.head_dim, rotary_dim=spec.rotary_dim, softcap=spec.softcap,
               max_position_embeddings=spec.max_position_embeddings,
               rope_type=_clattn_rope_type(spec), sliding_window=spec.sliding_window)
    pinned = {k: want[k] for k in got}
    pinned["sliding_window"] = want["sliding_window"] is not None   # a build-time switch
    assert got == pinned, name


def _positions(att):
    """(k_pos_offset, q_pos) per sequence: small, around the longrope switch, far."""
    if att.long_after is not None:
        o = att.long_after
        return [3, o - 20, o - 19, 99_980], [23, o - 1, o, 100_000]
    far = min(100_000, (att.max_position_embeddings or 100_000) - 1)
    return [3, 500, 1000, far - 20], [23, 520, 1020, far]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_from_hf_config_decodes_like_the_model(name):
    """CPU backend with clattn's spec vs the oracle reading the same raw config (f32)."""
    cfg = model(name)
    full = read_config(cfg)
    kv = min(full.num_kv_heads, 2)
    small = shrink(cfg, kv * min(full.num_qo_heads // full.num_kv_heads, 3), kv)
    att = read_config(small)
    spec = AttentionSpec.from_hf_config(small, page_size=16, dtype="float32")
    kpo, qpos = _positions(att)
    lengths = [20, 20, 20, 20]
    window = None
    if att.sliding_window is not None:
        lengths = [20, 20, att.sliding_window + 5 if att.sliding_window < 300 else 20, 20]
        window = [att.window_offset(n) for n in lengths]
    case = make_case(spec, lengths, seed=sum(map(ord, name)), rope=True, pos_offset=kpo,
                     q_pos=qpos, window=window, sinks=[0] * 4 if window else None)
    args, kw = decode_args(case)
    out, lse = batch_decode(spec, *args, **kw, rotary_mode=1, **att.call_kwargs())
    ref = naive_decode(*args, **kw, rotary_mode=1, **att.oracle_kwargs(), **att.call_kwargs())
    compare(out, lse, *ref, "float32", what=f"{name}: ")


def test_longrope_switch_is_real():
    """Phi-3.5: the oracle's long factors matter at q_pos + 1 > 4096 (and not before)."""
    att = read_config(model("Phi-3.5-mini"))
    assert att.long_after == 4096
    short, af = att.inv_freq(4095)
    long_, af2 = att.inv_freq(4096)
    assert af == af2 == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-14)
    assert not np.allclose(short, long_)


def test_yarn_factor_is_the_context_ratio():
    """transformers derives yarn's factor from max_position_embeddings / original when the
    dict names the original context (gpt-oss: 131072 / 4096 = 32, as its dict says)."""
    cfg = model("gpt-oss-20b")
    att = read_config(cfg)
    assert att.rope_params["factor"] == 32.0 == cfg["rope_scaling"]["factor"]
    other = read_config(dict(cfg, max_position_embeddings=65536))
    assert other.rope_params["factor"] == 16.0


def test_window_opt_in_and_off_switch():
    base = model("Mistral-7B-v0.1")
    assert read_config(base).sliding_window == 4096
    assert read_config(dict(base, use_sliding_window=False)).sliding_window is None
    qwen = model("Qwen2.5-7B")
    assert read_config(qwen).sliding_window is None
    assert read_config(dict(qwen, use_sliding_window=True)).sliding_window == 131072
    assert read_config(dict(qwen, use_sliding_window=None)).sliding_window is None
    assert read_config(base).window_offset(5000) == 904
    assert read_config(base).window_offset(100) == 0


def test_partial_rotary_factor_and_raw_gptj_keys():
    cfg = dict(model("Llama-3.2-1B"), partial_rotary_factor=0.5)
    assert read_config(cfg).rotary_dim == 32
    raw_gptj = {"model_type": "gptj", "n_head": 16, "n_embd": 4096, "rotary_dim": 64,
                "n_positions": 2048}
    att = read_config(raw_gptj)
    assert (att.num_qo_heads, att.num_kv_heads, att.head_dim, att.rotary_dim) == (16, 16, 256, 64)
    assert att.interleaved and att.max_position_embeddings == 2048



def test_window_and_partial_rotary_defaults_follow_transformers():
    """A Qwen config without use_sliding_window has no window in transformers (its
    config class defaults it to False); Mistral's window is on; GPT-NeoX's rotary_pct
    is its partial rotary factor."""
    import clattn
    base = dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=512,
                sliding_window=4096)
    assert not clattn.AttentionSpec.from_hf_config(dict(base, model_type="qwen2")).sliding_window
    assert clattn.AttentionSpec.from_hf_config(dict(base, model_type="mistral")).sliding_window
    assert clattn.AttentionSpec.from_hf_config(
        dict(base, model_type="qwen2", use_sliding_window=True)).sliding_window
    neox = clattn.AttentionSpec.from_hf_config(dict(num_attention_heads=8, hidden_size=512,
                                                    model_type="gpt_neox", rotary_pct=0.25))
    assert neox.rotary_dim == 16
