"""One ``clattn tune`` run on one device: device, ceilings, correctness, tuning, the winner's
checks, in the run's time budget (:mod:`clattn.tune.budget`).

1. **Device**: the properties that matter and the profile the registry gives it, with the
   rule; the rate it fills a new buffer at (what the working sets below cost).
2. **Ceilings** (:mod:`clattn.tune.ceilings`): streaming read and copy bandwidth past every
   cache, launch latency, host<->device transfers, the f32 multiply-add peak; in
   ``settings.ceiling_share`` of the budget (the working sets capped to fit it, said).
3. **Correctness** (:mod:`clattn.tune.checks`) of the device's current profile: decode (f16,
   f32, quantized pages), prefill, merges; and the pool bytes per token of each page format.
4. **Tuning**, only when every check passed, in what is left less the time the checks
   took (kept for the winner's): decode (:mod:`clattn.tune.search`), then prefill
   (:mod:`clattn.tune.prefill_search`) from the decode winner, in the larger of its floor
   and what the decode stage left (:func:`~clattn.tune.budget.stage_budgets`).
5. **The winner's correctness**: the full set again with the tuned profile, unless it is
   the profile already checked.
"""
from __future__ import annotations

import datetime as _dt
from typing import Any, Callable

from .. import runtime
from ..device_fit import report_fit
from ..profiles import device_info, match
from . import ceilings
from .budget import RunClock, ceiling_bytes, prefill_budget, stage_budgets
from .checks import correctness, kv_bytes
from .prefill_search import PrefillTuner, prefill_default
from .report import CeilingsResult, ProfileChoice, Report
from .search import Progress, Settings, Tuner
from .timing import first_line


def measure_ceilings(rt: Any, settings: Settings, max_bytes: int | None = None) -> CeilingsResult:
    """Read, copy, launch latency, transfers and the multiply-add peak, the working sets
    at most ``max_bytes`` (:func:`~clattn.tune.budget.ceiling_bytes`; the cap is said in
    the measurements' sizing); one that fails is reported, not raised."""
    res = CeilingsResult()
    target, widths = settings.ceiling_target_s, settings.ceiling_widths
    cap = None if max_bytes is None else (max(max_bytes, ceilings.MIN_WORKING_SET),
                                          "the time budget")
    working_set = ceilings.sizing(rt.device).working_set_bytes
    if cap is not None:
        working_set = min(working_set, cap[0])
    jobs: list[tuple[str, Callable[[], Any]]] = [
        ("read", lambda: ceilings.read_bandwidth(rt, None, target, widths=widths, cap=cap)),
        ("copy", lambda: ceilings.copy_bandwidth(rt, None, target, widths=widths, cap=cap)),
        ("launch", lambda: ceilings.launch_latency(rt, max(target, 0.05))),
        ("transfer", lambda: ceilings.transfer_bandwidth(rt, max(working_set // 4, 1 << 20),
                                                         target)),
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


def _fill_rate(rt: Any) -> float | None:
    """:func:`~clattn.tune.ceilings.fill_rate`, or None where it cannot be measured."""
    try:
        return ceilings.fill_rate(rt)
    except KeyboardInterrupt:
        raise
    except Exception:  # noqa: BLE001 - unknown: nothing is sized by it
        return None


def _tune(rep: Report, rt: Any, info: dict, current: ProfileChoice, builtin: ProfileChoice,
          settings: Settings, run: RunClock, reserve_s: float, fill: float | None,
          progress: bool, say: Callable[[str], None]) -> None:
    """Both tuning stages in what ``run`` has left less ``reserve_s``; into ``rep``."""
    tuning_s, decode_s, floor_s = stage_budgets(run.left(), reserve_s, settings.prefill_share)
    say(f"tuning ({settings.mode}, decode budget {decode_s:.0f} s, prefill at least "
        f"{floor_s:.0f} s)...")
    prog = Progress(decode_s, enabled=progress)
    seeds = [(current.profile, f"current ({current.level})")] \
        if current.profile != builtin.profile else []
    try:
        rep.tuning = Tuner(rt, info, builtin.profile, settings, prog, seeds, budget_s=decode_s,
                           fill_rate=fill).run()
    finally:
        prog.done()
    rep.step_seconds["tuning"] = rep.tuning.elapsed_s
    if rep.tuning.chosen is not None:
        rep.prefill = _tune_prefill(rt, info, rep.tuning.chosen.profile, builtin.profile,
                                    settings, prefill_budget(tuning_s, floor_s,
                                                             rep.tuning.elapsed_s),
                                    progress, say)
        rep.step_seconds["prefill tuning"] = rep.prefill.elapsed_s


def tune_device(device: Any, settings: Settings, *, progress: bool = True,
                log: Callable[[str], None] | None = None,
                run: RunClock | None = None) -> Report:
    """Run every step on ``device`` in ``settings.budget_s`` (:mod:`clattn.tune.budget`).

    Parameters
    ----------
    device : pyopencl.Device
    settings : Settings
    progress : bool
        Draw the tuner's progress line on stderr.
    log : callable, optional
        Called with one line per step.
    run : RunClock, optional
        The run's clock, started by the caller (the command starts it before it looks
        for the device); default: started here, on ``settings.budget_s``.

    Returns
    -------
    Report
    """
    say = log or (lambda text: None)
    run = run or RunClock(settings.budget_s)
    rt = runtime.Runtime.for_device(device)
    info = device_info(device)
    current, builtin = _choice(match(info), info), _choice(match(info, user=False), info)
    say(f"device: {info.get('device_name')} ({info.get('platform_name')}); profile "
        f"{current.name} [{current.level}]")
    steps: dict[str, float] = {}
    fill = _fill_rate(rt)

    say("measuring ceilings (read, copy, launch latency, transfers, multiply-add peak)...")
    t = run.elapsed()
    ceil = measure_ceilings(rt, settings, ceiling_bytes(
        fill, settings.ceiling_share * settings.budget_s))
    steps["ceilings"] = run.elapsed() - t

    say("checking correctness against the CPU backend...")
    t = run.elapsed()
    checks = correctness(device, profile=current.profile)
    steps["correctness"] = run.elapsed() - t
    rep = Report(_dt.datetime.now().astimezone().isoformat(timespec="seconds"), settings.mode,
                 info, current, builtin, ceil, checks, step_seconds=steps, kv_bytes=kv_bytes(),
                 budget_s=settings.budget_s)
    if not rep.correctness_passed:
        rep.tuning_note = "skipped: correctness failed"
    else:
        _tune(rep, rt, info, current, builtin, settings, run, steps["correctness"], fill,
              progress, say)
        if rep.chosen is not None and rep.chosen != current.profile:
            say("checking the tuned profile's correctness...")
            t = run.elapsed()
            rep.winner_checks = correctness(device, profile=rep.chosen)
            steps["tuned correctness"] = run.elapsed() - t
    rep.elapsed_s = run.elapsed()
    return rep


__all__ = ["measure_ceilings", "tune_device"]
