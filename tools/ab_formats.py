"""Quantized pages' decode time over f16 pages', this tree and another revision, in one process.

On a shared CPU a benchmark's rows move 2-4x between runs, so a format's time over f16's
from rows run one after the other says little. Here one process builds a decoder per
(package, format): this tree's f16, q8_0 and q4_0 and, with ``--rev``, that revision's
q8_0 and q4_0 (``ab_decode.load_revision``), each over a pool of its own pages
(``host_memory.empty``, as ``BatchDecode.empty_pages``; the same pseudo-random values,
one block packed and repeated), and calls them in turn, call by call, alternating the
order. Each row prints the median kernel event time (decode + merge) of each, its ratio
to this tree's f16 and the ratio of the 10th percentiles.

    python tools/ab_formats.py --rev f6346de --device pocl --batches 1,8 --ctx 16384,65536

A developer script, not a test.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pyopencl.array as cla
from ab_decode import PACK_PAGES, alternate, load_revision
from common import MODELS, PAGE  # first: it puts clattn on the path

import clattn
from clattn import host_memory
from clattn.quant import pack_pool

FORMATS = ("float16", "q8_0", "q4_0")


def one_row(pkgs: list, model: str, B: int, ctx: int, device: str, seconds: float) -> str:
    """The markdown row of one shape: every (package, format) decoder alternated."""
    m = MODELS[model]
    hqo, hkv, d = m.num_qo_heads, m.num_kv_heads, m.head_dim
    rng = np.random.default_rng(B + ctx)
    per_seq = ctx // PAGE
    tables = ((np.arange(B + 1) * per_seq).astype(np.int32),
              rng.permutation(B * per_seq).astype(np.int32), np.full(B, PAGE, np.int32))
    kv = rng.uniform(-1, 1, (min(PACK_PAGES, B * per_seq), 2, hkv, PAGE, d))
    q = rng.standard_normal((B, hqo, d)).astype(np.float16)
    runs = []
    for name, pkg in pkgs:
        for fmt in FORMATS if name == "this" else FORMATS[1:]:
            spec = pkg.AttentionSpec(hqo, hkv, d, page_size=PAGE, dtype="float16",
                                     k_format=fmt, v_format=fmt)
            block = kv.astype(np.float16) if fmt == "float16" else \
                pack_pool(kv[:, 0], kv[:, 1], spec.layout)
            dec = pkg.BatchDecode(spec, device=device)
            queue = dec.setup.runtime.queue
            pages = host_memory.empty(queue, spec.pool_shape(B * per_seq), spec.pool_dtype)
            pages.set(np.resize(block, (B * per_seq,) + block.shape[1:]))
            args = (cla.to_device(queue, q), pages,
                    *(cla.to_device(queue, t) for t in tables))
            plan = dec.plan(tables[0], tables[2])
            dec.run(*args, plan=plan)
            queue.finish()
            runs.append(dict(what=f"{name} {fmt}", dec=dec, queue=queue, args=args, plan=plan,
                             ms=[]))
    turn = alternate(runs, seconds)
    f16 = runs[0]["ms"]
    cells = ["%.2f (%.2fx, p10 %.2fx)" % (np.median(r["ms"]), np.median(r["ms"]) / np.median(f16),
                                          np.percentile(r["ms"], 10) / np.percentile(f16, 10))
             for r in runs]
    return f"| {model} | {B} | {ctx} | {turn} | " + " | ".join(cells) + " |"


def main(argv: list | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="also time this revision's q8_0 and q4_0 decode")
    ap.add_argument("--device", default="pocl")
    ap.add_argument("--models", default="Llama-3-8B")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ctx", default="16384,65536")
    ap.add_argument("--seconds", type=float, default=15.0, help="per row, all decoders")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pkgs = [("this", clattn)] + ([("base", load_revision(args.rev, Path(tmp)))]
                                     if args.rev else [])
        names = [f"{n} {f}" for n, _ in pkgs for f in (FORMATS if n == "this" else FORMATS[1:])]
        print(f"decode kernel ms, median of alternated calls (decode + merge events), "
              f"{args.device}; base = clattn {args.rev}; (median / this float16's, "
              f"10th percentile / this float16's)")
        print("| model | B | ctx | calls | " + " | ".join(names) + " |")
        print("|---|---:|---:|---:|" + "---:|" * len(names))
        for model in args.models.split(","):
            for B in (int(b) for b in args.batches.split(",")):
                for ctx in (int(c) for c in args.ctx.split(",")):
                    print(one_row(pkgs, model, B, ctx, args.device, args.seconds), flush=True)


if __name__ == "__main__":
    main()
