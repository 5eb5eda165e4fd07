#!/usr/bin/env python
"""The KV-cache step benchmark (issue 10; a developer script, not a test).

One whole decode step of a layer stack through clattn.PagedKVCache: ``begin`` +
``num_layers`` x (``append`` + ``attend``) + ``end``, for B sequences that each hold
``--context`` tokens. Reported per step (medians over ``--repeat`` steps):

* host: wall time of the calls themselves (enqueue only; nothing waits), split into
  begin, the appends, the attends and end; and begin alone repeated back to back (begin
  + cancel) with the device idle: on a CPU driver the kernels of the step share the
  cores with the host thread, and a step's first call after a wait finds cold caches;
* append / attend: device time of the append and decode (and merge) kernels from their
  profiling events, summed over the layers;
* step: wall time from begin to the last kernel's completion;
* bytes to the device: the step's tables (one upload) and, for an app whose q/k/v come
  from the host, the new tokens' q, k and v (the app here keeps them on the device, as
  a model whose projections run on the device does).

The cache is filled before timing with one prompt step (appends only). Figures only:
no timed assertions.

    python tools/bench_cache.py --device intel
    python tools/bench_cache.py --device pocl --batch 1,8 --context 4096 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import clattn  # noqa: E402
from clattn import runtime  # noqa: E402

MODELS = {"Llama-3-8B": (32, 8, 128, 32)}  # H_qo, H_kv, D, layers


def _secs(evt) -> float:
    return (evt.profile.end - evt.profile.start) * 1e-9


def run_case(args, model: str, B: int, dtype: str) -> dict:
    hqo, hkv, d, layers = MODELS[model]
    layers = args.layers or layers
    spec = clattn.AttentionSpec(hqo, hkv, d, page_size=args.page_size, dtype=dtype)
    per_seq = -(-(args.context + args.repeat + 2) // args.page_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache = clattn.PagedKVCache(spec, layers, num_pages=B * per_seq + B, device=args.device,
                                    profile=args.profile, backend="opencl",
                                    rope="attend" if args.rope else None)
    cl = runtime.cl()
    queue = cache._rt.queue
    rng = np.random.default_rng(0)
    dt = spec.np_dtype

    def dev(shape):
        return cl.array.to_device(queue, (rng.standard_normal(shape) * 0.5).astype(dt))

    ids = [f"s{b}" for b in range(B)]
    for i in ids:
        cache.add(i)
    # fill: one prompt step of `context` tokens per sequence, appends only
    t0 = time.perf_counter()
    cache.begin(ids, [args.context] * B)
    kf, vf = dev((B * args.context, hkv, d)), dev((B * args.context, hkv, d))
    for layer in range(layers):
        cache.append(layer, kf, vf)
    cache.end()
    queue.finish()
    fill = time.perf_counter() - t0
    del kf, vf
    k, v, q = dev((B, hkv, d)), dev((B, hkv, d)), dev((B, hqo, d))
    out = [cl.array.empty(queue, (B, hqo, d), dt) for _ in range(layers)]
    lse = [cl.array.empty(queue, (B, hqo), np.float32) for _ in range(layers)]
    rows = []
    for rep in range(args.repeat + 1):  # the first step builds the kernels: not counted
        queue.finish()
        up0 = cache.bytes_uploaded
        h = dict(begin=0.0, append=0.0, attend=0.0, end=0.0)
        t_start = time.perf_counter()
        t = time.perf_counter()
        cache.begin(ids)
        h["begin"] += time.perf_counter() - t
        app_evts, att_evts = [], []
        for layer in range(layers):
            t = time.perf_counter()
            app_evts.append(cache.append(layer, k, v))
            t1 = time.perf_counter()
            res = cache.attend(layer, q, out=out[layer], lse=lse[layer])
            t2 = time.perf_counter()
            h["append"] += t1 - t
            h["attend"] += t2 - t1
            att_evts.extend(res.events)
        t = time.perf_counter()
        cache.end()
        h["end"] += time.perf_counter() - t
        att_evts[-1].wait()
        queue.finish()
        wall = time.perf_counter() - t_start
        if rep == 0:
            continue
        rows.append(dict(host=sum(h.values()), **{f"host_{k_}": v_ for k_, v_ in h.items()},
                         append=sum(map(_secs, app_evts)), attend=sum(map(_secs, att_evts)),
                         step=wall, tables=cache.bytes_uploaded - up0))
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    # the code's own cost: begin + cancel back to back, with the device idle and warm
    queue.finish()
    warm = []
    for _ in range(30):
        t = time.perf_counter()
        cache.begin(ids)
        warm.append(time.perf_counter() - t)
        cache.cancel()
    med["host_begin_warm"] = statistics.median(warm[5:])
    itemsize = dt.itemsize
    qkv = B * (hqo + 2 * hkv) * d * itemsize * layers
    st = cache.stats()
    return dict(model=model, B=B, dtype=dtype, context=args.context, layers=layers,
                device=cache._rt.device.name, profile=cache.decoder.profile.name,
                fill_s=fill, pages_used=st.pages_used, qkv_bytes=qkv, **med)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="pocl, intel, P:D (default: clattn's)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--layers", type=int, default=0, help="default: the model's (32)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rope", action="store_true", help="in-kernel RoPE (rope='attend')")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = []
    for B in (int(x) for x in args.batch.split(",")):
        for dtype in args.dtype.split(","):
            r = run_case(args, "Llama-3-8B", B, dtype)
            res.append(r)
            ms = lambda x: f"{x * 1e3:7.3f}"  # noqa: E731
            print(f"{r['model']} B={B} {dtype} ctx={r['context']} x {r['layers']} layers on "
                  f"{r['device']} ({r['profile']}):\n"
                  f"  step {ms(r['step'])} ms | host {ms(r['host'])} ms (begin "
                  f"{ms(r['host_begin'])}, appends {ms(r['host_append'])}, attends "
                  f"{ms(r['host_attend'])}, end {ms(r['host_end'])}); begin repeated "
                  f"back to back {ms(r['host_begin_warm'])} ms\n"
                  f"  device: append {ms(r['append'])} ms, attend {ms(r['attend'])} ms "
                  f"(append = {100 * r['append'] / r['attend']:.2f}% of attend)\n"
                  f"  bytes to the device per step: tables {int(r['tables'])}; "
                  f"q/k/v if uploaded from the host {r['qkv_bytes']}\n"
                  f"  (fill {r['fill_s']:.1f} s, {r['pages_used']} pages)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
