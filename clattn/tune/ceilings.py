"""Device ceilings: streaming read/copy bandwidth, launch latency, transfers and the f32
multiply-add peak.

Measured the way clpeak does it, so that a kernel's "fraction of bandwidth" means something:

* the working set is at least :data:`COLD_FACTOR` times the largest cache the device or
  the host reports (:func:`sizing`: ``global_mem_cache_size``, and for a CPU device the
  host's caches from ``/sys/devices/system/cpu/cpu0/cache``), capped by the largest
  allocation and the global memory; the size used and why is in each result;
* every buffer is filled with pseudo-random data before timing (compressible data
  inflates bandwidth on GPUs with framebuffer compression; first touch of fresh pages is
  slow on CPU drivers);
* one warm-up launch per variant (it also compiles), never counted, then repetitions for
  about ``target_s`` (:func:`clattn.tune.timing.sample`);
* several vector widths (float .. float16) and two coalesced access patterns
  (``strided``: clpeak's grid-stride reads; ``blocked``: each work-group streams one
  contiguous block, what CPU prefetchers like); the variant with the best repetition is
  the ceiling, timed in :data:`STREAM_ROUNDS` rounds whose fastest median counts;
* times come from OpenCL profiling events (``END - START``).

Each :class:`Measurement` carries the best and the median repetition: compare a kernel's
median with ``median_gbps`` and its best with ``gbps``.

The arithmetic ceiling (:func:`fma_peak`) is clpeak's too: every work-item runs
independent chains of ``x = x * y + y`` on 96 lanes (:data:`FMA_WIDTHS`: 12 chains of
float8, or 6 of float16, the faster of the two counting: a kernel using 16-float vectors
on an AVX-512 CPU beats an 8-float peak), unrolled
:data:`FMA_UNROLL` times in a loop of :data:`FMA_ITERS`, so that neither latency nor
memory limits it; GFLOP/s counts 2 per lane per multiply-add. The program is built with
``-cl-mad-enable`` (the compiler may fuse); an explicit ``mad()`` or ``fma()`` is a library
call on PoCL and ran at a tenth of the speed (2-core AMD EPYC: 15 vs 186 GFLOP/s).
:func:`fma_launcher` gives the bare launch for callers that time it beside their own
kernels (``tools/bench.py``).

>>> from clattn.tune import ceilings                  # doctest: +SKIP
>>> print(ceilings.read_bandwidth("pocl").summary())  # doctest: +SKIP +NORMALIZE_WHITESPACE
read bandwidth on pthread-AMD EPYC: 23.41 GB/s (float16, strided; best of 8, median 21.76 GB/s;
working set 128 MiB = 4x the largest cache, host L3 32 MiB)

``runtime_or_device``: a :class:`clattn.runtime.Runtime`, or anything
:func:`clattn.runtime.select_device` accepts (None, ``"pocl"``, a Device/Context/Queue).
"""
from __future__ import annotations

import glob
import os
import re
import statistics
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from .. import runtime
from .timing import event_seconds, sample

WIDTHS = (1, 2, 4, 8, 16)
PATTERNS = ("strided", "blocked")
FETCH = 16  # vectors each work-item reads (clpeak's value; 32 and 64 measured slower on PoCL)
LOCAL = 256  # work-group size of the bandwidth kernels (capped by the device)
MiB = 1 << 20
#: working sets are at least this many times the largest cache reported
COLD_FACTOR = 4
#: and at least this large (launch overhead must not count)
MIN_WORKING_SET = 64 * MiB
#: rounds of the best variant of a streaming ceiling (the first is the sweep's); the round
#: with the fastest median counts: on a 2-vCPU VM one run's read median came out at 21.8
#: GB/s (best 34.3), another's at 29.0, and every fraction of it moved by a third
STREAM_ROUNDS = 3
#: where the host's caches are described (Linux)
HOST_CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"

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

/* each work-item fills one contiguous run of the buffer (a CPU driver runs a group's
   work-items one after another: interleaved indices would have every cache line written
   by many of them, far apart in time); the values depend on the index alone */
#define CLATTN_FILL_RUN(n) \
    const ulong run = (n + get_global_size(0) - 1) / get_global_size(0); \
    const ulong lo = min((ulong)n, get_global_id(0) * run), hi = min((ulong)n, lo + run)

__kernel void clattn_fill_f32(__global float* p, const ulong n, const uint seed, const float scale)
{
    CLATTN_FILL_RUN(n);
    for (ulong i = lo; i < hi; ++i)
        p[i] = clattn_rand((uint)i ^ (uint)(i >> 32) * 0x632BE5ABu, seed) * scale;
}

__kernel void clattn_fill_f16(__global half* p, const ulong n, const uint seed, const float scale)
{
    CLATTN_FILL_RUN(n);
    for (ulong i = lo; i < hi; ++i)
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


#: f32 lanes per work-item (chains x vector width), multiply-adds per chain per loop trip,
#: loop trips
FMA_LANES, FMA_UNROLL, FMA_ITERS = 96, 16, 128
#: vector widths of the peak kernel; the faster one is the peak
FMA_WIDTHS = (8, 16)
#: independent chains of the default (float8) kernel
FMA_CHAINS = FMA_LANES // 8
#: work-items per compute unit of one multiply-add launch
FMA_ITEMS_PER_CU = 4096
#: build options of the multiply-add kernel
FMA_OPTIONS = ("-cl-mad-enable",)

_FMA = r"""
__kernel void clattn_fma(__global float* out, const float a)
{
    const %(t)s y = (%(t)s)(a);
%(decl)s
    for (int i = 0; i < %(iters)d; ++i) {
%(body)s
    }
    const %(t)s s = %(total)s;
    float r = 0.0f;
    for (int i = 0; i < %(w)d; ++i) r += ((const float*)&s)[i];
    out[get_global_id(0)] = r;
}
"""


def fma_source(width: int = 8) -> str:
    """The OpenCL C of the multiply-add peak kernel ``clattn_fma(out, a)`` on ``width``-float
    vectors (:data:`FMA_LANES` / ``width`` chains): every lane of every chain reaches ``out``
    (nothing is dead code)."""
    t = f"float{width}"
    chains = range(FMA_LANES // width)
    decl = "\n".join(f"    {t} x{c} = ({t})(get_global_id(0) * 1e-9f + {c}.0f);"
                     for c in chains)
    body = "\n".join(f"        x{c} = x{c} * y + y;" for _ in range(FMA_UNROLL) for c in chains)
    return _FMA % {"t": t, "w": width, "decl": decl, "iters": FMA_ITERS, "body": body,
                   "total": " + ".join(f"x{c}" for c in chains)}


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


# -- how large: past every cache ---------------------------------------------------------------
def size_text(n: int) -> str:
    """``512 KiB``, ``32 MiB``, ``1.2 GiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Cache:
    """One cache the device or the host reports."""

    where: str
    size_bytes: int


@dataclass(frozen=True)
class Sizing:
    """The working set of a ceiling and why it is that large.

    ``caches``: every cache reported (device and, for a CPU device, host); ``cap``:
    empty, or why the working set is below :data:`COLD_FACTOR` x the largest cache.
    """

    working_set_bytes: int
    caches: tuple[Cache, ...] = ()
    cap: str = ""

    @property
    def largest_cache(self) -> Cache | None:
        """The largest cache reported, or None."""
        return max(self.caches, key=lambda c: c.size_bytes, default=None)

    def summary(self) -> str:
        """``working set 128 MiB = 4x the largest cache, host L3 32 MiB`` and any cap."""
        ws = f"working set {size_text(self.working_set_bytes)}"
        big = self.largest_cache
        if big is None:
            text = f"{ws} (no cache size reported)"
        else:
            ratio = self.working_set_bytes / big.size_bytes
            text = f"{ws} = {ratio:.3g}x the largest cache, {big.where} {size_text(big.size_bytes)}"
        return text + (f"; {self.cap}" if self.cap else "")


def parse_size(text: str) -> int:
    """Bytes of a sysfs cache size such as ``32K``, ``32768K``, ``1M`` or ``512``."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cache size {text!r}: expected digits with an optional K, M or G")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def host_caches(root: str = HOST_CACHE_DIR) -> list[Cache]:
    """The data and unified caches of the host's first CPU (empty where sysfs has none)."""
    out = []
    for d in sorted(glob.glob(os.path.join(root, "index*"))):
        try:
            with open(os.path.join(d, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(d, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(d, "size")) as f:
                size = parse_size(f.read())
        except (OSError, ValueError):
            continue
        if kind != "Instruction":
            out.append(Cache(f"host L{level}", size))
    return out


def host_available_bytes() -> int:
    """The host memory available now (``MemAvailable``; free pages where /proc is absent)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def host_cpus() -> int:
    """The CPUs this process may run on (its affinity: ``taskset`` counts), else the
    machine's, at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # no CPU affinity on this OS
        return os.cpu_count() or 1


def sizing(device: Any, *, factor: int = COLD_FACTOR, minimum: int = MIN_WORKING_SET,
           host_root: str = HOST_CACHE_DIR) -> Sizing:
    """A working set past every cache of ``device`` (and of the host when it is a CPU).

    Parameters
    ----------
    device : pyopencl.Device
    factor : int
        The working set is at least ``factor`` x the largest cache.
    minimum : int
        And at least this many bytes.
    host_root : str
        The sysfs directory of the host's caches (tests point it elsewhere).

    Returns
    -------
    Sizing
        Capped by ``max_mem_alloc_size`` (one buffer holds a read's working set), by a
        quarter of ``global_mem_size`` and, on a CPU device, by a quarter of the host
        memory available now; the cap is said.
    """
    cl = runtime.cl()
    caches = []
    dev_cache = int(getattr(device, "global_mem_cache_size", 0) or 0)
    if dev_cache:
        caches.append(Cache("device global memory cache", dev_cache))
    if int(getattr(device, "type", 0) or 0) & cl.device_type.CPU:
        caches += host_caches(host_root)
    largest = max((c.size_bytes for c in caches), default=0)
    want = max(minimum, factor * largest)
    caps = [(int(getattr(device, "max_mem_alloc_size", 0) or 0), "max_mem_alloc_size"),
            (int(getattr(device, "global_mem_size", 0) or 0) // 4, "a quarter of global_mem_size")]
    if int(getattr(device, "type", 0) or 0) & cl.device_type.CPU:
        caps.append((host_available_bytes() // 4, "a quarter of the host's available memory"))
    size, cap = want, ""
    for limit, what in caps:
        if 0 < limit < size:
            size, cap = limit, f"capped by {what} ({limit / MiB:.0f} MiB)"
    return Sizing(int(size), tuple(caches), cap)


# -- results -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measurement:
    """One bandwidth ceiling (1 GB = 1e9 B).

    ``gbps``: the best variant's bytes / its best repetition; ``median_gbps``: bytes /
    that variant's median repetition, in the fastest of its :data:`STREAM_ROUNDS` rounds
    (``repetitions`` counts that round). ``variants``: ``(label, GB/s)`` of every variant
    (best repetition each). ``bytes_moved`` counts what one repetition reads (``read``),
    reads + writes (``copy``) or transfers (``h2d``/``d2h``); ``sizing`` says how large
    the working set is and why.
    """

    kind: str
    device: str
    gbps: float
    best: str
    bytes_moved: int
    seconds: float  # best repetition of the best variant
    median_gbps: float  # median repetition of the best variant
    repetitions: int  # timed repetitions of the best variant (warm-up excluded)
    variants: tuple = ()
    sizing: Sizing | None = field(default=None)

    def summary(self) -> str:
        """One line: kind, device, GB/s best and median, the working set."""
        size = self.sizing.summary() if self.sizing else \
            f"{self.bytes_moved / MiB:.0f} MiB per repetition"
        return (f"{self.kind} bandwidth on {self.device}: {self.gbps:.2f} GB/s ({self.best}; "
                f"best of {self.repetitions}, median {self.median_gbps:.2f} GB/s; {size})")


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
        """One line with every figure."""
        return (f"launch latency on {self.device}: round trip {self.round_trip_us:.1f} us median "
                f"({self.round_trip_min_us:.1f} best), kernel event {self.kernel_us:.1f} us "
                f"({self.kernel_min_us:.1f} best), queued->end {self.queued_to_end_us:.1f} us "
                f"({self.repetitions} repetitions)")


@dataclass(frozen=True)
class FmaPeak:
    """The f32 multiply-add peak (1 GFLOP = 1e9 FLOPs; a multiply-add counts 2).

    ``gflops``: ``flops`` / the median repetition; ``best_gflops``: / the best one.
    ``samples``: seconds of every timed launch (the warm-up launch excluded).
    """

    device: str
    gflops: float
    best_gflops: float
    samples: tuple[float, ...]
    flops: int  # FLOPs of one launch
    width: int = 8  # vector width of the faster kernel (:data:`FMA_WIDTHS`)

    @property
    def repetitions(self) -> int:
        """Timed launches."""
        return len(self.samples)

    def summary(self) -> str:
        """One line: device, GFLOP/s median and best, the method."""
        return (f"f32 multiply-add peak on {self.device}: {self.gflops:.1f} GFLOP/s median "
                f"(best {self.best_gflops:.1f} of {self.repetitions}; {FMA_LANES // self.width} "
                f"chains of float{self.width} a * b + c per work-item, the faster of float8 "
                f"and float16)")


@dataclass(frozen=True)
class Transfer:
    """Host -> device and device -> host copies (``enqueue_copy`` from/to pageable numpy)."""

    h2d: Measurement
    d2h: Measurement

    def summary(self) -> str:
        """One line with both directions."""
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
    fma: FmaPeak | None = field(default=None)

    def summary(self) -> str:
        """One line per ceiling."""
        parts = [self.read.summary(), self.copy.summary(), self.latency.summary()]
        parts += [x.summary() for x in (self.transfer, self.fma) if x is not None]
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
            raise ValueError("the queue was created without PROFILING_ENABLE: clattn.tune.ceilings "
                             "times kernels with profiling events")
        return runtime.Runtime(q.device, q.context, q)
    dev = runtime.select_device(runtime_or_device)
    if dev is None:
        raise runtime.NoDeviceError("no OpenCL device to measure")
    key = runtime_or_device if isinstance(runtime_or_device, cl.Context) else dev
    return runtime.Runtime.for_device(key)


_KERNELS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _kernel(rt: runtime.Runtime, name: str) -> Any:
    cache = _KERNELS.setdefault(rt, {})
    if name not in cache:
        cache[name] = runtime.cl().Kernel(rt.program(source()), name)
    return cache[name]


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


def fill_rate(runtime_or_device: Any = None, size_bytes: int = 32 * MiB,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Bytes per second the device allocates and fills a new f16 buffer at
    (:func:`fill_random`, first touch included): what setting up a page pool or a
    ceiling's working set costs.

    Parameters
    ----------
    runtime_or_device : Runtime, device, name, context or queue
    size_bytes : int
        The buffer timed (after a small one that builds the kernel; at least 1 MiB).
    clock : callable
        Seconds from an arbitrary origin.

    Returns
    -------
    float
    """
    rt = as_runtime(runtime_or_device)
    cl = runtime.cl()
    # the same launch size as the timed fill (a driver may compile per launch size)
    warm = cl.array.empty(rt.queue, (max(1, min(size_bytes, MiB) // 2),), np.float16)
    fill_random(rt, warm)
    t0 = clock()
    buf = cl.array.empty(rt.queue, (max(1, size_bytes // 2),), np.float16)
    fill_random(rt, buf)
    seconds = clock() - t0
    for a in (warm, buf):
        a.base_data.release()
    return buf.nbytes / max(seconds, 1e-9)


def _timed(launch: Callable[[], Any], target_s: float, max_reps: int = 1000) -> tuple[float, ...]:
    """Seconds of each timed launch (one warm-up first, not counted), about target_s long."""
    res = sample({"x": lambda: {"s": event_seconds([launch()])}}, warmup=1, min_runs=3,
                 max_runs=max_reps, seconds=target_s)
    return res["x"]["s"].values


def _local_size(rt: runtime.Runtime) -> int:
    return max(1, min(LOCAL, int(rt.device.max_work_group_size)))


class _StreamBuffers:
    """The source and destination of a read or copy ceiling, filled and ready; the
    ``size`` bytes of the source are whole work-groups at every width."""

    def __init__(self, kind: str, rt: runtime.Runtime, working_set: int) -> None:
        cl = runtime.cl()
        self.kind, self.rt, self.ls = kind, rt, _local_size(rt)
        quantum = 16 * 4 * FETCH * self.ls
        src_bytes = working_set if kind == "read" else working_set // 2
        self.size = max(quantum, (src_bytes // quantum) * quantum)
        n_f32 = self.size // 4
        self.src = cl.Buffer(rt.context, cl.mem_flags.READ_WRITE, self.size)
        fill_random(rt, self.src, dtype=np.float32, seed=0x5EED)
        self.dst = cl.Buffer(rt.context, cl.mem_flags.READ_WRITE,
                             n_f32 // FETCH * 4 if kind == "read" else self.size)
        fill_random(rt, self.dst, dtype=np.float32, seed=0xD57)  # touch before timing

    @property
    def moved(self) -> int:
        """Bytes one launch reads (``read``) or reads + writes (``copy``)."""
        return self.size if self.kind == "read" else 2 * self.size

    def launcher(self, label: str) -> Callable[[], Any]:
        """The bare launch of variant ``label`` (``"float16, strided"``) on these buffers."""
        cl = runtime.cl()
        width, pat = (x.strip() for x in label.split(","))
        knl = _kernel(self.rt, f"{self.kind}_{pat}_{width}")
        w = 1 if width == "float" else int(width[len("float"):])
        gsz = self.size // 4 // (w * FETCH)

        def launch() -> Any:
            knl.set_args(self.src, self.dst)
            return cl.enqueue_nd_range_kernel(self.rt.queue, knl, (gsz,), (self.ls,))
        return launch

    def release(self) -> None:
        self.src.release()
        self.dst.release()


def read_launcher(runtime_or_device: Any, measurement: Measurement
                  ) -> tuple[Callable[[], Any], int, Callable[[], None]]:
    """The best variant of a read ceiling as a bare launch, on a new working set of the
    same size, for timing it beside other kernels (``tools/bench.py`` does, row by row).

    Returns
    -------
    (launch, bytes, release)
        ``launch()`` enqueues one read and returns its event (not waited for); ``bytes``
        is what it reads; ``release()`` frees the buffers.
    """
    rt = as_runtime(runtime_or_device)
    bufs = _StreamBuffers("read", rt, measurement.bytes_moved)
    return bufs.launcher(measurement.best), bufs.moved, bufs.release


def _stream(kind: str, rt: runtime.Runtime, size_bytes: int | None, target_s: float,
            widths: tuple, patterns: tuple, cap: tuple[int, str] | None) -> Measurement:
    plan = sizing(rt.device)
    if size_bytes is not None:
        plan = replace(plan, working_set_bytes=int(size_bytes), cap="size given by the caller")
    elif cap is not None and 0 < cap[0] < plan.working_set_bytes:
        plan = replace(plan, working_set_bytes=int(cap[0]),
                       cap=f"capped by {cap[1]} ({cap[0] / MiB:.0f} MiB)")
    bufs = _StreamBuffers(kind, rt, plan.working_set_bytes)
    results, launches = [], {}
    try:
        for pat in patterns:
            for w in widths:
                label = f"{_tname(w)}, {pat}"
                launches[label] = bufs.launcher(label)
                results.append((label, _timed(launches[label], target_s)))
        best_label, first = min(results, key=lambda r: min(r[1]))
        rounds = [first] + [_timed(launches[best_label], target_s)
                            for _ in range(STREAM_ROUNDS - 1)]
    finally:
        bufs.release()
    moved = bufs.moved  # what one repetition reads (+ writes)
    best_times = min(rounds, key=statistics.median)
    fastest = min(min(r) for r in rounds)
    return Measurement(
        kind=kind, device=rt.device.name.strip(), gbps=moved / fastest * 1e-9,
        best=best_label, bytes_moved=moved, seconds=fastest,
        median_gbps=moved / statistics.median(best_times) * 1e-9, repetitions=len(best_times),
        variants=tuple((lab, round(moved / min(t) * 1e-9, 3)) for lab, t in results),
        sizing=replace(plan, working_set_bytes=moved))


# -- public measurements -------------------------------------------------------------------
def read_bandwidth(runtime_or_device: Any = None, size_bytes: int | None = None,
                   target_s: float = 0.25, *, widths: tuple = WIDTHS,
                   patterns: tuple = PATTERNS,
                   cap: tuple[int, str] | None = None) -> Measurement:
    """Streaming global-memory read bandwidth (GB/s of bytes read), best variant.

    Parameters
    ----------
    runtime_or_device : Runtime, device, name, context or queue
    size_bytes : int, optional
        The buffer read; default :func:`sizing` (past every cache).
    target_s : float
        Time spent per variant (10 variants by default).
    widths, patterns : tuple
        Vector widths (1..16) and access patterns tried.
    cap : (int, str), optional
        With ``size_bytes`` None: at most this many bytes, and why (said in the
        measurement's sizing, e.g. ``"the time budget"``).

    Returns
    -------
    Measurement
        Each work-item reads ``FETCH`` vectors coalesced across the work-group and writes
        one float (1/``FETCH`` extra traffic at float, less at wider types; not counted).
    """
    return _stream("read", as_runtime(runtime_or_device), size_bytes, target_s,
                   tuple(widths), tuple(patterns), cap)


def copy_bandwidth(runtime_or_device: Any = None, size_bytes: int | None = None,
                   target_s: float = 0.25, *, widths: tuple = WIDTHS,
                   patterns: tuple = PATTERNS,
                   cap: tuple[int, str] | None = None) -> Measurement:
    """Device-to-device copy bandwidth: GB/s of bytes read + written (STREAM's count).

    ``size_bytes``: the working set (source + destination; default :func:`sizing`, at
    most ``cap``); other parameters as for :func:`read_bandwidth`.
    """
    return _stream("copy", as_runtime(runtime_or_device), size_bytes, target_s,
                   tuple(widths), tuple(patterns), cap)


def launch_latency(runtime_or_device: Any = None, target_s: float = 0.25, *,
                   min_reps: int = 20, max_reps: int = 5000) -> Latency:
    """Latency of an empty kernel: host round trip (enqueue + wait) and event times.

    Three warm-up launches are not counted; then at least ``min_reps`` launches, more
    while ``target_s`` lasts (at most ``max_reps``).
    """
    rt = as_runtime(runtime_or_device)
    cl = runtime.cl()
    knl = _kernel(rt, "clattn_empty")
    dummy = cl.Buffer(rt.context, cl.mem_flags.READ_WRITE, 64)
    knl.set_args(dummy)

    def once() -> dict[str, float]:
        t0 = time.perf_counter()
        evt = cl.enqueue_nd_range_kernel(rt.queue, knl, (1,), (1,))
        evt.wait()
        trip = time.perf_counter() - t0
        p = evt.profile
        return {"trip": trip, "kernel": (p.end - p.start) * 1e-9, "q2e": (p.end - p.queued) * 1e-9}

    try:
        res = sample({"empty": once}, warmup=3, min_runs=min_reps, max_runs=max_reps,
                     seconds=target_s)["empty"]
    finally:
        dummy.release()
    us = 1e6
    return Latency(device=rt.device.name.strip(), kernel_us=res["kernel"].median * us,
                   kernel_min_us=res["kernel"].best * us, queued_to_end_us=res["q2e"].median * us,
                   round_trip_us=res["trip"].median * us, round_trip_min_us=res["trip"].best * us,
                   repetitions=res["trip"].runs)


def transfer_bandwidth(runtime_or_device: Any = None, size_bytes: int = 64 * MiB,
                       target_s: float = 0.25) -> Transfer:
    """Host->device and device->host bandwidth of ``enqueue_copy`` (event times)."""
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
            times = _timed(launch, target_s, max_reps=200)
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


def fma_launcher(rt: Any, width: int | None = None) -> tuple[Callable[[], Any], float]:
    """The multiply-add peak kernel, built once, as a bare launch.

    Parameters
    ----------
    rt : Runtime, device, name, context or queue
        As ``runtime_or_device`` elsewhere in this module; the kernel is built through the
        runtime's program cache and enqueued on its (profiling-enabled) queue.
    width : int, optional
        Vector width of :data:`FMA_WIDTHS`; None: the faster one on this device (one
        timed launch of each after a warm-up).

    Returns
    -------
    (launch, flops)
        ``launch()`` enqueues one call and returns its event (not waited for);
        ``flops`` is what that call computes, so the device's f32 peak is
        ``flops / seconds`` with :func:`~clattn.tune.timing.event_seconds` of the event.
    """
    r = as_runtime(rt)
    if width is None:
        return min((fma_launcher(r, w) for w in FMA_WIDTHS), key=_launch_seconds)
    cl = runtime.cl()
    knl = cl.Kernel(r.program(fma_source(width), FMA_OPTIONS), "clattn_fma")
    n = FMA_ITEMS_PER_CU * max(1, int(r.device.max_compute_units or 1))
    out = cl.Buffer(r.context, cl.mem_flags.WRITE_ONLY, 4 * n)
    knl.set_arg(1, np.float32(0.999))  # x -> 0.999 / 0.001: stays finite

    def launch() -> Any:
        knl.set_arg(0, out)  # the launch holds the buffer
        return cl.enqueue_nd_range_kernel(r.queue, knl, (n,), None)

    return launch, float(n) * FMA_ITERS * FMA_UNROLL * FMA_LANES * 2


def _launch_seconds(launcher: tuple[Callable[[], Any], float]) -> float:
    """Seconds per FLOP of a launcher's second launch (the first warms it up)."""
    launch, flops = launcher
    launch().wait()
    return event_seconds([launch()]) / flops


#: rounds of the multiply-add peak; the round with the fastest median counts (on a 2-vCPU
#: VM one round in a few measured exactly half the peak, every launch of it on one core)
FMA_ROUNDS = 3


def fma_peak(runtime_or_device: Any = None, target_s: float = 0.25) -> FmaPeak:
    """The device's f32 multiply-add peak, clpeak's way (see the module's text).

    Parameters
    ----------
    runtime_or_device : Runtime, device, name, context or queue
    target_s : float
        About this long of timed launches (at least 3) in each of :data:`FMA_ROUNDS`
        rounds, after one warm-up launch that is not counted; the round with the fastest
        median is the peak.

    Returns
    -------
    FmaPeak
        GFLOP/s of the median and of the best launch of that round, and its launches'
        seconds.
    """
    rt = as_runtime(runtime_or_device)
    times, flops, width = min(((_timed(launch, target_s / FMA_ROUNDS), flops, w)
                               for w in FMA_WIDTHS for launch, flops in [fma_launcher(rt, w)]
                               for _ in range(FMA_ROUNDS)),
                              key=lambda r: statistics.median(r[0]) / r[1])
    return FmaPeak(device=rt.device.name.strip(), gflops=flops / statistics.median(times) * 1e-9,
                   best_gflops=flops / min(times) * 1e-9, samples=tuple(times), flops=int(flops),
                   width=width)


def measure_all(runtime_or_device: Any = None, *, target_s: float = 0.25,
                transfers: bool = True) -> Ceilings:
    """Read and copy bandwidth (working sets from :func:`sizing`), launch latency,
    (optionally) transfers and the f32 multiply-add peak of one device."""
    rt = as_runtime(runtime_or_device)
    transfer_bytes = max(sizing(rt.device).working_set_bytes // 4, MiB)
    return Ceilings(read=read_bandwidth(rt, None, target_s),
                    copy=copy_bandwidth(rt, None, target_s),
                    latency=launch_latency(rt, target_s),
                    transfer=transfer_bandwidth(rt, transfer_bytes, target_s)
                    if transfers else None,
                    fma=fma_peak(rt, target_s))


__all__ = ["COLD_FACTOR", "STREAM_ROUNDS", "Cache", "Ceilings", "FMA_CHAINS", "FMA_ITERS",
           "FMA_LANES", "FMA_UNROLL", "FMA_WIDTHS", "FmaPeak",
           "Latency", "Measurement", "Sizing", "Transfer", "as_runtime", "copy_bandwidth",
           "fill_random", "fill_rate", "fma_launcher", "fma_peak", "fma_source",
           "host_available_bytes", "host_caches", "host_cpus",
           "launch_latency", "measure_all", "parse_size", "read_bandwidth", "read_launcher",
           "size_text", "sizing",
           "source", "transfer_bandwidth"]
