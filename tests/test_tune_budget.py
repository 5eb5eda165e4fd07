"""``clattn tune``'s time budget: a stage stops between candidates and between shapes once
its share is spent, a workload whose setup cannot fit is not set up, the tuned profile's
checks come out of the stages' time (a winner whose checks do not fit is dropped), and
whatever is left out is said. Every clock here is a fake one: no
assertion depends on this machine's speed, and nothing is built.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
from test_profiler import _fake_report

from clattn.fit import Limits
from clattn.profiles.record import Profile
from clattn.tune import session
from clattn.tune.budget import ChecksCost, RunClock, ceiling_bytes, prefill_budget, stage_budgets
from clattn.tune.ceilings import MIN_WORKING_SET, Sizing
from clattn.tune.checks import Check
from clattn.tune.report import ProfileChoice, Report, format_report, jsonable
from clattn.tune.search import (
    Candidate,
    CoordinateSearch,
    Parameter,
    Progress,
    Settings,
    TuningResult,
)

MiB = 1 << 20


class FakeClock:
    """Seconds that pass only when a fake step says so."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass(frozen=True)
class FakeShape:
    model: str
    key: str


#: two axes, four values each from the default (vec 8, tile_rows 4) in a full search
SPACE = (Parameter("vec", (1, 2, 4, 8, 16)), Parameter("tile_rows", (1, 2, 4, 8, 16)))
DEFAULT = Profile(strategy="rows", vec=8, tile_rows=4)


class FakeStage(CoordinateSearch):
    """A stage whose kernels "take" ``build_s`` to build, each shape timing ``time_s``
    (``others_s`` after the default) and each model's workload ``setup_bytes[model]`` at
    ``true_rate`` bytes/s to set up, on a fake clock; candidate ``#i`` measures
    ``1 ms / (1 + i)`` (later ones faster)."""

    def __init__(self, budget_s: float, shapes: list[FakeShape], *, time_s: float,
                 others_s: float | None = None,
                 build_s: float = 0.5, setup_bytes: dict[str, int] | None = None,
                 true_rate: float = 1e9, fill_rate: float | None = None,
                 hold_s: object = None) -> None:
        self.fake = FakeClock()
        settings = Settings(quick=False, budget_s=budget_s, passes=1, max_kernels=50)
        super().__init__(settings, Progress(budget_s, enabled=False), Limits(), SPACE,
                         [(DEFAULT, "default")], budget_s, fill_rate=fill_rate,
                         clock=self.fake, hold_s=hold_s)
        self.shapes = list(shapes)
        self.time_s, self.build_s, self.true_rate = time_s, build_s, true_rate
        self.others_s = time_s if others_s is None else others_s
        self.setup_bytes = setup_bytes or {}
        self.ready: set[str] = set()
        self.set_up: list[str] = []

    def _setup_bytes(self, shape: FakeShape) -> int:
        return 0 if shape.model in self.ready else self.setup_bytes.get(shape.model, 0)

    def _setup(self, shape: FakeShape) -> None:
        self.fake.advance(self._setup_bytes(shape) / self.true_rate)
        self.ready.add(shape.model)
        self.set_up.append(shape.model)

    def _measure(self, cand: Candidate, runner: object, shape: FakeShape,
                 label: str) -> float:
        self.fake.advance(self.others_s if cand.id else self.time_s)
        return 1e-3 / (1 + cand.id)

    def evaluate(self, prof: Profile, origin: str, *, force: bool = False) -> Candidate | None:
        if any(c.profile == prof for c in self.candidates):
            return None
        why = "" if force else self._budget_refusal(True)
        if why:
            self._not_tried(origin, why)
            return None
        start = self._cost_start()
        cand = Candidate(len(self.candidates), prof, origin)
        self.candidates.append(cand)
        self.fake.advance(self.build_s)
        if cand.id:  # a new kernel: two programs built and verified
            self._note_builds(2, self.build_s)
        self._time_shapes(cand, {s.model: None for s in self.shapes}, origin)
        self._cost_end(start)
        self._rescore()
        return cand

    def result(self) -> TuningResult:
        best = self.best()
        return TuningResult(self.settings, list(self.shapes), dict(self.skipped_shapes),
                            list(self.candidates), self.elapsed(), self.stop_reason,
                            chosen=best, default=self.candidates[0], budget_s=self.budget_s,
                            not_tried={k: list(v) for k, v in self.not_tried.items()})


def _shapes(*models: str, per_model: int = 2) -> list[FakeShape]:
    return [FakeShape(m, f"{m} #{i}") for m in models for i in range(per_model)]


def _origins_of_the_space() -> set[str]:
    return {f"vec={v}" for v in (1, 2, 4, 16)} | {f"tile_rows={v}" for v in (1, 2, 8, 16)}


def test_a_stage_whose_candidates_take_longer_than_its_share_stops_and_says_what_it_skipped():
    """Each shape "takes" 3 s against a 10 s budget: the default is timed (its reserve
    for the re-timing moves the deadline to 5 s), then nothing else starts, and every
    value of the pass is listed as not tried, in the result, its JSON and its text."""
    st = FakeStage(10.0, _shapes("m"), time_s=3.0)
    st.search()
    res = st.result()
    assert [c.origin for c in res.candidates] == ["default"]
    assert res.candidates[0].status == "ok" and len(res.candidates[0].times) == 2
    assert st.elapsed() <= 10.0
    assert "time budget of 10 s used up" in res.stopped
    tried_not = {o for origins in res.not_tried.values() for o in origins}
    assert tried_not == _origins_of_the_space()
    assert all("time budget" in why for why in res.not_tried)
    j = jsonable(res)
    json.dumps(j)
    assert j["not_tried"] == res.not_tried


def test_candidates_stop_once_the_share_is_spent_with_the_rest_reported():
    """Cheap candidates (0.2 s a shape) in a 4 s stage: several are timed, none starts
    past the deadline, the one running when it passes stops between two shapes, and
    every value never started is in not_tried."""
    st = FakeStage(4.0, _shapes("m", per_model=3), time_s=0.2, build_s=0.1)
    st.search()
    res = st.result()
    started = {c.origin for c in res.candidates[1:]}
    assert len(started) >= 2
    assert st.elapsed() <= 4.0 + 0.2  # at most one shape past the deadline
    not_tried = {o for origins in res.not_tried.values() for o in origins}
    assert started | not_tried == _origins_of_the_space() and not started & not_tried
    for c in res.candidates:
        assert c.status in ("ok", "stopped")
        assert c.status == "ok" or "time budget" in c.reason


def test_a_candidate_stops_between_two_shapes_when_the_deadline_passes():
    """The default times 4 shapes in 0.5 s each, a 12 s stage (deadline 6 s: the reserve
    is half the budget); #1 starts at 2.5 s, but its shapes take 2 s each: it passes the
    deadline after its second shape and stops there; it is never the winner."""
    st = FakeStage(12.0, _shapes("m", per_model=4), time_s=0.5, others_s=2.0)
    st.search()
    res = st.result()
    one = res.candidates[1]
    assert one.status == "stopped" and "time budget" in one.reason
    assert 0 < len(one.times) < 4 and one.score is None
    assert res.chosen is res.candidates[0]


def test_a_workload_whose_setup_cannot_fit_is_not_set_up_and_is_reported():
    """Model "big" needs 4 GiB filled at 100 MB/s (43 s) in a 20 s stage: its shapes are
    left out with the reason, its pool is never allocated, the other model's shapes are
    timed."""
    st = FakeStage(20.0, _shapes("small", "big"), time_s=0.1,
                   setup_bytes={"small": 10 * MiB, "big": 4096 * MiB}, true_rate=1e8,
                   fill_rate=1e8)
    st.search()
    res = st.result()
    assert st.set_up == ["small"]
    assert set(res.skipped_shapes) == {"big #0", "big #1"}
    for why in res.skipped_shapes.values():
        assert "setting up its workload (4096 MiB, about 43 s) does not fit" in why
        assert why.endswith("(the default was not timed on it)")
    assert [s.key for s in res.shapes] == ["small #0", "small #1"]
    assert res.candidates[0].status == "ok"
    text = "\n".join(format_report_lines(res))
    assert "shape big #0 not measured: time budget of 20 s: setting up its workload" in text


def test_the_setup_rate_is_learnt_from_the_setups_done():
    """No rate given: the first setup runs; the second model's is predicted from the
    first's measured rate (1 GiB at 100 MB/s) and skipped when it cannot fit."""
    st = FakeStage(30.0, _shapes("a", "b", per_model=1), time_s=0.1,
                   setup_bytes={"a": 1000 * MiB, "b": 2000 * MiB}, true_rate=1e8)
    st.search()
    assert st.set_up == ["a"] and list(st.skipped_shapes) == ["b #0"]
    assert math.isclose(st.setup_seconds(1000 * MiB), 1000 * MiB / 1e8)


def test_without_a_budget_nothing_is_cut():
    st = FakeStage(math.inf, _shapes("m"), time_s=1e6)
    st.search()
    res = st.result()
    assert not res.not_tried and not res.skipped_shapes and not res.stopped
    assert {c.origin for c in res.candidates[1:]} >= {"vec=4", "vec=16"}


def format_report_lines(res: TuningResult) -> list[str]:
    """The report's text of one stage (through the whole report's formatter)."""
    rep = _fake_report()
    rep.tuning = res
    return format_report(rep).splitlines()


# -- the run: ceilings, the stages' shares, the tuned profile's checks ------------------------

def test_stage_budgets_and_the_prefill_budget():
    assert stage_budgets(100.0, 20.0, 0.25) == (80.0, 60.0, 20.0)
    assert stage_budgets(5.0, 20.0, 0.3) == (0.0, 0.0, 0.0)  # the reserve ate it all
    assert stage_budgets(math.inf, 20.0, 0.3) == (math.inf,) * 3
    assert prefill_budget(30.0, 2.0) == 28.0  # what the run has left, less the final checks
    assert prefill_budget(1.0, 2.0) == 0.0  # the run is spent: the default alone
    assert math.isinf(prefill_budget(math.inf, 2.0))


def test_the_checks_estimate_scales_the_set_by_what_new_programs_cost():
    cost = ChecksCost(1.2, 12)
    assert cost.estimate() == cost.estimate(None) == 1.2  # nothing built yet: what it took
    assert cost.estimate(0.05) == 1.2  # cached kernels: never below what it took
    assert cost.estimate(0.8) == pytest.approx(9.6)  # 12 new programs at 0.8 s each


def test_the_hold_moves_the_deadline_and_grows_with_what_new_kernels_cost():
    """A 20 s stage holding 12 programs x the measured seconds per program (beyond a 1 s
    reserve): the first new kernel "takes" 1.5 s for two programs, so the hold becomes
    12 x 0.75 - 1 = 8 s and the search stops early, with the rest in not_tried."""
    holder: list[FakeStage] = []
    cost = ChecksCost(1.0, 12)
    st = FakeStage(20.0, _shapes("m", per_model=1), time_s=0.2, build_s=1.5,
                   hold_s=lambda: cost.estimate(holder[0].seconds_per_program()) - cost.seconds)
    holder.append(st)
    assert st.end() == 20.0 and st.seconds_per_program() is None
    st.search()
    assert st.seconds_per_program() == pytest.approx(0.75)
    assert st.end() == pytest.approx(12.0)
    assert st.elapsed() <= st.end() + 0.2
    assert st.result().not_tried
    free = FakeStage(20.0, _shapes("m", per_model=1), time_s=0.2, build_s=1.5)
    free.search()
    assert len(free.candidates) > len(st.candidates)


def test_run_clock_counts_from_its_start():
    clock = FakeClock()
    run = RunClock(20.0, clock)
    clock.advance(12.5)
    assert run.elapsed() == 12.5 and run.left() == 7.5
    clock.advance(10.0)
    assert run.left() == 0.0
    assert math.isinf(RunClock(math.inf, clock).left())


def test_ceilings_working_sets_are_capped_by_their_share(monkeypatch):
    """The read and copy working sets get the cap and its reason; the transfers a quarter
    of it; never below the ceilings' minimum working set."""
    seen = {}
    monkeypatch.setattr(session.ceilings, "sizing", lambda dev: Sizing(2048 * MiB))
    for name in ("read_bandwidth", "copy_bandwidth"):
        monkeypatch.setattr(session.ceilings, name,
                            lambda rt, size, target, *, widths, cap, name=name:
                            seen.setdefault(name, (size, cap)))
    monkeypatch.setattr(session.ceilings, "transfer_bandwidth",
                        lambda rt, size, target: seen.setdefault("transfer", size))
    monkeypatch.setattr(session.ceilings, "launch_latency", lambda rt, target: None)
    monkeypatch.setattr(session.ceilings, "fma_peak", lambda rt, target: None)

    class Dev:
        device = None

    settings = Settings.make(True, 20.0)
    cap = ceiling_bytes(480e6, settings.ceiling_share * settings.budget_s)
    assert MIN_WORKING_SET < cap < 2048 * MiB
    res = session.measure_ceilings(Dev(), settings, cap)
    assert not res.errors
    assert seen["read_bandwidth"] == (None, (cap, "the time budget"))
    assert seen["copy_bandwidth"] == (None, (cap, "the time budget"))
    assert seen["transfer"] == cap // 4
    seen.clear()
    session.measure_ceilings(Dev(), settings, 1)
    assert seen["read_bandwidth"][1][0] == MIN_WORKING_SET
    seen.clear()
    session.measure_ceilings(Dev(), settings, None)  # no budget: past every cache
    assert seen["read_bandwidth"] == (None, None) and seen["transfer"] == 512 * MiB


def _fake_stages(monkeypatch, clock: FakeClock, decode_takes: float, winner: Profile,
                 seen: dict) -> None:
    """Stand-ins for both stages: the decode stage "takes" ``decode_takes`` and crowns
    ``winner`` (a second candidate when it is not the default); the prefill stage keeps
    its default."""

    class FakeTuner:
        def __init__(self, rt, info, base, settings, progress, seeds=(), *, budget_s,
                     fill_rate, hold_s):
            seen["decode"] = budget_s
            seen["hold"] = hold_s
            self.base = base

        def seconds_per_program(self):
            return None

        def run(self):
            clock.advance(decode_takes)
            cands = [Candidate(0, self.base, "default", status="ok", score=1.0)]
            if winner != self.base:
                cands.append(Candidate(1, winner, "vec=4", status="ok", score=0.5))
            return TuningResult(Settings.make(True, None), [], {}, cands, decode_takes,
                                chosen=cands[-1], default=cands[0])

    class FakePrefill:
        def __init__(self, rt, info, base, settings, progress, budget_s, seeds=()):
            seen["prefill"] = budget_s
            seen["prefill base"] = base
            self.base = base

        def run(self):
            win = Candidate(0, self.base, "default", status="ok", score=1.0)
            return TuningResult(Settings.make(True, None), [], {}, [win], 0.1, chosen=win,
                                default=win)

    monkeypatch.setattr(session, "Tuner", FakeTuner)
    monkeypatch.setattr(session, "PrefillTuner", FakePrefill)


class FakeRuntime:
    device = None


def _fake_groups(monkeypatch, clock: FakeClock, seconds: list[float], ran: list) -> None:
    """The correctness set as one group per entry of ``seconds``, each "taking" it."""

    def groups(device, profile):
        def group(i: int) -> list[Check]:
            clock.advance(seconds[i])
            ran.append((profile, i))
            return [Check(f"group {i}", True, 0.0, 1e-3)]
        return [(f"group {i}", lambda i=i: group(i)) for i in range(len(seconds))]

    monkeypatch.setattr(session, "check_groups", groups)


def _run_tune(monkeypatch, decode_takes: float, winner: Profile, group_s: list[float],
              cost: ChecksCost) -> tuple[Report, dict, list]:
    """``session._tune`` in a 20 s run 6 s in, on the fake stages and check groups:
    (the report, what the stages were given, the check groups run)."""
    clock = FakeClock()
    run = RunClock(20.0, clock)
    clock.advance(6.0)
    seen: dict = {}
    _fake_stages(monkeypatch, clock, decode_takes, winner, seen)
    ran: list = []
    _fake_groups(monkeypatch, clock, group_s, ran)
    rep = _fake_report()
    rep.tuning = None
    choice = ProfileChoice("p", "vendor", "r", (), DEFAULT)
    session._tune(rep, FakeRuntime(), {}, choice, choice, Settings.make(True, 20.0), run,
                  cost, None, False, lambda text: None)
    return rep, seen, ran


@pytest.mark.parametrize("decode_takes, prefill_gets", [(30.0, 0.0), (2.0, 10.0)])
def test_prefill_gets_what_the_run_has_left(monkeypatch, decode_takes, prefill_gets):
    """20 s run, 6 s already spent, 2 s kept for the winner's checks: 12 s of tuning, the
    decode stage 8.4 s of it; the prefill stage what the run has left less the 2 s (none
    when the decode stage overran: its default alone is timed). The decode stage kept
    its default: nothing is checked between the stages."""
    rep, seen, ran = _run_tune(monkeypatch, decode_takes, DEFAULT, [1.0] * 12,
                               ChecksCost(2.0, 12))
    assert math.isclose(seen["decode"], 12.0 * 0.7)
    assert seen["hold"]() == 0.0  # no new kernel measured: nothing held past the reserve
    assert math.isclose(seen["prefill"], prefill_gets)
    assert rep.prefill is not None and rep.step_seconds["tuning"] == decode_takes
    assert rep.winner_checks is None and not ran


def test_the_decode_winners_checks_run_before_the_prefill_stage_out_of_its_time(monkeypatch):
    """The decode stage crowns vec=4 after 8 s: its checks (12 groups of 0.1 s) run next,
    and the prefill stage, from the checked winner, gets what the run has left less the
    final checks' reserve (20 - 6 - 8 - 1.2 - 2)."""
    winner = DEFAULT.with_(vec=4)
    rep, seen, ran = _run_tune(monkeypatch, 8.0, winner, [0.1] * 12, ChecksCost(2.0, 12))
    assert [i for _, i in ran] == list(range(12)) and all(p == winner for p, _ in ran)
    assert len(rep.winner_checks) == 12 and rep.winner_passed
    assert rep.tuning.chosen.profile == winner
    assert seen["prefill base"] == winner
    assert math.isclose(seen["prefill"], 20.0 - 6.0 - 8.0 - 1.2 - 2.0)
    assert rep.step_seconds["tuned correctness"] == pytest.approx(1.2)


def test_a_winner_whose_checks_do_not_fit_is_dropped(monkeypatch):
    """The winner's kernels are new: each group "takes" 3 s and the run has 4 s left
    after the decode stage; one group runs, the next has no room, and the winner is
    dropped: the checked default is kept (said as the re-timing's verdict, which the
    report prints under the tuned parameters), the prefill stage starts from it with no
    time, and no tuned checks are reported."""
    rep, seen, ran = _run_tune(monkeypatch, 10.0, DEFAULT.with_(vec=4), [3.0] * 12,
                               ChecksCost(1.2, 12))
    assert len(ran) == 1
    assert rep.tuning.chosen.profile == DEFAULT and rep.winner_checks is None
    verdict = rep.tuning.confirmation.kept_default
    assert "did not fit the time budget (11 kernel group(s) of the set not checked" in verdict
    assert seen["prefill base"] == DEFAULT and seen["prefill"] == 0.0
    assert rep.chosen == DEFAULT


def test_checks_in_time_stop_before_a_group_the_run_has_no_room_for(monkeypatch):
    """Groups of 1 s in a run with 2.5 s left: two run (the estimate before the first is
    0.1 s, then the longest so far), the third would pass the end."""
    clock = FakeClock()
    run = RunClock(2.5, clock)
    ran: list = []
    _fake_groups(monkeypatch, clock, [1.0] * 5, ran)
    done, left = session.checks_in_time(None, DEFAULT, run, 0.1)
    assert len(done) == 2 and left == 3
    ran.clear()
    done, left = session.checks_in_time(None, DEFAULT, RunClock(math.inf, clock), 0.1)
    assert len(done) == 5 and left == 0


def test_pools_shrink_to_the_time_their_fill_may_take(monkeypatch):
    """A cold wish of 1.9 GiB per model filled at 100 MB/s in a 10 s stage: the pools
    shrink alike to 25% of it (250 MB), keep two page sets each, and the report says so.
    Nothing is allocated or built (the tuner sizes its pools when it is made)."""
    from test_profiler import POCL, _sized_tuner

    if POCL is None:
        pytest.skip("PoCL is not installed")
    t = _sized_tuner(monkeypatch, cold=1920 << 20, host_available=64 << 30,
                     budget_s=10.0, fill_rate=1e8)
    used = sum(n * t.specs[m].layout.page_bytes for m, n in t._pool_pages.items())
    assert not t.skipped_shapes and used <= 0.25 * 10.0 * 1e8
    assert any("so that filling them takes at most 25% of the time budget of 10 s" in n
               for n in t.memory_notes)
    for s in t.shapes:
        assert t._pool_pages[s.model] >= 2 * s.num_pages


def test_a_kernel_cost_leaves_the_setups_out():
    """The default's 60 s pool fill is not what the next kernel costs: with 100 s, a
    candidate still starts after it (its estimate: build and timings alone)."""
    st = FakeStage(100.0, _shapes("m"), time_s=1.0,
                   setup_bytes={"m": 6000 * 10**6}, true_rate=1e8, fill_rate=1e8)
    st.search()
    assert st._kernel_costs[0] == pytest.approx(2.5)
    assert len(st.candidates) > 1 and st.candidates[1].status == "ok"
