"""``clattn tune``: what a device can do, whether clattn is right on it, and its best profile.

The tool around the core, never imported by it. Modules, in import order:

* :mod:`~clattn.tune.timing`: the one timing helper (event times, warm-up kept out) and
  the one table printer, shared with ``tools/bench.py``;
* :mod:`~clattn.tune.budget`: the run's time budget and each step's share of it;
* :mod:`~clattn.tune.ceilings`: read/copy bandwidth past every cache, launch latency,
  transfers, the f32 multiply-add peak;
* :mod:`~clattn.tune.roofline`: the roofline bound of a decode call from the ceilings;
* :mod:`~clattn.tune.workloads`: model shapes, page pools and rotating page sets;
* :mod:`~clattn.tune.checks`: the correctness set against the CPU backend (decode, f16
  and quantized pages, prefill, merges);
* :mod:`~clattn.tune.search`: the search space and the tuner (the decode stage, and the
  coordinate search both stages share);
* :mod:`~clattn.tune.prefill_search`: the prefill stage's space and tuner;
* :mod:`~clattn.tune.report`: the report as typed data, its text, JSON and plot;
* :mod:`~clattn.tune.session`: one run, step by step;
* :mod:`~clattn.tune.command`: the ``clattn tune`` command line (alias ``clattn profile``).
"""
from . import (
    budget,
    ceilings,
    checks,
    command,
    prefill_search,
    report,
    roofline,
    search,
    session,
    timing,
    workloads,
)
from .checks import Check, correctness
from .report import Report, format_report, plot_report
from .search import Settings, Tuner
from .session import tune_device

__all__ = ["Check", "Report", "Settings", "Tuner", "budget", "ceilings", "checks", "command",
           "correctness", "format_report", "plot_report", "prefill_search", "report", "roofline",
           "search", "session", "timing", "tune_device", "workloads"]
