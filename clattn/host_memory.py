"""KV page pools in the host's huge pages, for CPU OpenCL devices.

A CPU device's buffers are host memory in 4 KiB pages. A decode visits a sequence's KV pages
wherever they lie in the pool, a span of 2-8 KiB per KV head at a time. On a large pool
nearly every span is then also a TLB miss (a 2-vCPU Zen 4 VM with 4 KiB pages read random 2
KiB spans of a 1 GiB pool at 50-57% of its streaming read, and those of a 128 MiB pool at
about the full rate; ``tools/span_read.py``). Transparent huge pages (2 MiB) cover the same
pool with 512x fewer TLB entries. Neither PoCL nor Intel's CPU runtime asks for them, so
under the kernel's usual THP mode (``madvise``) their buffers get none. For a CPU device,
:func:`empty` maps the memory itself, 2 MiB aligned, advises huge pages and hands it to the
device with ``CL_MEM_USE_HOST_PTR``. The decode then ran 1.00-1.20x faster on PoCL at 16k
tokens (median 1.10x over five models, f16 and f32, B 1 and 8), 1.18-1.29x at 64k tokens and
B = 8, and 0.97-1.13x (median 1.04x) on Intel's runtime (``tools/ab_decode.py --pools``).

Other devices (GPUs, Oclgrind, which reports every device type), hosts without
``madvise(MADV_HUGEPAGE)`` and THP mode ``never`` get a plain ``pyopencl.array.empty``.
"""
from __future__ import annotations

import mmap
import weakref
from typing import Any

import numpy as np

from . import runtime

#: where Linux states its transparent-huge-page mode
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
#: the huge page size the mapping is aligned to (x86-64 and arm64 with 4 KiB base pages)
HUGE_PAGE = 2 << 20


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``; ``""`` if unknown).

    The file reads like ``always [madvise] never``: the bracketed word is the mode.
    """
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end].strip() if 0 <= start < end else ""


def wants_huge_pages(device: Any, mode: str | None = None) -> bool:
    """Whether :func:`empty` maps huge pages for ``device``'s pools.

    Only for a device that is a CPU and nothing else (Oclgrind reports every type), on a
    host with ``MADV_HUGEPAGE`` and a THP mode other than ``never``.
    """
    cl = runtime.cl()
    if int(getattr(device, "type", 0) or 0) != int(cl.device_type.CPU):
        return False
    mode = thp_mode() if mode is None else mode
    return hasattr(mmap, "MADV_HUGEPAGE") and mode in ("always", "madvise")


def huge_page_bytes(nbytes: int) -> np.ndarray:
    """``uint8 [nbytes]`` of fresh anonymous memory, 2 MiB aligned, advised huge pages.

    The array keeps its mapping alive; the pages are faulted in (zeroed) on first touch.
    """
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, np.uint8)
    skip = (-raw.ctypes.data) % HUGE_PAGE
    m.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
    return raw[skip:skip + nbytes]


def empty(queue: Any, shape: tuple, dtype: Any) -> Any:
    """An uninitialised ``pyopencl.array.Array`` for a page pool on ``queue``'s device.

    Parameters
    ----------
    queue : pyopencl.CommandQueue
    shape : tuple of int
    dtype : numpy dtype

    Returns
    -------
    pyopencl.array.Array
        In huge pages of host memory (``CL_MEM_USE_HOST_PTR``) where
        :func:`wants_huge_pages` and the pool holds at least one huge page, else
        ``pyopencl.array.empty``.
    """
    cl = runtime.cl()
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < HUGE_PAGE or not wants_huge_pages(queue.device):
        return cl.array.empty(queue, shape, dtype)
    try:
        host = huge_page_bytes(nbytes)
    except (OSError, ValueError):  # no such mapping here: the device's own memory
        return cl.array.empty(queue, shape, dtype)
    flags = cl.mem_flags.READ_WRITE | cl.mem_flags.USE_HOST_PTR
    buf = cl.Buffer(queue.context, flags, hostbuf=host)
    # The buffer holds `host` until it is released, but the device may still read the
    # memory then (a released buffer lives on while commands use it), and dropping `host`
    # unmaps it. So before `host` goes, its queue finishes (the callback runs as `host` is
    # freed, before its mapping is). Work on other queues must end before the pool is
    # dropped, as for any buffer over host memory.
    done = weakref.finalize(host, _finish_quietly, queue)
    done.atexit = False
    return cl.array.Array(queue, shape, dtype, data=buf)


def _finish_quietly(queue: Any) -> None:
    """Wait for ``queue`` (a finalizer: any error is dropped, the queue may be gone)."""
    try:
        queue.finish()
    except Exception:  # noqa: BLE001 - nothing to report to at this point
        pass
