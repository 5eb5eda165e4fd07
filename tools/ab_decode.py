"""Decode kernel time of this tree against another revision, alternated in one process.

Timings on a shared CPU move 20-60% between runs, and the ceilings a benchmark measures
move with them; two builds called in turn in one process see the same machine. The other
revision's whole package is loaded beside this one (as ``clattn_base``, from ``git
archive``), each with its own context on the same device, over the same pages and
queries. Each model row prints both medians of the kernel event time (decode and merge),
their ratio and the largest difference of the outputs.

    python tools/ab_decode.py --rev b7917c1 --device pocl --models Llama-3-8B,Qwen2.5-0.5B

``--formats q8_0,q4_0`` times quantized pages (``k_format = v_format``; one block of
pages packed by ``clattn.quant.pack_pool`` and repeated over the pool).

``--pools`` instead of ``--rev`` times this tree twice over the same pages: in a plain
device array (``pyopencl.array.to_device``) and in the pool ``BatchDecode.empty_pages``
gives (huge pages of host memory on a CPU device).

A developer script, not a test.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import pyopencl.array as cla
from common import MODELS, PAGE, ROOT  # first: it puts clattn on the path

import clattn
from clattn.quant import QUANTIZED, pack_pool

#: pages of pseudo-random values packed at once for a quantized pool (repeated over it)
PACK_PAGES = 256


def load_revision(rev: str, into: Path):
    """The package ``clattn`` of git revision ``rev``, imported as ``clattn_base``."""
    blob = subprocess.run(["git", "archive", rev, "clattn", "kernels"], cwd=ROOT, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    spec = importlib.util.spec_from_file_location(
        "clattn_base", into / "clattn" / "__init__.py",
        submodule_search_locations=[str(into / "clattn")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["clattn_base"] = mod
    spec.loader.exec_module(mod)
    return mod


def alternate(runs: list, seconds: float) -> int:
    """Call each run's ``dec.run(*args, plan=plan)`` in turns (the order reversed every
    other turn) for ``seconds``, at least 6 turns, appending its kernel event ms to its
    ``ms``; returns the turns."""
    t0, turn = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or turn < 6:
        for r in runs if turn % 2 == 0 else runs[::-1]:
            res = r["dec"].run(*r["args"], plan=r["plan"])
            r["queue"].finish()
            r["ms"].append(sum(e.profile.end - e.profile.start for e in res.events) * 1e-6)
        turn += 1
    return turn


def one_row(pkgs: list, name: str, dtype: str, B: int, ctx: int, device: str,
            seconds: float, seed: int, pools: tuple = ("plain", "plain"),
            fmt: str | None = None) -> dict:
    """Median kernel ms of each package's decode of one model shape, alternated call by call.

    ``pools[i]``: ``plain`` (a device array of the pages) or ``empty_pages`` (the
    decoder's own pool, the pages copied in) for package ``i``; ``fmt``: the page format
    of K and V (default: ``dtype``)."""
    m = MODELS[name]
    hqo, hkv, d = m.num_qo_heads, m.num_kv_heads, m.head_dim
    rng = np.random.default_rng(seed)
    per_seq = ctx // PAGE
    fmt = fmt or dtype
    if fmt in QUANTIZED:
        kv = rng.uniform(-1, 1, (min(PACK_PAGES, B * per_seq), 2, hkv, PAGE, d))
        block = pack_pool(kv[:, 0], kv[:, 1], clattn.AttentionSpec(
            hqo, hkv, d, page_size=PAGE, dtype=dtype, k_format=fmt, v_format=fmt).layout)
        pages = np.resize(block, (B * per_seq, block.shape[1]))
    else:
        pages = rng.standard_normal((B * per_seq, 2, hkv, PAGE, d)).astype(dtype)
    q = rng.standard_normal((B, hqo, d)).astype(dtype)
    indptr = (np.arange(B + 1) * per_seq).astype(np.int32)
    indices = rng.permutation(B * per_seq).astype(np.int32)
    last = np.full(B, PAGE, np.int32)
    runs = []
    for pkg, pool in zip(pkgs, pools):
        aspec = pkg.AttentionSpec(hqo, hkv, d, page_size=PAGE, dtype=dtype, k_format=fmt,
                                  v_format=fmt)
        dec = pkg.BatchDecode(aspec, device=device)
        queue = dec.setup.runtime.queue
        if pool == "plain":
            dp = cla.to_device(queue, pages)
        else:
            dp = dec.empty_pages(len(pages))
            dp.set(pages)
        dq = cla.to_device(queue, q)
        plan = dec.plan(indptr, last)
        tables = [cla.to_device(queue, t) for t in (indptr, indices, last)]
        first = dec.run(dq, dp, *tables, plan=plan)
        queue.finish()
        out = first.out.get() if hasattr(first.out, "get") else np.asarray(first.out)
        runs.append(dict(dec=dec, queue=queue, args=(dq, dp, *tables), plan=plan, out=out,
                         ms=[]))
    turn = alternate(runs, seconds)
    diff = float(np.max(np.abs(runs[0]["out"].astype(np.float64) - runs[1]["out"])))
    plan = runs[1]["plan"]
    return dict(model=name, dtype=fmt, B=B, ctx=ctx,
                plan=f"split {plan.part_rows} x{plan.num_parts}" if plan.split else "no split",
                base_ms=float(np.median(runs[0]["ms"])), this_ms=float(np.median(runs[1]["ms"])),
                calls=turn, max_diff=diff)


def main(argv: list | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--rev", help="the revision to compare against")
    which.add_argument("--pools", action="store_true",
                       help="this tree over a plain device array against empty_pages' pool")
    ap.add_argument("--device", default="pocl")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--formats", default="",
                    help="page formats (k_format = v_format), e.g. q8_0,q4_0 (default: the "
                         "dtypes' own)")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=4.0, help="per row, both builds")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.pools:
            pkgs, pools, what = [clattn, clattn], ("plain", "empty_pages"), \
                "plain device pages -> BatchDecode.empty_pages"
        else:
            pkgs, pools, what = [load_revision(args.rev, Path(tmp)), clattn], \
                ("plain", "plain"), f"clattn {args.rev} -> this tree"
        print(f"decode kernel ms (median of alternated calls, decode + merge events), "
              f"{args.device}, {what}, ctx {args.ctx}")
        print("| model | format | B | plan | base ms | this ms | base / this | calls | max diff |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|")
        for name in args.models.split(","):
            for dtype, fmt in ((t, f or None) for t in args.dtypes.split(",")
                               for f in args.formats.split(",")):
                for B in (int(b) for b in args.batches.split(",")):
                    r = one_row(pkgs, name, dtype, B, args.ctx, args.device,
                                args.seconds, seed=len(name) + B, pools=pools, fmt=fmt)
                    print(f"| {r['model']} | {r['dtype']} | {r['B']} | {r['plan']} | "
                          f"{r['base_ms']:.3f} | {r['this_ms']:.3f} | "
                          f"{r['base_ms'] / r['this_ms']:.2f} | {r['calls']} | "
                          f"{r['max_diff']:.1e} |", flush=True)

if __name__ == "__main__":
    main()
