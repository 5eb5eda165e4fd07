#!/usr/bin/env python
"""What quantized KV pages cost in accuracy (a developer script).

1. Attention error: for the five model shapes of the benchmarks, decode attention over
   q8_0 and q4_0 pages against unquantized f32 attention (float64 oracle), with keys that
   have outlier channels as real keys do (a few channels per head 10-30x the others, the
   query leaning on them so that attention is peaked), values Gaussian. Printed: relative
   L2 error of the output, its largest absolute error, and the largest lse difference.
2. Greedy tokens: through the transformers integration (``k_format``/``v_format`` of the
   cache), the 2-layer random-weight models of tests/test_transformers.py generate 32
   greedy tokens with f32 weights; printed: how many of the 32 equal eager f32 attention's,
   the first that differs, and the largest logit difference.
3. Rounding: the codes of ggml's reference quantizer (what the cache stores) against the
   codes nearest to ``x / d`` on the stored scale (``quant.quantize(rounding="nearest")``),
   over N(0,1) blocks: the share of blocks and values whose codes differ, RMS and largest
   dequantization error (absolute, and in units of the block's stored scale), and the
   decode-attention error of part 1 computed on each rounding's values (float64 oracle
   on the dequantized pages against the f32 pages, the first model shape).

Examples
  python tools/quant_error.py                      # every part, PoCL for part 2
  python tools/quant_error.py --part attention --context 8192
  python tools/quant_error.py --part rounding --blocks 1000000
"""
from __future__ import annotations

import argparse
import sys
import warnings

import numpy as np
from common import MODELS, ROOT  # first: it puts clattn on the path

sys.path.insert(0, str(ROOT / "tests"))

import clattn  # noqa: E402
from clattn import cpu_backend, quant  # noqa: E402

FORMATS = ("q8_0", "q4_0")


def outlier_keys(rng, n: int, hkv: int, d: int, channels: int = 4) -> np.ndarray:
    """Gaussian keys ``[n, hkv, d]`` whose heads each have ``channels`` outlier channels
    10-30x larger, with a per-channel offset (as observed in LLM keys)."""
    k = rng.standard_normal((n, hkv, d)).astype(np.float32)
    for h in range(hkv):
        idx = rng.choice(d, channels, replace=False)
        k[:, h, idx] = k[:, h, idx] * rng.uniform(10, 30, channels) + rng.uniform(-20, 20, channels)
    return k


def attention_errors(context: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for name, m in MODELS.items():
        hqo, hkv, d = m.num_qo_heads, m.num_kv_heads, m.head_dim
        ps = 16
        P = context // ps
        k = outlier_keys(rng, context, hkv, d)
        v = rng.standard_normal((context, hkv, d)).astype(np.float32)
        # queries that lean on the outlier channels: peaked attention, as in real heads
        q = rng.standard_normal((1, hqo, d)).astype(np.float32)
        q += 0.05 * np.repeat(np.sign(k.mean(0)), hqo // hkv, axis=0)[None]
        paged = lambda x: x.reshape(P, ps, hkv, d).transpose(0, 2, 1, 3)  # noqa: E731
        tables = (np.array([0, P], np.int32), np.arange(P, dtype=np.int32),
                  np.array([ps], np.int32))
        ref = _oracle(q, k, v, hqo // hkv, 1 / np.sqrt(d))
        for fmt in FORMATS:
            spec = clattn.AttentionSpec(hqo, hkv, d, page_size=ps, dtype="float32",
                                        k_format=fmt, v_format=fmt)
            pool = quant.pack_pool(paged(k), paged(v), spec.layout)
            out, lse = cpu_backend.batch_decode(spec, q, pool, *tables)
            err = out.astype(np.float64) - ref[0]
            rows.append(dict(model=name, fmt=fmt, rel_l2=float(np.linalg.norm(err) /
                                                              np.linalg.norm(ref[0])),
                             max_abs=float(np.abs(err).max()),
                             lse=float(np.abs(lse - ref[1]).max())))
    return rows


def _oracle(q, k, v, group, scale):
    """float64 attention of one query over dense k, v; lse in base 2."""
    kk = np.repeat(k.astype(np.float64), group, axis=1)  # [n, hqo, d]
    vv = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("hd,nhd->hn", q[0].astype(np.float64), kk) * scale
    m = s.max(1, keepdims=True)
    p = np.exp(s - m)
    out = np.einsum("hn,nhd->hd", p, vv) / p.sum(1, keepdims=True)
    lse = (m[:, 0] + np.log(p.sum(1))) / np.log(2)
    return out[None], lse[None]


def rounding_errors(blocks: int, seed: int) -> list[dict]:
    """Value errors of both roundings over ``blocks`` N(0,1) blocks of 32."""
    x = np.random.default_rng(seed).standard_normal((blocks, 32)).astype(np.float32)
    rows = []
    for fmt in FORMATS:
        codes = {}
        for rounding in quant.ROUNDINGS:
            data, d = quant.quantize(x, fmt, rounding=rounding)
            codes[rounding] = data
            err = quant.dequantize(data, d, fmt).astype(np.float64) - x
            unit = np.abs(d.astype(np.float64))
            rows.append(dict(fmt=fmt, rounding=rounding,
                             rms=float(np.sqrt(np.mean(err ** 2))),
                             max_abs=float(np.abs(err).max()),
                             max_steps=float((np.abs(err) / unit).max())))
        diff = codes["ggml"] != codes["nearest"]
        for r in rows[-2:]:
            r.update(blocks_differ=float(diff.any(-1).mean()),
                     bytes_differ=float(diff.mean()))
    return rows


def rounding_attention(context: int, seed: int) -> list[dict]:
    """Part 1's attention error of the first model shape on each rounding's values."""
    rng = np.random.default_rng(seed)
    first = next(iter(MODELS.values()))
    hqo, hkv, d = first.num_qo_heads, first.num_kv_heads, first.head_dim
    k = outlier_keys(rng, context, hkv, d)
    v = rng.standard_normal((context, hkv, d)).astype(np.float32)
    q = rng.standard_normal((1, hqo, d)).astype(np.float32)
    q += 0.05 * np.repeat(np.sign(k.mean(0)), hqo // hkv, axis=0)[None]
    ref = _oracle(q, k, v, hqo // hkv, 1 / np.sqrt(d))
    rows = []
    for fmt in FORMATS:
        for rounding in quant.ROUNDINGS:
            kq, vq = (quant.dequantize(*quant.quantize(x, fmt, rounding=rounding), fmt)
                      for x in (k, v))
            out, lse = _oracle(q, kq, vq, hqo // hkv, 1 / np.sqrt(d))
            err = out[0] - ref[0]
            rows.append(dict(model=first.name, fmt=fmt, rounding=rounding,
                             rel_l2=float(np.linalg.norm(err) / np.linalg.norm(ref[0])),
                             lse=float(np.abs(lse - ref[1]).max())))
    return rows


def token_agreement(device: str) -> list[dict]:
    import test_transformers as tt

    import clattn.integrations.transformers as cltf
    rows = []
    for name in list(tt.CONFIGS)[:5]:
        ref = tt.eager(name, False)
        for fmt in FORMATS:
            cltf.register(device=device, k_format=fmt, v_format=fmt)
            try:
                got = tt.run(name, False, attn_implementation="clattn")
            finally:
                cltf.register()
            a, b = got.sequences[0, -tt.NEW_TOKENS:], ref.sequences[0, -tt.NEW_TOKENS:]
            same = (a == b).numpy()
            first = int(np.argmin(same)) if not same.all() else tt.NEW_TOKENS
            diff = max(float((x - y).abs().max()) for x, y in zip(got.logits, ref.logits))
            rows.append(dict(model=name, fmt=fmt, equal=int(same.sum()), first_diff=first,
                             logits=diff))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("all", "attention", "tokens", "rounding"), default="all")
    ap.add_argument("--blocks", type=int, default=200000, help="N(0,1) blocks (part 3)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--device", default="pocl")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.part in ("all", "attention"):
        print(f"## Decode attention over quantized pages vs f32 (B=1, context {args.context}, "
              f"keys with 4 outlier channels per head)\n")
        print("| model | format | rel. L2 error of out | max abs error | max lse error |")
        print("|---|---|---:|---:|---:|")
        for r in attention_errors(args.context, args.seed):
            print(f"| {r['model']} | {r['fmt']} | {r['rel_l2']:.2e} | {r['max_abs']:.2e} | "
                  f"{r['lse']:.2e} |")
    if args.part in ("all", "tokens"):
        print(f"\n## 32 greedy tokens through transformers (2-layer random-weight models, f32 "
              f"weights, device {args.device}) vs eager f32\n")
        print("| config | cache | tokens equal | first different | max logit diff |")
        print("|---|---|---:|---:|---:|")
        for r in token_agreement(args.device):
            first = "-" if r["first_diff"] == 32 else r["first_diff"]
            print(f"| {r['model']} | {r['fmt']} | {r['equal']}/32 | {first} | "
                  f"{r['logits']:.3g} |")
    if args.part in ("all", "rounding"):
        print(f"\n## Rounding: ggml's reference codes vs the codes nearest x / d ({args.blocks} "
              f"N(0,1) blocks)\n")
        print("| format | rounding | blocks differing | code bytes differing | RMS error | "
              "max abs error | max error / scale |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in rounding_errors(args.blocks, args.seed):
            print(f"| {r['fmt']} | {r['rounding']} | {r['blocks_differ']:.2%} | "
                  f"{r['bytes_differ']:.3%} | {r['rms']:.5g} | {r['max_abs']:.4g} | "
                  f"{r['max_steps']:.4f} |")
        print(f"\nDecode attention on each rounding's values (context {args.context}):\n")
        print("| model | format | rounding | rel. L2 error of out | max lse error |")
        print("|---|---|---|---:|---:|")
        for r in rounding_attention(args.context, args.seed):
            print(f"| {r['model']} | {r['fmt']} | {r['rounding']} | {r['rel_l2']:.4e} | "
                  f"{r['lse']:.3e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
