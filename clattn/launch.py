"""Kernel arguments described once, and the one way a clattn kernel is launched.

Each kernel has one :class:`ArgTable`: an ordered list of :class:`Buffer` (a ``__global``
pointer, usually followed by its element offset, as pyopencl's ``VectorArg(...,
with_offset=True)``) and :class:`Scalar` arguments. The template renders its parameter
list and the pointer fix-up from the table (:meth:`ArgTable.signature`,
:meth:`ArgTable.fixup`); :class:`Launcher` sets the arguments by name from the same
table, so the signature and the launch cannot drift apart.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

# importing does not enumerate platforms: clattn.runtime's ICD set-up still applies
import pyopencl as cl

#: numpy dtype of each scalar C type a table may use
SCALAR_DTYPES = {"int": np.int32, "uint": np.uint32, "long": np.int64, "ulong": np.uint64,
                 "float": np.float32}
_OFFSET_LIMITS = {"int": 2**31 - 1, "ulong": 2**63 - 1}
#: host-order packing of each scalar C type (kernel arguments are host values)
_PACK = {"int": struct.Struct("=i").pack, "uint": struct.Struct("=I").pack,
         "long": struct.Struct("=q").pack, "ulong": struct.Struct("=Q").pack,
         "float": struct.Struct("=f").pack}
# pyopencl's own invokers set scalars from packed bytes (0.3 us); its public set_arg
# with a numpy scalar costs 15 us. Use the fast entry where this pyopencl has it.
_SET_BYTES = getattr(cl.Kernel, "_set_arg_buf", None)
_UNSET = object()  # no argument of that name set yet


@dataclass(frozen=True)
class Buffer:
    """A ``__global`` pointer argument ``name`` to elements of C type ``ctype``.

    ``offset`` is the C type of the element-offset argument that follows it
    (``"int"``, ``"ulong"``) or None for a buffer always passed from its start.
    ``const`` marks a read-only argument.
    """

    name: str
    ctype: str
    const: bool = True
    offset: str | None = "int"

    @property
    def offset_name(self) -> str:
        return f"{self.name}_off"


@dataclass(frozen=True)
class Scalar:
    """A by-value argument ``name`` of C type ``ctype`` (a key of :data:`SCALAR_DTYPES`)."""

    name: str
    ctype: str

    def __post_init__(self) -> None:
        if self.ctype not in SCALAR_DTYPES:
            raise ValueError(f"scalar {self.name}: C type {self.ctype!r} not in "
                             f"{sorted(SCALAR_DTYPES)}")


class ArgTable:
    """The ordered arguments of one kernel (the single source of its signature)."""

    def __init__(self, kernel: str, args: Iterable[Buffer | Scalar]) -> None:
        self.kernel = kernel
        self.args = tuple(args)
        names = [a.name for a in self.args] + [a.offset_name for a in self.args
                                               if isinstance(a, Buffer) and a.offset]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"{kernel}: argument names used twice: {sorted(dup)}")
        self.names = frozenset(a.name for a in self.args)
        self.positions: dict[str, int] = {}  # name -> index of its OpenCL argument
        i = 0
        for a in self.args:
            self.positions[a.name] = i
            i += 2 if isinstance(a, Buffer) and a.offset else 1
        self.by_name = {a.name: a for a in self.args}

    def signature(self) -> str:
        """The C parameter list (without parentheses)."""
        parts = []
        for a in self.args:
            if isinstance(a, Buffer):
                parts.append(f"{'const ' if a.const else ''}__global {a.ctype}* {a.name}")
                if a.offset:
                    parts.append(f"const {a.offset} {a.offset_name}")
            else:
                parts.append(f"const {a.ctype} {a.name}")
        return ", ".join(parts)

    def fixup(self) -> str:
        """C statements that move every offset pointer to its first element."""
        return " ".join(f"{a.name} += {a.offset_name};" for a in self.args
                        if isinstance(a, Buffer) and a.offset)

    def scalar_dtypes(self) -> list:
        """Per OpenCL argument: the numpy dtype of a scalar, None for a buffer."""
        out: list = []
        for a in self.args:
            if isinstance(a, Buffer):
                out.append(None)
                if a.offset:
                    out.append(SCALAR_DTYPES[a.offset])
            else:
                out.append(SCALAR_DTYPES[a.ctype])
        return out

    def values(self, named: Mapping[str, Any], dummy: Any) -> list:
        """The positional argument list from ``named`` (every argument, by name).

        A buffer is given as a pyopencl array (its view offset becomes the offset
        argument), a ``(cl.Buffer, element offset)`` pair, a bare ``cl.Buffer`` or None
        (``dummy``, never read by the kernel).
        """
        if len(named) != len(self.names) or not self.names.issuperset(named):
            missing = self.names - set(named)
            extra = set(named) - self.names
            raise TypeError(f"{self.kernel}: arguments missing {sorted(missing)}, "
                            f"unknown {sorted(extra)}")
        out: list = []
        for a in self.args:
            v = named[a.name]
            if a.__class__ is Scalar:
                out.append(v)
                continue
            if v is None:
                out.append(dummy)
                if a.offset:
                    out.append(0)
                continue
            buf, off = _buffer_and_offset(a, v, dummy)
            out.append(buf)
            if a.offset:
                out.append(off)
            elif off:
                raise ValueError(f"{self.kernel}: {a.name} is passed from its start, got a view "
                                 f"{off} elements in")
        return out


def _buffer_and_offset(arg: Buffer, v: Any, dummy: Any) -> tuple[Any, int]:
    if v is None:
        return dummy, 0
    if isinstance(v, tuple):
        return v[0], int(v[1])
    if hasattr(v, "base_data"):  # a pyopencl array (views included)
        if v.base_data is None:  # zero-size: no buffer, nothing read
            return dummy, 0
        if not v.offset:
            return v.base_data, 0
        item = v.dtype.itemsize
        if v.offset % item:
            raise ValueError(f"{arg.name}: the array view starts {v.offset} bytes into its "
                             f"buffer, not a whole number of {item}-byte elements")
        off = v.offset // item
        limit = _OFFSET_LIMITS.get(arg.offset or "int", 0)
        if off > limit:
            raise ValueError(f"{arg.name}: the array view starts {off} elements into its "
                             f"buffer; views beyond {limit} elements are not supported: "
                             f"pass an array nearer the start of its buffer")
        return v.base_data, off
    return v, 0


class Launcher:
    """A built kernel with its table: set arguments by name and enqueue, atomically.

    One pyopencl ``Kernel`` object holds one set of arguments, so setting them and
    enqueueing is done under a lock: launches from several threads never mix.
    """

    def __init__(self, program: Any, table: ArgTable, dummy: Any) -> None:
        self.table = table
        self.program = program
        self.kernel = cl.Kernel(program, table.kernel)
        self.kernel.set_scalar_arg_dtypes(table.scalar_dtypes())
        self._dummy = dummy
        self._lock = threading.Lock()

    def __call__(self, queue: Any, global_size: Sequence[int], local_size: Sequence[int] | None,
                 wait_for: list | None = None, **named: Any) -> Any:
        """Enqueue with every argument given by name; returns the event."""
        args = self.table.values(named, self._dummy)
        with self._lock:
            return self.kernel(queue, tuple(global_size),
                               None if local_size is None else tuple(local_size), *args,
                               wait_for=wait_for or None)

    def bind(self, **named: Any) -> "BoundKernel":
        """A private kernel object with every argument set now; change a few per launch."""
        return BoundKernel(self, named)

    def work_group_size(self, device: Any) -> int | None:
        """CL_KERNEL_WORK_GROUP_SIZE of the built kernel (None if the driver cannot say)."""
        try:
            return int(self.kernel.get_work_group_info(
                cl.kernel_work_group_info.WORK_GROUP_SIZE, device))
        except Exception:  # noqa: BLE001 - a driver without the query
            return None


class BoundKernel:
    """A kernel object of its own with its arguments kept set between launches.

    For a call repeated with mostly the same arguments (one decode step, every
    layer): :meth:`launch` sets only the arguments named in it, then enqueues. Not
    shared between threads unless the caller holds :attr:`lock`.
    """

    def __init__(self, launcher: Launcher, named: Mapping[str, Any]) -> None:
        self.table = launcher.table
        self._dummy = launcher._dummy
        self.kernel = cl.Kernel(launcher.program, self.table.kernel)
        self.kernel.set_scalar_arg_dtypes(self.table.scalar_dtypes())
        self.kernel.set_args(*self.table.values(named, self._dummy))
        # what each argument was last set from: the caller's object (a kernel object does
        # not keep its buffers alive: they are held here while set), and for buffers the
        # (buffer, offset) it resolved to, so that a launch sets only what changed
        self._refs = dict(named)
        self._set = {k: _buffer_and_offset(self.table.by_name[k], v, self._dummy)
                     for k, v in named.items() if self.table.by_name[k].__class__ is Buffer}
        self.lock = threading.Lock()

    def rebound(self, launcher: Launcher) -> "BoundKernel":
        """A bound kernel of ``launcher`` (a build of the same argument table) holding
        every argument this one holds now."""
        if launcher.table is not self.table:
            raise ValueError(f"rebound: {launcher.table.kernel}'s arguments are not "
                             f"{self.table.kernel}'s")
        with self.lock:
            return BoundKernel(launcher, self._refs)

    def set(self, **named: Any) -> None:
        """Set some arguments by name (buffers as in :meth:`ArgTable.values`); an argument
        equal to what it holds already (the same array object, the same buffer and offset,
        an equal scalar) is not set again."""
        self._set_named(named)

    def _set_named(self, named: Mapping[str, Any]) -> None:
        pos, by_name, k = self.table.positions, self.table.by_name, self.kernel
        refs, done = self._refs, self._set
        for name, v in named.items():
            if refs.get(name, _UNSET) is v:
                continue  # the same object (or None again): set already
            a = by_name[name]
            i = pos[name]
            if a.__class__ is Scalar:
                if refs.get(name) == v:
                    continue
                _set_scalar(k, i, a.ctype, v)
                refs[name] = v
                continue
            buf, off = _buffer_and_offset(a, v, self._dummy)  # may refuse v: nothing set
            refs[name] = v
            last = done[name]
            if last[0] is buf and last[1] == off:
                continue
            done[name] = (buf, off)
            if last[0] is not buf:
                k.set_arg(i, buf)
            if a.offset and last[1] != off:  # views of one buffer: the offset alone
                _set_scalar(k, i + 1, a.offset, off)

    def launch(self, queue: Any, global_size: tuple, local_size: tuple | None,
               wait_for: list | None = None, **named: Any) -> Any:
        """Set ``named`` and enqueue; returns the event."""
        with self.lock:
            if named:
                self._set_named(named)
            return cl.enqueue_nd_range_kernel(queue, self.kernel, global_size, local_size,
                                              wait_for=wait_for or None)


def _set_scalar(kernel: Any, index: int, ctype: str, value: Any) -> None:
    if _SET_BYTES is not None:
        _SET_BYTES(kernel, index, _PACK[ctype](value))
    else:
        kernel.set_arg(index, SCALAR_DTYPES[ctype](value))
