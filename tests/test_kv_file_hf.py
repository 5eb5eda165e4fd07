"""A ClattnCache saved after one ``generate`` and loaded in a new process continues the
conversation (issue 39): the second turn's tokens and logits are the uninterrupted run's.

A tiny Llama (2 layers, random f32 weights, saved with ``save_pretrained``) answers a
prompt; the cache is saved; a child process loads the model and the cache and generates
the second turn (the first turn's tokens and a new user message). The same second turn
run on without the save is the reference. The child runs torch on as many threads as the
parent: torch's CPU matmuls round differently with the thread count, and the logits are
compared bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import DEVICES, _selected, device_indices  # noqa: E402

import clattn.integrations.transformers  # noqa: E402,F401  (registers "clattn")
from clattn.integrations.hf_cache import ClattnCache  # noqa: E402

NEW = 5
CHILD = textwrap.dedent("""
    import json, sys, torch, transformers
    import clattn.integrations.transformers
    from clattn.integrations.hf_cache import ClattnCache
    folder, model_dir, device, ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    torch.set_num_threads(int(sys.argv[5]))
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    m.set_attn_implementation("clattn")
    kw = dict(backend="cpu") if device == "cpu" else dict(device=device, backend="opencl")
    cache = ClattnCache(m, max_cache_len=64, **kw)
    cache.load(folder)
    seen = cache.get_seq_length()
    out = m.generate(torch.tensor([ids]), cache=cache, max_new_tokens=%d, min_new_tokens=%d,
                     do_sample=False, output_logits=True, return_dict_in_generate=True)
    print(json.dumps({"seen": seen, "tokens": out.sequences[0].tolist(), "restarts":
                      cache.restarts, "logits": [x[0].tolist() for x in out.logits]}))
""" % (NEW, NEW))

WHERE = (["cpu"] if _selected("cpu") else []) + list(DEVICES)[:1]


def tiny_llama(folder):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=256, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.save_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("where", WHERE)
def test_saved_conversation_continues_in_a_new_process(where, tmp_path):
    m = tiny_llama(tmp_path / "model")
    m.set_attn_implementation("clattn")
    dev = "cpu" if where == "cpu" else device_indices(DEVICES[where])
    kw = dict(backend="cpu") if where == "cpu" else dict(device=DEVICES[where],
                                                          backend="opencl")
    g = torch.Generator().manual_seed(3)
    prompt, user = (torch.randint(3, 128, (1, n), generator=g) for n in (9, 6))
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = ClattnCache(m, max_cache_len=64, **kw)
        turn1 = m.generate(prompt, cache=cache, **gen)
        cache.save(tmp_path / "chat")
        turn2_in = torch.cat([turn1, user], dim=1)
        ref = m.generate(turn2_in, cache=cache, output_logits=True,
                         return_dict_in_generate=True, **gen)
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "chat"),
                          str(tmp_path / "model"), dev, json.dumps(turn2_in[0].tolist()),
                          str(torch.get_num_threads())],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["seen"] == turn1.shape[1] - 1  # the first turn's tokens but the last one
    assert got["restarts"] == 0
    assert got["tokens"] == ref.sequences[0].tolist()
    assert torch.equal(torch.tensor(got["logits"]), torch.stack([x[0] for x in ref.logits]))


def test_refused_folder_leaves_the_cache_empty(tmp_path):
    m = tiny_llama(tmp_path / "model")
    m.set_attn_implementation("clattn")
    cache = ClattnCache(m, max_cache_len=64, backend="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.generate(torch.tensor([[5, 6, 7]]), cache=cache, max_new_tokens=2, do_sample=False)
    cache.save(tmp_path / "chat")
    other = ClattnCache(m, max_cache_len=64, backend="cpu", k_format="q8_0")
    from clattn.kv_file import KVFileMismatchError
    with pytest.raises(KVFileMismatchError):
        other.load(tmp_path / "chat")
    assert other.rows is None and not other.groups
    with pytest.raises(ValueError, match="holds no sequences"):
        cache.load(tmp_path / "chat")


def test_window_and_full_layer_kinds_in_process(tmp_path):
    """A batch of three on a model with sliding-window and full layers (two layer kinds,
    two files; the new cache's pools sized for the file's rows) whose window has given
    pages back by the save; files of two saves mixed are refused."""
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, sliding_window=8,
                                    max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    m = transformers.Gemma2ForCausalLM(cfg).eval()
    m.set_attn_implementation("clattn")
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    prompt, user = torch.randint(3, 128, (3, 12)), torch.randint(3, 128, (3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = ClattnCache(m, max_cache_len=64, backend="cpu", page_size=4)
        turn1 = m.generate(prompt, cache=cache, **gen)
        assert len(cache.groups) == 2
        assert cache.groups[8].cache.table.state(cache.rows[0]).dropped > 0
        cache.save(tmp_path / "chat")
        turn2_in = torch.cat([turn1, user], dim=1)
        ref = m.generate(turn2_in, cache=cache, **gen)
        cache.save(tmp_path / "later")
        fresh = ClattnCache(m, max_cache_len=64, backend="cpu", page_size=4)
        fresh.load(tmp_path / "chat")
        assert [g.cache.num_pages for g in fresh.groups.values()] == \
            [g.cache.num_pages for g in cache.groups.values()]
        assert torch.equal(m.generate(turn2_in, cache=fresh, **gen), ref)
    (tmp_path / "chat" / "full.clkv").replace(tmp_path / "mixed-full.clkv")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (tmp_path / "mixed-full.clkv").replace(mixed / "full.clkv")
    (tmp_path / "later" / "window-8.clkv").replace(mixed / "window-8.clkv")
    other = ClattnCache(m, max_cache_len=64, backend="cpu", page_size=4)
    from clattn.kv_file import KVFileMismatchError
    with pytest.raises(KVFileMismatchError, match="different saves"):
        other.load(mixed)
    assert other.rows is None and not other.groups
