#!/usr/bin/env python3
"""A prompt through clattn.PagedKVCache: milliseconds per layer of its attend.

One sequence's prompt of ``--prompt`` tokens (Llama-3-8B's attention by default: 32
query heads, 8 KV heads, head_dim 128, float16, pages of 16) goes through ``begin``,
every layer's ``append`` and ``attend`` (device arrays, the call returns at once) and
``end``; the attends of the layers are timed together on the host, from the first
launch to the last one's completion, and divided by the layers. Each repetition adds the
sequence again on an empty cache. Prints one JSON line per repetition set: the median
ms per layer, which kernels the step ran, and the clattn that was imported (so that two
checkouts can be compared by running the script with each on ``PYTHONPATH``; a clattn
without the cache's prefill path runs every token on the decode kernel).

    PYTHONPATH=. python tools/bench_cache_prefill.py --device pocl --layers 2 --reps 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="pocl", help="a device as device= takes it (a name fragment, pocl, intel or P:D)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (after a warm-up)")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--decode-only", action="store_true",
                    help="prefill=False: every token on the decode kernel")
    args = ap.parse_args()

    import clattn
    from clattn import runtime

    H, Hkv, D = (int(x) for x in args.heads.split(","))
    spec = clattn.AttentionSpec(H, Hkv, D, page_size=16, dtype=args.dtype)
    kw = {"prefill": False} if args.decode_only else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache = clattn.PagedKVCache(spec, args.layers, device=args.device, backend="opencl",
                                    num_pages=args.prompt // 16 + 2, **kw)
    cl = runtime.cl()
    queue = cache.pools[0].queue
    n, L = args.prompt, args.layers
    rng = np.random.default_rng(0)
    dt = spec.np_dtype
    k = [cl.array.to_device(queue, rng.standard_normal((n, Hkv, D)).astype(dt))
         for _ in range(L)]
    v = [cl.array.to_device(queue, rng.standard_normal((n, Hkv, D)).astype(dt))
         for _ in range(L)]
    q = [cl.array.to_device(queue, rng.standard_normal((n, H, D)).astype(dt)) for _ in range(L)]
    out = [cl.array.empty(queue, (n, H, D), dt) for _ in range(L)]
    lse = [cl.array.empty(queue, (n, H), np.float32) for _ in range(L)]
    times, kinds = [], None
    for rep in range(args.reps + 1):
        cache.add("p")
        cache.begin(["p"], [n])
        kinds = getattr(cache, "step_kernels", ("decode",))
        for layer in range(L):
            cache.append(layer, k[layer], v[layer])
        queue.finish()
        t0 = time.perf_counter()
        res = [cache.attend(layer, q[layer], out=out[layer], lse=lse[layer])
               for layer in range(L)]
        res[-1].event.wait()
        queue.finish()
        if rep:  # the first is a warm-up (kernel builds)
            times.append((time.perf_counter() - t0) * 1e3 / L)
        cache.end()
        cache.remove("p")
    print(json.dumps(dict(clattn=clattn.__file__, device=args.device, prompt=n, layers=L,
                          kernels=list(kinds), ms_per_layer=round(statistics.median(times), 2),
                          all_ms=[round(t, 2) for t in times])), flush=True)


if __name__ == "__main__":
    main()
