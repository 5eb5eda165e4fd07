"""The one device-call path: inputs to the device, outputs allocated, results back.

A :class:`Call` collects, for one API call, every device array the launch touches (so
their pending events gate it), uploads numpy inputs, allocates the outputs the caller
did not pass, and at the end attaches the launch's events to the outputs and copies
back into numpy ``out=``/``lse=`` arrays (then the call waits).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import runtime
from .validate import is_host


class Call:
    """The arrays of one device call on ``rt`` (a :class:`clattn.runtime.Runtime`)."""

    def __init__(self, rt: Any, queue: Any = None, wait_for: Sequence | None = None) -> None:
        self.rt = rt
        if queue is not None and queue.context != rt.context:
            raise ValueError(f"queue: belongs to another OpenCL context than this call's device "
                             f"({rt.device.name!r}); pass a queue of that context")
        self.queue = queue or rt.queue
        self._waits = list(wait_for or [])
        self._used: list = []
        self._host_outs: list = []  # (device array, numpy target)

    def input(self, name: str, a: Any) -> Any:
        """``a`` on the device (uploaded if numpy; None stays None)."""
        if a is None:
            return None
        if is_host(a):
            d = runtime.cl().array.to_device(self.queue, np.ascontiguousarray(a))
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
        d = runtime.cl().array.empty(self.queue, shape, dtype)
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
        given (the call waited), else the device arrays. With no events (nothing launched) host outputs are zeros.
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
        res = []
        for d in outputs:
            h = d.get(queue=self.queue) if last is not None else np.zeros(d.shape, d.dtype)
            t = targets.get(id(d))
            if t is not None:
                t[...] = h
                h = t
            res.append(h)
        return res
