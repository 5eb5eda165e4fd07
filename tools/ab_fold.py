"""The split merge folded into the decode launch against the separate launches, alternated
in one process (profile field ``fold_merge`` on and off, everything else the device's).

Two measurements, each alternating the two builds call by call on the same device:

* ``decode``: one split ``BatchDecode.run`` (device arrays, the default plan): the
  kernels' event time (decode, plus the merge when separate) and the wall time of the
  call to its end (``queue.finish()``), which holds the launch overhead too;
* ``cache``: a ``PagedKVCache`` one-token step of every layer (append fused in where the
  profile fuses it): host time in the calls (begin to end, kernels running) and wall time
  to the last kernel.

Each prints the medians of both and their ratio, and checks that the two give the same
bits.

    python tools/ab_fold.py --device pocl --model Llama-3-8B --ctx 16384 --seconds 20

A developer script, not a test.
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import pyopencl.array as cla

from common import MODELS, PAGE, log  # first: it puts clattn on the path
import clattn


def _pool(rng: np.random.Generator, spec: clattn.AttentionSpec, B: int, ctx: int) -> tuple:
    """Random pages (f16/f32), tables and q of B sequences of ctx rows."""
    per_seq = ctx // PAGE
    hqo, hkv, d = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    pages = rng.standard_normal((B * per_seq, 2, hkv, PAGE, d)).astype(spec.np_dtype)
    q = rng.standard_normal((B, hqo, d)).astype(spec.np_dtype)
    indptr = (np.arange(B + 1) * per_seq).astype(np.int32)
    indices = rng.permutation(B * per_seq).astype(np.int32)
    return pages, q, indptr, indices, np.full(B, PAGE, np.int32)


def decode_row(device: str, spec: clattn.AttentionSpec, B: int, ctx: int,
               seconds: float) -> dict:
    """Medians of kernel and wall ms per call, folded and separate."""
    pages, q, indptr, indices, last = _pool(np.random.default_rng(0), spec, B, ctx)
    runs = {}
    for fold in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            dec = clattn.BatchDecode(spec, device=device, profile={"fold_merge": fold})
        queue = dec.setup.runtime.queue
        tables = [cla.to_device(queue, t) for t in (indptr, indices, last)]
        plan = dec.plan(indptr, last)
        out = cla.empty(queue, q.shape, q.dtype)
        lse = cla.empty(queue, q.shape[:2], np.float32)
        args = (cla.to_device(queue, q), cla.to_device(queue, pages), *tables)
        dec.run(*args, plan=plan, out=out, lse=lse)
        queue.finish()
        runs[fold] = dict(dec=dec, queue=queue, args=args, plan=plan, out=out, lse=lse,
                          kernel=[], wall=[], launches=0)
    t0, turn = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or turn < 6:
        for fold in ((True, False) if turn % 2 == 0 else (False, True)):
            r = runs[fold]
            r["queue"].finish()
            t = time.perf_counter()
            res = r["dec"].run(*r["args"], plan=r["plan"], out=r["out"], lse=r["lse"])
            r["queue"].finish()
            r["wall"].append((time.perf_counter() - t) * 1e3)
            r["kernel"].append(sum(e.profile.end - e.profile.start for e in res.events) * 1e-6)
            r["launches"] = len(res.events)
        turn += 1
    same = all(np.array_equal(runs[True][k].get(), runs[False][k].get()) for k in ("out", "lse"))
    plan = runs[False]["plan"]
    return dict(plan=str(plan), same=same, calls=turn,
                **{f"{w}_{k}": float(np.median(runs[f][k])) for f, w in ((True, "fold"),
                                                                          (False, "sep"))
                   for k in ("kernel", "wall")},
                launches=(runs[True]["launches"], runs[False]["launches"]))


def cache_row(device: str, spec: clattn.AttentionSpec, B: int, ctx: int, layers: int,
              seconds: float) -> dict:
    """Medians of host and wall ms per one-token step, folded and separate."""
    rng = np.random.default_rng(1)
    hqo, hkv, d, dt = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.np_dtype
    fill = (rng.standard_normal((B * ctx, hkv, d)) * 0.5).astype(dt)
    host = {k: (rng.standard_normal(s) * 0.5).astype(dt)
            for k, s in (("q", (B, hqo, d)), ("k", (B, hkv, d)), ("v", (B, hkv, d)))}
    runs = {}
    for fold in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            cache = clattn.PagedKVCache(spec, layers, device=device, backend="opencl",
                                        profile={"fold_merge": fold},
                                        num_pages=B * (-(-(ctx + 2) // PAGE)), prefill=False)
        queue = cache.pools[0].queue
        ids = [f"s{b}" for b in range(B)]
        dfill = cla.to_device(queue, fill)
        for i in ids:
            cache.add(i)
        cache.begin(ids, [ctx] * B)
        for layer in range(layers):
            cache.append(layer, dfill, dfill)
        cache.end()
        x = {k: cla.to_device(queue, a) for k, a in host.items()}
        outs = [(cla.empty(queue, (B, hqo, d), dt), cla.empty(queue, (B, hqo), np.float32))
                for _ in range(layers)]
        runs[fold] = dict(cache=cache, queue=queue, ids=ids, x=x, outs=outs, host=[],
                          wall=[], launches=0)

    def step(r: dict) -> None:
        cache, x = r["cache"], r["x"]
        r["queue"].finish()
        n0 = cache.stats().launches
        t = time.perf_counter()
        cache.begin(r["ids"])
        for layer in range(layers):
            cache.append(layer, x["k"], x["v"])
            cache.attend(layer, x["q"], out=r["outs"][layer][0], lse=r["outs"][layer][1])
        cache.end()
        host = time.perf_counter() - t
        r["queue"].finish()
        r["wall"].append((time.perf_counter() - t) * 1e3)
        r["host"].append(host * 1e3)
        r["launches"] = (cache.stats().launches - n0) / layers
        for i in r["ids"]:
            cache.pop(i, 1)

    for r in runs.values():
        step(r)  # warm-up
    t0, turn = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or turn < 6:
        for fold in ((True, False) if turn % 2 == 0 else (False, True)):
            step(runs[fold])
        turn += 1
    same = all(np.array_equal(a.get(), b.get())
               for (a0, a1), (b0, b1) in zip(runs[True]["outs"], runs[False]["outs"])
               for a, b in ((a0, b0), (a1, b1)))
    return dict(same=same, steps=turn,
                **{f"{w}_{k}": float(np.median(runs[f][k])) for f, w in ((True, "fold"),
                                                                          (False, "sep"))
                   for k in ("host", "wall")},
                launches=(runs[True]["launches"], runs[False]["launches"]))


def main(argv: list | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="pocl")
    ap.add_argument("--model", default="Llama-3-8B", choices=sorted(MODELS))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=16384, help="decode rows per sequence")
    ap.add_argument("--cache-ctx", type=int, default=4096, help="cache rows per sequence")
    ap.add_argument("--layers", type=int, default=None, help="cache layers (the model's)")
    ap.add_argument("--seconds", type=float, default=15.0, help="per measurement")
    ap.add_argument("--only", choices=("decode", "cache"), default=None)
    args = ap.parse_args(argv)
    m = MODELS[args.model]
    spec = clattn.AttentionSpec(m.num_qo_heads, m.num_kv_heads, m.head_dim, page_size=PAGE,
                                dtype=args.dtype)
    if args.only in (None, "decode"):
        r = decode_row(args.device, spec, args.B, args.ctx, args.seconds)
        log(f"decode {args.model} {args.dtype} B={args.B} ctx={args.ctx} on {args.device} "
            f"({r['plan']}; {r['calls']} calls each; launches {r['launches']}; same bits: "
            f"{r['same']}): kernels {r['fold_kernel']:.3f} ms folded / "
            f"{r['sep_kernel']:.3f} ms separate = {r['fold_kernel'] / r['sep_kernel']:.3f}; "
            f"wall {r['fold_wall']:.3f} / {r['sep_wall']:.3f} ms = "
            f"{r['fold_wall'] / r['sep_wall']:.3f}")
    if args.only in (None, "cache"):
        layers = args.layers or m.layers
        r = cache_row(args.device, spec, args.B, args.cache_ctx, layers, args.seconds)
        log(f"cache step {args.model} {args.dtype} B={args.B} ctx={args.cache_ctx} x {layers} "
            f"layers on {args.device} ({r['steps']} steps each; launches per layer "
            f"{r['launches']}; same bits: {r['same']}): host {r['fold_host']:.3f} ms folded / "
            f"{r['sep_host']:.3f} ms separate = {r['fold_host'] / r['sep_host']:.3f}; wall "
            f"{r['fold_wall']:.3f} / {r['sep_wall']:.3f} ms = "
            f"{r['fold_wall'] / r['sep_wall']:.3f}")


if __name__ == "__main__":
    main()
