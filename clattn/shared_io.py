"""Host arrays a CPU device reads and writes in place: a region of fine-grained buffer SVM.

A one-token layer's host inputs (k, v, q) and outputs (out, lse) are a few KiB, and on a
CPU device each write or read command costs more than its bytes (PyPI's PoCL 40-50 us a
command, Intel's runtime 15-20 us; ``tools/RESULTS.md``, "Host arrays in shared
memory"). Where the device shares the host's memory at fine grain
(``CL_DEVICE_SVM_FINE_GRAIN_BUFFER``), the host copies the inputs into a shared region, the
kernel reads them and writes its results there, and the host copies the results out once
the launch's event is complete: the launch is the call's only command.

Rules:

* OpenCL 2.0's fine-grained buffer memory: what the host wrote before a launch is
  enqueued is visible to it, and what the kernel wrote is visible to the host once the
  launch's event is complete. Nothing else is relied on (no atomics, no concurrent use).
* The host writes the region only while no launch that reads or writes it is pending: a
  call through it returns once its launches are complete, so one region per cache serves
  every call.
* CPU devices only (:func:`shares_host_memory`): GPUs that offer fine-grained SVM (some
  with unified memory) have not been measured, and keep the write and read commands.
* Calls of more than :data:`MAX_SHARED_BYTES` keep the commands: there the bytes cost more
  than the commands, and a region keeps its largest size.
* A region's memory is freed (``clSVMFree``) when its owner is collected, the memory it
  had before each growth with it (kernel objects may still hold those pointers until their
  next launch sets new ones; a region grows at least twofold). No launch uses it then: the
  calls through it wait for theirs. Not on the queue: pyopencl's queue-bound free
  (``clEnqueueSVMFree``) corrupted the heap of the test process in 3 of 3 runs of the
  cache tests on this machine's CPU drivers; freeing at once, in none.
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from . import runtime

#: the largest call (inputs and outputs) a region takes; larger calls use write and read
#: commands
MAX_SHARED_BYTES = 1 << 20
#: every part of a region starts at a multiple of this many bytes (a cache line, and a
#: whole number of elements of any type a kernel reads)
REGION_ALIGN = 64


def shares_host_memory(device: Any) -> bool:
    """True for a CPU device whose driver offers fine-grained buffer SVM."""
    cl = runtime.cl()
    try:
        if not device.type & cl.device_type.CPU:
            return False
        caps = int(device.svm_capabilities)
    except (cl.Error, AttributeError, ValueError):  # OpenCL 1.x: no such query
        return False
    return bool(caps & cl.device_svm_capabilities.FINE_GRAIN_BUFFER)


def region_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`REGION_ALIGN`."""
    return -(-nbytes // REGION_ALIGN) * REGION_ALIGN


class SharedRegion:
    """One growing region of shared memory on a context: ``data`` (bytes, its host view)
    and ``arg`` (the kernel argument naming it).

    Parameters
    ----------
    context
        The pyopencl context.
    """

    def __init__(self, context: Any) -> None:
        self.context = context
        self.data: np.ndarray | None = None
        self.arg: Any = None
        self._frees: list = []  # one finalizer per allocation, run when this is collected

    def take(self, nbytes: int) -> "SharedRegion":
        """The region, grown to at least ``nbytes`` (its contents are then undefined)."""
        if self.data is None or self.data.nbytes < nbytes:
            cl = runtime.cl()
            flags = cl.svm_mem_flags.READ_WRITE | cl.svm_mem_flags.SVM_FINE_GRAIN_BUFFER
            size = max(nbytes, 2 * self.data.nbytes if self.data is not None else 1)
            data = cl.svm_empty(self.context, flags, (region_bytes(size),), np.uint8,
                                alignment=REGION_ALIGN)
            free = weakref.finalize(self, data.base.release)
            free.atexit = False  # at exit the process gives everything back
            self._frees.append(free)
            self.data, self.arg = data, cl.SVM(data)
        return self

    def view(self, dtype: Any, at: int, shape: tuple) -> np.ndarray:
        """The host view of ``shape`` ``dtype`` elements from byte ``at``."""
        dt = np.dtype(dtype)
        return self.data[at:at + math.prod(shape) * dt.itemsize].view(dt).reshape(shape)

    def operand(self, dtype: Any, at: int) -> tuple:
        """The kernel argument ``(pointer, element offset)`` of the region's part at byte
        ``at`` (a multiple of ``dtype``'s size)."""
        item = np.dtype(dtype).itemsize
        if at % item:
            raise ValueError(f"a shared region's part at byte {at} is not a whole number "
                             f"of {item}-byte elements in")
        return self.arg, at // item
