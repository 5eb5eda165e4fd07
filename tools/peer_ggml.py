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

Both sides read the same q, K and V (N(0, 1), f16; ggml from a file); every side's output is
checked against clattn's CPU backend before anything is timed; a mismatch ends the script
with status 1. Both sides
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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import (  # common first: the package on the path
    MODELS,
    PAGE,
    ROOT,
    cpu_description,
    csv,
    driver_description,
    log,
)

from clattn import cpu_backend, runtime
from clattn.spec import AttentionSpec
from clattn.tune.checks import decoder
from clattn.tune.timing import table

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


def ggml_commit(src: Path) -> str:
    """The commit of the ggml checkout ``src`` (``unknown`` outside git)."""
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], text=True,
                             capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


class Inputs:
    """One row's q and contiguous K/V (f16, N(0, 1): peaked softmaxes, not near-uniform
    ones whose outputs all sit near 0), the file ggml reads them from, and the same
    values in clattn's pages (sequence after sequence, pages in order)."""

    def __init__(self, spec: AttentionSpec, B: int, ctx: int, tmp: Path, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        hkv, d = spec.num_kv_heads, spec.head_dim
        self.q = rng.standard_normal((B, spec.num_qo_heads, d), dtype=np.float32)
        self.q = self.q.astype(np.float16)
        kv = rng.standard_normal((2, B, hkv, ctx, d), dtype=np.float32).astype(np.float16)
        self.data = tmp / f"in-{B}-{ctx}.bin"
        with open(self.data, "wb") as f:
            f.write(self.q.astype(np.float32).tobytes())
            f.write(kv[0].tobytes())
            f.write(kv[1].tobytes())
        n = -(-ctx // PAGE)
        padded = np.zeros((2, B, hkv, n * PAGE, d), np.float16)
        padded[..., :ctx, :] = kv
        # [2, B, hkv, n, PAGE, d] -> [B, n, 2, hkv, PAGE, d] -> pages
        self.pages = np.ascontiguousarray(padded.reshape(2, B, hkv, n, PAGE, d)
                                          .transpose(1, 3, 0, 2, 4, 5)
                                          .reshape(B * n, 2, hkv, PAGE, d))
        self.indptr = (np.arange(B + 1) * n).astype(np.int32)
        self.indices = np.arange(B * n, dtype=np.int32)
        self.last = np.full(B, ctx - (n - 1) * PAGE, np.int32)
        self.ref = cpu_backend.batch_decode(spec, self.q, self.pages, self.indptr,
                                            self.indices, self.last)[0]


def ggml_run(exe: Path, path: str, spec: AttentionSpec, x: Inputs, ctx: int, B: int,
             threads: int, iters: int, warmup: int) -> tuple[float, np.ndarray]:
    """(median ms of ``iters`` timed computations, the output [B, H, D]) of one ggml path."""
    out = x.data.with_suffix(f".{path}.out")
    cmd = [str(exe), path, str(spec.num_qo_heads), str(spec.num_kv_heads), str(spec.head_dim),
           str(ctx), str(B), str(spec.softcap or 0.0), str(threads), str(iters), str(warmup),
           str(x.data), str(out)]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    o = np.fromfile(out, np.float32).reshape(B, spec.num_qo_heads, spec.head_dim)
    return float(res.stdout.split()[0]), o


class ClattnRow:
    """One device's decoder and the row's inputs on it."""

    def __init__(self, dev: object, spec: AttentionSpec, x: Inputs) -> None:
        rt = runtime.Runtime.for_device(dev)
        cla = runtime.cl().array
        self.args = [cla.to_device(rt.queue, a) for a in
                     (x.q, x.pages, x.indptr, x.indices, x.last)]
        self.out = cla.empty(rt.queue, x.q.shape, np.float16)
        self.lse = cla.empty(rt.queue, x.q.shape[:2], np.float32)
        self.dec = decoder(spec, dev, None)
        self.plan = self.dec.plan(x.indptr, x.last, split=None)

    def result(self) -> np.ndarray:
        """One call's output on the host."""
        return self.dec.run(*self.args, out=self.out, lse=self.lse, plan=self.plan).out.get()

    def median_ms(self, iters: int, warmup: int) -> float:
        """Median wall time of ``iters`` calls (each waits for its last kernel)."""
        times = []
        for i in range(warmup + iters):
            t = time.perf_counter()
            self.dec.run(*self.args, out=self.out, lse=self.lse, plan=self.plan).event.wait()
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3


def mismatch(got: np.ndarray, ref: np.ndarray, dtype_eps: float) -> str | None:
    """None when ``got`` is within ``dtype_eps`` x the largest reference value of the CPU
    backend's f32-accumulated result (f16 inputs and outputs), else why not."""
    err = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
    bound = dtype_eps * max(1.0, float(np.max(np.abs(ref))))
    return None if err <= bound else f"max error {err:.3g} > {bound:.3g}"


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
    tmp = Path(tempfile.mkdtemp(prefix="clattn-peer-"))
    for name in args.models:
        m = MODELS[name]
        spec = AttentionSpec(m.num_qo_heads, m.num_kv_heads, m.head_dim, page_size=PAGE,
                             dtype="float16", softcap=m.softcap)
        for B in args.batches:
            for ctx in args.contexts:
                x = Inputs(spec, B, ctx, tmp)
                rows = {d: ClattnRow(dev, spec, x) for d, dev in devices.items()}
                # f16 storage of the output and f16 products inside ggml: a few f16 ulps
                why = {d: mismatch(r.result(), x.ref, 4e-3) for d, r in rows.items()}
                for path in ("flash", "plain"):
                    why[f"ggml {path}"] = mismatch(ggml_run(exe, path, spec, x, ctx, B,
                                                            args.threads, 1, 0)[1], x.ref, 4e-3)
                bad = {k: v for k, v in why.items() if v}
                if bad:
                    log(f"{name} B={B} ctx={ctx}: MISMATCH {bad}")
                    failed = True
                    continue
                times: dict[str, list[float]] = {k: [] for k in ["flash", "plain", *rows]}
                for _ in range(args.rounds):
                    for path in ("flash", "plain"):
                        times[path].append(ggml_run(exe, path, spec, x, ctx, B, args.threads,
                                                    args.iters, args.warmup)[0])
                    for d, r in rows.items():
                        times[d].append(r.median_ms(args.iters, args.warmup))
                med = {k: statistics.median(v) for k, v in times.items()}
                best = min(med["flash"], med["plain"])
                for d in rows:
                    lines.append([name, str(B), str(ctx), d, f"{med[d]:.3f}",
                                  f"{med['flash']:.3f}", f"{med['plain']:.3f}",
                                  f"{best / med[d]:.2f}x",
                                  " ".join(f"{t:.2f}" for t in times[d])])
                del rows
                log(f"{name} B={B} ctx={ctx}: " + ", ".join(f"{k} {v:.3f} ms"
                                                           for k, v in med.items()))
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"- CPU: {cpu_description()}; ggml {ggml_commit(args.ggml_src)}, {args.threads} "
          f"threads")
    for line in driver_description(devices.values()):
        print(f"- OpenCL: {line}")
    print()
    print("\n".join(table(["model", "B", "ctx", "device", "clattn ms", "ggml flash ms",
                           "ggml plain ms", "ggml best / clattn", "clattn rounds"],
                          lines, right=set(range(1, 8)), markdown=True)))
    return 1 if failed else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
