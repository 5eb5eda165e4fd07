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
   took (kept for the winner's): decode (:mod:`clattn.tune.search`) in its share, less
   what the winner's checks should take beyond that at the cost of the new kernels it
   built (:class:`~clattn.tune.budget.ChecksCost`); the decode winner's checks, one kernel
   at a time while the run has time (a winner whose checks do not fit is dropped); then
   prefill (:mod:`clattn.tune.prefill_search`) from the decode winner, in what the run
   has left (:func:`~clattn.tune.budget.prefill_budget`).
5. **The winner's correctness**: the full set again with the tuned profile, unless it is
   a profile already checked.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import replace
from typing import Any, Callable

from .. import runtime
from ..device_fit import report_fit
from ..profiles import device_info, match
from . import ceilings
from .budget import ChecksCost, RunClock, ceiling_bytes, prefill_budget, stage_budgets
from .checks import Check, check_groups, correctness, kv_bytes
from .prefill_search import PrefillTuner, prefill_default
from .report import CeilingsResult, ProfileChoice, Report
from .search import Confirmation, Progress, Settings, Tuner
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


def checks_in_time(device: Any, profile: Any, run: RunClock,
                   per_group_s: float) -> tuple[list[Check], int]:
    """The correctness set of ``profile`` (:func:`~clattn.tune.checks.check_groups`), a
    group started only while ``run`` has time left for it: ``per_group_s`` before the
    first, then the longest group so far.

    Returns
    -------
    (checks, groups_left)
        The checks run and the number of groups left out (0: the whole set ran).
    """
    groups = check_groups(device, profile)
    done: list[Check] = []
    longest = per_group_s
    for i, (_, group) in enumerate(groups):
        if run.left() < longest:
            return done, len(groups) - i
        t = run.elapsed()
        done += group()
        longest = max(longest if i else 0.0, run.elapsed() - t)
    return done, 0


def _drop_winner(rep: Report, current: ProfileChoice, why: str) -> Any:
    """Keep the candidate of the decode stage that is ``current``'s profile (the one
    checked), saying ``why`` as the re-timing's verdict; that profile, or None if no
    candidate is it."""
    t = rep.tuning
    keep = next((c for c in t.candidates if c.status == "ok" and c.profile == current.profile),
                None)
    rep.tuning = replace(t, chosen=keep, confirmation=replace(
        t.confirmation or Confirmation(), kept_default=why))
    return keep.profile if keep else None


def _tune(rep: Report, rt: Any, info: dict, current: ProfileChoice, builtin: ProfileChoice,
          settings: Settings, run: RunClock, cost: ChecksCost, fill: float | None,
          progress: bool, say: Callable[[str], None]) -> None:
    """Both tuning stages and the decode winner's checks in what ``run`` has left, the
    registry checks' seconds (``cost``) kept for the tuned profile's; into ``rep``."""
    _, decode_s, prefill_s = stage_budgets(run.left(), cost.seconds, settings.prefill_share)
    say(f"tuning ({settings.mode}, decode budget {decode_s:.0f} s, prefill about "
        f"{prefill_s:.0f} s)...")
    prog = Progress(decode_s, enabled=progress)
    seeds = [(current.profile, f"current ({current.level})")] \
        if current.profile != builtin.profile else []

    def hold() -> float:
        # the winner's checks beyond the reserve, at what the tuner's new kernels cost
        return cost.estimate(tuner.seconds_per_program()) - cost.seconds

    tuner = Tuner(rt, info, builtin.profile, settings, prog, seeds, budget_s=decode_s,
                  fill_rate=fill, hold_s=hold)
    try:
        rep.tuning = tuner.run()
    finally:
        prog.done()
    rep.step_seconds["tuning"] = rep.tuning.elapsed_s
    if rep.tuning.chosen is None:
        return
    decoded = rep.tuning.chosen.profile
    base = prefill_default(decoded, builtin.profile)
    if base != current.profile:
        say("checking the decode winner's correctness...")
        t = run.elapsed()
        checks, left = checks_in_time(rt.device, base, run, cost.seconds / max(cost.programs, 1))
        rep.step_seconds["tuned correctness"] = run.elapsed() - t
        if left:
            decoded = _drop_winner(rep, current, (
                f"#{rep.tuning.chosen.id} won, but its correctness checks did not fit the "
                f"time budget ({left} kernel group(s) of the set not checked; those built are "
                f"cached by drivers that keep a kernel cache, so a rerun goes further)"))
            if decoded is None:
                return
        else:
            rep.winner_checks = checks
            if not rep.winner_passed:
                return
    rep.prefill = _tune_prefill(rt, info, decoded, builtin.profile, settings,
                                prefill_budget(run.left(), cost.seconds), progress, say)
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
    t, built = run.elapsed(), rt.programs_built
    checks = correctness(device, profile=current.profile)
    steps["correctness"] = run.elapsed() - t
    cost = ChecksCost(steps["correctness"], rt.programs_built - built)
    rep = Report(_dt.datetime.now().astimezone().isoformat(timespec="seconds"), settings.mode,
                 info, current, builtin, ceil, checks, step_seconds=steps, kv_bytes=kv_bytes(),
                 budget_s=settings.budget_s)
    if not rep.correctness_passed:
        rep.tuning_note = "skipped: correctness failed"
    else:
        _tune(rep, rt, info, current, builtin, settings, run, cost, fill, progress, say)
        checked = [current.profile] + ([prefill_default(rep.tuning.chosen.profile,
                                                        builtin.profile)]
                                       if rep.winner_checks is not None else [])
        if rep.chosen is not None and rep.chosen not in checked:
            say("checking the tuned profile's correctness...")
            t = run.elapsed()
            rep.winner_checks = correctness(device, profile=rep.chosen)
            steps["tuned correctness"] = steps.get("tuned correctness", 0.0) \
                + run.elapsed() - t
    rep.elapsed_s = run.elapsed()
    return rep


__all__ = ["checks_in_time", "measure_ceilings", "tune_device"]
