"""The time budget of one ``clattn tune`` run: the whole run's clock and each step's share.

``--budget`` is the wall time of the whole run. :class:`RunClock` measures it from the
start; the steps take their shares in order:

1. the **ceilings** get ``ceiling_share`` of the budget: their working sets are capped at
   what the device fills in that time (:func:`ceiling_bytes`; the fill of a buffer past
   every cache is most of a bandwidth ceiling's cost on a CPU device);
2. the **correctness checks** of the registry's profile run in full (never cut short:
   nothing is tuned or saved on a device that computes wrong answers); their time is
   measured, and the same again is kept for the winner's checks;
3. the **tuning** gets what is left (:func:`stage_budgets`): ``prefill_share`` of it is
   the prefill stage's floor, the decode stage stops at the rest, and the prefill stage
   gets the larger of its floor and what the decode stage left (:func:`prefill_budget`).

A budget that cannot be met (a compiler slower than the budget, say) is overrun only by
work no answer can do without: the correctness checks, and the default profile timed on
one shape of each stage. The report says where the time went.
"""
from __future__ import annotations

import math
import time
from typing import Callable

#: a clock: seconds from an arbitrary origin (``time.perf_counter``; tests pass a fake)
Clock = Callable[[], float]
#: filling a bandwidth ceiling's working set takes about this fraction of its time (the
#: timed launches read it at 10-40x the fill rate): its cap is the fill rate x its time / this
CEILING_FILL_PARTS = 3
#: parts of the ceilings' time: read, copy, transfers (launch latency and the
#: multiply-add peak take a fixed few tenths of a second)
CEILING_PARTS = 3


class RunClock:
    """The whole run's wall time against its budget.

    Parameters
    ----------
    budget_s : float
        Seconds the run may take (``math.inf``: no budget).
    clock : callable
        Seconds from an arbitrary origin (default ``time.perf_counter``).
    """

    def __init__(self, budget_s: float, clock: Clock = time.perf_counter) -> None:
        self.budget_s = budget_s
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        """Seconds since the start."""
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds of the budget left (0 once spent; ``inf`` without a budget)."""
        return max(0.0, self.budget_s - self.elapsed())


def ceiling_bytes(fill_rate: float | None, seconds: float) -> int | None:
    """The largest working set of one bandwidth ceiling that fits ``seconds`` for all
    the ceilings (None: no cap, for an unknown fill rate or no budget).

    Parameters
    ----------
    fill_rate : float or None
        Bytes per second the device fills a new buffer at (:func:`clattn.tune.ceilings.fill_rate`).
    seconds : float
        The ceilings' share of the budget.

    Examples
    --------
    >>> ceiling_bytes(480e6, 3.0) // 2**20
    152
    """
    if not fill_rate or not math.isfinite(seconds):
        return None
    return max(1, int(fill_rate * seconds / (CEILING_PARTS * CEILING_FILL_PARTS)))


def stage_budgets(left_s: float, reserve_s: float, prefill_share: float
                  ) -> tuple[float, float, float]:
    """The tuning stages' budgets from what the run has left.

    Parameters
    ----------
    left_s : float
        Seconds of the run's budget left when tuning starts (``inf``: no budget).
    reserve_s : float
        Seconds kept for what runs after tuning (the winner's correctness checks).
    prefill_share : float
        The prefill stage's floor, as a fraction of the tuning time.

    Returns
    -------
    (tuning_s, decode_s, prefill_floor_s)
        The tuning time (never negative), the decode stage's budget and the prefill
        stage's floor; all ``inf`` without a budget.

    Examples
    --------
    >>> stage_budgets(100.0, 20.0, 0.25)
    (80.0, 60.0, 20.0)
    """
    if not math.isfinite(left_s):
        return math.inf, math.inf, math.inf
    tuning = max(0.0, left_s - reserve_s)
    floor = tuning * prefill_share
    return tuning, tuning - floor, floor


def prefill_budget(tuning_s: float, floor_s: float, decode_elapsed_s: float) -> float:
    """The prefill stage's budget: what the decode stage left of ``tuning_s``, never
    less than ``floor_s``.

    Examples
    --------
    >>> prefill_budget(80.0, 20.0, 75.0), prefill_budget(80.0, 20.0, 30.0)
    (20.0, 50.0)
    """
    if not math.isfinite(tuning_s):
        return math.inf
    return max(floor_s, tuning_s - decode_elapsed_s)


__all__ = ["CEILING_FILL_PARTS", "CEILING_PARTS", "Clock", "RunClock", "ceiling_bytes",
           "prefill_budget", "stage_budgets"]
