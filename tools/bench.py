#!/usr/bin/env python
"""clattn benchmarks (a developer script, not a test).

Suites
  fallback  the CPU backend (clattn.cpu_backend.batch_decode) next to a plain numpy
            dense-attention baseline (K/V contiguous [B, Hkv, T, D]) measured in the same run.
  decode    BatchDecode (f16, f32) on one OpenCL device with device-resident arrays:
            kernel time from the events of each call (decode + merge when split), cold
            (each call reads another page set; the sets span at least 4x the largest cache,
            as successive layers do) and hot (the same pages every call); wall time per
            call; KV bytes/s and its fraction of the streaming-read ceiling (medians with
            medians); then merge_state_ bandwidth (N=4096) and small-N merge time vs the
            launch latency.
  split     split-KV: unsplit vs the planner's choice vs the best forced partition size
            (cold, as above).

Every timed configuration is first checked against the CPU backend on the same shape;
a mismatch is reported in its row and the script exits with status 1.

Examples
  python tools/bench.py --suite fallback --quick
  python tools/bench.py --suite decode --device intel --json tools/results/decode-intel.json
  python tools/bench.py --suite split --device pocl --profile adreno-7xx

Data: pseudo-random f16/f32 (filled on the device before timing), pages shuffled within
each page set, one pool per (model, dtype) reused by every row, one warm-up run per
configuration (it includes the compile; never counted). Medians over ``--repeat`` timed
runs (at least 3, fewer than --repeat once a row has run ``--row-seconds``), variants of a
row timed round-robin (clattn.tune.timing.sample).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from dataclasses import asdict
from typing import Any, Callable

# numpy's BLAS (the dense baseline) single-threaded unless the caller says otherwise: the
# CPU backend is single-threaded too, and OpenBLAS's spinning threads turn any background
# load on a small machine into 2-5x noise
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clattn import cpu_backend, runtime  # noqa: E402
from clattn.merge import merge_state_  # noqa: E402
from clattn.spec import AttentionSpec, default_sm_scale  # noqa: E402
from clattn.tune import ceilings as ceil  # noqa: E402
from clattn.tune.checks import TOL, compare, decoder  # noqa: E402
from clattn.tune.timing import cell, event_seconds, sample, table  # noqa: E402
from clattn.tune.workloads import PagePool, Workload, pool_pages, rotating_tables  # noqa: E402

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
    """A progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def csv(text: str | None, cast: Callable = str) -> list | None:
    """``"a,b"`` -> ``[cast("a"), cast("b")]``; None stays None."""
    return None if text is None else [cast(x.strip()) for x in text.split(",") if x.strip()]


def kv_bytes(hkv: int, d: int, B: int, ctx: int, itemsize: int) -> int:
    """Bytes of the K and V rows a decode reads."""
    return 2 * B * hkv * ctx * d * itemsize


def io_bytes(hqo: int, hkv: int, d: int, B: int, ctx: int, itemsize: int) -> int:
    """Bytes a decode must move: K and V attended, q in, out and lse written."""
    return kv_bytes(hkv, d, B, ctx, itemsize) + 2 * B * hqo * d * itemsize + B * hqo * 4


def short_plan(plan: Any) -> str:
    """``split 512 x8`` or ``no split``."""
    return f"split {plan.part_rows} x{plan.num_parts}" if plan.split else "no split"


class Deadline:
    """Rows after ``seconds`` are skipped."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def over(self) -> bool:
        """Whether the time is up."""
        return time.perf_counter() > self.end


def sample_interleaved(calls: dict, repeat: int, row_seconds: float,
                       after: Callable | None = None) -> tuple[dict, dict]:
    """:func:`clattn.tune.timing.sample` in the form the suites read: per variant the
    median of each key, ``min_<key>`` and ``runs``; and ``after()`` once after each
    variant's warm-up (its output, for checks)."""
    outs: dict = {}

    def observe(name: str, _: Any, warm: bool) -> None:
        if warm and after is not None:
            outs[name] = after()

    res = sample(calls, warmup=1, min_runs=3, max_runs=max(1, repeat), seconds=row_seconds,
                 observe=observe)
    flat = {}
    for name, keys in res.items():
        r: dict = {k: s.median for k, s in keys.items()}
        r.update({f"min_{k}": s.best for k, s in keys.items()})
        r["runs"] = next(iter(keys.values())).runs
        flat[name] = r
    return flat, outs


def _secs(evt: Any) -> float:
    return event_seconds([evt])


fmt = cell  # the one cell formatter (tools/bench_prefill.py reads it from here)


def markdown(rows: list[dict], cols: list[tuple]) -> str:
    """A Markdown table of result rows; cols: (key, header, format spec; "" = text)."""
    cells = []
    for r in rows:
        if r.get("skipped"):
            line = [cell(r.get(k), f) if k in ("model", "dtype", "B", "ctx", "N") else ""
                    for k, _, f in cols]
            line[-1] = f"skipped: {r['skipped']}"
        else:
            line = [cell(r.get(k), f) for k, _, f in cols]
        cells.append(line)
    right = {i for i, c in enumerate(cols) if c[2]}
    return "\n".join(table([c[1] for c in cols], cells, right=right, markdown=True))


def host_pool(rng: np.random.Generator, n_pages: int, hkv: int, d: int, dtype: Any) -> np.ndarray:
    """[P, 2, Hkv, PAGE, D] pseudo-random in [-1, 1), generated in chunks."""
    pages = np.empty((n_pages, 2, hkv, PAGE, d), dtype=dtype)
    flat = pages.reshape(-1)
    step = 1 << 24
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        flat[i:i + n] = rng.random(n, dtype=np.float32) * 2 - 1
    return pages


def page_table(rng: np.random.Generator, pool_pages_: int, B: int, ctx: int):
    """Host (indptr, indices, last_page_len): B sequences of ctx rows on shuffled pages."""
    indptr, last, sets = rotating_tables(rng, pool_pages_, B, ctx, PAGE)
    return indptr, sets[0], last


class Mismatches:
    """Configurations whose result disagreed with the CPU backend (exit status 1)."""

    items: list[str] = []

    @classmethod
    def check(cls, row: dict, what: str, ok: bool, err: float, why: str) -> bool:
        """Record the max error in ``row``; on a mismatch mark the row and remember it."""
        row["max_err"] = max(row.get("max_err") or 0.0, err)
        if not ok:
            row["skipped"] = f"WRONG RESULT ({what}): max error {err:.3g}; {why}"
            cls.items.append(f"{what}: max error {err:.3g} ({why})")
            log(f"MISMATCH {what}: max error {err:.3g} ({why})")
        return ok


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


def _fallback_row(args: argparse.Namespace, row: dict, spec: AttentionSpec, pool: np.ndarray,
                  rng: np.random.Generator) -> None:
    B, ctx = row["B"], row["ctx"]
    hqo, hkv, d = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    indptr, indices, last = page_table(rng, len(pool), B, ctx)
    q = (rng.standard_normal((B, hqo, d), dtype=np.float32)).astype(spec.np_dtype)
    sel = pool[indices].reshape(B, -1, 2, hkv, PAGE, d)  # [B, np, 2, Hkv, PS, D]
    K = np.ascontiguousarray(sel[:, :, 0].transpose(0, 2, 1, 3, 4).reshape(B, hkv, -1, d)[:, :, :ctx])
    V = np.ascontiguousarray(sel[:, :, 1].transpose(0, 2, 1, 3, 4).reshape(B, hkv, -1, d)[:, :, :ctx])
    del sel
    scale = default_sm_scale(d)
    o_fb, _ = cpu_backend.batch_decode(spec, q, pool, indptr, indices, last)
    o_dn = dense_attention(q, K, V, scale)
    err = float(np.max(np.abs(o_fb.astype(np.float32) - o_dn.astype(np.float32))))
    tol = 2 * TOL[spec.dtype]  # both sides rounded to the storage dtype
    if not Mismatches.check(row, f"fallback {row['model']} {spec.dtype} B={B} ctx={ctx}",
                            err <= tol, err, f"vs numpy dense attention, tolerance {tol:g}"):
        return

    def timed(fn: Callable[[], Any]) -> Callable[[], dict]:
        def call() -> dict:
            t = time.perf_counter()
            fn()
            return {"s": time.perf_counter() - t}
        return call

    res, _ = sample_interleaved(
        {"fb": timed(lambda: cpu_backend.batch_decode(spec, q, pool, indptr, indices, last)),
         "dense": timed(lambda: dense_attention(q, K, V, scale))},
        args.repeat, args.row_seconds)
    a, b = res["fb"], res["dense"]
    kvb = kv_bytes(hkv, d, B, ctx, spec.itemsize)
    row.update(fallback_ms=a["s"] * 1e3, fallback_gbps=kvb / a["s"] * 1e-9,
               dense_ms=b["s"] * 1e3, dense_gbps=kvb / b["s"] * 1e-9,
               ratio=a["s"] / b["s"], kv_mib=kvb / 2**20, runs=a["runs"])
    log(f"fallback {row['model']} {spec.dtype} B={B} ctx={ctx}: {row['fallback_ms']:.2f} ms "
        f"vs dense {row['dense_ms']:.2f} ms")


def suite_fallback(args: argparse.Namespace, deadline: Deadline) -> dict:
    """The CPU backend vs numpy dense attention."""
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
            n_pages = max(batches) * -(-max(contexts) // PAGE)
            pool = None
            for B in batches:
                for ctx in contexts:
                    row = dict(model=name, dtype=dt, B=B, ctx=ctx)
                    rows.append(row)
                    if deadline.over():
                        row["skipped"] = "time budget"
                        continue
                    if pool is None:
                        pool = host_pool(rng, n_pages, hkv, d, spec.np_dtype)
                    _fallback_row(args, row, spec, pool, rng)
            del pool
    cols = [("model", "model", ""), ("dtype", "dtype", ""), ("B", "B", "d"), ("ctx", "ctx", "d"),
            ("kv_mib", "KV MiB", ".1f"), ("fallback_ms", "CPU backend ms", ".2f"),
            ("fallback_gbps", "CPU backend GB/s", ".2f"), ("dense_ms", "numpy dense ms", ".2f"),
            ("dense_gbps", "dense GB/s", ".2f"), ("ratio", "backend/dense", ".2f"),
            ("max_err", "max abs diff", ".1e")]
    return {"sections": [("CPU backend vs numpy dense attention", rows, cols)], "ceilings": None}


# -- device helpers ----------------------------------------------------------------------
class DeviceBench:
    """A device, its runtime, its measured ceilings and the cold working set."""

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
        self.sizing = ceil.sizing(self.dev)
        size = int(args.bw_mib * 2**20) if args.bw_mib else None
        self.cold_bytes = int(args.cold_mib * 2**20) if args.cold_mib else \
            self.sizing.working_set_bytes
        t = time.perf_counter()
        self.read = ceil.read_bandwidth(self.rt, size, args.bw_target_s)
        log(self.read.summary())
        self.copy = ceil.copy_bandwidth(self.rt, size, args.bw_target_s)
        log(self.copy.summary())
        self.latency = ceil.launch_latency(self.rt, args.bw_target_s)
        log(self.latency.summary())
        log(f"(ceilings measured in {time.perf_counter() - t:.1f} s)")

    def ceilings(self) -> dict:
        """The ceilings as JSON-able dicts."""
        return {"read": asdict(self.read), "copy": asdict(self.copy),
                "latency": asdict(self.latency), "cold_bytes": self.cold_bytes,
                "caches": [asdict(c) for c in self.sizing.caches]}

    def header(self) -> list[str]:
        """Markdown bullet lines: device, ceilings, caches, the cold working set."""
        caches = ", ".join(f"{c.where} {ceil.size_text(c.size_bytes)}" for c in self.sizing.caches)
        return [f"- device: {self.dev.platform.name.strip()} / {self.dev.name.strip()} "
                f"({self.dev.max_compute_units} CUs)",
                f"- {self.read.summary()}", f"- {self.copy.summary()}",
                f"- {self.latency.summary()}",
                f"- caches reported: {caches or 'none'}; cold rows rotate over page sets "
                f"spanning at least {ceil.size_text(self.cold_bytes)}"]

    def decoder(self, spec: AttentionSpec, profile: Any) -> Any:
        """A built OpenCL BatchDecode."""
        return decoder(spec, self.dev, profile)

    def pool(self, spec: AttentionSpec, set_pages: int) -> PagePool:
        """A page pool for sets of ``set_pages`` pages, spanning the cold working set."""
        page_bytes = 2 * spec.num_kv_heads * PAGE * spec.head_dim * spec.itemsize
        pages = pool_pages(set_pages, page_bytes, self.cold_bytes)
        return PagePool(self.rt, spec, pages, seed=int(self.rng.integers(1 << 31)))

    def workload(self, pool: PagePool, B: int, ctx: int) -> Workload:
        """A row's tables on ``pool`` (every page set)."""
        return Workload(self.rt, pool, B, ctx, seed=int(self.rng.integers(1 << 31)))


def timed_decode(dec: Any, w: Workload, plan: Any, *, hot: bool = False) -> Callable[[], dict]:
    """A call of ``dec`` on ``w`` (another page set each call unless ``hot``) returning
    wall, decode, merge and kernel seconds (kernel = decode + merge, from the events)."""
    counter = itertools.count()

    def call() -> dict:
        t = time.perf_counter()
        res = dec.run(*w.args(next(counter), hot=hot), out=w.out, lse=w.lse, plan=plan)
        events = getattr(res, "events", (res.event,))
        events[-1].wait()
        wall = time.perf_counter() - t
        dk, mk = event_seconds(events[:1]), event_seconds(events[1:])
        return {"wall": wall, "decode": dk, "merge": mk, "kernel": dk + mk}
    return call


def check_decode_row(row: dict, what: str, dec: Any, w: Workload, plans: dict,
                     ref: tuple | None = None) -> tuple | None:
    """Run every plan once on page set 0 and compare with the CPU backend (timed: the
    row's ``fallback_ms``); the reference, or None after a mismatch."""
    if ref is None:
        q, pages, indptr, indices, last = w.host_args()
        t = time.perf_counter()
        ref = cpu_backend.batch_decode(dec.spec, q, pages, indptr, indices, last)
        row["fallback_ms"] = (time.perf_counter() - t) * 1e3
    for name, plan in plans.items():
        res = dec.run(*w.args(0), out=w.out, lse=w.lse, plan=plan)
        ok, err, why = compare(res.out.get(), res.lse.get(), ref[0], ref[1], dec.spec.dtype)
        if not Mismatches.check(row, f"{what} [{name}: {plan}]", ok, err, why):
            return None
    return ref


# -- decode suite ------------------------------------------------------------------------
def _decode_row(args: argparse.Namespace, db: DeviceBench, row: dict, dec: Any,
                pool: PagePool) -> None:
    B, ctx = row["B"], row["ctx"]
    spec = dec.spec
    w = db.workload(pool, B, ctx)
    try:
        plan = dec.plan(w.indptr, w.last, split=None)
        what = f"decode {row['model']} {row['dtype']} B={B} ctx={ctx}"
        if check_decode_row(row, what, dec, w, {"planned": plan}) is None:
            return
        res, _ = sample_interleaved({"cold": timed_decode(dec, w, plan),
                                     "hot": timed_decode(dec, w, plan, hot=True)},
                                    args.repeat, args.row_seconds)
    finally:
        w.release()
    r, h = res["cold"], res["hot"]
    nbytes = io_bytes(spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, B, ctx, spec.itemsize)
    gbps = nbytes / r["kernel"] * 1e-9
    row.update(plan=short_plan(plan), plan_full=str(plan), page_sets=w.n_sets,
               kernel_ms=r["kernel"] * 1e3, decode_ms=r["decode"] * 1e3,
               merge_ms=r["merge"] * 1e3, hot_ms=h["kernel"] * 1e3,
               cold_vs_hot=r["kernel"] / h["kernel"], wall_ms=r["wall"] * 1e3, gbps=gbps,
               frac=gbps / db.read.median_gbps, wall_gbps=nbytes / r["wall"] * 1e-9,
               runs=r["runs"], mib=nbytes / 2**20)
    row["fallback_ratio"] = row["fallback_ms"] / row["wall_ms"]
    log(f"decode {row['model']} {row['dtype']} B={B} ctx={ctx}: kernel {row['kernel_ms']:.3f} ms "
        f"cold, {row['hot_ms']:.3f} hot ({row['frac']:.0%} of read bw), wall "
        f"{row['wall_ms']:.3f} ms; {row['plan']}")


def suite_decode(args: argparse.Namespace, deadline: Deadline) -> dict:
    """BatchDecode on one device, cold and hot, then the merge sections."""
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
                        todo.append((row, need // page_bytes))
            if not todo:
                continue
            if deadline.over():
                for row, _ in todo:
                    row["skipped"] = "time budget"
                continue
            pool = db.pool(spec, max(n for _, n in todo))
            dec = db.decoder(spec, args.profile)
            for row, _ in todo:
                if deadline.over():
                    row["skipped"] = "time budget"
                    continue
                _decode_row(args, db, row, dec, pool)
            pool.release()
            del pool, dec
    cols = [("model", "model", ""), ("dtype", "dtype", ""), ("B", "B", "d"), ("ctx", "ctx", "d"),
            ("mib", "MiB moved", ".1f"), ("plan", "plan", ""), ("page_sets", "page sets", "d"),
            ("decode_ms", "decode ms", ".3f"), ("merge_ms", "merge ms", ".3f"),
            ("kernel_ms", "cold ms", ".3f"), ("hot_ms", "hot ms", ".3f"),
            ("cold_vs_hot", "cold/hot", ".2f"), ("wall_ms", "wall ms", ".3f"),
            ("gbps", "GB/s (cold)", ".2f"), ("frac", "of read bw (medians)", ".1%"),
            ("fallback_ms", "CPU backend ms", ".2f"), ("fallback_ratio", "backend/wall", ".1f"),
            ("max_err", "max abs err", ".1e")]
    sections = [("Decode (median kernel event times, cold: page sets rotating over at least "
                 f"{db.cold_bytes / 2**20:.0f} MiB; hot: the same pages; GB/s = KV + q/out/lse "
                 "bytes / cold kernel time)", rows, cols)]
    sections += merge_sections(args, db, deadline)
    return {"sections": sections, "ceilings": db.ceilings(), "header": db.header()}


def _merge_row(args: argparse.Namespace, db: DeviceBench, row: dict, small: bool) -> None:
    cla = runtime.cl().array
    N, H, D = row["N"], row["H"], row["D"]
    arrs = [cla.empty(db.queue, (N, H, D), np.float16), cla.empty(db.queue, (N, H), np.float32),
            cla.empty(db.queue, (N, H, D), np.float16), cla.empty(db.queue, (N, H), np.float32)]
    for i, a in enumerate(arrs):
        ceil.fill_random(db.rt, a, seed=100 + i, scale=1.0 if i % 2 == 0 else 8.0)
    v, s, vo, so = arrs
    try:
        host = [a.get() for a in arrs]
        rv, rs = cpu_backend.merge_state(*host)
        merge_state_(v, s, vo, so, profile=args.profile)
        ok, err, why = compare(v.get(), s.get(), rv, rs, "float16")
        if not Mismatches.check(row, f"merge_state_ N={N}", ok, err, why):
            return

        def call() -> dict:
            t = time.perf_counter()
            evt = merge_state_(v, s, vo, so, profile=args.profile)
            evt.wait()
            return {"wall": time.perf_counter() - t, "kernel": event_seconds([evt])}

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            r = sample_interleaved({"m": call}, max(args.repeat, 20 if small else args.repeat),
                                   args.row_seconds)[0]["m"]
    finally:
        for a in arrs:
            a.finish()
            a.base_data.release()
    nbytes = 3 * N * H * D * 2 + 3 * N * H * 4
    row.update(kernel_us=r["kernel"] * 1e6, wall_us=r["wall"] * 1e6, runs=r["runs"],
               kernel_min_us=r["min_kernel"] * 1e6, wall_min_us=r["min_wall"] * 1e6,
               gbps=nbytes / r["kernel"] * 1e-9, mib=nbytes / 2**20)
    row["frac"] = row["gbps"] / db.read.median_gbps
    row["frac_copy"] = row["gbps"] / db.copy.median_gbps
    row["lat_ratio"] = r["kernel"] * 1e6 / db.latency.kernel_us
    row["trip_ratio"] = r["wall"] * 1e6 / db.latency.round_trip_us
    row["lat_min_ratio"] = r["min_kernel"] * 1e6 / max(db.latency.kernel_min_us, 1e-3)
    log(f"merge N={N}: kernel {row['kernel_us']:.1f} us, wall {row['wall_us']:.1f} us, "
        f"{row['gbps']:.2f} GB/s")


def merge_sections(args: argparse.Namespace, db: DeviceBench, deadline: Deadline) -> list:
    """merge_state_ bandwidth at large N and latency at small N (checked first)."""
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
        _merge_row(args, db, row, N in small)
    c1 = [("N", "N", "d"), ("H", "H", "d"), ("D", "D", "d"), ("dtype", "dtype", ""),
          ("mib", "MiB moved", ".1f"), ("kernel_us", "kernel us", ".1f"),
          ("wall_us", "wall us", ".1f"), ("gbps", "GB/s", ".2f"),
          ("frac", "of read bw (medians)", ".1%"), ("frac_copy", "of copy bw (medians)", ".0%"),
          ("max_err", "max abs err", ".1e")]
    lat = db.latency
    c2 = [("N", "N", "d"), ("kernel_us", "kernel us", ".1f"),
          ("lat_ratio", f"/ empty kernel ({lat.kernel_us:.1f} us)", ".2f"),
          ("kernel_min_us", "best kernel us", ".1f"),
          ("lat_min_ratio", f"/ best empty kernel ({lat.kernel_min_us:.1f} us)", ".2f"),
          ("wall_us", "merge_state_ call+wait us", ".1f"),
          ("trip_ratio", f"/ empty round trip ({lat.round_trip_us:.1f} us)", ".2f"),
          ("max_err", "max abs err", ".1e")]
    return [("merge_state_ bandwidth (GB/s = v, v_other read + v written, and the lse)",
             rows_bw, c1),
            ("merge_state_ at small N (H=32, D=128, f16) vs the empty-kernel launch latency",
             rows_lat, c2)]


# -- split suite -------------------------------------------------------------------------
def _split_plans(dec: Any, w: Workload, sizes: list[int]) -> tuple[dict, str]:
    plans = {"unsplit": dec.plan(w.indptr, w.last, split=False)}
    for rows_per in sizes:
        p = dec.plan(w.indptr, w.last, split=rows_per)
        if p.split and not any(o.split and o.part_rows == p.part_rows for o in plans.values()):
            plans[f"split {p.part_rows}"] = p
    planned = dec.plan(w.indptr, w.last, split=None)
    key = "unsplit" if not planned.split else f"split {planned.part_rows}"
    plans.setdefault(key, planned)
    return plans, key


def _split_row(args: argparse.Namespace, db: DeviceBench, row: dict, dec: Any,
               pool: PagePool, sizes: list[int]) -> None:
    B, ctx = row["B"], row["ctx"]
    spec = dec.spec
    w = db.workload(pool, B, ctx)
    try:
        plans, planned_key = _split_plans(dec, w, sizes)
        what = f"split {row['model']} B={B} ctx={ctx}"
        if check_decode_row(row, what, dec, w, plans) is None:
            return
        calls = {k: timed_decode(dec, w, p) for k, p in plans.items()}
        # a control: the unsplit launch timed twice; their difference is the noise floor
        calls["unsplit (control)"] = timed_decode(dec, w, plans["unsplit"])
        res, _ = sample_interleaved(calls, args.repeat, args.row_seconds)
    finally:
        w.release()
    nbytes = io_bytes(spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, B, ctx, spec.itemsize)
    unsplit, planned = res["unsplit"], res[planned_key]
    control = res.pop("unsplit (control)")
    forced = [(plans[k], r) for k, r in res.items() if k != "unsplit"]
    best_p, best = min(forced, key=lambda x: x[1]["kernel"]) if forced else (None, None)
    better = min(unsplit["kernel"], best["kernel"]) if best else unsplit["kernel"]
    bw = db.read.median_gbps
    row.update(
        mib=nbytes / 2**20, unsplit_ms=unsplit["kernel"] * 1e3, page_sets=w.n_sets,
        plan=str(plans[planned_key]), planned_ms=planned["kernel"] * 1e3,
        planned_decode_ms=planned["decode"] * 1e3, planned_merge_ms=planned["merge"] * 1e3,
        planned_wall_ms=planned["wall"] * 1e3,
        best_rows=best_p.part_rows if best_p else None,
        best_parts=best_p.num_parts if best_p else None,
        best_ms=best["kernel"] * 1e3 if best else None,
        best_merge_ms=best["merge"] * 1e3 if best else None,
        speedup=unsplit["kernel"] / best["kernel"] if best else None,
        frac_unsplit=nbytes / unsplit["kernel"] * 1e-9 / bw,
        frac_planned=nbytes / planned["kernel"] * 1e-9 / bw,
        frac_best=nbytes / better * 1e-9 / bw,
        slowdown=planned["kernel"] / better - 1.0,
        forced={str(p.part_rows): r["kernel"] * 1e3 for p, r in forced},
        runs=unsplit["runs"],
        noise=abs(control["kernel"] - unsplit["kernel"]) / unsplit["kernel"])
    log(f"split {row['model']} B={B} ctx={ctx}: unsplit {row['unsplit_ms']:.3f} ms, planned "
        f"{row['planned_ms']:.3f} ms [{row['plan']}], best forced "
        f"{row['best_ms'] if best else float('nan'):.3f} ms at {row['best_rows']} rows")


def suite_split(args: argparse.Namespace, deadline: Deadline) -> dict:
    """Unsplit vs the planner's choice vs forced partition sizes (cold)."""
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
        todo_rows = [dict(model=name, dtype=dt, B=B, ctx=ctx) for B in batches for ctx in contexts]
        rows += todo_rows
        if deadline.over():
            for row in todo_rows:
                row["skipped"] = "time budget"
            continue
        pool = db.pool(spec, max(batches) * -(-max(contexts) // PAGE))
        dec = db.decoder(spec, args.profile)
        for row in todo_rows:
            if deadline.over():
                row["skipped"] = "time budget"
                continue
            _split_row(args, db, row, dec, pool, sizes)
        pool.release()
        del pool, dec
    cols = [("model", "model", ""), ("B", "B", "d"), ("ctx", "ctx", "d"), ("mib", "MiB", ".0f"),
            ("unsplit_ms", "unsplit ms", ".3f"), ("frac_unsplit", "unsplit bw", ".1%"),
            ("plan", "planner's choice", ""), ("planned_ms", "planned ms", ".3f"),
            ("planned_merge_ms", "of which merge", ".3f"), ("frac_planned", "planned bw", ".1%"),
            ("best_rows", "best forced rows", "d"), ("best_ms", "best forced ms", ".3f"),
            ("speedup", "unsplit/best split", ".2f"), ("frac_best", "best bw", ".1%"),
            ("slowdown", "planner vs better", "+.1%"),
            ("noise", "noise (unsplit timed twice)", ".1%"), ("max_err", "max abs err", ".1e")]
    title = "Split-KV (median kernel event times, decode + merge, cold page sets)"
    if args.profile:
        title += f", profile forced to {args.profile}"
    return {"sections": [(title, rows, cols)], "ceilings": db.ceilings(), "header": db.header()}


# -- main --------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
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
                    help="decode rows whose KV is larger are skipped")
    ap.add_argument("--bw-mib", type=float, default=None,
                    help="bandwidth working set (MiB; default: 4x the largest cache reported)")
    ap.add_argument("--cold-mib", type=float, default=None,
                    help="cold rows rotate over page sets spanning this much (MiB; default: "
                         "4x the largest cache reported)")
    ap.add_argument("--bw-target-s", type=float, default=0.1,
                    help="seconds per bandwidth variant")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for m in args.models or []:
        if m not in MODELS:
            ap.error(f"--models: unknown {m!r}; known: {', '.join(MODELS)}")
    if args.smoke:
        args.bw_mib = min(args.bw_mib or 32, 32)
        args.bw_target_s = min(args.bw_target_s, 0.02)
        args.repeat = min(args.repeat, 3)
    return args


def source_version() -> str:
    """The git commit of the checkout (``+dirty`` with uncommitted changes to clattn/)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "clattn"],
                               cwd=root, text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def _print_markdown(argv: list[str] | None, res: dict, version: str, elapsed: float) -> None:
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


def main(argv: list[str] | None = None) -> int:
    """Run one suite; 1 if any configuration disagreed with the CPU backend."""
    args = parse(argv)
    Mismatches.items = []
    deadline = Deadline(args.budget_s)
    version = source_version()
    t0 = time.perf_counter()
    res = {"fallback": suite_fallback, "decode": suite_decode, "split": suite_split}[args.suite](
        args, deadline)
    elapsed = time.perf_counter() - t0
    if args.markdown:
        _print_markdown(argv, res, version, elapsed)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        out = {"suite": args.suite, "args": vars(args), "elapsed_s": elapsed,
               "host": platform.node(), "time": datetime.datetime.now().isoformat(),
               "clattn_version": version, "clattn_version_at_end": source_version(),
               "ceilings": res.get("ceilings"), "mismatches": Mismatches.items,
               "sections": {title: rows for title, rows, _ in res["sections"]}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        log(f"wrote {args.json}")
    if Mismatches.items:
        log(f"bench: {len(Mismatches.items)} configuration(s) disagree with the CPU backend:")
        for item in Mismatches.items:
            log(f"  {item}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
