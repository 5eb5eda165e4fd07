#!/usr/bin/env python
"""clattn benchmarks (a developer script, not a test).

Suites
  fallback  the CPU fallback (clattn.reference.batch_decode) next to a plain numpy
            dense-attention baseline (K/V contiguous [B, Hkv, T, D]) measured in the same run.
  decode    BatchDecode (f16, f32) on one OpenCL device with device-resident arrays:
            kernel time from profiling events (decode + merge when split), wall time per
            call, KV bytes/s, fraction of the streaming-read bandwidth measured by
            clattn.bandwidth in the same run, the CPU fallback's time as a ratio; then
            merge_state_ bandwidth (N=4096) and small-N merge time vs the launch latency.
  split     split-KV: unsplit vs the planner's choice vs the best forced partition size.

Examples
  python tools/bench.py --suite fallback --quick
  python tools/bench.py --suite decode --device intel --json tools/results/decode-intel.json
  python tools/bench.py --suite split --device pocl --profile adreno-7xx

Data: pseudo-random f16/f32 (filled on the device before timing), pages shuffled in the
pool, pools allocated once per (model, dtype) and reused by every row, one warm-up run per
configuration (it includes the compile). Medians over ``--repeat`` timed runs (at least 3,
fewer than --repeat once a row has run ``--row-seconds``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict
from typing import Any, Callable

# numpy's BLAS (the dense baseline) single-threaded unless the caller says otherwise: the
# fallback is single-threaded too, and OpenBLAS's spinning threads turn any background load
# on a small machine into 2-5x noise
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clattn import bandwidth, reference, runtime  # noqa: E402
from clattn.spec import AttentionSpec, default_sm_scale  # noqa: E402

MODELS = {  # name: (H_qo, H_kv, D)
    "Llama-3.2-1B": (32, 8, 64),
    "Llama-3-8B": (32, 8, 128),
    "Qwen2.5-0.5B": (14, 2, 64),
    "Gemma-2-2B": (8, 4, 256),
    "Phi-3-mini": (32, 32, 96),
}
GiB = 1 << 30
PAGE = 16


# -- small utilities ---------------------------------------------------------------------
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def csv(text: str | None, cast: Callable = str) -> list | None:
    return None if text is None else [cast(x.strip()) for x in text.split(",") if x.strip()]


def kv_bytes(hkv: int, d: int, B: int, ctx: int, itemsize: int) -> int:
    return 2 * B * hkv * ctx * d * itemsize


def io_bytes(hqo: int, hkv: int, d: int, B: int, ctx: int, itemsize: int) -> int:
    """Bytes a decode must move: K and V attended, q in, out and lse written."""
    return kv_bytes(hkv, d, B, ctx, itemsize) + 2 * B * hqo * d * itemsize + B * hqo * 4


def short_plan(plan: Any) -> str:
    return f"split {plan.part_rows} x{plan.num_parts}" if plan.split else "no split"


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def over(self) -> bool:
        return time.perf_counter() > self.end


def sample(call: Callable[[], dict], repeat: int, row_seconds: float) -> dict:
    """One warm-up call, then up to ``repeat`` timed calls; the median of each key."""
    call()
    runs: list[dict] = []
    t0 = time.perf_counter()
    while len(runs) < max(1, repeat) and (len(runs) < 3 or time.perf_counter() - t0 < row_seconds):
        runs.append(call())
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out.update({f"min_{k}": min(r[k] for r in runs) for k in runs[0]})
    out["runs"] = len(runs)
    return out


def sample_interleaved(calls: dict, repeat: int, row_seconds: float,
                       after: Callable | None = None) -> tuple[dict, dict]:
    """Like :func:`sample` for several variants, run round-robin so that background load
    hits them alike. Returns (medians per variant, ``after()`` once after each warm-up)."""
    outs = {}
    for k, c in calls.items():
        c()
        if after is not None:
            outs[k] = after()
    runs: dict = {k: [] for k in calls}
    t0 = time.perf_counter()
    budget = row_seconds * len(calls)
    n = 0
    while n < max(1, repeat) and (n < 3 or time.perf_counter() - t0 < budget):
        for k, c in calls.items():
            runs[k].append(c())
        n += 1
    res = {}
    for k, rs in runs.items():
        r = {key: statistics.median(x[key] for x in rs) for key in rs[0]}
        r.update({f"min_{key}": min(x[key] for x in rs) for key in rs[0]})
        r["runs"] = len(rs)
        res[k] = r
    return res, outs


def fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


def markdown(rows: list[dict], cols: list[tuple]) -> str:
    """cols: (key, header, format spec)."""
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "|" + "|".join("---" if c[2] == "" else "---:" for c in cols) + "|"
    lines = [head, sep]
    for r in rows:
        if "skipped" in r and r["skipped"]:
            cells = [fmt(r.get(k), f) if k in ("model", "dtype", "B", "ctx", "N") else ""
                     for k, _, f in cols]
            cells[-1] = f"skipped: {r['skipped']}"
        else:
            cells = [fmt(r.get(k), f) for k, _, f in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def host_pool(rng: np.random.Generator, n_pages: int, hkv: int, d: int, dtype: Any) -> np.ndarray:
    """[P, 2, Hkv, PAGE, D] pseudo-random in [-1, 1), generated in chunks."""
    pages = np.empty((n_pages, 2, hkv, PAGE, d), dtype=dtype)
    flat = pages.reshape(-1)
    step = 1 << 24
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        flat[i:i + n] = rng.random(n, dtype=np.float32) * 2 - 1
    return pages


def page_table(rng: np.random.Generator, pool_pages: int, B: int, ctx: int):
    """Host (indptr, indices, last_page_len): B sequences of ctx rows on shuffled pages."""
    npages = max(1, -(-ctx // PAGE))
    if B * npages > pool_pages:
        raise ValueError("pool too small")
    indices = rng.permutation(pool_pages)[:B * npages].astype(np.int32)
    indptr = (np.arange(B + 1) * npages).astype(np.int32)
    last = np.full(B, ctx - (npages - 1) * PAGE, dtype=np.int32)
    return indptr, indices, last


# -- fallback suite ----------------------------------------------------------------------
def dense_attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float) -> np.ndarray:
    """Plain numpy attention: q [B, H, D], K/V [B, Hkv, T, D] (f32 math)."""
    B, H, D = q.shape
    hkv = K.shape[1]
    qf = q.astype(np.float32).reshape(B, hkv, H // hkv, D)
    Kf = K.astype(np.float32, copy=False)
    Vf = V.astype(np.float32, copy=False)
    s = np.matmul(qf, Kf.transpose(0, 1, 3, 2)) * np.float32(scale)  # [B, Hkv, G, T]
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    o = np.matmul(p, Vf) / p.sum(axis=-1, keepdims=True)
    return o.reshape(B, H, D).astype(q.dtype)


def suite_fallback(args: argparse.Namespace, deadline: Deadline) -> dict:
    models = args.models or (["Llama-3.2-1B", "Llama-3-8B", "Qwen2.5-0.5B"] if args.quick
                             else list(MODELS))
    batches = args.batches or [1, 8]
    contexts = args.contexts or ([512, 4096] if args.quick else [512, 4096, 16384])
    dtypes = args.dtypes or ["float16"]
    if args.smoke:
        models, batches, contexts, dtypes = ["Qwen2.5-0.5B"], [1], [512], ["float16"]
    rng = np.random.default_rng(args.seed)
    rows = []
    for name in models:
        hqo, hkv, d = MODELS[name]
        for dt in dtypes:
            spec = AttentionSpec(hqo, hkv, d, page_size=PAGE, dtype=dt)
            pool_pages = max(batches) * -(-max(contexts) // PAGE)
            pool = None
            for B in batches:
                for ctx in contexts:
                    row = dict(model=name, dtype=dt, B=B, ctx=ctx)
                    rows.append(row)
                    if deadline.over():
                        row["skipped"] = "time budget"
                        continue
                    if pool is None:
                        pool = host_pool(rng, pool_pages, hkv, d, spec.np_dtype)
                    indptr, indices, last = page_table(rng, pool_pages, B, ctx)
                    q = (rng.standard_normal((B, hqo, d), dtype=np.float32)).astype(spec.np_dtype)
                    sel = pool[indices].reshape(B, -1, 2, hkv, PAGE, d)  # [B, np, 2, Hkv, PS, D]
                    K = np.ascontiguousarray(sel[:, :, 0].transpose(0, 2, 1, 3, 4)
                                             .reshape(B, hkv, -1, d)[:, :, :ctx])
                    V = np.ascontiguousarray(sel[:, :, 1].transpose(0, 2, 1, 3, 4)
                                             .reshape(B, hkv, -1, d)[:, :, :ctx])
                    del sel
                    scale = default_sm_scale(d)

                    def fb():
                        t = time.perf_counter()
                        reference.batch_decode(spec, q, pool, indptr, indices, last)
                        return {"s": time.perf_counter() - t}

                    def dn():
                        t = time.perf_counter()
                        dense_attention(q, K, V, scale)
                        return {"s": time.perf_counter() - t}

                    o_fb, _ = reference.batch_decode(spec, q, pool, indptr, indices, last)
                    o_dn = dense_attention(q, K, V, scale)
                    err = float(np.max(np.abs(o_fb.astype(np.float32) - o_dn.astype(np.float32))))
                    res, _ = sample_interleaved({"fb": fb, "dense": dn}, args.repeat,
                                                args.row_seconds)
                    a, b = res["fb"], res["dense"]
                    kvb = kv_bytes(hkv, d, B, ctx, spec.itemsize)
                    row.update(fallback_ms=a["s"] * 1e3, fallback_gbps=kvb / a["s"] * 1e-9,
                               dense_ms=b["s"] * 1e3, dense_gbps=kvb / b["s"] * 1e-9,
                               ratio=a["s"] / b["s"], max_err=err, kv_mib=kvb / 2**20,
                               runs=a["runs"])
                    log(f"fallback {name} {dt} B={B} ctx={ctx}: {row['fallback_ms']:.2f} ms "
                        f"vs dense {row['dense_ms']:.2f} ms")
                    del K, V
            del pool
    cols = [("model", "model", ""), ("dtype", "dtype", ""), ("B", "B", "d"), ("ctx", "ctx", "d"),
            ("kv_mib", "KV MiB", ".1f"), ("fallback_ms", "fallback ms", ".2f"),
            ("fallback_gbps", "fallback GB/s", ".2f"), ("dense_ms", "numpy dense ms", ".2f"),
            ("dense_gbps", "dense GB/s", ".2f"), ("ratio", "fallback/dense", ".2f"),
            ("max_err", "max abs diff", ".1e")]
    return {"sections": [("CPU fallback vs numpy dense attention", rows, cols)], "ceilings": None}


# -- device helpers ----------------------------------------------------------------------
class _Recorder:
    """Wraps a pyopencl Kernel and keeps the events of its launches."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.events: list = []

    def __call__(self, *a: Any, **kw: Any) -> Any:
        evt = self.kernel(*a, **kw)
        self.events.append(evt)
        return evt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def _secs(evt: Any) -> float:
    return (evt.profile.end - evt.profile.start) * 1e-9


class DeviceBench:
    """A device, its runtime and its measured ceilings."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dev = runtime.select_device(args.device)
        if self.dev is None:
            raise SystemExit("no OpenCL device")
        self.rt = runtime.Runtime.for_device(self.dev)
        self.queue = self.rt.queue
        self.rng = np.random.default_rng(args.seed)
        log(f"device: {self.dev.platform.name.strip()} / {self.dev.name.strip()} "
            f"({self.dev.max_compute_units} compute units)")
        size = int(args.bw_mib * 2**20)
        t = time.perf_counter()
        self.read = bandwidth.read_bandwidth(self.rt, size, args.bw_target_s)
        log(self.read.summary())
        self.copy = bandwidth.copy_bandwidth(self.rt, max(size // 2, 2**20), args.bw_target_s)
        log(self.copy.summary())
        self.latency = bandwidth.launch_latency(self.rt, args.bw_target_s)
        log(self.latency.summary())
        log(f"(ceilings measured in {time.perf_counter() - t:.1f} s)")

    def ceilings(self) -> dict:
        return {"read": asdict(self.read), "copy": asdict(self.copy),
                "latency": asdict(self.latency)}

    def header(self) -> list[str]:
        return [f"- device: {self.dev.platform.name.strip()} / {self.dev.name.strip()} "
                f"({self.dev.max_compute_units} CUs)",
                f"- {self.read.summary()}", f"- {self.copy.summary()}",
                f"- {self.latency.summary()}"]

    def decoder(self, spec: AttentionSpec, profile: Any) -> Any:
        from clattn.decode import BatchDecode
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            dec = BatchDecode(spec, self.dev, backend="opencl", profile=profile).build()
        # keep the decode and merge events apart (run() returns only the last one)
        if getattr(dec, "_kernel", None) is not None and getattr(dec, "_merge", None) is not None:
            dec._kernel = _Recorder(dec._kernel)
            dec._merge = _Recorder(dec._merge)
        return dec

    def pool(self, spec: AttentionSpec, n_pages: int) -> Any:
        import pyopencl.array as cla
        arr = cla.empty(self.queue, (n_pages, 2, spec.num_kv_heads, PAGE, spec.head_dim),
                        spec.np_dtype)
        bandwidth.fill_random(self.rt, arr, seed=int(self.rng.integers(1 << 31)))
        return arr

    def to_dev(self, a: np.ndarray) -> Any:
        import pyopencl.array as cla
        return cla.to_device(self.queue, a)

    def timed_decode(self, dec: Any, tables: tuple, plan: Any) -> Callable[[], dict]:
        dq, dpool, dindptr, dindices, dlast, dout, dlse = tables
        rec = isinstance(getattr(dec, "_kernel", None), _Recorder)

        def call() -> dict:
            if rec:
                dec._kernel.events.clear()
                dec._merge.events.clear()
            t = time.perf_counter()
            res = dec.run(dq, dpool, dindptr, dindices, dlast, out=dout, lse=dlse, plan=plan)
            res.event.wait()
            wall = time.perf_counter() - t
            dout.finish()
            dlse.finish()
            if rec:
                dk = sum(_secs(e) for e in dec._kernel.events)
                mk = sum(_secs(e) for e in dec._merge.events)
            else:  # only the last event is known
                dk, mk = _secs(res.event), 0.0
            return {"wall": wall, "decode": dk, "merge": mk, "kernel": dk + mk}
        return call


def _tables(db: DeviceBench, spec: AttentionSpec, dpool: Any, pool_pages: int, B: int, ctx: int):
    import pyopencl.array as cla
    indptr, indices, last = page_table(db.rng, pool_pages, B, ctx)
    q = db.rng.standard_normal((B, spec.num_qo_heads, spec.head_dim),
                               dtype=np.float32).astype(spec.np_dtype)
    dout = cla.zeros(db.queue, q.shape, spec.np_dtype)
    dlse = cla.zeros(db.queue, q.shape[:2], np.float32)
    host = (q, indptr, indices, last)
    return host, (db.to_dev(q), dpool, db.to_dev(indptr), db.to_dev(indices), db.to_dev(last),
                  dout, dlse)


def _release(*arrays: Any) -> None:
    for a in arrays:
        try:
            a.finish()
            a.base_data.release()
        except Exception:  # noqa: BLE001 - best effort
            pass


# -- decode suite ------------------------------------------------------------------------
def suite_decode(args: argparse.Namespace, deadline: Deadline) -> dict:
    db = DeviceBench(args)
    models = args.models or (["Llama-3-8B", "Qwen2.5-0.5B"] if args.quick else list(MODELS))
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    contexts = args.contexts or [512, 4096, 16384]
    dtypes = args.dtypes or ["float16", "float32"]
    if args.smoke:
        models, batches, contexts, dtypes = ["Qwen2.5-0.5B"], [1], [512], ["float16"]
    rows: list[dict] = []
    for name in models:
        hqo, hkv, d = MODELS[name]
        for dt in dtypes:
            spec = AttentionSpec(hqo, hkv, d, page_size=PAGE, dtype=dt)
            page_bytes = 2 * hkv * PAGE * d * spec.itemsize
            todo = []
            for B in batches:
                for ctx in contexts:
                    row = dict(model=name, dtype=dt, B=B, ctx=ctx)
                    rows.append(row)
                    need = B * -(-ctx // PAGE) * page_bytes
                    if need > args.max_pool_gib * GiB:
                        row["skipped"] = f"KV {need / GiB:.1f} GiB > --max-pool-gib"
                    else:
                        todo.append((row, need))
            if not todo:
                continue
            if deadline.over():
                for row, _ in todo:
                    row["skipped"] = "time budget"
                continue
            pool_pages = max(n for _, n in todo) // page_bytes
            dpool = db.pool(spec, pool_pages)
            dec = db.decoder(spec, args.profile)
            host_pool = None
            for row, _ in todo:
                if deadline.over():
                    row["skipped"] = "time budget"
                    continue
                B, ctx = row["B"], row["ctx"]
                (q, indptr, indices, last), tabs = _tables(db, spec, dpool, pool_pages, B, ctx)
                plan = dec.plan(indptr, last, split=None)
                r = sample(db.timed_decode(dec, tabs, plan), args.repeat, args.row_seconds)
                nbytes = io_bytes(hqo, hkv, d, B, ctx, spec.itemsize)
                gbps = nbytes / r["kernel"] * 1e-9
                row.update(plan=short_plan(plan), plan_full=str(plan), kernel_ms=r["kernel"] * 1e3,
                           decode_ms=r["decode"] * 1e3, merge_ms=r["merge"] * 1e3,
                           wall_ms=r["wall"] * 1e3, gbps=gbps, frac=gbps / db.read.gbps,
                           wall_gbps=nbytes / r["wall"] * 1e-9, runs=r["runs"],
                           mib=nbytes / 2**20)
                if ctx <= args.fallback_max_context and B <= args.fallback_max_batch:
                    if host_pool is None:
                        host_pool = dpool.get()
                    fb_t = []
                    for i in range(2):
                        t = time.perf_counter()
                        o_fb, _ = reference.batch_decode(spec, q, host_pool, indptr, indices, last)
                        fb_t.append(time.perf_counter() - t)
                    row["fallback_ms"] = min(fb_t) * 1e3
                    row["fallback_ratio"] = min(fb_t) / r["wall"]
                    o_dev = tabs[5].get()
                    row["max_err"] = float(np.max(np.abs(o_dev.astype(np.float32)
                                                         - o_fb.astype(np.float32))))
                log(f"decode {name} {dt} B={B} ctx={ctx}: kernel {row['kernel_ms']:.3f} ms "
                    f"({row['frac']:.0%} of read bw), wall {row['wall_ms']:.3f} ms; {row['plan']}")
                _release(*tabs[:1], *tabs[2:])
            _release(dpool)
            del dpool, host_pool, dec
    cols = [("model", "model", ""), ("dtype", "dtype", ""), ("B", "B", "d"), ("ctx", "ctx", "d"),
            ("mib", "MiB moved", ".1f"), ("plan", "plan", ""),
            ("decode_ms", "decode ms", ".3f"), ("merge_ms", "merge ms", ".3f"),
            ("wall_ms", "wall ms", ".3f"), ("gbps", "GB/s", ".2f"), ("frac", "of read bw", ".1%"),
            ("fallback_ms", "fallback ms", ".2f"), ("fallback_ratio", "fallback/wall", ".1f"),
            ("max_err", "max abs diff", ".1e")]
    sections = [("Decode (median kernel event times; GB/s = KV + q/out/lse bytes / kernel time)",
                 rows, cols)]
    sections += merge_sections(args, db, deadline)
    return {"sections": sections, "ceilings": db.ceilings(), "header": db.header()}


def merge_sections(args: argparse.Namespace, db: DeviceBench, deadline: Deadline) -> list:
    import pyopencl.array as cla
    from clattn.merge import merge_state_
    H, D = 32, 128
    big = [256] if args.smoke else [4096]
    small = [1, 32] if args.smoke else [1, 2, 4, 8, 16, 32]
    rows_bw, rows_lat = [], []
    for N in big + small:
        row = dict(N=N, H=H, D=D, dtype="float16")
        (rows_bw if N in big else rows_lat).append(row)
        if deadline.over():
            row["skipped"] = "time budget"
            continue
        arrs = [cla.empty(db.queue, (N, H, D), np.float16), cla.empty(db.queue, (N, H), np.float32),
                cla.empty(db.queue, (N, H, D), np.float16), cla.empty(db.queue, (N, H), np.float32)]
        for i, a in enumerate(arrs):
            bandwidth.fill_random(db.rt, a, seed=100 + i, scale=1.0 if i % 2 == 0 else 8.0)
        v, s, vo, so = arrs

        def call() -> dict:
            t = time.perf_counter()
            evt = merge_state_(v, s, vo, so, profile=args.profile)
            evt.wait()
            wall = time.perf_counter() - t
            v.finish()
            s.finish()
            return {"wall": wall, "kernel": _secs(evt)}

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            r = sample(call, max(args.repeat, 20 if N in small else args.repeat), args.row_seconds)
        nbytes = 3 * N * H * D * 2 + 3 * N * H * 4
        row.update(kernel_us=r["kernel"] * 1e6, wall_us=r["wall"] * 1e6, runs=r["runs"],
                   kernel_min_us=r["min_kernel"] * 1e6, wall_min_us=r["min_wall"] * 1e6,
                   gbps=nbytes / r["kernel"] * 1e-9, mib=nbytes / 2**20)
        row["frac"] = row["gbps"] / db.read.gbps
        row["frac_copy"] = row["gbps"] / db.copy.gbps
        row["lat_ratio"] = r["kernel"] * 1e6 / db.latency.kernel_us
        row["trip_ratio"] = r["wall"] * 1e6 / db.latency.round_trip_us
        row["lat_min_ratio"] = r["min_kernel"] * 1e6 / max(db.latency.kernel_min_us, 1e-3)
        log(f"merge N={N}: kernel {row['kernel_us']:.1f} us, wall {row['wall_us']:.1f} us, "
            f"{row['gbps']:.2f} GB/s")
        _release(*arrs)
    c1 = [("N", "N", "d"), ("H", "H", "d"), ("D", "D", "d"), ("dtype", "dtype", ""),
          ("mib", "MiB moved", ".1f"), ("kernel_us", "kernel us", ".1f"),
          ("wall_us", "wall us", ".1f"), ("gbps", "GB/s", ".2f"), ("frac", "of read bw", ".1%"),
          ("frac_copy", "of copy bw", ".0%")]
    lat = db.latency
    c2 = [("N", "N", "d"), ("kernel_us", "kernel us", ".1f"),
          ("lat_ratio", f"/ empty kernel ({lat.kernel_us:.1f} us)", ".2f"),
          ("kernel_min_us", "best kernel us", ".1f"),
          ("lat_min_ratio", f"/ best empty kernel ({lat.kernel_min_us:.1f} us)", ".2f"),
          ("wall_us", "merge_state_ call+wait us", ".1f"),
          ("trip_ratio", f"/ empty round trip ({lat.round_trip_us:.1f} us)", ".2f")]
    return [("merge_state_ bandwidth (GB/s = v, v_other read + v written, and the lse)",
             rows_bw, c1),
            ("merge_state_ at small N (H=32, D=128, f16) vs the empty-kernel launch latency",
             rows_lat, c2)]


# -- split suite -------------------------------------------------------------------------
def suite_split(args: argparse.Namespace, deadline: Deadline) -> dict:
    db = DeviceBench(args)
    models = args.models or (["Llama-3-8B"] if args.quick else ["Llama-3-8B", "Qwen2.5-0.5B"])
    batches = args.batches or [1, 4]
    contexts = args.contexts or ([4096, 16384, 32768] if args.quick
                                 else [1024, 4096, 16384, 32768, 65536])
    sizes = args.split_sizes or [256, 512, 1024, 2048, 4096, 8192]
    if args.smoke:
        models, batches, contexts, sizes = ["Qwen2.5-0.5B"], [1], [4096], [512, 1024]
    dt = (args.dtypes or ["float16"])[0]
    rows: list[dict] = []
    for name in models:
        hqo, hkv, d = MODELS[name]
        spec = AttentionSpec(hqo, hkv, d, page_size=PAGE, dtype=dt)
        page_bytes = 2 * hkv * PAGE * d * spec.itemsize
        pool_pages = max(batches) * -(-max(contexts) // PAGE)
        todo_rows = [dict(model=name, dtype=dt, B=B, ctx=ctx) for B in batches for ctx in contexts]
        rows += todo_rows
        if pool_pages * page_bytes > args.max_pool_gib * GiB:
            log(f"note: {name} pool {pool_pages * page_bytes / GiB:.1f} GiB exceeds "
                f"--max-pool-gib; allocating it anyway (split suite)")
        if deadline.over():
            for row in todo_rows:
                row["skipped"] = "time budget"
            continue
        dpool = db.pool(spec, pool_pages)
        dec = db.decoder(spec, args.profile)
        for row in todo_rows:
            if deadline.over():
                row["skipped"] = "time budget"
                continue
            B, ctx = row["B"], row["ctx"]
            (q, indptr, indices, last), tabs = _tables(db, spec, dpool, pool_pages, B, ctx)
            nbytes = io_bytes(hqo, hkv, d, B, ctx, spec.itemsize)

            unsplit_plan = dec.plan(indptr, last, split=False)
            planned_plan = dec.plan(indptr, last, split=None)
            plans = {"unsplit": unsplit_plan}
            for rows_per in sizes:
                p = dec.plan(indptr, last, split=rows_per)
                if p.split and not any(o.split and o.part_rows == p.part_rows
                                       for o in plans.values()):
                    plans[f"split {p.part_rows}"] = p
            planned_key = "unsplit" if not planned_plan.split else f"split {planned_plan.part_rows}"
            plans.setdefault(planned_key, planned_plan)
            calls = {k: db.timed_decode(dec, tabs, p) for k, p in plans.items()}
            # a control: the unsplit launch timed twice; their difference is the noise floor
            calls["unsplit (control)"] = db.timed_decode(dec, tabs, unsplit_plan)
            res, outs = sample_interleaved(calls, args.repeat, args.row_seconds,
                                           after=lambda: tabs[5].get())
            err = max(float(np.max(np.abs(o.astype(np.float32) - outs["unsplit"].astype(np.float32))))
                      for o in outs.values())
            unsplit, planned = res["unsplit"], res[planned_key]
            control = res.pop("unsplit (control)")
            outs.pop("unsplit (control)", None)
            forced = [(plans[k], r) for k, r in res.items() if k != "unsplit"]
            best_p, best = min(forced, key=lambda x: x[1]["kernel"]) if forced else (None, None)
            better = min(unsplit["kernel"], best["kernel"]) if best else unsplit["kernel"]
            row.update(
                mib=nbytes / 2**20, unsplit_ms=unsplit["kernel"] * 1e3,
                plan=str(planned_plan), planned_ms=planned["kernel"] * 1e3,
                planned_decode_ms=planned["decode"] * 1e3, planned_merge_ms=planned["merge"] * 1e3,
                planned_wall_ms=planned["wall"] * 1e3,
                best_rows=best_p.part_rows if best_p else None,
                best_parts=best_p.num_parts if best_p else None,
                best_ms=best["kernel"] * 1e3 if best else None,
                best_merge_ms=best["merge"] * 1e3 if best else None,
                speedup=unsplit["kernel"] / best["kernel"] if best else None,
                frac_unsplit=nbytes / unsplit["kernel"] * 1e-9 / db.read.gbps,
                frac_planned=nbytes / planned["kernel"] * 1e-9 / db.read.gbps,
                frac_best=nbytes / better * 1e-9 / db.read.gbps,
                slowdown=planned["kernel"] / better - 1.0,
                forced={str(p.part_rows): r["kernel"] * 1e3 for p, r in forced},
                runs=unsplit["runs"],
                noise=abs(control["kernel"] - unsplit["kernel"]) / unsplit["kernel"],
                split_vs_unsplit_maxdiff=err)
            log(f"split {name} B={B} ctx={ctx}: unsplit {row['unsplit_ms']:.3f} ms, planned "
                f"{row['planned_ms']:.3f} ms [{planned_plan}], best forced "
                f"{row['best_ms'] if best else float('nan'):.3f} ms at {row['best_rows']} rows")
            _release(*tabs[:1], *tabs[2:])
        _release(dpool)
        del dpool, dec
    cols = [("model", "model", ""), ("B", "B", "d"), ("ctx", "ctx", "d"), ("mib", "MiB", ".0f"),
            ("unsplit_ms", "unsplit ms", ".3f"), ("frac_unsplit", "unsplit bw", ".1%"),
            ("plan", "planner's choice", ""), ("planned_ms", "planned ms", ".3f"),
            ("planned_merge_ms", "of which merge", ".3f"), ("frac_planned", "planned bw", ".1%"),
            ("best_rows", "best forced rows", "d"), ("best_ms", "best forced ms", ".3f"),
            ("speedup", "unsplit/best split", ".2f"), ("frac_best", "best bw", ".1%"),
            ("slowdown", "planner vs better", "+.1%"),
            ("noise", "noise (unsplit timed twice)", ".1%")]
    title = "Split-KV (median kernel event times, decode + merge)"
    if args.profile:
        title += f", profile forced to {args.profile}"
    return {"sections": [(title, rows, cols)], "ceilings": db.ceilings(), "header": db.header()}


# -- main --------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--suite", choices=("fallback", "decode", "split"), required=True)
    ap.add_argument("--device", default="pocl",
                    help="OpenCL device: 'pocl' (default), 'intel', a name fragment or P:D")
    ap.add_argument("--profile", default=None, help="force a clattn profile (e.g. adreno-7xx)")
    ap.add_argument("--quick", action="store_true", help="a subset for a fast look")
    ap.add_argument("--smoke", action="store_true", help="one tiny row per section (tests)")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per row (max)")
    ap.add_argument("--row-seconds", type=float, default=1.5,
                    help="stop repeating a row after this long (3 runs at least)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="skip the remaining rows after this many seconds")
    ap.add_argument("--json", metavar="FILE", help="write the raw results as JSON")
    ap.add_argument("--markdown", action="store_true", default=True,
                    help="print markdown tables on stdout (the default)")
    ap.add_argument("--no-markdown", dest="markdown", action="store_false")
    ap.add_argument("--models", type=lambda s: csv(s), default=None,
                    help=f"comma list from {', '.join(MODELS)}")
    ap.add_argument("--batches", type=lambda s: csv(s, int), default=None)
    ap.add_argument("--contexts", type=lambda s: csv(s, int), default=None)
    ap.add_argument("--dtypes", type=lambda s: csv(s), default=None, help="float16,float32")
    ap.add_argument("--split-sizes", type=lambda s: csv(s, int), default=None,
                    help="forced partition sizes tried by --suite split")
    ap.add_argument("--max-pool-gib", type=float, default=2.0,
                    help="decode rows whose KV pool is larger are skipped")
    ap.add_argument("--fallback-max-context", type=int, default=4096,
                    help="decode suite: time the CPU fallback only up to this context")
    ap.add_argument("--fallback-max-batch", type=int, default=8)
    ap.add_argument("--bw-mib", type=float, default=256, help="bandwidth test buffer (MiB)")
    ap.add_argument("--bw-target-s", type=float, default=0.1,
                    help="seconds per bandwidth variant")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for m in args.models or []:
        if m not in MODELS:
            ap.error(f"--models: unknown {m!r}; known: {', '.join(MODELS)}")
    if args.smoke:
        args.bw_mib = min(args.bw_mib, 32)
        args.bw_target_s = min(args.bw_target_s, 0.02)
        args.repeat = min(args.repeat, 3)
    return args


def source_version() -> str:
    """The git commit of the checkout (``+dirty`` with uncommitted changes to clattn/ or kernels/)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "clattn", "kernels"],
                               cwd=root, text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    deadline = Deadline(args.budget_s)
    version = source_version()
    t0 = time.perf_counter()
    res = {"fallback": suite_fallback, "decode": suite_decode, "split": suite_split}[args.suite](
        args, deadline)
    elapsed = time.perf_counter() - t0
    if args.markdown:
        when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        cmd = "python tools/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
        print(f"## `{cmd}`\n")
        end_version = source_version()
        ver = version if end_version == version else f"{version} -> {end_version} (changed mid-run)"
        print(f"- {when}, host {platform.node()} ({os.cpu_count()} CPUs), {elapsed:.0f} s, "
              f"clattn {ver}")
        for line in res.get("header") or []:
            print(line)
        for title, rows, cols in res["sections"]:
            print(f"\n### {title}\n")
            print(markdown(rows, cols))
        print()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        out = {"suite": args.suite, "args": vars(args), "elapsed_s": elapsed,
               "host": platform.node(), "time": datetime.datetime.now().isoformat(),
               "clattn_version": version, "clattn_version_at_end": source_version(),
               "ceilings": res.get("ceilings"),
               "sections": {title: rows for title, rows, _ in res["sections"]}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
