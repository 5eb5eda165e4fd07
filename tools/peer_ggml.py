#!/usr/bin/env python
"""Decode attention: clattn beside ggml's CPU backend (llama.cpp's) in the same run.

ggml is built from its public source, outside the package: ``--ggml-src`` names a checkout
of https://github.com/ggml-org/ggml (built there under ``build/`` with CMake, native CPU
flags, when not built yet); ``tools/peer/ggml_decode.c`` is compiled against it. Each row
(a model shape of clattn.models, B sequences of ``ctx`` tokens, f16 K/V) times, round after
round, alternated:

* ggml ``flash``: ``ggml_flash_attn_ext`` on contiguous K/V (llama.cpp ``-fa on``);
* ggml ``plain``: mul_mat, soft-cap, soft_max_ext, mul_mat on V stored transposed
  (llama.cpp ``-fa off``);
* clattn's ``BatchDecode`` on each OpenCL device given, device-resident arrays, the
  planner's split, the same page set every call (as ggml reads the same K/V every call).

ggml's two paths are checked against each other on the same data and clattn against its
CPU backend before anything is timed; a mismatch ends the script with status 1. Both sides
use the model's soft-cap (Gemma-2: 50) and ``--threads`` threads (clattn: the OpenCL
driver's, one per core). The table gives each median of the round medians and clattn's
speed-up over ggml's faster path.

Example
  python tools/peer_ggml.py --ggml-src /work/ggml-src --devices pocl,intel \\
      --models Gemma-2-2B,Llama-3-8B,Qwen2.5-0.5B --contexts 16384
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import MODELS, PAGE, ROOT, csv, log  # common first: the package on the path
from clattn import cpu_backend, runtime
from clattn.spec import AttentionSpec
from clattn.tune.checks import compare, decoder
from clattn.tune.timing import table
from clattn.tune.workloads import PagePool, Workload

SOURCE = ROOT / "tools" / "peer" / "ggml_decode.c"


def build_ggml(src: Path) -> Path:
    """The ``ggml_decode`` binary, building ggml (CMake, Release, native) and it as needed."""
    build = src / "build"
    libdir = build / "src"
    if not any(libdir.glob("libggml-cpu.*")):
        log(f"building ggml in {build} (a few minutes)")
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BUILD_TESTS=OFF",
                        "-DGGML_BUILD_EXAMPLES=OFF"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1)],
                       check=True, stdout=subprocess.DEVNULL)
    exe = build / "ggml_decode"
    if not exe.exists() or exe.stat().st_mtime < SOURCE.stat().st_mtime:
        subprocess.run(["cc", "-O2", "-o", str(exe), str(SOURCE), f"-I{src / 'include'}",
                        f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-lggml", "-lggml-base",
                        "-lggml-cpu", "-lm"], check=True)
    return exe


def ggml_run(exe: Path, path: str, spec: AttentionSpec, ctx: int, B: int, threads: int,
             iters: int, warmup: int) -> tuple[float, float]:
    """(median ms, checksum) of ``iters`` timed computations of one ggml path."""
    cmd = [str(exe), path, str(spec.num_qo_heads), str(spec.num_kv_heads), str(spec.head_dim),
           str(ctx), str(B), str(spec.softcap or 0.0), str(threads), str(iters), str(warmup)]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    med, _best, check = res.stdout.split()
    return float(med), float(check)


class ClattnRow:
    """One device's decoder, pool and workload for a row, checked against the CPU backend."""

    def __init__(self, dev: object, spec: AttentionSpec, B: int, ctx: int) -> None:
        self.rt = runtime.Runtime.for_device(dev)
        pages = B * -(-ctx // PAGE)
        self.pool = PagePool(self.rt, spec, pages, seed=7)
        self.w = Workload(self.rt, self.pool, B, ctx, seed=8)
        self.dec = decoder(spec, dev, None)
        self.plan = self.dec.plan(self.w.indptr, self.w.last, split=None)

    def check(self) -> str | None:
        """None when the device's result matches the CPU backend's, else why not."""
        res = self.dec.run(*self.w.args(0), out=self.w.out, lse=self.w.lse, plan=self.plan)
        ref = cpu_backend.batch_decode(self.dec.spec, *self.w.host_args())
        ok, err, why = compare(res.out.get(), res.lse.get(), ref[0], ref[1], self.dec.spec.dtype)
        return None if ok else f"{why} (max error {err:.3g})"

    def median_ms(self, iters: int, warmup: int) -> float:
        """Median wall time of ``iters`` calls (each waits for its last kernel)."""
        times = []
        for i in range(warmup + iters):
            t = time.perf_counter()
            res = self.dec.run(*self.w.args(0, hot=True), out=self.w.out, lse=self.w.lse,
                               plan=self.plan)
            res.event.wait()
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    def release(self) -> None:
        """Free the device memory now."""
        self.w.release()
        self.pool.release()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ggml-src", type=Path, required=True,
                    help="a checkout of github.com/ggml-org/ggml (built under build/)")
    ap.add_argument("--devices", type=csv, default=["pocl", "intel"])
    ap.add_argument("--models", type=csv, default=["Gemma-2-2B", "Llama-3-8B", "Qwen2.5-0.5B"])
    ap.add_argument("--contexts", type=lambda s: csv(s, int), default=[16384])
    ap.add_argument("--batches", type=lambda s: csv(s, int), default=[1])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds per row")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per side per round")
    ap.add_argument("--warmup", type=int, default=3)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    exe = build_ggml(args.ggml_src.resolve())
    devices = {name: runtime.select_device(name) for name in args.devices}
    lines, failed = [], False
    for name in args.models:
        m = MODELS[name]
        spec = AttentionSpec(m.num_qo_heads, m.num_kv_heads, m.head_dim, page_size=PAGE,
                             dtype="float16", softcap=m.softcap)
        for B in args.batches:
            for ctx in args.contexts:
                rows = {d: ClattnRow(dev, spec, B, ctx) for d, dev in devices.items()}
                flash = ggml_run(exe, "flash", spec, ctx, B, args.threads, 1, 0)[1]
                plain = ggml_run(exe, "plain", spec, ctx, B, args.threads, 1, 0)[1]
                why = {d: r.check() for d, r in rows.items()}
                if abs(flash - plain) > 1e-2 * max(1.0, abs(plain)):
                    why["ggml"] = f"flash and plain paths disagree ({flash} vs {plain})"
                bad = {k: v for k, v in why.items() if v}
                if bad:
                    log(f"{name} B={B} ctx={ctx}: MISMATCH {bad}")
                    failed = True
                    continue
                times: dict[str, list[float]] = {k: [] for k in ["flash", "plain", *rows]}
                for _ in range(args.rounds):
                    for path in ("flash", "plain"):
                        times[path].append(ggml_run(exe, path, spec, ctx, B, args.threads,
                                                    args.iters, args.warmup)[0])
                    for d, r in rows.items():
                        times[d].append(r.median_ms(args.iters, args.warmup))
                med = {k: statistics.median(v) for k, v in times.items()}
                best = min(med["flash"], med["plain"])
                for d, r in rows.items():
                    lines.append([name, str(B), str(ctx), d, f"{med[d]:.3f}",
                                  f"{med['flash']:.3f}", f"{med['plain']:.3f}",
                                  f"{best / med[d]:.2f}x",
                                  " ".join(f"{t:.2f}" for t in times[d])])
                    r.release()
                log(f"{name} B={B} ctx={ctx}: " + ", ".join(f"{k} {v:.3f} ms"
                                                           for k, v in med.items()))
    print("\n".join(table(["model", "B", "ctx", "device", "clattn ms", "ggml flash ms",
                           "ggml plain ms", "ggml best / clattn", "clattn rounds"],
                          lines, right=set(range(1, 8)), markdown=True)))
    return 1 if failed else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
