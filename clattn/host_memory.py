"""KV page pools in the host's huge pages, for CPU OpenCL devices.

A CPU device's buffers are host memory in 4 KiB pages. A decode visits a sequence's KV pages
wherever they lie in the pool, a span of 2-8 KiB per KV head at a time. On a large pool
nearly every span is then also a TLB miss (a 2-vCPU Zen 4 VM with 4 KiB pages read random 2
KiB spans of a 1 GiB pool at 50-57% of its streaming read, and those of a 128 MiB pool at
about the full rate; ``tools/span_read.py``). Transparent huge pages (2 MiB) cover the same
pool with 512x fewer TLB entries. Neither PoCL nor Intel's CPU runtime asks for them, so
under the kernel's usual THP mode (``madvise``) their buffers get none. For a CPU device,
:func:`empty` allocates the pool as the device's own buffer, maps it once to learn where the
runtime put it (a CPU device maps a buffer in place), and advises huge pages for the 2 MiB
aligned part of that range before anything touches it. The decode runs 1.01-1.16x faster
on PoCL at 16k tokens and B = 8 (three models, f16 and f32), 1.11x at 64k tokens, and
1.02-1.10x on Intel's runtime (``tools/ab_decode.py --pools``; tools/RESULTS.md).

The memory stays the runtime's: it lives exactly as long as the buffer does, through every
queued command, mapping and sub-buffer. clattn never maps the memory itself and hands it
over with ``CL_MEM_USE_HOST_PTR``: a mapping or sub-buffer of the pool would then outlive
its memory, and exiting with work in flight would crash.

Other devices (GPUs, Oclgrind, which reports every device type), hosts without
``madvise(MADV_HUGEPAGE)`` and THP mode ``never`` get the plain ``pyopencl.array.empty``
without advice.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from typing import Any, Callable

import numpy as np

from . import runtime

#: where Linux states its transparent-huge-page mode
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
#: the huge page size advised ranges are aligned to (x86-64 and arm64 with 4 KiB base pages)
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
    """Whether :func:`empty` advises huge pages for ``device``'s pools.

    Only for a device that is a CPU and nothing else (Oclgrind reports every type), on a
    host with ``MADV_HUGEPAGE`` and a THP mode other than ``never``.
    """
    cl = runtime.cl()
    if int(getattr(device, "type", 0) or 0) != int(cl.device_type.CPU):
        return False
    mode = thp_mode() if mode is None else mode
    return hasattr(mmap, "MADV_HUGEPAGE") and mode in ("always", "madvise") \
        and _libc_madvise() is not None


@functools.lru_cache(maxsize=None)
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise(addr, length, advice)`` (None where there is no libc)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_page_range(address: int, nbytes: int) -> tuple[int, int]:
    """``(start, length)`` of the whole huge pages inside ``[address, address + nbytes)``
    (length 0 when none fits)."""
    lo = -(-address // HUGE_PAGE) * HUGE_PAGE
    hi = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return lo, max(0, hi - lo)


def advise_huge_pages(address: int, nbytes: int) -> int:
    """Advise huge pages for the whole huge pages inside ``[address, address + nbytes)``.

    Returns
    -------
    int
        The bytes advised: 0 when no huge page fits, or where the host has no
        ``madvise(MADV_HUGEPAGE)`` or refused it.
    """
    lo, length = huge_page_range(address, nbytes)
    fn = _libc_madvise()
    if not length or fn is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    return length if fn(lo, length, mmap.MADV_HUGEPAGE) == 0 else 0


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
        ``pyopencl.array.empty``; where :func:`wants_huge_pages` and the pool holds at
        least one huge page, its memory is advised huge pages before first use.
    """
    cl = runtime.cl()
    arr = cl.array.empty(queue, shape, np.dtype(dtype))
    if arr.nbytes < HUGE_PAGE or not wants_huge_pages(queue.device):
        return arr
    try:  # the pool is uninitialised: invalidating it costs no copy
        host, _ = cl.enqueue_map_buffer(queue, arr.base_data,
                                        cl.map_flags.WRITE_INVALIDATE_REGION, 0,
                                        (arr.nbytes,), np.uint8)
    except cl.Error:  # no such mapping here: the pool works, without the advice
        return arr
    try:
        advise_huge_pages(host.ctypes.data, arr.nbytes)
    finally:
        host.base.release(queue).wait()
    return arr
