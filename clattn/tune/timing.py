"""One timing helper and one table printer, shared by ``clattn tune`` and ``tools/bench.py``.

:func:`sample` runs one or more calls round-robin (so background load hits them alike):
warm-up calls first, never counted, then timed runs until a run count or a time budget is
reached. A call returns a mapping of named seconds (for a kernel: :func:`event_seconds` of
the events it enqueued; for host code: a ``perf_counter`` difference). :class:`Samples`
keeps every timed value; compare medians with medians and bests with bests.

:func:`table` prints rows as an aligned text table or as Markdown.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Container, Iterable, Mapping, Sequence

#: a call under :func:`sample`: returns named seconds, e.g. ``{"kernel": 1.2e-3}``
Timed = Callable[[], Mapping[str, float]]


def event_seconds(events: Iterable[Any]) -> float:
    """Summed device time (``END - START``) of OpenCL profiling events.

    Parameters
    ----------
    events : iterable of pyopencl.Event or None
        Events of one call (e.g. a decode result's ``.events``); None entries are skipped.
        Each is waited for.

    Returns
    -------
    float
        Seconds, host overhead and gaps between the kernels excluded.
    """
    total = 0.0
    for evt in events:
        if evt is None:
            continue
        evt.wait()
        total += (evt.profile.end - evt.profile.start) * 1e-9
    return total


@dataclass(frozen=True)
class Samples:
    """The timed values of one quantity (warm-up runs excluded), in seconds."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median value."""
        return statistics.median(self.values)

    @property
    def best(self) -> float:
        """The smallest value."""
        return min(self.values)

    @property
    def runs(self) -> int:
        """How many timed values."""
        return len(self.values)


def sample(calls: Mapping[str, Timed], *, warmup: int = 1, min_runs: int = 3,
           max_runs: int = 100, seconds: float = 1.0, warmup_seconds: float = 0.0,
           observe: Callable[[str, Mapping[str, float], bool], None] | None = None,
           ) -> dict[str, dict[str, Samples]]:
    """Time several calls round-robin, warm-up runs kept out of the samples.

    Parameters
    ----------
    calls : mapping of str to callable
        Variant name -> a call returning named seconds (the same names every time).
    warmup : int
        Untimed runs of each call first (compiles, faults pages in); at least 1.
    warmup_seconds : float
        Then untimed rounds (round-robin) until this long has passed since the first
        warm-up run (a CPU device's first 0.25 s of back-to-back decode calls measured
        up to 2x slower than the rest).
    min_runs, max_runs : int
        Timed rounds: at least ``min_runs``, at most ``max_runs``.
    seconds : float
        Budget per variant: rounds stop once ``min_runs`` are done and
        ``seconds x len(calls)`` has passed.
    observe : callable, optional
        ``observe(variant, result, is_warmup)`` after every run; raise to stop early
        (the tuner prunes a slow candidate this way).

    Returns
    -------
    dict
        ``{variant: {name: Samples}}``.

    Examples
    --------
    >>> res = sample({"f": lambda: {"s": 1e-3}}, min_runs=3, max_runs=3)
    >>> res["f"]["s"].runs, res["f"]["s"].median
    (3, 0.001)
    """
    def run(name: str, warm: bool) -> Mapping[str, float]:
        result = calls[name]()
        if observe is not None:
            observe(name, result, warm)
        return result

    t0 = time.perf_counter()
    for name in calls:
        for _ in range(max(1, warmup)):
            run(name, True)
    while time.perf_counter() - t0 < warmup_seconds:
        for name in calls:
            run(name, True)
    runs: dict[str, list[Mapping[str, float]]] = {k: [] for k in calls}
    budget = seconds * max(1, len(calls))
    t0 = time.perf_counter()
    done = 0
    while done < max(1, max_runs) and (done < min_runs or time.perf_counter() - t0 < budget):
        for name in calls:
            runs[name].append(run(name, False))
        done += 1
    return {name: {key: Samples(tuple(float(r[key]) for r in rs)) for key in rs[0]}
            for name, rs in runs.items()}


def cell(value: Any, spec: str = "") -> str:
    """One table cell: ``-`` for None, strings as they are, numbers by ``spec``."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def table(head: Sequence[str], rows: Sequence[Sequence[str]], *, right: Container[int] = (),
          markdown: bool = False, indent: str = "  ") -> list[str]:
    """Lines of a table: aligned text (``indent`` first) or Markdown.

    Parameters
    ----------
    head : sequence of str
        Column titles.
    rows : sequence of sequences of str
        Cells, already formatted (see :func:`cell`).
    right : container of int
        Right-aligned columns (numbers).
    markdown : bool
        Markdown (``| a | b |`` with an alignment row) instead of aligned text.
    indent : str
        Prefix of every text line.

    Examples
    --------
    >>> print("\\n".join(table(["x", "ms"], [["a", "1.5"]], right={1}, markdown=True)))
    | x | ms |
    |---|---:|
    | a | 1.5 |
    """
    if markdown:
        sep = "|" + "|".join("---:" if i in right else "---" for i in range(len(head))) + "|"
        return (["| " + " | ".join(head) + " |", sep]
                + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]

    def line(r: Sequence[str]) -> str:
        return indent + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                  for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [line(head)] + [line(r) for r in rows]


def first_line(exc: BaseException, n: int = 160) -> str:
    """``Type: message`` of an exception, its first non-empty line, at most ``n`` characters."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(exc).__name__
    return line if len(line) <= n else line[: n - 3] + "..."


__all__ = ["Samples", "Timed", "cell", "event_seconds", "first_line", "sample", "table"]
