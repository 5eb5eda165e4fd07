"""Prefill kernel time of this tree against another revision, alternated in one process.

The prefill counterpart of ``tools/ab_decode.py`` (whose ``load_revision`` loads the other
revision's package beside this one, as ``clattn_base``): each package plans and runs the
same batch (``B`` sequences of ``new`` queries over ``cached`` rows, causal) on its own
context of the same device, over the same pages and queries, calls alternated. Each row
prints both medians of the kernel event time, their ratio, the work units each plan cut
and the largest difference of the outputs.

    python tools/ab_prefill.py --rev f424c2b --device intel --models Llama-3-8B \
        --chunks 512:0,128:4096 --batches 1,4

A developer script, not a test.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pyopencl.array as cla
from ab_decode import alternate, load_revision
from common import MODELS, PAGE

import clattn


def one_row(pkgs: list, name: str, dtype: str, B: int, new: int, cached: int, device: str,
            seconds: float, seed: int) -> dict:
    """Median kernel ms of each package's prefill of one batch, alternated call by call."""
    m = MODELS[name]
    hqo, hkv, d = m.num_qo_heads, m.num_kv_heads, m.head_dim
    rng = np.random.default_rng(seed)
    per_seq = -(-(new + cached) // PAGE)
    pages = rng.standard_normal((B * per_seq, 2, hkv, PAGE, d)).astype(dtype)
    q = rng.standard_normal((B * new, hqo, d)).astype(dtype)
    qo = (np.arange(B + 1) * new).astype(np.int32)
    indptr = (np.arange(B + 1) * per_seq).astype(np.int32)
    indices = rng.permutation(B * per_seq).astype(np.int32)
    last = np.full(B, new + cached - (per_seq - 1) * PAGE, np.int32)
    runs = []
    for pkg in pkgs:
        spec = pkg.AttentionSpec(hqo, hkv, d, page_size=PAGE, dtype=dtype,
                                 softcap=m.softcap)
        pre = pkg.BatchPrefill(spec, device=device)
        queue = pre.setup.runtime.queue
        plan = pre.plan(qo, indptr, last)
        args = [cla.to_device(queue, a) for a in (q, pages, qo, indptr, indices, last)]
        first = pre.run(*args, plan=plan)
        queue.finish()
        runs.append(dict(dec=pre, queue=queue, args=args, plan=plan, out=first.out.get(),
                         ms=[]))
    turn = alternate(runs, seconds)
    diff = float(np.max(np.abs(runs[0]["out"].astype(np.float64) - runs[1]["out"])))
    return dict(model=name, dtype=dtype, B=B, chunk=f"{new}:{cached}",
                units=" / ".join(f"{len(r['plan'].units)}x{r['plan'].queries_per_unit}"
                                 for r in runs),
                base_ms=float(np.median(runs[0]["ms"])), this_ms=float(np.median(runs[1]["ms"])),
                calls=turn, max_diff=diff)


def main(argv: list | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the revision to compare against")
    ap.add_argument("--device", default="pocl")
    ap.add_argument("--models", default="Llama-3-8B,Qwen2.5-0.5B,Gemma-2-2B")
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--chunks", default="512:0,128:4096",
                    help="new:cached rows per sequence, comma-separated")
    ap.add_argument("--seconds", type=float, default=6.0, help="per row, both builds")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pkgs = [load_revision(args.rev, Path(tmp)), clattn]
        print(f"prefill kernel ms (median of alternated calls), {args.device}, clattn "
              f"{args.rev} -> this tree")
        print("| model | dtype | B | new:cached | units (base / this) | base ms | this ms | "
              "base / this | calls | max diff |")
        print("|---|---|---:|---|---|---:|---:|---:|---:|---:|")
        for name in args.models.split(","):
            for dtype in args.dtypes.split(","):
                for B in (int(b) for b in args.batches.split(",")):
                    for chunk in args.chunks.split(","):
                        new, cached = (int(x) for x in chunk.split(":"))
                        r = one_row(pkgs, name, dtype, B, new, cached, args.device,
                                    args.seconds, seed=len(name) + B + new)
                        print(f"| {r['model']} | {r['dtype']} | {r['B']} | {r['chunk']} | "
                              f"{r['units']} | {r['base_ms']:.2f} | {r['this_ms']:.2f} | "
                              f"{r['base_ms'] / r['this_ms']:.2f} | {r['calls']} | "
                              f"{r['max_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
