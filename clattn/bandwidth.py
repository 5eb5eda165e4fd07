"""clattn's own device ceilings: streaming read/copy bandwidth, launch latency, transfers.

Measured the way clpeak does it, so that a kernel's "fraction of bandwidth" means
something:

* every buffer is filled with pseudo-random data before timing (compressible data
  inflates bandwidth on GPUs with framebuffer compression; first touch of fresh
  pages is slow on CPU drivers);
* one warm-up launch (it also compiles), then repetitions calibrated so that each
  variant runs for about ``target_s``;
* several vector widths (float .. float16) and two coalesced access patterns
  (``strided``: clpeak's grid-stride reads; ``blocked``: each work-group streams one
  contiguous block, what CPU prefetchers like); the best is the ceiling;
* times come from OpenCL profiling events (``END - START``); the best repetition wins.

>>> from clattn import bandwidth                              # doctest: +SKIP
>>> print(bandwidth.read_bandwidth("pocl").summary())         # doctest: +SKIP
read bandwidth on pthread-AMD EPYC: 23.41 GB/s (float16, strided; 256 MiB per repetition, best of 8, median 21.76 GB/s)

``runtime_or_device``: a :class:`clattn.runtime.Runtime`, or anything
:func:`clattn.runtime.select_device` accepts (None, ``"pocl"``, a Device/Context/Queue).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import runtime

WIDTHS = (1, 2, 4, 8, 16)
PATTERNS = ("strided", "blocked")
FETCH = 16  # vectors each work-item reads (clpeak's value; 32 and 64 measured slower on PoCL)
LOCAL = 256  # work-group size of the bandwidth kernels (capped by the device)
MiB = 1 << 20

_SOURCE = r"""
#define FETCH %(fetch)d
%(kernels)s

__kernel void clattn_empty(__global float* out) { }

/* pseudo-random uniform values in [-1, 1): a hash of (seed, index), so any size
   fills in one pass without host data */
inline float clattn_rand(uint i, uint seed)
{
    uint x = i * 0x9E3779B9u ^ seed;
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return (float)(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

__kernel void clattn_fill_f32(__global float* p, const ulong n, const uint seed, const float scale)
{
    for (ulong i = get_global_id(0); i < n; i += get_global_size(0))
        p[i] = clattn_rand((uint)i ^ (uint)(i >> 32) * 0x632BE5ABu, seed) * scale;
}

__kernel void clattn_fill_f16(__global half* p, const ulong n, const uint seed, const float scale)
{
    for (ulong i = get_global_id(0); i < n; i += get_global_size(0))
        vstore_half(clattn_rand((uint)i ^ (uint)(i >> 32) * 0x632BE5ABu, seed) * scale, i, p);
}
"""

_READ = r"""
/* %(t)s reads: work-item reads FETCH elements and writes one float */
__kernel void read_strided_%(t)s(const __global %(t)s* restrict in, __global float* restrict out)
{
    const size_t gid = get_global_id(0), stride = get_global_size(0);
    %(t)s acc = (%(t)s)(0.0f);
    for (int i = 0; i < FETCH; ++i) acc += in[gid + i * stride];
    out[gid] = %(sum)s;
}
__kernel void read_blocked_%(t)s(const __global %(t)s* restrict in, __global float* restrict out)
{
    const size_t lid = get_local_id(0), ls = get_local_size(0);
    const __global %(t)s* p = in + get_group_id(0) * ls * FETCH + lid;
    %(t)s acc = (%(t)s)(0.0f);
    for (int i = 0; i < FETCH; ++i) acc += p[i * ls];
    out[get_global_id(0)] = %(sum)s;
}
__kernel void copy_strided_%(t)s(const __global %(t)s* restrict in, __global %(t)s* restrict out)
{
    const size_t gid = get_global_id(0), stride = get_global_size(0);
    for (int i = 0; i < FETCH; ++i) out[gid + i * stride] = in[gid + i * stride];
}
__kernel void copy_blocked_%(t)s(const __global %(t)s* restrict in, __global %(t)s* restrict out)
{
    const size_t lid = get_local_id(0), ls = get_local_size(0);
    const size_t base = get_group_id(0) * ls * FETCH + lid;
    for (int i = 0; i < FETCH; ++i) out[base + i * ls] = in[base + i * ls];
}
"""


def _tname(w: int) -> str:
    return "float" if w == 1 else f"float{w}"


def _hsum(w: int) -> str:
    if w == 1:
        return "acc"
    comps = "0123456789abcdef"[:w]
    return " + ".join(f"acc.s{c}" for c in comps)


def source() -> str:
    """The OpenCL C of the bandwidth, latency and fill kernels."""
    ks = "".join(_READ % {"t": _tname(w), "sum": _hsum(w)} for w in WIDTHS)
    return _SOURCE % {"fetch": FETCH, "kernels": ks}


# -- results -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measurement:
    """One bandwidth ceiling. ``gbps`` is the best variant's bytes / best time (1 GB = 1e9 B).

    ``variants``: ``(label, GB/s)`` for every variant tried (best repetition each).
    ``bytes_moved`` counts what one repetition reads (``read``), reads + writes
    (``copy``) or transfers (``h2d``/``d2h``).
    """

    kind: str
    device: str
    gbps: float
    best: str
    bytes_moved: int
    seconds: float  # best repetition of the best variant
    median_gbps: float  # median repetition of the best variant
    repetitions: int  # repetitions of the best variant
    variants: tuple = ()

    def summary(self) -> str:
        size = self.bytes_moved / MiB
        return (f"{self.kind} bandwidth on {self.device}: {self.gbps:.2f} GB/s ({self.best}; "
                f"{size:.0f} MiB per repetition, best of {self.repetitions}, median "
                f"{self.median_gbps:.2f} GB/s)")


@dataclass(frozen=True)
class Latency:
    """Launch latency of an empty kernel (global size 1), in microseconds.

    ``kernel_us``: the event's own duration (END - START), median and best.
    ``queued_to_end_us``: END - QUEUED (submission + scheduling + run), median.
    ``round_trip_us``: host enqueue -> wait returns, median and best.
    """

    device: str
    kernel_us: float
    kernel_min_us: float
    queued_to_end_us: float
    round_trip_us: float
    round_trip_min_us: float
    repetitions: int

    def summary(self) -> str:
        return (f"launch latency on {self.device}: round trip {self.round_trip_us:.1f} us median "
                f"({self.round_trip_min_us:.1f} best), kernel event {self.kernel_us:.1f} us "
                f"({self.kernel_min_us:.1f} best), queued->end {self.queued_to_end_us:.1f} us "
                f"({self.repetitions} repetitions)")


@dataclass(frozen=True)
class Transfer:
    """Host -> device and device -> host copies (``enqueue_copy`` from/to pageable numpy)."""

    h2d: Measurement
    d2h: Measurement

    def summary(self) -> str:
        return (f"transfers on {self.h2d.device}: host->device {self.h2d.gbps:.2f} GB/s, "
                f"device->host {self.d2h.gbps:.2f} GB/s "
                f"({self.h2d.bytes_moved / MiB:.0f} MiB, best of {self.h2d.repetitions})")


@dataclass(frozen=True)
class Ceilings:
    """Everything :func:`measure_all` measured on one device."""

    read: Measurement
    copy: Measurement
    latency: Latency
    transfer: Transfer | None = field(default=None)

    def summary(self) -> str:
        parts = [self.read.summary(), self.copy.summary(), self.latency.summary()]
        if self.transfer is not None:
            parts.append(self.transfer.summary())
        return "\n".join(parts)


# -- plumbing ------------------------------------------------------------------------------
def as_runtime(runtime_or_device: Any = None) -> runtime.Runtime:
    """A profiling-enabled :class:`Runtime` for a Runtime, device, name, context or queue."""
    if isinstance(runtime_or_device, runtime.Runtime):
        return runtime_or_device
    cl = runtime.cl()
    if isinstance(runtime_or_device, cl.CommandQueue):
        q = runtime_or_device
        if not q.properties & cl.command_queue_properties.PROFILING_ENABLE:
            raise ValueError("the queue was created without PROFILING_ENABLE: clattn.bandwidth "
                             "times kernels with profiling events")
        return runtime.Runtime(q.device, q.context, q)
    dev = runtime.select_device(runtime_or_device)
    if dev is None:
        raise runtime.NoDeviceError("no OpenCL device to measure")
    key = runtime_or_device if isinstance(runtime_or_device, cl.Context) else dev
    return runtime.Runtime.for_device(key)


def _program(rt: runtime.Runtime) -> Any:
    return rt.program(source())


def _kernel(rt: runtime.Runtime, name: str) -> Any:
    cache = rt.__dict__.setdefault("_clattn_bw_kernels", {})
    key = (name, FETCH)
    if key not in cache:
        cache[key] = runtime.cl().Kernel(_program(rt), name)
    return cache[key]


def _event_s(evt: Any) -> float:
    evt.wait()
    return (evt.profile.end - evt.profile.start) * 1e-9


def fill_random(rt_or_device: Any, buf: Any, *, dtype: Any = np.float32, seed: int = 1,
                scale: float = 1.0, wait: bool = True) -> Any:
    """Fill a buffer or pyopencl array with pseudo-random values in ``[-scale, scale)``.

    Runs on the device (fast, touches every page); ``dtype`` float32 or float16 (taken
    from the array when one is given). Returns the event.
    """
    rt = as_runtime(rt_or_device)
    if hasattr(buf, "base_data"):  # a pyopencl array
        dtype = buf.dtype
        if buf.offset or not buf.flags.forc:
            raise ValueError("fill_random: pass a whole contiguous array (or its buffer)")
        n = buf.size
        mem = buf.base_data
        queue = buf.queue or rt.queue
    else:
        mem = buf
        n = buf.size // np.dtype(dtype).itemsize
        queue = rt.queue
    dt = np.dtype(dtype)
    if dt == np.float32:
        knl = _kernel(rt, "clattn_fill_f32")
    elif dt == np.float16:
        knl = _kernel(rt, "clattn_fill_f16")
    else:
        raise TypeError(f"fill_random: dtype {dt} (float32 or float16)")
    cus = int(rt.device.max_compute_units or 1)
    gsz = min(max(1, n), cus * 4096)
    gsz = max(LOCAL, (gsz // LOCAL) * LOCAL)
    evt = knl(queue, (gsz,), None, mem, np.uint64(n), np.uint32(seed & 0xFFFFFFFF),
              np.float32(scale))
    if wait:
        evt.wait()
    return evt


def _calibrated(launch: Any, target_s: float, min_reps: int = 3, max_reps: int = 1000) -> list[float]:
    """Warm up once, then time ``launch()`` (which returns an event) about target_s long."""
    first = _event_s(launch())  # warm-up (compiles / faults in pages)
    est = _event_s(launch())
    est = max(min(first, est) if first > 0 else est, 1e-7)
    reps = int(min(max_reps, max(min_reps, math.ceil(target_s / est))))
    times = [est]
    for _ in range(reps - 1):
        times.append(_event_s(launch()))
    return times


def _local_size(rt: runtime.Runtime) -> int:
    return max(1, min(LOCAL, int(rt.device.max_work_group_size)))


def _stream(kind: str, rt: runtime.Runtime, size_bytes: int, target_s: float,
            widths: tuple, patterns: tuple) -> Measurement:
    cl = runtime.cl()
    ls = _local_size(rt)
    quantum = 16 * 4 * FETCH * ls  # whole work-groups at every width
    size = max(quantum, (int(size_bytes) // quantum) * quantum)
    n_f32 = size // 4
    src = cl.Buffer(rt.context, cl.mem_flags.READ_WRITE, size)
    fill_random(rt, src, dtype=np.float32, seed=0x5EED)
    if kind == "read":
        dst = cl.Buffer(rt.context, cl.mem_flags.READ_WRITE, n_f32 // FETCH * 4)
    else:
        dst = cl.Buffer(rt.context, cl.mem_flags.READ_WRITE, size)
    fill_random(rt, dst, dtype=np.float32, seed=0xD57)  # touch before timing
    results = []
    try:
        for pat in patterns:
            for w in widths:
                knl = _kernel(rt, f"{kind}_{pat}_{_tname(w)}")
                knl.set_args(src, dst)
                gsz = n_f32 // (w * FETCH)

                def launch(knl=knl, gsz=gsz):
                    return cl.enqueue_nd_range_kernel(rt.queue, knl, (gsz,), (ls,))

                times = _calibrated(launch, target_s)
                results.append((f"{_tname(w)}, {pat}", times))
    finally:
        src.release()
        dst.release()
    moved = size if kind == "read" else 2 * size
    best_label, best_times = min(results, key=lambda r: min(r[1]))
    return Measurement(
        kind=kind, device=rt.device.name.strip(), gbps=moved / min(best_times) * 1e-9,
        best=best_label, bytes_moved=moved, seconds=min(best_times),
        median_gbps=moved / statistics.median(best_times) * 1e-9, repetitions=len(best_times),
        variants=tuple((lab, round(moved / min(t) * 1e-9, 3)) for lab, t in results))


# -- public measurements -------------------------------------------------------------------
def read_bandwidth(runtime_or_device: Any = None, size_bytes: int = 256 * MiB,
                   target_s: float = 0.25, *, widths: tuple = WIDTHS,
                   patterns: tuple = PATTERNS) -> Measurement:
    """Streaming global-memory read bandwidth (GB/s of bytes read), best variant.

    Each work-item reads ``FETCH`` vectors (float .. float16) coalesced across the
    work-group, accumulates them and writes one float (1/``FETCH`` extra traffic at
    float, less at wider types; not counted). ``size_bytes`` should dwarf the caches.
    ``target_s``: time spent per variant (10 variants by default).
    """
    return _stream("read", as_runtime(runtime_or_device), size_bytes, target_s,
                   tuple(widths), tuple(patterns))


def copy_bandwidth(runtime_or_device: Any = None, size_bytes: int = 128 * MiB,
                   target_s: float = 0.25, *, widths: tuple = WIDTHS,
                   patterns: tuple = PATTERNS) -> Measurement:
    """Device-to-device copy kernel bandwidth: GB/s of bytes read + written (STREAM's count)."""
    return _stream("copy", as_runtime(runtime_or_device), size_bytes, target_s,
                   tuple(widths), tuple(patterns))


def launch_latency(runtime_or_device: Any = None, target_s: float = 0.25, *,
                   min_reps: int = 20, max_reps: int = 5000) -> Latency:
    """Latency of an empty kernel: host round trip (enqueue + wait) and event times."""
    rt = as_runtime(runtime_or_device)
    cl = runtime.cl()
    knl = _kernel(rt, "clattn_empty")
    dummy = cl.Buffer(rt.context, cl.mem_flags.READ_WRITE, 64)
    knl.set_args(dummy)
    try:
        for _ in range(3):  # warm-up
            cl.enqueue_nd_range_kernel(rt.queue, knl, (1,), (1,)).wait()
        trips, kern, q2e = [], [], []
        t_end = time.perf_counter() + target_s
        while len(trips) < max_reps and (len(trips) < min_reps or time.perf_counter() < t_end):
            t0 = time.perf_counter()
            evt = cl.enqueue_nd_range_kernel(rt.queue, knl, (1,), (1,))
            evt.wait()
            trips.append(time.perf_counter() - t0)
            kern.append((evt.profile.end - evt.profile.start) * 1e-9)
            q2e.append((evt.profile.end - evt.profile.queued) * 1e-9)
    finally:
        dummy.release()
    us = 1e6
    return Latency(device=rt.device.name.strip(), kernel_us=statistics.median(kern) * us,
                   kernel_min_us=min(kern) * us, queued_to_end_us=statistics.median(q2e) * us,
                   round_trip_us=statistics.median(trips) * us, round_trip_min_us=min(trips) * us,
                   repetitions=len(trips))


def transfer_bandwidth(runtime_or_device: Any = None, size_bytes: int = 64 * MiB,
                       target_s: float = 0.25) -> Transfer:
    """Host->device and device->host bandwidth of blocking ``enqueue_copy`` (event times)."""
    rt = as_runtime(runtime_or_device)
    cl = runtime.cl()
    n = max(1, int(size_bytes) // 4)
    host = np.random.default_rng(7).random(n, dtype=np.float32)
    back = np.empty_like(host)
    back.fill(0.0)  # fault the pages in
    buf = cl.Buffer(rt.context, cl.mem_flags.READ_WRITE, host.nbytes)
    fill_random(rt, buf, dtype=np.float32)
    out = []
    try:
        for kind, launch in (
                ("h2d", lambda: cl.enqueue_copy(rt.queue, buf, host, is_blocking=False)),
                ("d2h", lambda: cl.enqueue_copy(rt.queue, back, buf, is_blocking=False))):
            times = _calibrated(launch, target_s, max_reps=200)
            out.append(Measurement(
                kind=kind, device=rt.device.name.strip(), gbps=host.nbytes / min(times) * 1e-9,
                best="enqueue_copy", bytes_moved=host.nbytes, seconds=min(times),
                median_gbps=host.nbytes / statistics.median(times) * 1e-9,
                repetitions=len(times)))
    finally:
        buf.release()
    if not np.array_equal(back, host):
        raise RuntimeError("transfer_bandwidth: the data did not survive the round trip")
    return Transfer(*out)


def measure_all(runtime_or_device: Any = None, *, size_bytes: int = 256 * MiB,
                target_s: float = 0.25, transfers: bool = True) -> Ceilings:
    """Read and copy bandwidth, launch latency and (optionally) transfers of one device."""
    rt = as_runtime(runtime_or_device)
    return Ceilings(read=read_bandwidth(rt, size_bytes, target_s),
                    copy=copy_bandwidth(rt, max(size_bytes // 2, MiB), target_s),
                    latency=launch_latency(rt, target_s),
                    transfer=transfer_bandwidth(rt, max(size_bytes // 4, MiB), target_s)
                    if transfers else None)


__all__ = ["Measurement", "Latency", "Transfer", "Ceilings", "read_bandwidth", "copy_bandwidth",
           "launch_latency", "transfer_bandwidth", "measure_all", "fill_random", "as_runtime",
           "source"]
