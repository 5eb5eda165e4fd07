"""Read bandwidth of scattered spans: what a paged KV cache's layout lets a decode read.

A rows decode (CPU drivers) reads, for one KV head, that head's K rows of a page, then its
V rows: ``page_size x head_dim x bytes`` contiguous each (2 KiB for head_dim 64 in f16 at
16 rows a page), on pages anywhere in the pool. A CPU's own prefetchers stop at each span,
so a stream of small scattered spans reads slower than one long stream, whatever the kernel
does with the data. This script measures both in one run, on one device:

* the streaming read ceiling (:func:`clattn.tune.ceilings.read_bandwidth`);
* for each pool size (by default the streaming read's working set and 1 GiB), each
  memory (the device's own buffer, and on a CPU device that buffer advised huge pages as
  :mod:`clattn.host_memory` advises a page pool) and span size, every span of the pool read
  once per launch in a random order, one work-item per stream (``--streams-per-cu`` per
  compute unit), each reading its spans in turn, 64 bytes at a time. Where the device runs
  ``__builtin_prefetch`` (:func:`clattn.compiler_probe.prefetch_works`), each work-item
  prefetches the span ``--ahead-bytes`` ahead, line by line, as the decode does.

The default spans are the per-head regions of ``tools/bench.py``'s five models in f16 and
f32. Each row prints the median and best GB/s and the median against the streaming read's
median.

    python tools/span_read.py --device pocl
    python tools/span_read.py --device intel --spans 2048,4096,65536

A developer script, not a test.
"""
from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
from common import MODELS, PAGE  # first: it puts clattn on the path

from clattn import compiler_probe, host_memory, runtime
from clattn.tune import ceilings, timing

LINE = 64  # bytes per read step and per prefetch hint

SOURCE = r"""
__kernel void clattn_read_spans(const __global float8* restrict buf,
                                const __global int* restrict order, const int per_item,
                                const int span_vec, const int ahead,
                                __global float* restrict out)
{
    const __global int* ord = order + (long)get_global_id(0) * per_item;
    float8 a0 = 0.0f, a1 = 0.0f;
    for (int c = 0; c < per_item; ++c) {
        const __global float8* p = buf + (long)ord[c] * span_vec;
#if PREFETCH
        const __global uchar* pn = (const __global uchar*)(buf
            + (long)ord[min(c + ahead, per_item - 1)] * span_vec);
#endif
        for (int i = 0; i < span_vec; i += 2) {
#if PREFETCH
            __builtin_prefetch(pn + i * 32, 0, 2);
#endif
            a0 += p[i];
            a1 += p[i + 1];
        }
    }
    const float8 s = a0 + a1;
    out[get_global_id(0)] = s.s0 + s.s1 + s.s2 + s.s3 + s.s4 + s.s5 + s.s6 + s.s7;
}
"""


def model_spans() -> dict[int, list[str]]:
    """Span bytes -> the bench models (and dtypes) whose per-head page region it is."""
    spans: dict[int, list[str]] = {}
    for name, m in MODELS.items():
        for dtype, size in (("f16", 2), ("f32", 4)):
            spans.setdefault(PAGE * m.head_dim * size, []).append(f"{name} {dtype}")
    return dict(sorted(spans.items()))


def read_spans(rt: runtime.Runtime, span: int, pool_bytes: int, *, ahead_bytes: int,
               streams_per_cu: int, seconds: float, prefetch: bool, huge: bool = False,
               seed: int = 0) -> tuple[float, float, int]:
    """(median GB/s, best GB/s, timed launches) of reading every span of a pool once.

    ``span`` bytes (a multiple of 64) each, in a random order split over
    ``streams_per_cu`` x compute units work-items; the pool in the device's own memory,
    or (``huge``) advised huge pages as :mod:`clattn.host_memory` advises a page pool.
    """
    cl = runtime.cl()
    if span % LINE:
        raise ValueError(f"span {span}: a multiple of {LINE} bytes")
    streams = max(1, int(rt.device.max_compute_units or 1) * streams_per_cu)
    per_item = max(1, pool_bytes // span // streams)
    n_spans = per_item * streams
    order = np.random.default_rng(seed).permutation(n_spans).astype(np.int32)
    flags = cl.mem_flags
    if huge:   # the pool as clattn allocates one (the caller checked wants_huge_pages)
        buf = host_memory.empty(rt.queue, (n_spans * span,), np.uint8).base_data
    else:
        buf = cl.Buffer(rt.context, flags.READ_WRITE, n_spans * span)
    ceilings.fill_random(rt, buf, dtype=np.float32, seed=0x5EED)
    obuf = cl.Buffer(rt.context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=order)
    out = cl.Buffer(rt.context, flags.WRITE_ONLY, 4 * streams)
    options = (f"-DPREFETCH={int(prefetch)}",)
    knl = cl.Kernel(rt.program(SOURCE, options=options), "clattn_read_spans")
    knl.set_scalar_arg_dtypes([None, None, np.int32, np.int32, np.int32, None])
    ahead = max(1, math.ceil(ahead_bytes / span))

    def launch() -> dict[str, float]:
        evt = knl(rt.queue, (streams,), (1,), buf, obuf, per_item, span // 32, ahead, out)
        return {"s": timing.event_seconds([evt])}

    try:
        res = timing.sample({"spans": launch}, warmup=1, min_runs=3, max_runs=50,
                            seconds=seconds)["spans"]["s"].values
    finally:
        for b in (buf, obuf, out):
            b.release()
    moved = n_spans * span
    return moved / statistics.median(res) * 1e-9, moved / min(res) * 1e-9, len(res)


def main(argv: list | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="pocl")
    ap.add_argument("--spans", default="",
                    help="span bytes, comma-separated (default: the bench models' per-head "
                         "page regions, and 64 KiB)")
    ap.add_argument("--ahead-bytes", type=int, default=8192,
                    help="how far ahead each stream prefetches (where the device can)")
    ap.add_argument("--streams-per-cu", type=int, default=8)
    ap.add_argument("--pools-mib", default="0,1024",
                    help="pool sizes, comma-separated (0: the streaming read's working set)")
    ap.add_argument("--seconds", type=float, default=1.0, help="per span size")
    args = ap.parse_args(argv)
    rt = ceilings.as_runtime(args.device)
    named = model_spans()
    spans = ([int(s) for s in args.spans.split(",")] if args.spans
             else sorted(set(named) | {65536}))
    read = ceilings.read_bandwidth(rt)
    pools = [int(p) * ceilings.MiB or read.sizing.working_set_bytes
             for p in args.pools_mib.split(",")]
    memories = [False, True] if host_memory.wants_huge_pages(rt.device) else [False]
    prefetch = compiler_probe.prefetch_works(rt)
    print(f"# scattered spans on {rt.device.name.strip()}")
    print(f"- {read.summary()}")
    print(f"- every span of the pool read once per launch, in a random order, "
          f"{args.streams_per_cu} streams per compute unit; prefetch "
          + (f"{args.ahead_bytes} bytes ahead" if prefetch else "none (the device cannot)"))
    print()
    rows = []
    for pool in pools:
        for huge in memories:
            for span in spans:
                med, best, n = read_spans(rt, span, pool, ahead_bytes=args.ahead_bytes,
                                          streams_per_cu=args.streams_per_cu,
                                          seconds=args.seconds, prefetch=prefetch, huge=huge)
                rows.append([ceilings.size_text(pool), "huge pages" if huge else "device",
                             ceilings.size_text(span),
                             ", ".join(named.get(span, [])) or "-", f"{med:.2f}",
                             f"{best:.2f}", f"{med / read.median_gbps:.0%}", str(n)])
    print("\n".join(timing.table(
        ["pool", "memory", "span", "per-head page region of", "GB/s (median)", "GB/s (best)",
         "of streaming read (medians)", "launches"], rows, right={4, 5, 6, 7},
        markdown=True)))

if __name__ == "__main__":
    main()
