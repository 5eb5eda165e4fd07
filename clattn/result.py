"""The result of a decode call."""
from __future__ import annotations

from typing import Any


class DecodeResult(tuple):
    """``(out, lse, event)`` of one decode call.

    ``out [B, H_qo, D]``, ``lse [B, H_qo]`` (base 2, f32) and the event that completes
    them (None when nothing was launched, or on the CPU backend). ``events`` holds every
    event the call enqueued, in order: the decode kernel, then the merge of split
    partitions when the plan splits. Time a decode step with them.
    """

    out = property(lambda self: self[0], doc="attention output [B, H_qo, D]")
    lse = property(lambda self: self[1], doc="base-2 log-sum-exp [B, H_qo] (f32)")
    event = property(lambda self: self[2], doc="the last event of the call, or None")

    def __new__(cls, out: Any, lse: Any, event: Any = None,
                events: tuple = ()) -> "DecodeResult":
        self = super().__new__(cls, (out, lse, event))
        self.events = tuple(events) if events else ((event,) if event is not None else ())
        return self
