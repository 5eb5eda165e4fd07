"""An app keeps many chats with few resident: sequences offloaded to storage and back.

Without ``--hf``: a cache with room for two chats serves three. Each chat's prompt goes
through the cache (random keys and values stand in for a model's); the app offloads the
chat it is not serving (``PagedKVCache.offload``: a KV file, the pages freed) and
restores it when the user comes back (``restore``), then checks that the restored chat
attends exactly as if it had never left. With ``--hf``: a tiny random-weight Llama
answers a prompt through transformers, its ``ClattnCache`` is saved, and a new cache
loads it and generates the second turn, which matches the run that never stopped.

    python examples/save_load.py --device pocl
    python examples/save_load.py --hf --device cpu
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

import clattn

SPEC = clattn.AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                            dtype="float16")
LAYERS = 4


def run_step(cache, sid, n, rng):
    """``n`` tokens of chat ``sid`` through every layer; the last layer's output."""
    cache.begin([sid], [n])
    for layer in range(LAYERS):
        k, v = (rng.standard_normal((n, 2, 64)).astype(np.float16) for _ in range(2))
        q = rng.standard_normal((n, 8, 64)).astype(np.float16)
        cache.append(layer, k, v)
        out = cache.attend(layer, q).out
    cache.end()
    return out if isinstance(out, np.ndarray) else out.get()


def paged(device: str | None, folder: str) -> None:
    kw = dict(backend="cpu") if device == "cpu" else dict(device=device)
    cache = clattn.PagedKVCache(SPEC, LAYERS, num_pages=2 * (512 // 16 + 2), **kw)
    twin = clattn.PagedKVCache(SPEC, LAYERS, num_pages=4 * (512 // 16 + 2), **kw)
    for seed, sid in enumerate(("chat-1", "chat-2", "chat-3")):
        if len(cache) == 2:  # room for two: the oldest chat goes to storage
            old = cache.sequences[0]
            size = cache.offload(os.path.join(folder, f"{old}.clkv"), [old])
            print(f"offloaded {old}: {size} bytes; {cache.stats()}")
        for c in (cache, twin):
            c.add(sid)
            run_step(c, sid, 500, np.random.default_rng(seed))
    back = "chat-1"
    cache.offload(os.path.join(folder, "chat-2.clkv"), ["chat-2"])
    t = time.perf_counter()
    cache.restore(os.path.join(folder, f"{back}.clkv"))
    print(f"restored {back} in {1e3 * (time.perf_counter() - t):.1f} ms; {cache.stats()}")
    a = run_step(cache, back, 1, np.random.default_rng(7))
    b = run_step(twin, back, 1, np.random.default_rng(7))
    print("the restored chat attends as if it never left:", np.array_equal(a, b))


def hf(device: str | None, folder: str) -> None:
    import torch
    import transformers

    import clattn.integrations.transformers  # noqa: F401  (registers "clattn")
    from clattn.integrations.hf_cache import ClattnCache

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("clattn")
    kw = dict(backend="cpu") if device == "cpu" else dict(device=device)
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    prompt, reply = torch.randint(3, 256, (1, 12)), torch.randint(3, 256, (1, 5))
    cache = ClattnCache(model, max_cache_len=128, **kw)
    turn1 = model.generate(prompt, cache=cache, **gen)
    path = os.path.join(folder, "chat")
    print(f"saved {cache.save(path)} bytes after turn 1")
    turn2_in = torch.cat([turn1, reply], 1)
    ref = model.generate(turn2_in, cache=cache, **gen)  # the run that never stopped
    fresh = ClattnCache(model, max_cache_len=128, **kw)  # as a new process would make it
    fresh.load(path)
    got = model.generate(turn2_in, cache=fresh, **gen)
    print("turn 2 after the load:", got[0, turn2_in.shape[1]:].tolist())
    print("same as without the save:", torch.equal(got, ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", help="pocl, intel, a name, or cpu (the CPU backend)")
    ap.add_argument("--hf", action="store_true", help="the transformers flow")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        (hf if args.hf else paged)(args.device, folder)


if __name__ == "__main__":
    main()
