"""Generate with Hugging Face transformers on clattn: ``attn_implementation="clattn"``.

Builds a 2-layer model from Llama-3.2-1B's published config (or any ``config.json`` given
with ``--config``) with random weights, no hub access, and generates greedily with eager
attention and with clattn (keys and values in clattn's paged cache on the OpenCL device),
then prints both token lists and the time per new token.

    python examples/generate.py                       # clattn's default device
    python examples/generate.py --device intel --tokens 64
    python examples/generate.py --config path/to/config.json --layers 2

Needs the ``hf`` extra: ``pip install -e '.[hf,pocl]'``.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

import clattn.integrations.transformers as cltf

LLAMA_3_2_1B = {  # meta-llama/Llama-3.2-1B config.json (architecture keys)
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "num_hidden_layers": 16, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a Hugging Face config.json (default: Llama-3.2-1B's)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary kept (smaller: faster)")
    ap.add_argument("--device", help="OpenCL device: pocl, intel, a name (default: clattn's)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens")
    ap.add_argument("--prompt", type=int, default=16, help="prompt length (random tokens)")
    args = ap.parse_args()

    raw = dict(LLAMA_3_2_1B)
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            raw = json.load(f)
    raw.update(num_hidden_layers=args.layers, vocab_size=min(args.vocab, raw["vocab_size"]),
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cltf.register(device=args.device)
    prompt = torch.randint(3, config.vocab_size, (1, args.prompt))

    for impl in ("eager", "clattn", "clattn"):  # the first clattn run builds the kernels
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                             do_sample=False, attn_implementation=impl,
                             return_dict_in_generate=True)
        ms = (time.perf_counter() - t0) * 1e3 / args.tokens
        new = out.sequences[0, args.prompt:].tolist()
        print(f"{impl:7s} {ms:7.2f} ms/token  {type(out.cache).__name__:12s} {new[:12]} ...")
    print(out.cache, out.cache.stats())


if __name__ == "__main__":
    main()
