#!/usr/bin/env python
"""clattn prefill benchmark (a developer script; to be folded into tools/bench.py as
``--suite prefill``).

For each OpenCL device: BatchPrefill on device-resident arrays for the Llama-3-8B
(32/8/128) and Qwen2.5-0.5B (14/2/64) shapes, a 512-token prompt on an empty cache and a
128-token chunk over 4096 cached tokens, B = 1 and 4 (every sequence alike): kernel time
from profiling events, GFLOP/s (4 * H_qo * D per attended (query, key) pair: QK and PV),
and the fraction of the device's f32 multiply-add peak measured in the same run
(clpeak's method: independent chains of float8 a * b + c), timed round-robin with the
row like everything else (background load on a small machine moves both). Beside it, when torch is
installed, torch's ``scaled_dot_product_attention`` on the same shapes (dense K/V
``[B, H_kv, T, D]``, ``enable_gqa``; ``is_causal`` for the prompt, the bottom-right causal
mask for the chunk over a cache), in the storage dtype and in f32, timed round-robin with
the kernel so that background load hits both alike.

Examples
  python tools/bench_prefill.py --device pocl,intel
  python tools/bench_prefill.py --device intel --dtypes float16,float32 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

# torch's OpenMP threads spin after each call by default and would take the cores from the
# OpenCL runtime's threads in the round-robin timing: let them sleep
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench  # noqa: E402  (tools/bench.py: sampling, tables, pools)
from clattn import BatchPrefill, runtime  # noqa: E402
from clattn.spec import AttentionSpec, default_sm_scale  # noqa: E402

MODELS = {"Llama-3-8B": (32, 8, 128), "Qwen2.5-0.5B": (14, 2, 64)}
CASES = [(512, 0), (128, 4096)]  # (new tokens, cached tokens) per sequence
BATCHES = [1, 4]

PEAK_SRC = """
__kernel void clattn_peak(__global float* out, const float a)
{
    const float8 y = (float8)(a);
%s
    for (int i = 0; i < 128; ++i) {
%s
    }
    out[get_global_id(0)] = dot((%s).lo, (float4)(1.0f));
}
"""
PEAK_CHAINS, PEAK_UNROLL = 12, 16


def fma_peak(rt):
    """A timed call of the multiply-add peak kernel, and the FLOPs it does: the device's
    f32 peak is ``flops / s``."""
    cl = runtime.cl()
    decl = "\n".join(f"    float8 x{c} = (float8)(get_global_id(0) * 1e-9f + {c}.0f);"
                     for c in range(PEAK_CHAINS))
    body = "\n".join(f"        x{c} = x{c} * y + y;" for _ in range(PEAK_UNROLL)
                     for c in range(PEAK_CHAINS))
    total = " + ".join(f"x{c}" for c in range(PEAK_CHAINS))
    prg = rt.program(PEAK_SRC % (decl, body, total))
    k = cl.Kernel(prg, "clattn_peak")
    n = 64 * int(rt.device.max_compute_units) * 64
    out = cl.array.empty(rt.queue, n, np.float32)

    def call() -> dict:
        e = k(rt.queue, (n,), None, out.data, np.float32(0.999))
        e.wait()
        return {"s": bench._secs(e)}
    return call, n * 128 * PEAK_UNROLL * PEAK_CHAINS * 8 * 2


def flops(h: int, d: int, B: int, n: int, ctx: int) -> float:
    """4 * H * D per attended (query, key) pair, causal."""
    return 4.0 * h * d * B * (n * ctx + n * (n + 1) / 2)


def torch_sdpa(B: int, h: int, hkv: int, d: int, n: int, ctx: int, dtype: str):
    """A timed call of torch's SDPA on dense tensors of the same shape, or None."""
    try:
        import torch
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.rand(B, h, n, d, generator=g).to(dt)
    k = torch.rand(B, hkv, n + ctx, d, generator=g).to(dt)
    v = torch.rand(B, hkv, n + ctx, d, generator=g).to(dt)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = None if ctx == 0 else causal_lower_right(n, n + ctx)

    def call() -> dict:
        t = time.perf_counter()
        with torch.no_grad():
            sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True,
                 scale=default_sm_scale(d))
        return {"s": time.perf_counter() - t}
    return call


def prefill_call(pre: BatchPrefill, rng, B: int, h: int, hkv: int, d: int, n: int, ctx: int,
                 dtype: str):
    """A timed BatchPrefill call on device arrays (tables planned and uploaded once)."""
    cl = runtime.cl()
    rt = pre.setup.runtime
    stored = n + ctx
    pool_pages = B * -(-stored // bench.PAGE) + 4
    pages = bench.host_pool(rng, pool_pages, hkv, d, dtype)
    indptr, indices, last = bench.page_table(rng, pool_pages, B, stored)
    qo = (np.arange(B + 1) * n).astype(np.int32)
    q = (rng.random((B * n, h, d), dtype=np.float32) * 2 - 1).astype(dtype)
    dev = {k: cl.array.to_device(rt.queue, v) for k, v in dict(
        q=q, pages=pages, qo=qo, indptr=indptr, indices=indices, last=last).items()}
    out = cl.array.empty(rt.queue, q.shape, dtype)
    lse = cl.array.empty(rt.queue, q.shape[:2], np.float32)
    plan = pre.plan(qo, indptr, last)

    def call() -> dict:
        res = pre.run(dev["q"], dev["pages"], dev["qo"], dev["indptr"], dev["indices"],
                      dev["last"], out=out, lse=lse, plan=plan)
        res.event.wait()
        return {"s": bench._secs(res.event)}
    return call, plan


def run_device(args, name: str) -> tuple[dict, list]:
    dev = runtime.select_device(name)
    rt = runtime.Runtime.for_device(dev)
    peak_call, peak_flops = fma_peak(rt)
    bench.log(f"{name}: {dev.platform.name.strip()} / {dev.name.strip()}")
    peaks = []
    rng = np.random.default_rng(args.seed)
    rows = []
    for model in args.models:
        h, hkv, d = MODELS[model]
        for dtype in args.dtypes:
            spec = AttentionSpec(h, hkv, d, page_size=bench.PAGE, dtype=dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pre = BatchPrefill(spec, dev, backend="opencl", profile=args.profile).build()
            for n, ctx in CASES:
                for B in args.batches:
                    call, plan = prefill_call(pre, rng, B, h, hkv, d, n, ctx, dtype)
                    calls = {"clattn": call, "peak": peak_call}
                    for tdt in dict.fromkeys([dtype, "float32"]):
                        t = torch_sdpa(B, h, hkv, d, n, ctx, tdt)
                        if t is not None:
                            calls[f"torch-{tdt}"] = t
                    res, _ = bench.sample_interleaved(calls, args.repeat, args.row_seconds)
                    f = flops(h, d, B, n, ctx)
                    row = dict(device=name, model=model, dtype=dtype, B=B, n=n, ctx=ctx,
                               units=len(plan.units), ms=res["clattn"]["s"] * 1e3,
                               gflops=f / res["clattn"]["s"] * 1e-9)
                    row["peak"] = peak_flops / res["peak"]["s"] * 1e-9
                    row["peak_frac"] = row["gflops"] / row["peak"]
                    peaks.append(row["peak"])
                    for k in calls:
                        if k.startswith("torch"):
                            row[f"{k}_ms"] = res[k]["s"] * 1e3
                    torch_best = min((row[k] for k in row if k.startswith("torch")), default=None)
                    row["vs_torch"] = None if torch_best is None else torch_best / row["ms"]
                    rows.append(row)
                    bench.log(" ".join(f"{k}={bench.fmt(v, '.3g') if isinstance(v, float) else v}"
                                       for k, v in row.items()))
    return {"device": name, "peak_gflops": float(np.median(peaks))}, rows


COLS = [("device", "device", ""), ("model", "model", ""), ("dtype", "dtype", ""),
        ("B", "B", "d"), ("n", "new", "d"), ("ctx", "cached", "d"), ("ms", "ms", ".2f"),
        ("gflops", "GFLOP/s", ".1f"), ("peak", "peak", ".0f"), ("peak_frac", "of peak", ".0%"),
        ("torch-float16_ms", "torch f16 ms", ".2f"), ("torch-float32_ms", "torch f32 ms", ".2f"),
        ("vs_torch", "x torch", ".2f")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="pocl,intel", help="comma list of OpenCL devices")
    ap.add_argument("--profile", default=None, help="force a clattn profile")
    ap.add_argument("--models", type=bench.csv, default=list(MODELS))
    ap.add_argument("--dtypes", type=bench.csv, default=["float16"])
    ap.add_argument("--batches", type=lambda s: bench.csv(s, int), default=BATCHES)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per row (max)")
    ap.add_argument("--row-seconds", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="write the raw results as JSON")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ceilings, rows = [], []
    for name in bench.csv(args.device):
        c, r = run_device(args, name)
        ceilings.append(c)
        rows += r
    print(f"## `python tools/bench_prefill.py {' '.join(argv or sys.argv[1:])}`\n")
    print(f"- clattn {bench.source_version()}, {os.cpu_count()} CPUs, "
          f"{time.perf_counter() - t0:.0f} s; median multiply-add peaks: "
          + ", ".join(f"{c['device']} {c['peak_gflops']:.1f} GFLOP/s" for c in ceilings))
    print("- GFLOP/s: 4 * H_qo * D per attended (query, key) pair; peak: the f32 "
          "multiply-add peak timed round-robin with the row; x torch: torch's best SDPA "
          "time (either dtype) / clattn's\n")
    print(bench.markdown(rows, COLS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings, "rows": rows, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
