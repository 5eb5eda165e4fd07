"""The time budget of one ``clattn tune`` run: the whole run's clock and each step's share.

``--budget`` is the wall time of the whole run. :class:`RunClock` measures it from the
start; the steps take their shares in order:

1. the **ceilings** get ``ceiling_share`` of the budget: their working sets are capped at
   what the device fills in that time (:func:`ceiling_bytes`; the fill of a buffer past
   every cache is most of a bandwidth ceiling's cost on a CPU device);
2. the **correctness checks** of the registry's profile run in full (never cut short:
   nothing is tuned or saved on a device that computes wrong answers); their seconds and
   the programs they built (:class:`ChecksCost`) are kept, and their seconds reserved for
   the tuned profile's checks;
3. the **decode stage** stops at ``1 - prefill_share`` of what is left
   (:func:`stage_budgets`), less what the tuned profile's checks should take beyond the
   reserve once the tuner has built new kernels (:meth:`ChecksCost.estimate`: the set's
   programs x what a new program cost the tuner to build and verify);
4. the **tuned profile's checks** (the decode stage's winner with the registry's prefill
   fields) run next, one kernel's group at a time while the run has time for it; a winner
   whose checks do not fit is dropped (the profile checked in step 2 is kept);
5. the **prefill stage** gets what the run has left less the final checks' reserve
   (:func:`prefill_budget`);
6. the **final checks**: the whole set again when the prefill stage's winner differs
   from the profile checked last (its kernels are built by then: the registry's checks'
   seconds bound them).

A budget that cannot be met (a compiler slower than the budget, say) is overrun only by
work no answer can do without: the registry profile's correctness checks, each stage's
default timed on its first shape (the prefill stage's: on each of its few shapes), and
one kernel's build, checks or re-timing that started in time. The report says where the
time went.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
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
        Seconds kept for the tuned profile's correctness checks.
    prefill_share : float
        The share of the tuning time kept for the prefill stage (the decode stage stops
        at the rest).

    Returns
    -------
    (tuning_s, decode_s, prefill_s)
        The tuning time (never negative), the decode stage's budget and the prefill
        stage's share; all ``inf`` without a budget.

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


def prefill_budget(run_left_s: float, final_s: float) -> float:
    """The prefill stage's budget: what the run has left less ``final_s`` (kept for the
    final checks), never negative (``inf`` without a budget).

    Examples
    --------
    >>> prefill_budget(12.0, 2.0), prefill_budget(1.0, 2.0)
    (10.0, 0.0)
    """
    if not math.isfinite(run_left_s):
        return math.inf
    return max(0.0, run_left_s - final_s)


@dataclass(frozen=True)
class ChecksCost:
    """What the correctness set cost on the registry's profile: its seconds and the
    programs it built (the difference of ``clattn.runtime.Runtime.programs_built``).

    Parameters
    ----------
    seconds : float
    programs : int
    """

    seconds: float
    programs: int

    def estimate(self, per_program_s: float | None = None) -> float:
        """Seconds the set should take on a profile whose kernels are all new: its
        programs x ``per_program_s`` (what a new program cost the tuner to build and
        verify; None: not measured), never less than :attr:`seconds`.

        Examples
        --------
        >>> cost = ChecksCost(1.0, 12)
        >>> cost.estimate(), cost.estimate(0.05), cost.estimate(0.5)
        (1.0, 1.0, 6.0)
        """
        if not per_program_s:
            return self.seconds
        return max(self.seconds, self.programs * per_program_s)


__all__ = ["CEILING_FILL_PARTS", "CEILING_PARTS", "ChecksCost", "Clock", "RunClock",
           "ceiling_bytes", "prefill_budget", "stage_budgets"]
