"""The result of an attention call: decode, prefill, a prepared step, the cache's attend."""
from __future__ import annotations

from typing import Any


class AttentionResult(tuple):
    """``(out, lse, event)`` of one attention call.

    ``out [N, H_qo, D]``, ``lse [N, H_qo]`` (base 2, f32), one row per query (a sequence's
    query in decode, a new token in prefill and in the cache), and the event that
    completes them (None when nothing was launched, or on the CPU backend). ``events``
    holds every event the call enqueued, in order: the decode kernel, then the merge of
    split partitions when the plan splits (a prefill: its one kernel). Time a step with
    them.
    """

    out = property(lambda self: self[0], doc="attention output [N, H_qo, D]")
    lse = property(lambda self: self[1], doc="base-2 log-sum-exp [N, H_qo] (f32)")
    event = property(lambda self: self[2], doc="the last event of the call, or None")

    def __new__(cls, out: Any, lse: Any, event: Any = None,
                events: tuple = ()) -> "AttentionResult":
        self = super().__new__(cls, (out, lse, event))
        self.events = tuple(events) if events else ((event,) if event is not None else ())
        return self


#: :class:`AttentionResult` under a second name (callers that import it by that name)
DecodeResult = AttentionResult
