#!/usr/bin/env python
"""clattn benchmarks (a developer script, not a test).

Suites
  fallback  the CPU backend (clattn.cpu_backend.batch_decode) next to a plain numpy
            dense-attention baseline (K/V contiguous [B, Hkv, T, D]) measured in the same run.
  decode    BatchDecode (f16, f32) on one OpenCL device with device-resident arrays:
            kernel time from the events of each call (decode + merge when split), cold
            (each call reads another page set; the sets span at least 4x the largest cache,
            as successive layers do) and hot (the same pages every call); wall time per
            call; GB/s of the KV bytes actually read (data + block scales of the page
            format) and its fraction of the streaming-read ceiling (medians with medians);
            the roofline of the row's shape (bytes at the read bandwidth or multiply-adds at
            the FMA peak, whichever is slower) and the achieved fraction of it, both
            ceilings timed round-robin with the row's own calls (the same moments);
            ``--formats float16,q8_0,q4_0`` runs every row with each page format
            (``k_format = v_format``), prints each time over the float16 pages' time on
            the same row and a table of bytes per KV row per format; then the merge
            bandwidth (merge_state_ at N=4096 and 32768, merge_states K=4; f16 and f32)
            and small-N merge time vs the launch latency.
  split     split-KV: unsplit vs the planner's choice vs the best forced partition size,
            cold (as above, every plan's calls taking the next page set of one rotation)
            and hot (page set 0), all in turns.
  prefill   BatchPrefill (a 512-token prompt on an empty cache, a 128-token chunk over
            4096 cached tokens; ``--chunks``): kernel time, GFLOP/s (4 * H_qo * D per
            attended (query, key) pair) and its fraction of the device's f32 multiply-add
            peak (clattn.tune.ceilings.fma_launcher) timed round-robin with the row, beside
            torch's scaled_dot_product_attention on the same inputs (dense K/V, GQA,
            is_causal / the bottom-right causal mask; storage dtype and f32) when torch
            is importable.
  cache     one decode step of a layer stack through clattn.PagedKVCache (begin, layers x
            (append + attend), end) for B sequences holding ``ctx`` tokens each: host time
            of each call, device time of the append and attend kernels, wall time from
            begin to the last kernel, begin alone (begin + cancel back to back), the
            calls' own cost with the queue held (one step; 8 steps back to back), bytes
            uploaded per step.
  gpu-model the tiled (GPU) decode kernel's work per KV row counted under Oclgrind for
            every GPU profile x model shape, the verdict against the baseline counts and the
            modelled time per device (tools/gpu_model.py; tools/gpu_model.md).

Every timed configuration is first checked against the CPU backend on the same inputs
(decode: clattn.cpu_backend.batch_decode on the row's page set, one sequence at a time;
prefill: batch_prefill; cache: every layer's attend against a CPU-backend PagedKVCache fed
the same tokens); a mismatch is reported in its row and the script exits with status 1.

Examples
  python tools/bench.py --suite fallback --quick
  python tools/bench.py --suite decode --device intel --json tools/results/decode-intel.json
  python tools/bench.py --suite decode --device pocl --formats float16,q8_0,q4_0
  python tools/bench.py --suite split --device pocl --profile adreno-7xx
  python tools/bench.py --suite prefill --device intel
  python tools/bench.py --suite cache --device pocl --batches 1,8 --contexts 4096
  python tools/bench.py --suite gpu-model --profile mali-valhall

Data: pseudo-random f16/f32 (filled on the device before timing; quantized pools are a
block of pages packed by clattn.quant.pack_pool on the host and repeated over the pool),
pages shuffled within each page set, one pool per (model, dtype, format) reused by every
row, one warm-up run per configuration (it includes the compile; never counted). Medians
over ``--repeat`` timed runs (at least 3, fewer than --repeat once a row has run
``--row-seconds``), variants of a row timed round-robin (clattn.tune.timing.sample).
Rows whose pool does not fit (``--max-pool-gib``, the device's largest allocation, the
host memory the check needs) are skipped with the reason.
"""
from __future__ import annotations

import argparse
import datetime
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
# load on a small machine into 2-5x noise; torch's OpenMP threads (the prefill baseline)
# sleep between calls instead of spinning on the cores the OpenCL runtime's threads need
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

# common first: it puts the package on the import path
from common import (  # noqa: E402
    MODELS,
    PAGE,
    ROOT,
    GiB,
    cpu_description,
    csv,
    driver_description,
    gib,
    io_bytes,
    kv_bytes,
    log,
    model_spec,
    page_bytes,
)

from clattn import BatchPrefill, PagedKVCache, cpu_backend, host_memory, runtime  # noqa: E402
from clattn.merge import merge_state_, merge_states  # noqa: E402
from clattn.profiles import get_profile  # noqa: E402
from clattn.quant import KV_FORMATS, QUANTIZED, bytes_per_value, pack_pool, row_bytes  # noqa: E402
from clattn.spec import AttentionSpec, default_sm_scale  # noqa: E402
from clattn.tune import ceilings as ceil  # noqa: E402
from clattn.tune.checks import TOL, compare, decoder  # noqa: E402
from clattn.tune.roofline import decode_roofline  # noqa: E402
from clattn.tune.timing import cell, event_seconds, sample, table  # noqa: E402
from clattn.tune.workloads import (  # noqa: E402
    PREFILL_CHUNKS,
    PagePool,
    Workload,
    pool_pages,
    prefill_flops,
    rotating_tables,
)

#: values packed on the host at once for a quantized pool (the block repeated over it)
PACK_VALUES = 1 << 22
#: row keys shown in the table even when the row was skipped
KEY_COLS = ("model", "dtype", "format", "B", "ctx", "n", "N", "layers")


# -- small utilities ---------------------------------------------------------------------
def chunk(text: str) -> tuple[int, int]:
    """``"128:4096"`` -> ``(128, 4096)``: new tokens, cached tokens."""
    new, _, cached = text.partition(":")
    return int(new), int(cached or 0)


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


def skip(rows: list[dict], why: str) -> None:
    """Mark rows skipped, with the reason."""
    for row in rows:
        row["skipped"] = why


def run_rows(rows: list[dict], deadline: Deadline, run: Callable[[dict], Any]) -> None:
    """``run(row)`` for each row until the time is up; the rest are marked skipped."""
    for i, row in enumerate(rows):
        if deadline.over():
            skip(rows[i:], "time budget")
            return
        run(row)


#: untimed back-to-back calls before each row's samples (``--warmup-s``): on this 2-core VM
#: a decode's first 0.25 s of calls measured up to 2x slower than the rest, which made rows
#: of 5-10 samples twice too slow (Llama-3.2-1B f16: 4.7 ms cold against 2.4 ms)
WARMUP_S = 0.3


def sample_interleaved(calls: dict, repeat: int, row_seconds: float,
                       after: Callable | None = None) -> tuple[dict, dict]:
    """:func:`clattn.tune.timing.sample` in the form the suites read: per variant the
    median of each key, ``min_<key>`` and ``runs``; and ``after()`` after each of the
    variant's warm-up runs (its output, for checks); :data:`WARMUP_S` of warm-up."""
    outs: dict = {}

    def observe(name: str, _: Any, warm: bool) -> None:
        if warm and after is not None:
            outs[name] = after()

    res = sample(calls, warmup=1, min_runs=3, max_runs=max(1, repeat), seconds=row_seconds,
                 warmup_seconds=WARMUP_S, observe=observe)
    flat = {}
    for name, keys in res.items():
        r: dict = {k: s.median for k, s in keys.items()}
        r.update({f"min_{k}": s.best for k, s in keys.items()})
        r["runs"] = next(iter(keys.values())).runs
        flat[name] = r
    return flat, outs


def timed_wall(fn: Callable[[], Any]) -> Callable[[], dict]:
    """A call of ``fn`` under :func:`sample`: its wall time as ``{"s": seconds}``."""
    def call() -> dict:
        t = time.perf_counter()
        fn()
        return {"s": time.perf_counter() - t}
    return call


def markdown(rows: list[dict], cols: list[tuple]) -> str:
    """A Markdown table of result rows; cols: (key, header, format spec; "" = text)."""
    cells = []
    for r in rows:
        if r.get("skipped"):
            line = [cell(r.get(k), f) if k in KEY_COLS else "" for k, _, f in cols]
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


def dense_kv(pool: np.ndarray, indices: np.ndarray, B: int, ctx: int) -> tuple[np.ndarray, ...]:
    """Contiguous ``K, V [B, Hkv, ctx, D]`` of B sequences with equally many pages each
    (``indices`` in order) of a float pool ``[P, 2, Hkv, PAGE, D]``."""
    _, _, hkv, _, d = pool.shape
    sel = pool[indices].reshape(B, -1, 2, hkv, PAGE, d)  # [B, np, 2, Hkv, PS, D]
    return tuple(np.ascontiguousarray(
        sel[:, :, kind].transpose(0, 2, 1, 3, 4).reshape(B, hkv, -1, d)[:, :, :ctx])
        for kind in (0, 1))


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
    hqo, d = spec.num_qo_heads, spec.head_dim
    indptr, indices, last = page_table(rng, len(pool), B, ctx)
    q = (rng.standard_normal((B, hqo, d), dtype=np.float32)).astype(spec.np_dtype)
    K, V = dense_kv(pool, indices, B, ctx)
    scale = default_sm_scale(d)
    o_fb, _ = cpu_backend.batch_decode(spec, q, pool, indptr, indices, last)
    o_dn = dense_attention(q, K, V, scale)
    err = float(np.max(np.abs(o_fb.astype(np.float32) - o_dn.astype(np.float32))))
    tol = 2 * TOL[spec.dtype]  # both sides rounded to the storage dtype
    if not Mismatches.check(row, f"fallback {row['model']} {spec.dtype} B={B} ctx={ctx}",
                            err <= tol, err, f"vs numpy dense attention, tolerance {tol:g}"):
        return
    res, _ = sample_interleaved(
        {"fb": timed_wall(lambda: cpu_backend.batch_decode(spec, q, pool, indptr, indices, last)),
         "dense": timed_wall(lambda: dense_attention(q, K, V, scale))},
        args.repeat, args.row_seconds)
    a, b = res["fb"], res["dense"]
    kvb = kv_bytes(spec, B, ctx)
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
        for dt in dtypes:
            spec = model_spec(name, dt)
            todo = [dict(model=name, dtype=dt, B=B, ctx=ctx) for B in batches for ctx in contexts]
            rows += todo
            n_pages = max(batches) * -(-max(contexts) // PAGE)
            pool = None if deadline.over() else host_pool(rng, n_pages, spec.num_kv_heads,
                                                          spec.head_dim, spec.np_dtype)
            run_rows(todo, deadline, lambda row: _fallback_row(args, row, spec, pool, rng))
            pool = None  # freed before the next one is made
    cols = [("model", "model", ""), ("dtype", "dtype", ""), ("B", "B", "d"), ("ctx", "ctx", "d"),
            ("kv_mib", "KV MiB", ".1f"), ("fallback_ms", "CPU backend ms", ".2f"),
            ("fallback_gbps", "CPU backend GB/s", ".2f"), ("dense_ms", "numpy dense ms", ".2f"),
            ("dense_gbps", "dense GB/s", ".2f"), ("ratio", "backend/dense", ".2f"),
            ("max_err", "max abs diff", ".1e")]
    return {"sections": [("CPU backend vs numpy dense attention", rows, cols)], "ceilings": None}


# -- device helpers ----------------------------------------------------------------------
class PackedPagePool(PagePool):
    """A byte pool (quantized or mixed page formats) on the device: pseudo-random values in
    [-1, 1) packed by :func:`clattn.quant.pack_pool` on the host, one block of
    :data:`PACK_VALUES` values repeated over the pool (every page is still memory of its
    own, so cold page sets stay cold; quantizing gigabytes in numpy would take minutes).
    The pool is allocated as :class:`PagePool`'s (``BatchDecode.empty_pages``' huge pages on
    a CPU device), so the formats of a row differ in their pages only."""

    def __init__(self, rt: Any, spec: AttentionSpec, pages: int, seed: int) -> None:
        self.spec = spec
        self.pages = host_memory.empty(rt.queue, spec.pool_shape(pages), spec.pool_dtype)
        per_page = 2 * spec.num_kv_heads * PAGE * spec.head_dim
        values = host_pool(np.random.default_rng(seed), min(pages, max(1, PACK_VALUES // per_page)),
                           spec.num_kv_heads, spec.head_dim, np.float32)
        block = pack_pool(values[:, 0], values[:, 1], spec.layout)
        for start in range(0, pages, len(block)):
            n = min(len(block), pages - start)
            self.pages[start:start + n].set(block[:n])
        rt.queue.finish()


class DeviceBench:
    """A device, its runtime, its measured ceilings (unless told otherwise) and the cold
    working set."""

    def __init__(self, args: argparse.Namespace, *, ceilings: bool = True) -> None:
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
        self.cold_bytes = int(args.cold_mib * 2**20) if args.cold_mib else \
            self.sizing.working_set_bytes
        self.read = self.copy = self.latency = self.fma = None
        self._row_ceilings: dict | None = None
        if ceilings:
            self._measure()

    def _measure(self) -> None:
        args = self.args
        size = int(args.bw_mib * 2**20) if args.bw_mib else None
        t = time.perf_counter()
        self.read = ceil.read_bandwidth(self.rt, size, args.bw_target_s)
        log(self.read.summary())
        self.copy = ceil.copy_bandwidth(self.rt, size, args.bw_target_s)
        log(self.copy.summary())
        self.latency = ceil.launch_latency(self.rt, args.bw_target_s)
        log(self.latency.summary())
        self.fma = ceil.fma_peak(self.rt, args.bw_target_s)
        log(self.fma.summary())
        log(f"(ceilings measured in {time.perf_counter() - t:.1f} s)")

    def row_ceilings(self) -> dict:
        """Timed calls of the read ceiling's best variant (``read``) and of the multiply-add
        peak (``fma``), each returning ``{"s": seconds}``, for a row to time round-robin
        with its own calls: the ceilings a fraction divides by are then those of the same
        moments (on a 2-vCPU VM one run's read median was 21.8 GB/s, another's 38)."""
        if self._row_ceilings is None:
            launch, self.read_bytes, self._release_read = ceil.read_launcher(self.rt, self.read)
            fma, self.fma_flops = fma_peak_call(self.rt)
            self._row_ceilings = {"read": lambda: {"s": event_seconds([launch()])}, "fma": fma}
        return self._row_ceilings

    def release_row_ceilings(self) -> None:
        """Free the read ceiling's working set of :meth:`row_ceilings`."""
        if self._row_ceilings is not None:
            self._release_read()
            self._row_ceilings = None

    def ceilings(self) -> dict:
        """The ceilings as JSON-able dicts (those measured)."""
        out = {k: asdict(m) for k, m in (("read", self.read), ("copy", self.copy),
                                         ("latency", self.latency), ("fma", self.fma))
               if m is not None}
        return dict(out, cold_bytes=self.cold_bytes, cold_cap=self.sizing.cap,
                    caches=[asdict(c) for c in self.sizing.caches])

    def header(self) -> list[str]:
        """Markdown bullet lines: device, then ceilings, caches and the cold working set
        when measured."""
        lines = [f"- device: {driver_description([self.dev])[0]} "
                 f"({self.dev.max_compute_units} CUs)"]
        if self.read is None:
            return lines
        caches = ", ".join(f"{c.where} {ceil.size_text(c.size_bytes)}" for c in self.sizing.caches)
        return lines + [f"- {self.read.summary()}", f"- {self.copy.summary()}",
                        f"- {self.latency.summary()}", f"- {self.fma.summary()}",
                        f"- caches reported: {caches or 'none'}; cold rows rotate over page "
                        f"sets spanning at least {ceil.size_text(self.cold_bytes)}"]

    def decoder(self, spec: AttentionSpec, profile: Any) -> Any:
        """A built OpenCL BatchDecode."""
        return decoder(spec, self.dev, profile)

    def pool_pages(self, spec: AttentionSpec, set_pages: int) -> int:
        """Pages of a pool for sets of ``set_pages`` pages, spanning the cold working set."""
        return pool_pages(set_pages, page_bytes(spec), self.cold_bytes)

    def pool(self, spec: AttentionSpec, set_pages: int) -> PagePool:
        """A page pool for sets of ``set_pages`` pages, spanning the cold working set."""
        pages, seed = self.pool_pages(spec, set_pages), int(self.rng.integers(1 << 31))
        if spec.byte_pool:
            return PackedPagePool(self.rt, spec, pages, seed)
        return PagePool(self.rt, spec, pages, seed=seed)

    def no_room(self, spec: AttentionSpec, B: int, ctx: int) -> str | None:
        """Why a decode row cannot run here (its KV past ``--max-pool-gib``, its pool past
        the device's largest allocation, or the pool and the host copy the check reads
        past the host memory available), or None."""
        set_pages = B * -(-ctx // PAGE)
        kv = set_pages * page_bytes(spec)
        pool = self.pool_pages(spec, set_pages) * page_bytes(spec)
        if kv > self.args.max_pool_gib * GiB:
            return f"KV {gib(kv)} > --max-pool-gib {self.args.max_pool_gib:g}"
        if pool > self.dev.max_mem_alloc_size:
            return f"pool {gib(pool)} > the device's largest allocation " \
                   f"{gib(self.dev.max_mem_alloc_size)}"
        # the check's host copy of the page set (+ one sequence's pages in f32 for a byte
        # pool), and the pool itself when the device is the host's CPU
        host = kv + (ctx * 8 * spec.num_kv_heads * spec.head_dim * 3 if spec.byte_pool else 0)
        host += pool if self.dev.type & runtime.cl().device_type.CPU else 0
        avail = ceil.host_available_bytes()
        if host > 0.8 * avail:
            return f"needs {gib(host)} of host memory (pool, the check's copy), " \
                   f"{gib(avail)} available"
        return None

    def workload(self, pool: PagePool, B: int, ctx: int) -> Workload:
        """A row's tables on ``pool`` (every page set)."""
        return Workload(self.rt, pool, B, ctx, seed=int(self.rng.integers(1 << 31)))


def timed_decode(dec: Any, w: Workload, plan: Any, *, hot: bool = False) -> Callable[[], dict]:
    """A call of ``dec`` on ``w`` (another page set each call unless ``hot``) returning
    wall, decode, merge and kernel seconds (kernel = decode + merge, from the events).
    Cold calls of every variant on ``w`` share its one rotation of page sets. A hot call
    is timed right after an untimed call over the same pages: the calls timed in turns
    with it (other variants, cold sets, the ceilings' streams) evict them, and a hot
    call that followed them read its pages partly from memory, the more so the earlier
    its variant came in the turn."""
    def call() -> dict:
        if hot:
            res = dec.run(*w.args(hot=True), out=w.out, lse=w.lse, plan=plan)
            getattr(res, "events", (res.event,))[-1].wait()
        t = time.perf_counter()
        res = dec.run(*w.args(hot=hot), out=w.out, lse=w.lse, plan=plan)
        events = getattr(res, "events", (res.event,))
        events[-1].wait()
        wall = time.perf_counter() - t
        dk, mk = event_seconds(events[:1]), event_seconds(events[1:])
        return {"wall": wall, "decode": dk, "merge": mk, "kernel": dk + mk}
    return call


HELD_CALLS = 32  # calls per sample of the held host timing (their kernels run after it)
HELD_SAMPLES = 5


def held_host_us(dec: Any, w: Workload, plan: Any) -> dict:
    """Host microseconds per call with the queue held: the launches wait on a user event
    set complete after the timing, so the calls' own cost is timed, not that of kernels
    sharing a CPU device's cores. ``run``: the one-call ``BatchDecode.run`` (device
    arrays, the plan, ``out=``/``lse=``); ``step``: a prepared ``DecodeStep.run`` over the
    same tables. Medians over ``HELD_SAMPLES`` samples of ``HELD_CALLS`` calls each, the
    two kinds alternating."""
    cl = runtime.cl()
    q, pages, indptr, indices, last = w.args(hot=True)
    queue = q.queue
    step = dec.prepare(indptr, indices, last, num_pages=pages.shape[0], plan=plan)
    calls = {"run": lambda: dec.run(q, pages, indptr, indices, last, plan=plan, out=w.out,
                                    lse=w.lse),
             "step": lambda: step.run(q, pages, out=w.out, lse=w.lse)}
    times: dict = {k: [] for k in calls}
    for _ in range(HELD_SAMPLES + 1):  # the first sample warms up
        for name, fn in calls.items():
            queue.finish()
            gate = cl.UserEvent(queue.context)
            cl.enqueue_marker(queue, wait_for=[gate])
            try:
                t = time.perf_counter()
                for _ in range(HELD_CALLS):
                    fn()
                times[name].append((time.perf_counter() - t) / HELD_CALLS)
            finally:
                gate.set_status(cl.command_execution_status.COMPLETE)
                queue.finish()
    return {k: float(np.median(v[1:])) * 1e6 for k, v in times.items()}


def cpu_decode(spec: AttentionSpec, q: np.ndarray, pages: np.ndarray, indptr: np.ndarray,
               indices: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cpu_backend.batch_decode`` one sequence at a time: a byte pool is decoded to f32
    per call, so only one sequence's pages at once."""
    res = [cpu_backend.batch_decode(spec, q[b:b + 1], pages, indptr[b:b + 2] - indptr[b],
                                    indices[indptr[b]:indptr[b + 1]], last[b:b + 1])
           for b in range(len(q))]
    return np.concatenate([o for o, _ in res]), np.concatenate([s for _, s in res])


def check_decode_row(row: dict, what: str, dec: Any, w: Workload, plans: dict,
                     ref: tuple | None = None) -> tuple | None:
    """Run every plan once on page set 0 and compare with the CPU backend (timed: the
    row's ``fallback_ms``); the reference, or None after a mismatch."""
    if ref is None:
        host = w.host_args()
        t = time.perf_counter()
        ref = cpu_decode(dec.spec, *host)
        row["fallback_ms"] = (time.perf_counter() - t) * 1e3
        del host
    for name, plan in plans.items():
        res = dec.run(*w.args(hot=True), out=w.out, lse=w.lse, plan=plan)
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
        what = f"decode {row['model']} {row['dtype']} {row['format']} pages B={B} ctx={ctx}"
        if check_decode_row(row, what, dec, w, {"planned": plan}) is None:
            return
        calls = {"cold": timed_decode(dec, w, plan),
                 "hot": timed_decode(dec, w, plan, hot=True)}
        calls.update(db.row_ceilings())
        res, _ = sample_interleaved(calls, args.repeat, args.row_seconds)
        held = held_host_us(dec, w, plan)
    finally:
        w.release()
    row.update(run_host_us=held["run"], step_host_us=held["step"])
    r, h = res["cold"], res["hot"]
    nbytes = io_bytes(spec, B, ctx)
    gbps = nbytes / r["kernel"] * 1e-9
    # the ceilings timed round-robin with the row: the machine's state of those moments
    read_gbps = db.read_bytes / res["read"]["s"] * 1e-9
    fma_gflops = db.fma_flops / res["fma"]["s"] * 1e-9
    row.update(plan=short_plan(plan), plan_full=str(plan), page_sets=w.n_sets,
               kernel_ms=r["kernel"] * 1e3, decode_ms=r["decode"] * 1e3,
               merge_ms=r["merge"] * 1e3, hot_ms=h["kernel"] * 1e3,
               cold_vs_hot=r["kernel"] / h["kernel"], wall_ms=r["wall"] * 1e3, gbps=gbps,
               frac=gbps / read_gbps, wall_gbps=nbytes / r["wall"] * 1e-9,
               runs=r["runs"], mib=nbytes / 2**20, read_gbps=read_gbps,
               fma_gflops=fma_gflops)
    roof = decode_roofline(batch=B, context=ctx, num_qo_heads=spec.num_qo_heads,
                           head_dim=spec.head_dim, bytes_moved=nbytes,
                           read_gbps=read_gbps, fma_gflops=fma_gflops)
    row.update(roof_ms=roof.bound_s * 1e3, roof_bound=roof.bound,
               roof_frac=roof.fraction(r["kernel"]))
    row["fallback_ratio"] = row["fallback_ms"] / row["wall_ms"]
    log(f"{what}: kernel {row['kernel_ms']:.3f} ms cold, {row['hot_ms']:.3f} hot "
        f"({row['frac']:.0%} of read bw), wall {row['wall_ms']:.3f} ms; {row['plan']}; host "
        f"per call, queue held: run {row['run_host_us']:.1f} us, prepared step "
        f"{row['step_host_us']:.1f} us")


def _decode_spec_rows(args: argparse.Namespace, db: DeviceBench, deadline: Deadline, name: str,
                      spec: AttentionSpec, batches: list[int], contexts: list[int]) -> list[dict]:
    """Every (B, ctx) row of one model, dtype and page format, on one pool."""
    rows = [dict(model=name, dtype=spec.dtype, format=spec.k_format, B=B, ctx=ctx)
            for B in batches for ctx in contexts]
    for row in rows:
        why = db.no_room(spec, row["B"], row["ctx"])
        if why:
            row["skipped"] = why
            log(f"decode {name} {spec.dtype} {spec.k_format} B={row['B']} ctx={row['ctx']}: "
                f"skipped: {why}")
    todo = [r for r in rows if not r.get("skipped")]
    if deadline.over():
        skip(todo, "time budget")
    if not todo or deadline.over():
        return rows
    pool = db.pool(spec, max(r["B"] * -(-r["ctx"] // PAGE) for r in todo))
    dec = db.decoder(spec, args.profile)
    run_rows(todo, deadline, lambda row: _decode_row(args, db, row, dec, pool))
    pool.release()
    return rows


def relate_to_float16(rows: list[dict]) -> None:
    """``vs_f16``: a row's cold kernel time over that of the row of the same model, dtype,
    B and ctx with float16 pages."""
    def key(r: dict) -> tuple:
        return r["model"], r["dtype"], r["B"], r["ctx"]
    base = {key(r): r["kernel_ms"] for r in rows if r["format"] == "float16" and "kernel_ms" in r}
    for r in rows:
        if "kernel_ms" in r and key(r) in base:
            r["vs_f16"] = r["kernel_ms"] / base[key(r)]


def format_costs(models: list[str], formats: list[str]) -> tuple:
    """The section of bytes per KV row (one K or V row of one KV head) per page format."""
    rows = []
    for name in models:
        d = MODELS[name].head_dim
        for fmt in dict.fromkeys(["float16"] + formats):
            spec = model_spec(name, "float16", fmt)
            data, total = row_bytes(fmt, d), d * bytes_per_value(fmt)
            rows.append(dict(model=name, format=fmt, D=d, data=data, scales=total - data,
                             row=total, vs_f16=total / (2 * d),
                             in_pool=spec.layout.region_bytes(fmt) / PAGE,
                             token=spec.bytes_per_token))
    cols = [("model", "model", ""), ("format", "format", ""), ("D", "D", "d"),
            ("data", "data B/row", "d"), ("scales", "scales B/row", ".0f"),
            ("row", "B/row read", ".0f"), ("vs_f16", "/ float16", ".3f"),
            ("in_pool", "B/row in the pool (16-byte aligned regions)", ".2f"),
            ("token", "KV B/token/layer (all KV heads)", ".0f")]
    return ("GPU cost per page format: bytes a kernel reads per KV row (one K or V row of "
            "one KV head: data + f16 block scales)", rows, cols)


def suite_decode(args: argparse.Namespace, deadline: Deadline) -> dict:
    """BatchDecode on one device, cold and hot, per page format; then the merge sections."""
    db = DeviceBench(args)
    models = args.models or (["Llama-3-8B", "Qwen2.5-0.5B"] if args.quick else list(MODELS))
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    contexts = args.contexts or [512, 4096, 16384]
    dtypes = args.dtypes or ["float16", "float32"]
    if args.smoke:
        models, batches, contexts, dtypes = ["Qwen2.5-0.5B"], [1], [512], ["float16"]
    rows: list[dict] = []
    for name in models:
        for dt in dtypes:
            for fmt in args.formats or [dt]:
                rows += _decode_spec_rows(args, db, deadline, name, model_spec(name, dt, fmt),
                                          batches, contexts)
    relate_to_float16(rows)
    cols = [("model", "model", ""), ("dtype", "dtype", ""), ("format", "pages", ""),
            ("B", "B", "d"), ("ctx", "ctx", "d"),
            ("mib", "MiB moved", ".1f"), ("plan", "plan", ""), ("page_sets", "page sets", "d"),
            ("decode_ms", "decode ms", ".3f"), ("merge_ms", "merge ms", ".3f"),
            ("kernel_ms", "cold ms", ".3f"), ("hot_ms", "hot ms", ".3f"),
            ("cold_vs_hot", "cold/hot", ".2f"), ("wall_ms", "wall ms", ".3f"),
            ("gbps", "GB/s (cold)", ".2f"), ("read_gbps", "read GB/s (row)", ".2f"),
            ("frac", "of read bw (medians)", ".1%"),
            ("roof_ms", "roofline ms", ".3f"), ("roof_bound", "bound", ""),
            ("roof_frac", "of roofline (cold)", ".1%")]
    if args.formats:
        cols.append(("vs_f16", "cold ms / float16 pages'", ".2f"))
    cols += [("run_host_us", "run() host us, queue held", ".1f"),
             ("step_host_us", "prepared step host us, queue held", ".1f"),
             ("fallback_ms", "CPU backend ms", ".2f"), ("fallback_ratio", "backend/wall", ".1f"),
             ("max_err", "max abs err", ".1e")]
    sections = [("Decode (median kernel event times, cold: page sets rotating over at least "
                 f"{db.cold_bytes / 2**20:.0f} MiB; hot: the same pages; GB/s = KV bytes read "
                 "(data + block scales of the page format) + q/out/lse bytes / cold kernel "
                 "time; read GB/s (row): the read ceiling's best variant timed round-robin "
                 "with the row's calls, its median, and so the multiply-add peak; roofline: "
                 "the larger of those bytes / that read bandwidth and 2 x heads x head_dim "
                 "multiply-adds per row / that peak)", rows, cols)]
    if args.formats:
        sections.append(format_costs(models, args.formats))
    sections += merge_sections(args, db, deadline)
    db.release_row_ceilings()
    return {"sections": sections, "ceilings": db.ceilings(), "header": db.header()}


def _merge_arrays(db: DeviceBench, row: dict) -> list:
    """The row's states on the device, random: pairwise (v, s, v_other, s_other) or K-way
    (v [N, K, H, D], s [N, K, H], out, lse)."""
    cla = runtime.cl().array
    N, H, D, K = row["N"], row["H"], row["D"], row.get("K", 2)
    dt = np.dtype(row["dtype"])
    if row.get("kind", "pair") == "pair":
        shapes = [((N, H, D), dt), ((N, H), np.float32)] * 2
    else:
        shapes = [((N, K, H, D), dt), ((N, K, H), np.float32), ((N, H, D), dt),
                  ((N, H), np.float32)]
    arrs = [cla.empty(db.queue, shape, t) for shape, t in shapes]
    for i, a in enumerate(arrs):
        ceil.fill_random(db.rt, a, seed=100 + i, scale=1.0 if i % 2 == 0 else 8.0)
    return arrs


def _merge_row(args: argparse.Namespace, db: DeviceBench, row: dict, small: bool) -> None:
    N, H, D, K = row["N"], row["H"], row["D"], row.get("K", 2)
    pair = row.get("kind", "pair") == "pair"
    arrs = _merge_arrays(db, row)
    try:
        host = [a.get() for a in arrs]
        if pair:
            rv, rs = cpu_backend.merge_state(*host)
            merge_state_(*arrs, profile=args.profile)
            got = arrs[0].get(), arrs[1].get()
        else:
            rv, rs = cpu_backend.merge_states(host[0], host[1])
            merge_states(arrs[0], arrs[1], out=arrs[2], lse=arrs[3], profile=args.profile)
            got = arrs[2].get(), arrs[3].get()
        ok, err, why = compare(*got, rv, rs, row["dtype"])
        what = f"merge_state_ N={N}" if pair else f"merge_states N={N} K={K}"
        if not Mismatches.check(row, f"{what} {row['dtype']}", ok, err, why):
            return

        def call() -> dict:
            t = time.perf_counter()
            if pair:
                evt = merge_state_(*arrs, profile=args.profile)
            else:
                merge_states(arrs[0], arrs[1], out=arrs[2], lse=arrs[3], profile=args.profile)
                evt = arrs[2].events[-1]
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
    item = np.dtype(row["dtype"]).itemsize
    nbytes = (K + 1) * N * H * (D * item + 4)  # K states read, one written (v and lse)
    row.update(kernel_us=r["kernel"] * 1e6, wall_us=r["wall"] * 1e6, runs=r["runs"],
               kernel_min_us=r["min_kernel"] * 1e6, wall_min_us=r["min_wall"] * 1e6,
               gbps=nbytes / r["kernel"] * 1e-9, mib=nbytes / 2**20)
    row["frac"] = row["gbps"] / db.read.median_gbps
    row["frac_copy"] = row["gbps"] / db.copy.median_gbps
    row["lat_ratio"] = r["kernel"] * 1e6 / db.latency.kernel_us
    row["trip_ratio"] = r["wall"] * 1e6 / db.latency.round_trip_us
    row["lat_min_ratio"] = r["min_kernel"] * 1e6 / max(db.latency.kernel_min_us, 1e-3)
    log(f"{what} {row['dtype']}: kernel {row['kernel_us']:.1f} us, wall {row['wall_us']:.1f} "
        f"us, {row['gbps']:.2f} GB/s")


def merge_sections(args: argparse.Namespace, db: DeviceBench, deadline: Deadline) -> list:
    """merge_state_ bandwidth at large N and latency at small N (checked first)."""
    H, D = 32, 128
    big = [256] if args.smoke else [4096, 32768]
    small = [1, 32] if args.smoke else [1, 2, 4, 8, 16, 32]
    dtypes = ["float16"] if args.smoke else args.dtypes or ["float16", "float32"]
    rows_bw = [dict(kind=kind, K=K, N=N, H=H, D=D, dtype=dt) for dt in dtypes
               for kind, K, Ns in (("pair", 2, big), ("k-way", 4, big[:1]))
               for N in Ns]
    rows_lat = [dict(N=N, H=H, D=D, dtype="float16") for N in small]
    run_rows(rows_bw + rows_lat, deadline, lambda row: _merge_row(args, db, row, row["N"] in small))
    c1 = [("kind", "merge", ""), ("K", "K", "d"), ("N", "N", "d"), ("H", "H", "d"),
          ("D", "D", "d"), ("dtype", "dtype", ""),
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
    return [("Merge bandwidth (pair: merge_state_ in place; k-way: merge_states of K states "
             "per row; GB/s = the K states read + one written, v and lse)", rows_bw, c1),
            ("merge_state_ at small N (H=32, D=128, f16) vs the empty-kernel launch latency",
             rows_lat, c2)]


# -- split suite -------------------------------------------------------------------------
def _split_plans(dec: Any, w: Workload, sizes: list[int]) -> tuple[dict, str, Any]:
    """The plans timed (unsplit and each forced size that splits), the key of the one the
    planner chose, and the planner's own plan (its reason)."""
    plans = {"unsplit": dec.plan(w.indptr, w.last, split=False)}
    for rows_per in sizes:
        p = dec.plan(w.indptr, w.last, split=rows_per)
        if p.split and not any(o.split and o.part_rows == p.part_rows for o in plans.values()):
            plans[f"split {p.part_rows}"] = p
    planned = dec.plan(w.indptr, w.last, split=None)
    key = "unsplit" if not planned.split else f"split {planned.part_rows}"
    plans.setdefault(key, planned)
    return plans, key, planned


def _split_row(args: argparse.Namespace, db: DeviceBench, row: dict, dec: Any,
               pool: PagePool, sizes: list[int]) -> None:
    B, ctx = row["B"], row["ctx"]
    spec = dec.spec
    w = db.workload(pool, B, ctx)
    try:
        plans, planned_key, chosen = _split_plans(dec, w, sizes)
        what = f"split {row['model']} B={B} ctx={ctx}"
        if check_decode_row(row, what, dec, w, plans) is None:
            return
        calls = {k: timed_decode(dec, w, p) for k, p in plans.items()}
        # a control: the unsplit launch timed twice; their difference is the noise floor
        calls["unsplit (control)"] = timed_decode(dec, w, plans["unsplit"])
        calls.update({("hot", k): timed_decode(dec, w, p, hot=True) for k, p in plans.items()})
        res, _ = sample_interleaved(calls, args.repeat, args.row_seconds)
    finally:
        w.release()
    nbytes = io_bytes(spec, B, ctx)
    hot = {k[1]: res.pop(k)["kernel"] for k in list(res) if isinstance(k, tuple)}
    unsplit, planned = res["unsplit"], res[planned_key]
    control = res.pop("unsplit (control)")
    forced = [(plans[k], r) for k, r in res.items() if k != "unsplit"]
    best_p, best = min(forced, key=lambda x: x[1]["kernel"]) if forced else (None, None)
    hot_forced = [(plans[k], t) for k, t in hot.items() if k != "unsplit"]
    hot_p, hot_best = min(hot_forced, key=lambda x: x[1]) if hot_forced else (None, None)
    better = min(unsplit["kernel"], best["kernel"]) if best else unsplit["kernel"]
    bw = db.read.median_gbps
    row.update(
        mib=nbytes / 2**20, unsplit_ms=unsplit["kernel"] * 1e3, page_sets=w.n_sets,
        plan=str(chosen), planned_ms=planned["kernel"] * 1e3,
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
        noise=abs(control["kernel"] - unsplit["kernel"]) / unsplit["kernel"],
        hot_unsplit_ms=hot["unsplit"] * 1e3, hot_planned_ms=hot[planned_key] * 1e3,
        hot_best_rows=hot_p.part_rows if hot_p else None,
        hot_best_ms=hot_best * 1e3 if hot_p else None,
        hot_speedup=hot["unsplit"] / hot_best if hot_p else None)
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
        spec = model_spec(name, dt)
        todo = [dict(model=name, dtype=dt, B=B, ctx=ctx) for B in batches for ctx in contexts]
        rows += todo
        if deadline.over():
            skip(todo, "time budget")
            continue
        pool = db.pool(spec, max(batches) * -(-max(contexts) // PAGE))
        dec = db.decoder(spec, args.profile)
        run_rows(todo, deadline, lambda row: _split_row(args, db, row, dec, pool, sizes))
        pool.release()
    cols = [("model", "model", ""), ("B", "B", "d"), ("ctx", "ctx", "d"), ("mib", "MiB", ".0f"),
            ("unsplit_ms", "unsplit ms", ".3f"), ("frac_unsplit", "unsplit bw", ".1%"),
            ("plan", "planner's choice", ""), ("planned_ms", "planned ms", ".3f"),
            ("planned_merge_ms", "of which merge", ".3f"), ("frac_planned", "planned bw", ".1%"),
            ("best_rows", "best forced rows", "d"), ("best_ms", "best forced ms", ".3f"),
            ("speedup", "unsplit/best split", ".2f"), ("frac_best", "best bw", ".1%"),
            ("slowdown", "planner vs better", "+.1%"),
            ("hot_unsplit_ms", "hot: unsplit ms", ".3f"), ("hot_planned_ms", "planned ms", ".3f"),
            ("hot_best_rows", "best forced rows", "d"), ("hot_best_ms", "best forced ms", ".3f"),
            ("hot_speedup", "unsplit/best split", ".2f"),
            ("noise", "noise (unsplit timed twice)", ".1%"), ("max_err", "max abs err", ".1e")]
    title = ("Split-KV (median kernel event times, decode + merge; cold: each call the next "
             "page set of one rotation, whichever plan; hot: set 0 every call)")
    if args.profile:
        title += f", profile forced to {args.profile}"
    return {"sections": [(title, rows, cols)], "ceilings": db.ceilings(), "header": db.header()}



# -- prefill suite -----------------------------------------------------------------------
def fma_peak_call(rt: Any) -> tuple[Callable[[], dict], float]:
    """A timed launch of the f32 multiply-add peak kernel and the FLOPs it does."""
    launch, flops = ceil.fma_launcher(rt)
    return (lambda: {"s": event_seconds([launch()])}), flops


class PrefillInputs:
    """One prefill row on the host and the device: a pool holding ``n + ctx`` rows per
    sequence (the new tokens' keys and values already appended, as the cache does before
    attending), its tables, q, and out/lse on the device."""

    def __init__(self, rt: Any, spec: AttentionSpec, rng: np.random.Generator, B: int, n: int,
                 ctx: int) -> None:
        cla = runtime.cl().array
        n_pages = B * -(-(n + ctx) // PAGE)
        self.pages = host_pool(rng, n_pages, spec.num_kv_heads, spec.head_dim, spec.np_dtype)
        self.indptr, self.indices, self.last = page_table(rng, n_pages, B, n + ctx)
        self.qo = (np.arange(B + 1) * n).astype(np.int32)
        self.q = (rng.random((B * n, spec.num_qo_heads, spec.head_dim), dtype=np.float32) * 2
                  - 1).astype(spec.np_dtype)
        self.host = (self.q, self.pages, self.qo, self.indptr, self.indices, self.last)
        self.dev = tuple(cla.to_device(rt.queue, a) for a in self.host)
        self.out = cla.empty(rt.queue, self.q.shape, spec.np_dtype)
        self.lse = cla.empty(rt.queue, self.q.shape[:2], np.float32)


def timed_prefill(pre: BatchPrefill, x: PrefillInputs, plan: Any) -> Callable[[], dict]:
    """A call of ``pre`` on ``x`` returning its kernel seconds (from the events)."""
    def call() -> dict:
        res = pre.run(*x.dev, out=x.out, lse=x.lse, plan=plan)
        return {"s": event_seconds(res.events)}
    return call


def torch_sdpa_calls(spec: AttentionSpec, x: PrefillInputs, B: int, n: int,
                     ctx: int) -> dict[str, Callable[[], dict]]:
    """Timed calls of torch's scaled_dot_product_attention on the row's inputs (dense K/V
    ``[B, H_kv, n + ctx, D]``, GQA; is_causal, or the bottom-right causal mask over a
    cache) in the storage dtype and in f32; none without torch."""
    try:
        import torch
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        return {}
    torch.set_num_threads(os.cpu_count() or 1)
    K, V = dense_kv(x.pages, x.indices, B, n + ctx)
    q = x.q.reshape(B, n, spec.num_qo_heads, spec.head_dim).transpose(0, 2, 1, 3)
    mask = None if ctx == 0 else causal_lower_right(n, n + ctx)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {}
    scale = default_sm_scale(spec.head_dim)
    for dt in dict.fromkeys([spec.dtype, "float32"]):
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, dt))
                      for a in (q, K, V))

        def run(tq: Any = tq, tk: Any = tk, tv: Any = tv) -> None:
            with torch.no_grad():
                sdpa(tq, tk, tv, attn_mask=mask, is_causal=mask is None, enable_gqa=True,
                     scale=scale)
        calls[f"torch-{dt}"] = timed_wall(run)
        if spec.softcap is not None:
            calls[f"torch-eager-{dt}"] = timed_wall(
                eager_softcap_call(torch, tq, tk, tv, spec, n, ctx, scale))
    return calls


def eager_softcap_call(torch: Any, q: Any, k: Any, v: Any, spec: AttentionSpec, n: int,
                       ctx: int, scale: float) -> Callable[[], None]:
    """torch computing what a soft-capped model's attention is (transformers' eager
    Gemma-2): ``softmax(cap * tanh(q k^T * scale / cap) + causal mask) v``, GQA by
    repeating the KV heads, in the inputs' dtype (SDPA has no soft-cap)."""
    G, cap = spec.group_size, float(spec.softcap)
    kr, vr = (x.repeat_interleave(G, dim=1) for x in (k, v))
    allowed = torch.ones(n, n + ctx, dtype=torch.bool).tril(diagonal=ctx)
    bias = torch.zeros(n, n + ctx, dtype=q.dtype).masked_fill(~allowed, float("-inf"))

    def run() -> None:
        with torch.no_grad():
            s = torch.tanh(torch.matmul(q, kr.transpose(-1, -2)) * (scale / cap)) * cap
            torch.matmul(torch.softmax(s + bias, dim=-1, dtype=torch.float32).to(q.dtype), vr)
    return run


def _prefill_row(args: argparse.Namespace, db: DeviceBench, row: dict, pre: BatchPrefill,
                 peak: tuple[Callable[[], dict], float]) -> None:
    spec, B, n, ctx = pre.spec, row["B"], row["n"], row["ctx"]
    x = PrefillInputs(db.rt, spec, db.rng, B, n, ctx)
    plan = pre.plan(x.qo, x.indptr, x.last)
    t = time.perf_counter()
    ref = cpu_backend.batch_prefill(spec, *x.host)
    row["fallback_ms"] = (time.perf_counter() - t) * 1e3
    pre.run(*x.dev, out=x.out, lse=x.lse, plan=plan).event.wait()
    ok, err, why = compare(x.out.get(), x.lse.get(), ref[0], ref[1], spec.dtype)
    what = f"prefill {row['model']} {spec.dtype} B={B} new={n} cached={ctx}"
    if not Mismatches.check(row, what, ok, err, why):
        return
    calls = {"clattn": timed_prefill(pre, x, plan), "peak": peak[0]}
    calls.update(torch_sdpa_calls(spec, x, B, n, ctx))
    res, _ = sample_interleaved(calls, args.repeat, args.row_seconds)
    s = res["clattn"]["s"]
    row.update(units=len(plan.units), kernel_ms=s * 1e3, runs=res["clattn"]["runs"],
               gflops=prefill_flops(spec.num_qo_heads, spec.head_dim, B, n, ctx) / s * 1e-9,
               peak=peak[1] / res["peak"]["s"] * 1e-9)
    row["peak_frac"] = row["gflops"] / row["peak"]
    torch_s = {k: r["s"] for k, r in res.items() if k.startswith("torch")}
    row.update({f"{k}_ms": v * 1e3 for k, v in torch_s.items()})
    row["vs_torch"] = min(torch_s.values()) / s if torch_s else None
    # of the torch calls computing the same function: eager where the model soft-caps
    same = [v for k, v in torch_s.items() if (spec.softcap is None) != ("eager" in k)]
    row["vs_torch_same"] = min(same) / s if same else None
    log(f"{what}: {row['kernel_ms']:.2f} ms, {row['gflops']:.1f} GFLOP/s = "
        f"{row['peak_frac']:.0%} of {row['peak']:.0f}; torch best / clattn "
        f"{cell(row['vs_torch'], '.2f')}")


def suite_prefill(args: argparse.Namespace, deadline: Deadline) -> dict:
    """BatchPrefill vs the multiply-add peak and torch's SDPA, timed round-robin."""
    db = DeviceBench(args, ceilings=False)
    peak = fma_peak_call(db.rt)
    models = args.models or ["Llama-3-8B", "Qwen2.5-0.5B"]
    batches = args.batches or [1, 4]
    chunks = args.chunks or list(PREFILL_CHUNKS)
    dtypes = args.dtypes or ["float16"]
    if args.smoke:
        models, batches, chunks, dtypes = ["Qwen2.5-0.5B"], [1], [(32, 64)], ["float16"]
    rows: list[dict] = []
    for name in models:
        for dt in dtypes:
            spec = model_spec(name, dt)
            todo = [dict(model=name, dtype=dt, B=B, n=n, ctx=ctx) for n, ctx in chunks
                    for B in batches]
            rows += todo
            if deadline.over():
                skip(todo, "time budget")
                continue
            pre = decoder(spec, db.dev, args.profile, kind=BatchPrefill)
            run_rows(todo, deadline, lambda row: _prefill_row(args, db, row, pre, peak))
    peaks = [r["peak"] for r in rows if "peak" in r]
    cols = [("model", "model", ""), ("dtype", "dtype", ""), ("B", "B", "d"), ("n", "new", "d"),
            ("ctx", "cached", "d"), ("units", "work units", "d"), ("kernel_ms", "ms", ".2f"),
            ("gflops", "GFLOP/s", ".1f"), ("peak", "peak GFLOP/s", ".0f"),
            ("peak_frac", "of peak", ".0%"), ("torch-float16_ms", "torch f16 ms", ".2f"),
            ("torch-float32_ms", "torch f32 ms", ".2f"),
            ("torch-eager-float16_ms", "torch eager f16 ms", ".2f"),
            ("torch-eager-float32_ms", "torch eager f32 ms", ".2f"),
            ("vs_torch", "torch best / clattn", ".2f"),
            ("vs_torch_same", "torch same function / clattn", ".2f"),
            ("fallback_ms", "CPU backend ms", ".1f"),
            ("max_err", "max abs err", ".1e")]
    header = db.header() + [
        "- GFLOP/s: 4 * H_qo * D per attended (query, key) pair; peak: the f32 multiply-add "
        "peak (clattn.tune.ceilings.fma_launcher) timed round-robin with each row"
        + (", " + "-".join(dict.fromkeys(f"{p:.0f}" for p in (min(peaks), max(peaks))))
           + " GFLOP/s over the rows" if peaks else ""),
        "- torch: scaled_dot_product_attention on the same inputs (dense K/V, GQA, causal), "
        "wall time; torch best / clattn > 1: clattn is faster; SDPA has no logit soft-cap, "
        "so a soft-capped model's SDPA rows (Gemma-2) skip the tanh clattn computes; torch "
        "eager: matmul, cap * tanh(s / cap), mask, softmax, matmul (transformers' eager "
        "Gemma-2), timed for soft-capped models; torch same function / clattn: the best of "
        "the torch calls that compute clattn's function (eager where the model soft-caps)"]
    return {"sections": [("Prefill (median kernel event times; device-resident inputs)", rows,
                          cols)],
            "ceilings": dict(db.ceilings(), fma_gflops=peaks),
            "header": header}


# -- cache suite -------------------------------------------------------------------------
class StepInputs:
    """A cache row's inputs: the fill (``ctx`` tokens per sequence) and one decode token's
    q, k, v per sequence, on the host (for the CPU-backend twin) and on the device (an app
    whose projections run on the device keeps them there); each layer's out and lse."""

    def __init__(self, queue: Any, spec: AttentionSpec, rng: np.random.Generator, B: int,
                 ctx: int, layers: int) -> None:
        cla = runtime.cl().array
        hqo, hkv, d, dt = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.np_dtype
        shapes = dict(fill_k=(B * ctx, hkv, d), fill_v=(B * ctx, hkv, d), q=(B, hqo, d),
                      k=(B, hkv, d), v=(B, hkv, d))
        self.host = {k: (rng.standard_normal(s, dtype=np.float32) * 0.5).astype(dt)
                     for k, s in shapes.items()}
        self.dev = {k: cla.to_device(queue, a) for k, a in self.host.items()}
        self.out = [cla.empty(queue, (B, hqo, d), dt) for _ in range(layers)]
        self.lse = [cla.empty(queue, (B, hqo), np.float32) for _ in range(layers)]
        self.queue = queue


def fill_cache(cache: PagedKVCache, ids: list[str], k: Any, v: Any) -> None:
    """One prompt step of ``len(k) / len(ids)`` tokens per sequence, appends only."""
    cache.begin(ids, [len(k) // len(ids)] * len(ids))
    for layer in range(cache.num_layers):
        cache.append(layer, k, v)
    cache.end()


def timed_step(cache: PagedKVCache, ids: list[str], x: StepInputs,
               held: bool = False) -> Callable[[], dict]:
    """One whole decode step (begin, layers x (append + attend), end) with the device idle
    first: host seconds of each call (enqueue only), device seconds of the append and
    attend kernels (a fused append's write is in the attend's), wall seconds from begin to
    the last kernel, bytes uploaded, kernel launches per layer.

    ``held``: the queue waits on a user event until the layers are enqueued, so the host
    times of begin, append and attend are the calls' own cost, not shared with a CPU
    device's kernels running on the same cores (or with waits); the event is released
    before ``end`` (which reads the device check's flags of quantized pages, waiting for
    the queue), and step wall time counts from the release."""
    def call() -> dict:
        x.queue.finish()
        gate = None
        if held:
            cl = runtime.cl()
            gate = cl.UserEvent(x.queue.context)
            cl.enqueue_marker(x.queue, wait_for=[gate])
        up0, launches0 = cache.bytes_uploaded, cache.stats().launches
        host = dict.fromkeys(("begin", "append", "attend", "end"), 0.0)
        appends, attends = [], []
        t0 = t = time.perf_counter()
        cache.begin(ids)
        host["begin"] = time.perf_counter() - t
        for layer in range(cache.num_layers):
            t = time.perf_counter()
            appends.append(cache.append(layer, x.dev["k"], x.dev["v"]))
            t1 = time.perf_counter()
            attends += cache.attend(layer, x.dev["q"], out=x.out[layer], lse=x.lse[layer]).events
            host["append"] += t1 - t
            host["attend"] += time.perf_counter() - t1
        if gate is not None:  # released before end(): with quantized pages end() reads the
            t0 = time.perf_counter()  # device check's flags, which waits for the queue
            gate.set_status(runtime.cl().command_execution_status.COMPLETE)
        t = time.perf_counter()
        cache.end()
        host["end"] = time.perf_counter() - t
        x.queue.finish()
        step = time.perf_counter() - t0
        for i in ids:  # every step at the row's context, however many warm-up steps ran
            cache.pop(i, 1)
        return dict({f"host_{k}": s for k, s in host.items()}, host=sum(host.values()),
                    step=step, append=event_seconds(appends), attend=event_seconds(attends),
                    tables=cache.bytes_uploaded - up0,
                    launches=(cache.stats().launches - launches0) / cache.num_layers)
    return call


STEADY = 8  # steps of the steady host timing


def steady_steps(cache: PagedKVCache, ids: list[str], x: StepInputs, n: int) -> dict:
    """``n`` whole decode steps back to back with the queue held throughout, so that no
    kernel runs between them (on a CPU device the kernels of a step run on the host's
    cores and leave its caches cold for the next step's calls): the host seconds of
    begin, of the layers' appends and attends, and of the whole step, all of the step
    whose whole is the median (so that the parts add up within it)."""
    cl = runtime.cl()
    quantized = cache.spec.k_format in QUANTIZED or cache.spec.v_format in QUANTIZED
    x.queue.finish()
    gate = cl.UserEvent(x.queue.context)
    cl.enqueue_marker(x.queue, wait_for=[gate])
    held = []  # the table uploads' events: pyopencl's event of a copy from host memory
    times = []  # waits for the copy when dropped, which would wait for the held queue
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            cache.begin(ids)
            t1 = time.perf_counter()
            held += cache.upload_events
            for layer in range(cache.num_layers):
                cache.append(layer, x.dev["k"], x.dev["v"])
                cache.attend(layer, x.dev["q"], out=x.out[layer], lse=x.lse[layer])
            t2 = time.perf_counter()
            if quantized:  # end() reads the device check's flags: it would wait
                cache.cancel()
            else:
                cache.end()
            times.append((t1 - t0, t2 - t1, time.perf_counter() - t0))
    finally:
        gate.set_status(cl.command_execution_status.COMPLETE)
        x.queue.finish()
    times.sort(key=lambda t: t[2])
    med = times[len(times) // 2]
    return dict(begin=med[0], layers=med[1], step=med[2])


def timed_begin(cache: PagedKVCache, ids: list[str]) -> Callable[[], dict]:
    """``begin`` alone (then cancel), with the device idle and the caches warm."""
    def call() -> dict:
        t = time.perf_counter()
        cache.begin(ids)
        s = time.perf_counter() - t
        cache.cancel()
        return {"s": s}
    return call


def check_step(row: dict, what: str, cache: PagedKVCache, twin: PagedKVCache, ids: list[str],
               x: StepInputs) -> bool:
    """One step on the device cache and on its CPU-backend twin (layer 0, the same tokens):
    every layer's output must match the twin's (each layer got the same keys and values)."""
    twin.begin(ids)
    twin.append(0, x.host["k"], x.host["v"])
    ref = twin.attend(0, x.host["q"])
    twin.end()
    timed_step(cache, ids, x)()
    for layer in range(cache.num_layers):
        ok, err, why = compare(x.out[layer].get(), x.lse[layer].get(), ref.out, ref.lse,
                               cache.spec.dtype)
        if not Mismatches.check(row, f"{what} layer {layer}", ok, err, why):
            return False
    return True


def cache_pair(args: argparse.Namespace, db: DeviceBench, spec: AttentionSpec, B: int,
               ctx: int, layers: int,
               fuse: bool = True) -> tuple[PagedKVCache, PagedKVCache, list[str]]:
    """The device cache of a row (``fuse``: the profile's ``fuse_append``), its one-layer
    CPU-backend twin, and B sequence ids added to both; pages for the fill, the check step
    and the steady steps (a timed step pops its token again)."""
    profile = (get_profile(args.profile).with_(fuse_append=fuse) if args.profile
               else {"fuse_append": fuse})
    steps = 2 + STEADY  # the check, the one timed step in flight, the steady steps
    kw = dict(num_pages=B * -(-(ctx + steps) // PAGE),
              rope="attend" if args.rope else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache = PagedKVCache(spec, layers, device=db.dev, profile=profile, backend="opencl",
                             **kw)
    twin = PagedKVCache(spec, 1, backend="cpu", **kw)
    ids = [f"s{b}" for b in range(B)]
    for c in (cache, twin):
        for i in ids:
            c.add(i)
    return cache, twin, ids


def _cache_row(args: argparse.Namespace, db: DeviceBench, row: dict) -> None:
    spec = model_spec(row["model"], row["dtype"], row["format"])
    B, ctx, layers = row["B"], row["ctx"], row["layers"]
    cache, twin, ids = cache_pair(args, db, spec, B, ctx, layers, row["append"] == "fused")
    x = StepInputs(db.queue, spec, db.rng, B, ctx, layers)
    t = time.perf_counter()
    fill_cache(cache, ids, x.dev["fill_k"], x.dev["fill_v"])
    x.queue.finish()
    row["fill_s"] = time.perf_counter() - t
    fill_cache(twin, ids, x.host["fill_k"], x.host["fill_v"])
    what = f"cache {row['model']} {spec.dtype} {spec.k_format} pages B={B} ctx={ctx}"
    if not check_step(row, what, cache, twin, ids, x):
        return
    del twin
    r = sample_interleaved({"step": timed_step(cache, ids, x)}, args.repeat,
                           args.row_seconds)[0]["step"]
    alone = sample({"begin": timed_begin(cache, ids)}, warmup=5, min_runs=25,
                   max_runs=25)["begin"]["s"].median
    held = sample_interleaved({"step": timed_step(cache, ids, x, held=True)}, args.repeat,
                              args.row_seconds)[0]["step"]
    steady = steady_steps(cache, ids, x, STEADY)
    row.update(held_host_ms=held["host"] * 1e3, held_begin_ms=held["host_begin"] * 1e3,
               held_layers_ms=(held["host_append"] + held["host_attend"]) * 1e3,
               steady_host_ms=steady["step"] * 1e3, steady_begin_ms=steady["begin"] * 1e3,
               steady_layers_ms=steady["layers"] * 1e3)
    row.update({f"{k}_ms": r[k] * 1e3 for k in ("step", "host", "host_begin", "host_append",
                                                "host_attend", "host_end", "append", "attend")},
               begin_alone_ms=alone * 1e3, append_vs_attend=r["append"] / r["attend"],
               tables_bytes=r["tables"], launches_per_layer=r["launches"], runs=r["runs"],
               pages_used=cache.stats().pages_used,
               profile=cache.profile.name,
               qkv_bytes=B * (spec.num_qo_heads + 2 * spec.num_kv_heads) * spec.head_dim
               * spec.itemsize * layers)
    log(f"{what} x {layers} layers, append {row['append']}: step {row['step_ms']:.3f} ms, "
        f"host {row['host_ms']:.3f} ms (queue held {row['held_host_ms']:.3f}, steady "
        f"{row['steady_host_ms']:.3f}), {row['launches_per_layer']:g} launches per layer, "
        f"append {row['append_ms']:.3f} ms / attend {row['attend_ms']:.3f} ms on the device")


def suite_cache(args: argparse.Namespace, deadline: Deadline) -> dict:
    """Decode steps through PagedKVCache: host, device and wall time per call kind."""
    db = DeviceBench(args, ceilings=False)
    models = args.models or ["Llama-3-8B"]
    batches = args.batches or [1, 8]
    contexts = args.contexts or [4096]
    dtypes = args.dtypes or ["float16"]
    if args.smoke:
        models, batches, contexts, dtypes = ["Qwen2.5-0.5B"], [1], [64], ["float16"]
    appends = {"both": ["fused", "separate"], "fused": ["fused"], "separate": ["separate"]}
    rows = [dict(model=name, dtype=dt, format=fmt or dt, B=B, ctx=ctx,
                 layers=args.layers or (2 if args.smoke else MODELS[name].layers), append=a)
            for name in models for dt in dtypes for fmt in args.formats or [None]
            for B in batches for ctx in contexts for a in appends[args.append]]
    run_rows(rows, deadline, lambda row: _cache_row(args, db, row))
    cols = [("model", "model", ""), ("dtype", "dtype", ""), ("format", "pages", ""),
            ("B", "B", "d"), ("ctx", "ctx", "d"), ("layers", "layers", "d"),
            ("append", "append", ""), ("launches_per_layer", "launches per layer", "g"),
            ("step_ms", "step ms (begin to last kernel)", ".3f"), ("host_ms", "host ms", ".3f"),
            ("host_begin_ms", "begin", ".3f"), ("host_append_ms", "appends", ".3f"),
            ("host_attend_ms", "attends", ".3f"), ("host_end_ms", "end", ".3f"),
            ("held_host_ms", "host ms, queue held", ".3f"),
            ("held_begin_ms", "begin", ".3f"), ("held_layers_ms", "appends + attends", ".3f"),
            ("steady_host_ms", "host ms, steady", ".3f"), ("steady_begin_ms", "begin", ".3f"),
            ("steady_layers_ms", "appends + attends", ".3f"),
            ("begin_alone_ms", "begin alone ms", ".3f"),
            ("launches_per_layer", "launches per layer", ".2f"),
            ("append_ms", "append kernels ms", ".3f"), ("attend_ms", "attend kernels ms", ".3f"),
            ("append_vs_attend", "append/attend", ".2%"),
            ("tables_bytes", "tables B/step", ".0f"),
            ("qkv_bytes", "q/k/v B/step if from the host", "d"), ("max_err", "max abs err", ".1e")]
    title = ("PagedKVCache decode step (medians; host: time in the calls while the kernels "
             "run (on a CPU device they share the cores); host, queue held: the same calls "
             "with the queue held back by a user event until the step is enqueued, i.e. "
             f"their own cost; host, steady: {STEADY} steps back to back with the queue held "
             "throughout, so no kernel runs between them (a CPU device's kernels run on the "
             "host's cores and leave its caches cold for the next step's calls; on a GPU "
             "they do not; the step whose whole is the median, with its parts); begin alone: "
             "begin + cancel back to back, device idle; append: fused into the decode launch "
             "(a fused append's device time is in the attend's) or separate launches, the "
             "profile's fuse_append)")
    if args.rope:
        title += ", in-kernel RoPE (rope='attend')"
    return {"sections": [(title, rows, cols)], "ceilings": None, "header": db.header()}


# -- main --------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--suite", choices=tuple(SUITES), required=True)
    ap.add_argument("--device", default="pocl",
                    help="OpenCL device: 'pocl' (default), 'intel', a name fragment or P:D")
    ap.add_argument("--profile", default=None, help="force a clattn profile (e.g. adreno-7xx)")
    ap.add_argument("--quick", action="store_true", help="a subset for a fast look")
    ap.add_argument("--smoke", action="store_true", help="one tiny row per section (tests)")
    ap.add_argument("--repeat", type=int, default=100,
                    help="timed runs per row (max; --row-seconds ends a row first)")
    ap.add_argument("--row-seconds", type=float, default=1.5,
                    help="stop repeating a row after this long (3 runs at least)")
    ap.add_argument("--warmup-s", type=float, default=WARMUP_S,
                    help="untimed calls of each row for this long first")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="skip the remaining rows after this many seconds")
    ap.add_argument("--json", metavar="FILE", help="write the raw results as JSON")
    ap.add_argument("--markdown", action="store_true", default=True,
                    help="print markdown tables on stdout (the default)")
    ap.add_argument("--no-markdown", dest="markdown", action="store_false")
    ap.add_argument("--models", type=lambda s: csv(s), default=None,
                    help=f"comma list from {', '.join(MODELS)}")
    ap.add_argument("--batches", type=lambda s: csv(s, int), default=None)
    ap.add_argument("--append", choices=("both", "fused", "separate"), default="both",
                    help="--suite cache: the append fused into the decode launch, separate "
                         "launches, or both rows (default)")
    ap.add_argument("--contexts", type=lambda s: csv(s, int), default=None)
    ap.add_argument("--dtypes", type=lambda s: csv(s), default=None, help="float16,float32")
    ap.add_argument("--formats", type=lambda s: csv(s), default=None,
                    help=f"page formats of --suite decode/cache, from {','.join(KV_FORMATS)} "
                         "(default: the dtype's own); include float16 for the ratio column")
    ap.add_argument("--chunks", type=lambda s: csv(s, chunk), default=None,
                    help="prefill rows as new:cached tokens per sequence (default: "
                         + ",".join(f"{n}:{c}" for n, c in PREFILL_CHUNKS) + ")")
    ap.add_argument("--layers", type=int, default=0,
                    help="layers of --suite cache (default: the model's)")
    ap.add_argument("--rope", action="store_true",
                    help="--suite cache: in-kernel RoPE (rope='attend')")
    ap.add_argument("--split-sizes", type=lambda s: csv(s, int), default=None,
                    help="forced partition sizes tried by --suite split")
    ap.add_argument("--max-pool-gib", type=float, default=4.0,
                    help="decode rows whose KV is larger are skipped (so are rows whose pool "
                         "exceeds the device's largest allocation or the host memory)")
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
    for f in args.formats or []:
        if f not in KV_FORMATS:
            ap.error(f"--formats: unknown {f!r}; known: {', '.join(KV_FORMATS)}")
    if args.smoke:
        args.bw_mib = min(args.bw_mib or 32, 32)
        args.bw_target_s = min(args.bw_target_s, 0.02)
        args.repeat = min(args.repeat, 3)
        args.warmup_s = 0.0
    return args


def source_version() -> str:
    """The git commit of the checkout (``+dirty`` with uncommitted changes to clattn/)."""
    root = str(ROOT)
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
    print(f"- {when}, host {platform.node()}, {elapsed:.0f} s, clattn {ver}")
    print(f"- CPU: {cpu_description()}")
    for line in res.get("header") or []:
        print(line)
    for title, rows, cols in res["sections"]:
        print(f"\n### {title}\n")
        print(markdown(rows, cols))
    print()


# -- gpu-model suite ---------------------------------------------------------------------
def suite_gpu_model(args: argparse.Namespace, deadline: Deadline) -> dict:
    """The tiled kernel's work per KV row counted under Oclgrind for every GPU profile x
    model shape (or ``--profile`` / ``--models``), the verdict against the baseline
    kernels' counts, and the modelled time per device (tools/gpu_model.py,
    tools/gpu_model.md); counts are cached per kernel source."""
    import gpu_model as gm  # noqa: PLC0415 - a sibling tool, imported only for this suite
    profiles = [args.profile] if args.profile else None
    shapes = args.models or None
    if args.smoke:
        profiles, shapes = ["mali-valhall"], ["Qwen2.5-0.5B"]
    rows = gm.count_all(profiles, shapes, jobs=2, base_rows=32 if args.smoke else gm.BASE_ROWS)
    counts, verdicts, model = [], [], []
    for r in rows:
        c, v = r.counts, gm.verdict(r)
        counts.append(dict(profile=r.profile, shape=r.shape, record=r.record or "(none)",
                           geometry=r.geometry, glob=r.per_kv_byte("global_load"),
                           local_ld=r.per_kv_byte("local_load"),
                           local_st=r.per_kv_byte("local_store"), barriers=r.wg_barriers,
                           arith=c.arith, other=c.other, f16=c.f16_conv))
        verdicts.append(dict(profile=r.profile, shape=r.shape, local_cut=v["local_cut"],
                             barrier_cut=v["barrier_cut"], ok="yes" if v["ok"] else "no"))
    for dev, r, L in gm.device_rows(rows, gm.load_devices()):
        e, sp = gm.estimate(r, dev, L), gm.split_choice(r, dev, L)
        model.append(dict(device=dev["name"], profile=r.profile, shape=r.shape, L=L,
                          wgs=e.work_groups, bound=e.bound + ("*" if e.local_form else ""),
                          est_us=e.time_us, floor_us=e.floor_us, parts=sp.planned_parts,
                          gain=sp.gain, best_parts=sp.best_parts, best_gain=sp.best_gain,
                          follows="yes" if sp.follows else "no"))
    c1 = [("profile", "profile", ""), ("shape", "shape", ""), ("record", "device record", ""),
          ("geometry", "geometry", ""), ("glob", "global B/KV B", ".3f"),
          ("local_ld", "local ld B/KV B", ".2f"), ("local_st", "local st B/KV B", ".2f"),
          ("barriers", "WG barriers/row", ".3f"), ("arith", "arith/row", ".0f"),
          ("other", "other/row", ".0f"), ("f16", "f16 conv/row", ".0f")]
    c2 = [("profile", "profile", ""), ("shape", "shape", ""),
          ("local_cut", "local loads cut", ".1f"), ("barrier_cut", "barriers cut", ".1f"),
          ("ok", f"global <= {gm.GLOBAL_LIMIT} B/KV B and (adreno/mali) cuts >= "
                 f"{gm.IMPROVE:.0f}x", "")]
    c3 = [("device", "device", ""), ("profile", "profile", ""), ("shape", "shape", ""),
          ("L", "rows", "d"), ("wgs", "work-groups", "d"), ("bound", "bound", ""),
          ("est_us", "est. us/token/layer", ".1f"), ("floor_us", "KV floor us", ".1f"),
          ("parts", "planner's partitions", "d"), ("gain", "its split gain", ".2f"),
          ("best_parts", "model's best partitions", "d"), ("best_gain", "its gain", ".2f"),
          ("follows", "planner follows the model", "")]
    return {"sections": [
        ("Tiled decode: counted work per KV row (Oclgrind, f16, local-memory form)", counts, c1),
        ("Today's counts against the baseline kernels' (tools/gpu_model.py BASELINE)",
         verdicts, c2),
        ("Modelled time per token per layer (B=1; tools/gpu_devices.json; *: sub-group "
         "device counted in the local form, an upper bound)", model, c3)],
        "ceilings": None, "header": []}


SUITES: dict[str, Callable[[argparse.Namespace, Deadline], dict]] = {
    "fallback": suite_fallback, "decode": suite_decode, "split": suite_split,
    "prefill": suite_prefill, "cache": suite_cache, "gpu-model": suite_gpu_model}


def main(argv: list[str] | None = None) -> int:
    """Run one suite; 1 if any configuration disagreed with the CPU backend."""
    args = parse(argv)
    global WARMUP_S
    WARMUP_S = args.warmup_s
    Mismatches.items = []
    deadline = Deadline(args.budget_s)
    version = source_version()
    t0 = time.perf_counter()
    res = SUITES[args.suite](args, deadline)
    elapsed = time.perf_counter() - t0
    if args.markdown:
        _print_markdown(argv, res, version, elapsed)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        out = {"suite": args.suite, "args": vars(args), "elapsed_s": elapsed,
               "host": platform.node(), "cpu": cpu_description(),
               "time": datetime.datetime.now().isoformat(),
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
