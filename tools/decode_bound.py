"""Is a decode shape bound by memory or by its work per row? One build, two pools.

The same decoder runs over pages that fit a quarter of the largest cache (each timed call
right after an untimed one, so that they are read from the cache) and over pages spanning
at least 4x that cache, alternated call by call with the read ceiling's best variant and
the multiply-add peak (the ceilings of the same moments, as ``tools/bench.py`` times
them). Each row prints
the kernel time per KV row (one KV head's K and V row, all its query heads) of both
pools, the roofline's time per row and the fraction of it each pool reaches.

Where the cached pool is no faster than the large one, the kernel is not waiting for
memory: its work per row bounds it, and the cached fraction is the most this build can
reach on this machine, whatever the memory does. PoCL's thread count is set by
``POCL_MAX_PTHREAD_COUNT`` (run once with 1 and once unset to see what a second core
gives).

    python tools/decode_bound.py --device pocl --models Qwen2.5-0.5B,Llama-3.2-1B

A developer script, not a test.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pyopencl.array as cla
from common import MODELS, PAGE, io_bytes, model_spec  # first: it puts clattn on the path

import clattn
from clattn.tune import ceilings as ceil
from clattn.tune.roofline import decode_roofline
from clattn.tune.timing import event_seconds, sample


class Pool:
    """``B`` sequences of ``ctx`` rows on pages in the decoder's own pool (huge pages on a
    CPU device), a random page order, and the call that times one decode over them
    (``warm``: right after an untimed one)."""

    def __init__(self, dec: clattn.BatchDecode, B: int, ctx: int, seed: int,
                 warm: bool) -> None:
        spec, queue = dec.spec, dec.setup.runtime.queue
        hqo, hkv, d = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
        rng = np.random.default_rng(seed)
        per_seq = ctx // PAGE
        self.B, self.ctx, self.rows = B, ctx, B * ctx * hkv
        self.nbytes = io_bytes(spec, B, ctx)
        self.pages = dec.empty_pages(B * per_seq)
        self.pages.set(rng.standard_normal(self.pages.shape).astype(spec.dtype))
        self.q = cla.to_device(queue, rng.standard_normal((B, hqo, d)).astype(spec.dtype))
        indptr = (np.arange(B + 1) * per_seq).astype(np.int32)
        self.tables = [cla.to_device(queue, t) for t in (
            indptr, rng.permutation(B * per_seq).astype(np.int32), np.full(B, PAGE, np.int32))]
        self.plan = dec.plan(indptr, np.full(B, PAGE, np.int32))
        self.dec, self.warm = dec, warm

    def __call__(self) -> dict:
        """One decode's event time; a cached pool's decode is the second of two back to
        back (the first brings the pages back into the cache the other calls evicted)."""
        if self.warm:
            self.dec.run(self.q, self.pages, *self.tables, plan=self.plan)
        res = self.dec.run(self.q, self.pages, *self.tables, plan=self.plan)
        return {"s": event_seconds(res.events)}


def contexts(spec, cache_bytes: int, cached_B: int, past_B: int) -> tuple[int, int]:
    """Rows per sequence of the cached pool (a quarter of the cache, at most 16384) and
    of the large one (at least 4x the cache, at least 16384), whole pages."""
    token = int(spec.bytes_per_token)
    cached = max(PAGE, min(16384, cache_bytes // 4 // (cached_B * token) // PAGE * PAGE))
    past_rows = -(-4 * cache_bytes // (past_B * token))
    past = max(16384, -(-past_rows // 1024) * 1024)
    return cached, past


def main(argv: list | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="pocl")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--cached-batch", type=int, default=1,
                    help="sequences of the pool that fits the cache")
    ap.add_argument("--past-batch", type=int, default=8,
                    help="sequences of the pool past the cache")
    ap.add_argument("--seconds", type=float, default=4.0, help="per row, per call timed")
    args = ap.parse_args(argv)
    rt = ceil.as_runtime(args.device)
    sizing = ceil.sizing(rt.device)
    cache = sizing.largest_cache
    if cache is None:
        sys.exit(f"{args.device}: no cache size reported, so no pool can be sized to it")
    read = ceil.read_bandwidth(rt)
    read_launch, read_bytes, release = ceil.read_launcher(rt, read)
    fma_launch, fma_flops = ceil.fma_launcher(rt)
    threads = os.environ.get("POCL_MAX_PTHREAD_COUNT", "unset")
    print(f"decode time per KV row, {rt.device.name.strip()} ({args.device}, "
          f"POCL_MAX_PTHREAD_COUNT {threads}); largest cache: {cache.where} "
          f"{ceil.size_text(cache.size_bytes)}; medians of calls alternated with the read "
          f"ceiling ({read.best}) and the multiply-add peak")
    print("| model | dtype | cached pool | ns/row | past pool | ns/row | past / cached | "
          "read GB/s | roofline ns/row (bound) | roofline / cached (the most this build "
          "reaches) | past: of roofline |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    try:
        for name in args.models.split(","):
            for dtype in args.dtypes.split(","):
                spec = model_spec(name, dtype)
                dec = clattn.BatchDecode(spec, device=rt.queue).build()
                c_ctx, p_ctx = contexts(spec, cache.size_bytes, args.cached_batch,
                                        args.past_batch)
                pools = {"cached": Pool(dec, args.cached_batch, c_ctx, seed=1, warm=True),
                         "past": Pool(dec, args.past_batch, p_ctx, seed=2, warm=False)}
                calls = dict(pools, read=lambda: {"s": event_seconds([read_launch()])},
                             fma=lambda: {"s": event_seconds([fma_launch()])})
                res = sample(calls, warmup=2, warmup_seconds=0.5, min_runs=10,
                             max_runs=100000, seconds=args.seconds)
                med = {k: v["s"].median for k, v in res.items()}
                read_gbps = read_bytes / med["read"] * 1e-9
                fma_gflops = fma_flops / med["fma"] * 1e-9
                cells = []
                for key in ("cached", "past"):
                    p = pools[key]
                    roof = decode_roofline(batch=p.B, context=p.ctx,
                                           num_qo_heads=spec.num_qo_heads,
                                           head_dim=spec.head_dim, bytes_moved=p.nbytes,
                                           read_gbps=read_gbps, fma_gflops=fma_gflops)
                    cells.append((p, med[key] / p.rows * 1e9, roof))
                (cp, c_ns, c_roof), (pp, p_ns, p_roof) = cells
                roof_ns = p_roof.bound_s / pp.rows * 1e9
                print(f"| {name} | {dtype} | B {cp.B} x {cp.ctx} "
                      f"({ceil.size_text(cp.nbytes)}) | {c_ns:.1f} | B {pp.B} x {pp.ctx} "
                      f"({ceil.size_text(pp.nbytes)}) | {p_ns:.1f} | {p_ns / c_ns:.2f} | "
                      f"{read_gbps:.1f} | {roof_ns:.1f} ({p_roof.bound}) | "
                      f"{c_roof.fraction(med['cached']):.0%} | "
                      f"{p_roof.fraction(med['past']):.0%} |", flush=True)
                del pools, calls, dec
    finally:
        release()


if __name__ == "__main__":
    main()
