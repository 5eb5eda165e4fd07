"""One ``clattn tune`` run on one device: device, ceilings, correctness, tuning, the winner's
checks.

1. **Device**: the properties that matter and the profile the registry gives it, with the rule.
2. **Ceilings** (:mod:`clattn.tune.ceilings`): streaming read and copy bandwidth past every
   cache, launch latency, host<->device transfers, the f32 multiply-add peak.
3. **Correctness** (:mod:`clattn.tune.checks`) of the device's current profile: decode (f16,
   f32, quantized pages), prefill, merges; and the pool bytes per token of each page format.
4. **Tuning**, only when every check passed: decode (:mod:`clattn.tune.search`), in
   ``settings.decode_budget_s``, then prefill (:mod:`clattn.tune.prefill_search`) from
   the decode winner, in what is left of the budget.
5. **The winner's correctness**: the full set again with the tuned profile, unless it is
   the profile already checked.
"""
from __future__ import annotations

import datetime as _dt
import time
from typing import Any, Callable

from .. import runtime
from ..device_fit import report_fit
from ..profiles import device_info, match
from . import ceilings
from .checks import correctness, kv_bytes
from .prefill_search import PrefillTuner, prefill_default
from .report import CeilingsResult, ProfileChoice, Report
from .search import Progress, Settings, Tuner
from .timing import first_line


def measure_ceilings(rt: Any, settings: Settings) -> CeilingsResult:
    """Read, copy, launch latency, transfers and the multiply-add peak; one that fails is
    reported, not raised."""
    res = CeilingsResult()
    target, widths = settings.ceiling_target_s, settings.ceiling_widths
    jobs: list[tuple[str, Callable[[], Any]]] = [
        ("read", lambda: ceilings.read_bandwidth(rt, None, target, widths=widths)),
        ("copy", lambda: ceilings.copy_bandwidth(rt, None, target, widths=widths)),
        ("launch", lambda: ceilings.launch_latency(rt, max(target, 0.05))),
        ("transfer", lambda: ceilings.transfer_bandwidth(
            rt, max(ceilings.sizing(rt.device).working_set_bytes // 4, 1 << 20), target)),
        ("fma", lambda: ceilings.fma_peak(rt, target)),
    ]
    for name, job in jobs:
        try:
            setattr(res, name, job())
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - a ceiling that cannot be measured is reported
            res.errors[name] = first_line(exc)
    return res


def _choice(m: Any, info: dict) -> ProfileChoice:
    fit = report_fit(m.profile, info)
    return ProfileChoice(m.profile.name, m.level, m.rule, fit.notes, fit.profile)


def _tune_prefill(rt: Any, info: dict, decoded: Any, builtin: Any, settings: Settings,
                 budget_s: float, progress: bool, say: Callable[[str], None]) -> Any:
    """The prefill stage from the decode stage's winner ``decoded``: the default has the
    registry's prefill fields (``builtin``'s), ``decoded``'s own (a user profile's) are a
    seed."""
    say(f"tuning prefill (budget {budget_s:.0f} s)...")
    base = prefill_default(decoded, builtin)
    seeds = ((decoded, "current"),) if decoded != base else ()
    prog = Progress(budget_s, enabled=progress)
    try:
        return PrefillTuner(rt, info, base, settings, prog, budget_s, seeds).run()
    finally:
        prog.done()


def tune_device(device: Any, settings: Settings, *, progress: bool = True,
                log: Callable[[str], None] | None = None) -> Report:
    """Run every step on ``device``.

    Parameters
    ----------
    device : pyopencl.Device
    settings : Settings
    progress : bool
        Draw the tuner's progress line on stderr.
    log : callable, optional
        Called with one line per step.

    Returns
    -------
    Report
    """
    say = log or (lambda text: None)
    t_start = time.perf_counter()
    rt = runtime.Runtime.for_device(device)
    info = device_info(device)
    current, builtin = _choice(match(info), info), _choice(match(info, user=False), info)
    say(f"device: {info.get('device_name')} ({info.get('platform_name')}); profile "
        f"{current.name} [{current.level}]")
    steps: dict[str, float] = {}

    say("measuring ceilings (read, copy, launch latency, transfers, multiply-add peak)...")
    t = time.perf_counter()
    ceil = measure_ceilings(rt, settings)
    steps["ceilings"] = time.perf_counter() - t

    say("checking correctness against the CPU backend...")
    t = time.perf_counter()
    checks = correctness(device, profile=current.profile)
    steps["correctness"] = time.perf_counter() - t
    rep = Report(_dt.datetime.now().astimezone().isoformat(timespec="seconds"), settings.mode,
                 info, current, builtin, ceil, checks, step_seconds=steps, kv_bytes=kv_bytes())
    if not rep.correctness_passed:
        rep.tuning_note = "skipped: correctness failed"
    else:
        say(f"tuning ({settings.mode}, budget {settings.budget_s:.0f} s)...")
        prog = Progress(settings.decode_budget_s, enabled=progress)
        seeds = [(current.profile, f"current ({current.level})")] \
            if current.profile != builtin.profile else []
        try:
            rep.tuning = Tuner(rt, info, builtin.profile, settings, prog, seeds).run()
        finally:
            prog.done()
        steps["tuning"] = rep.tuning.elapsed_s
        if rep.tuning.chosen is not None:
            rep.prefill = _tune_prefill(rt, info, rep.tuning.chosen.profile, builtin.profile,
                                        settings, settings.budget_s - rep.tuning.elapsed_s,
                                        progress, say)
            steps["prefill tuning"] = rep.prefill.elapsed_s
        if rep.chosen is not None and rep.chosen != current.profile:
            say("checking the tuned profile's correctness...")
            t = time.perf_counter()
            rep.winner_checks = correctness(device, profile=rep.chosen)
            steps["tuned correctness"] = time.perf_counter() - t
    rep.elapsed_s = time.perf_counter() - t_start
    return rep


__all__ = ["measure_ceilings", "tune_device"]
