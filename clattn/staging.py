"""The one device-call path: inputs to the device, outputs allocated, results back.

A :class:`Call` collects, for one API call, every device array the launch touches (so
their pending events gate it), uploads numpy inputs, allocates the outputs the caller
did not pass, and at the end attaches the launch's events to the outputs and copies
back into numpy ``out=``/``lse=`` arrays (then the call waits). The host-path helpers
of the decode and prefill calls live here too: the sink and table arguments uploaded
through a :class:`Call`, and the CPU backend's run of a call with its checks.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import runtime
from .validate import DecodeArgs, is_host


class Call:
    """The arrays of one device call on ``rt`` (a :class:`clattn.runtime.Runtime`)."""

    def __init__(self, rt: Any, queue: Any = None, wait_for: Sequence | None = None) -> None:
        self.rt = rt
        if queue is not None and not isinstance(queue, runtime.cl().CommandQueue):
            raise TypeError(f"queue: expected a pyopencl.CommandQueue or None, got "
                            f"{type(queue).__name__}")
        if queue is not None and queue.context != rt.context:
            raise ValueError(f"queue: belongs to another OpenCL context than this call's device "
                             f"({rt.device.name!r}); pass a queue of that context")
        self.queue = queue or rt.queue
        self._waits = events_list(wait_for, rt)
        self._used: list = []
        self._host_outs: list = []  # (device array, numpy target)

    def input(self, name: str, a: Any) -> Any:
        """``a`` on the device (uploaded if numpy; None stays None)."""
        if a is None:
            return None
        if is_host(a):
            try:
                d = runtime.cl().array.to_device(self.queue, np.ascontiguousarray(a))
            except runtime.cl().Error as exc:
                note_allocation(exc, name, a.nbytes, self.rt)
                raise
        else:
            if a.context != self.rt.context:
                raise ValueError(f"{name}: lives in another OpenCL context than this call's "
                                 f"device ({self.rt.device.name!r}); create it in "
                                 f"that device's context")
            d = a
        self._used.append(d)
        return d

    def output(self, name: str, given: Any, shape: tuple, dtype: Any) -> Any:
        """A device array to write: ``given`` if it is one, else a new array (copied
        back into ``given`` by :meth:`finish` when that is a numpy array)."""
        if given is not None and not is_host(given):
            return self.input(name, given)
        try:
            d = runtime.cl().array.empty(self.queue, shape, dtype)
        except runtime.cl().Error as exc:
            note_allocation(exc, name, int(np.prod(shape)) * np.dtype(dtype).itemsize, self.rt)
            raise
        self._used.append(d)
        if given is not None:
            self._host_outs.append((d, given))
        return d

    def wait_list(self, *extra: Any) -> list:
        """Every event the launch must wait for: the caller's, the arrays', ``extra``."""
        return self._waits + [e for a in self._used for e in (a.events or [])] + \
            [e for e in extra if e is not None]

    def finish(self, outputs: Sequence[Any], events: Sequence[Any],
               host: bool) -> list:
        """Attach the last event to ``outputs``; copy back into numpy targets.

        Returns the outputs as numpy arrays when ``host`` or when a numpy target was
        given (the call waited), else the device arrays. With no events (nothing
        launched) host outputs are zeros.
        """
        last = events[-1] if events else None
        if last is not None:
            # the launch waited for every earlier event of the outputs, so the last
            # event stands for all of them (add_event would block on old ones instead)
            for d in outputs:
                d.events[:] = [last]
        targets = {id(d): t for d, t in self._host_outs}
        if not (host or targets):
            return list(outputs)
        # every result copied back before any numpy target is written: a failed copy
        # leaves the caller's out=/lse= as they were, never half delivered
        fetched = [d.get(queue=self.queue) if last is not None else np.zeros(d.shape, d.dtype)
                   for d in outputs]
        res = []
        for d, h in zip(outputs, fetched):
            t = targets.get(id(d))
            if t is not None:
                t[...] = h
                h = t
            res.append(h)
        return res


def events_list(wait_for: Any, rt: Any = None) -> list:
    """``wait_for`` (None or an iterable of pyopencl events) as a list, checked before
    anything is enqueued: a ``TypeError`` naming it for anything but events, and, when
    the call launches on ``rt`` (a :class:`clattn.runtime.Runtime`; None: a host call,
    which only waits), a ``ValueError`` for an event of another context than ``rt``'s
    (a driver refuses to enqueue it: docs/contract.md section 10). Every public call
    taking ``wait_for`` checks it here."""
    if wait_for is None:
        return []
    cl = runtime.cl()
    try:
        waits = list(wait_for)
    except TypeError:
        raise TypeError(f"wait_for: expected a list of pyopencl events, got "
                        f"{type(wait_for).__name__}") from None
    for i, e in enumerate(waits):
        if not isinstance(e, cl.Event):
            raise TypeError(f"wait_for: expected pyopencl events, got {type(e).__name__} {e!r}")
        if rt is not None and _context_of(e) != rt.context:
            raise ValueError(f"wait_for[{i}]: an event of another OpenCL context than this "
                             f"call's device ({rt.device.name!r}); pass events of that "
                             f"device's context (wait for others with pyopencl.wait_for_events)")
    return waits


def _context_of(event: Any) -> Any:
    """``event``'s context, None when the driver cannot name it (Intel's runtime once the
    context's last Python reference is gone): never this call's context."""
    try:
        return event.context
    except runtime.cl().Error:
        return None


def note_allocation(exc: BaseException, what: str, nbytes: int, rt: Any) -> None:
    """Add to a driver's error (kept as it is) what clattn was putting on the device."""
    exc.add_note(f"clattn: allocating {what} ({nbytes} bytes) on {rt.device.name!r} failed")


def sink_args(call: Call, sink_logits: Any) -> dict:
    """The learned-sink arguments of the decode, merge and prefill kernels, by name
    (``sink_logits`` on the device, or None and the flag off)."""
    return dict(sink_logits=call.input("sink_logits", sink_logits),
                use_sinks=int(sink_logits is not None))


def upload_tables(call: Call, spec: Any, args: DecodeArgs, page_indptr: Any, page_indices: Any,
                  length_info: Any, window_offset: Any, sink_size: Any, q_pos: Any,
                  k_pos_offset: Any, rotary_mode: int) -> dict:
    """The decode kernel's table arguments by name, on the device."""
    named = dict(page_indptr=call.input("page_indptr", page_indptr),
                 page_indices=call.input("page_indices", page_indices),
                 num_pages=args.num_pages, nnz=args.nnz,
                 window_offset=None, sink_size=None, q_pos=None, k_pos_offset=None)
    if length_info is not None:
        packed = call.input("length_info", length_info)
        named["last_page_len"] = packed[0] if spec.sliding_window else packed
        if spec.sliding_window:  # rows 1 and 2 of the packed [3, B] table
            named["window_offset"], named["sink_size"] = packed[1], packed[2]
    else:
        named["last_page_len"] = call.input("last_page_len", args.last_page_len)
        if spec.sliding_window:
            named["window_offset"] = call.input("window_offset", window_offset)
            named["sink_size"] = call.input("sink_size", sink_size)
    if rotary_mode:
        named["q_pos"] = call.input("q_pos", q_pos)
        named["k_pos_offset"] = call.input("k_pos_offset", k_pos_offset)
    return named


def check_host_call(plan: Any, plan_type: type, planner: str, queue: Any,
                    wait_for: Any) -> None:
    """The arguments of a CPU-backend call that only a device call uses, checked as a
    device call checks them: a plan of the right kind or None (the host plans nothing), a
    pyopencl queue or None (device inputs are read on their own queues), and events,
    which are waited for before any input is read."""
    if plan is not None and not isinstance(plan, plan_type):
        raise TypeError(f"plan: expected a {plan_type.__name__} from {planner}, got "
                        f"{type(plan).__name__}")
    if queue is not None and not isinstance(queue, runtime.cl().CommandQueue):
        raise TypeError(f"queue: expected a pyopencl.CommandQueue or None, got "
                        f"{type(queue).__name__}")
    waits = events_list(wait_for)
    if waits:
        runtime.cl().wait_for_events(waits)


def run_on_host(fn: Any, spec: Any, arrays: tuple, kw: dict, out: Any,
                lse: Any) -> tuple:
    """The CPU backend's ``fn(spec, *arrays, **kw, out=, lse=)`` with device arrays fetched
    to the host; device ``out``/``lse`` are written back once the call succeeded."""
    host_kw = {k: (_host(v) if hasattr(v, "shape") else v) for k, v in kw.items()}
    o, s = fn(spec, *[_host(a) for a in arrays], **host_kw, out=_host(out), lse=_host(lse))
    for given, res in ((out, o), (lse, s)):
        if given is not None and not is_host(given):
            given.set(res)
    return o, s


def _host(a: Any) -> Any:
    """A device array fetched to the host; anything else, and a non-contiguous device
    array, as given (validation judges it)."""
    return a.get() if hasattr(a, "base_data") and a.flags.c_contiguous else a
