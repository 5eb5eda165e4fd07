"""The prefill stage of ``clattn tune`` (clattn.tune.prefill_search): its space respects
the fit on every recorded device, a quick run without a time budget verifies every
candidate against the CPU backend before timing it (a kernel that fails to build or
answers wrong is skipped with the reason, never timed), the report and the saved profile
carry the prefill fields, and a tuned prefill profile computes what the default does
within the float64 oracle's bound.

Kernel builds are few: one tiny shape, the tuner's two models, at most four kernels."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from cases import compare, spec_scenario
from prefill_cases import naive_prefill, prefill_case, run
from test_profiler import POCL, _fake_report, _isolate, _main, _stub_run, needs_pocl

import clattn
from clattn import runtime
from clattn.device_fit import fit_device
from clattn.fit import Limits, prefill_geometry
from clattn.prefill import BatchPrefill
from clattn.profiles import builtin_profiles, device_info, match
from clattn.tune import search, session
from clattn.tune.prefill_search import (
    GEOMETRY_OF,
    PREFILL_FIELDS,
    PREFILL_SPACE,
    PrefillShapeResult,
    PrefillTuner,
    prefill_default,
)
from clattn.tune.report import format_report
from clattn.tune.search import Candidate, Settings, TuningResult, values_to_try
from clattn.tune.workloads import MODELS, PrefillShape, prefill_shapes_for, spec_for

RECORDS = json.loads((Path(__file__).parent / "data" / "devices.json").read_text())["records"]
#: the tiny prefill point of the runs here: 16 new tokens over 48 cached
TINY = ((1, 16, 48),)


# -- the space ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rec", RECORDS, ids=[r["id"] for r in RECORDS])
def test_every_candidate_of_the_space_fits_or_is_refused_with_a_reason(rec):
    """From every built-in profile on every recorded device, each value the space offers
    is allowed by the device, and its fitted geometry on the tuner's models either holds
    the wish, or cuts it with a note, or is refused with the fit's reason (the candidate
    is then skipped with it)."""
    limits = Limits.from_info(rec)
    specs = [spec_for(m) for m in MODELS]
    for name, prof in builtin_profiles().items():
        base = fit_device(prof, rec).profile
        for quick in (True, False):
            for param in PREFILL_SPACE:
                for value in values_to_try(param, base, limits, quick):
                    assert param.strategies == (base.strategy,)
                    assert param.allowed is None or param.allowed(value, limits)
                    cand = fit_device(base.with_(**{param.field: value}), rec).profile
                    for spec in specs:
                        try:
                            g = prefill_geometry(spec, cand, limits)
                        except ValueError as exc:  # skipped: "not valid on this device: ..."
                            assert "local memory" in str(exc)
                            continue
                        got = getattr(g, GEOMETRY_OF[g.strategy].get(param.field, "qb"))
                        cut = [n for n in g.notes if n.startswith(f"{param.field} ")]
                        if g.strategy != base.strategy:  # llvmpipe: tiled -> rows, said
                            assert any("tiled -> rows" in n for n in g.notes)
                            continue
                        assert got == value or (cut and len(cut[0].split(": ", 1)[1]) > 10), \
                            (name, param.field, value, g.notes)
                        if g.strategy == "rows":
                            assert g.vec <= limits.rows_max_vec
                        else:
                            assert g.threads <= limits.max_work_group_size
                            assert g.local_mem_bytes <= limits.local_mem_size


def test_space_fields_and_values():
    assert PREFILL_FIELDS == ("prefill_vec", "prefill_kb", "prefill_qb", "prefill_tc",
                              "prefill_rm")
    by = {(p.field, p.strategies): p for p in PREFILL_SPACE}
    assert by["prefill_vec", ("rows",)].values == (4, 8, 16)
    assert by["prefill_kb", ("rows",)].values == (4, 8, 16)
    assert by["prefill_qb", ("rows",)].values == (2, 4, 8, 16, 32)
    assert {p.field for p in PREFILL_SPACE if p.strategies == ("tiled",)} == \
        {"prefill_tc", "prefill_rm", "prefill_kb", "prefill_qb"}
    # PoCL's PyPI build compiles the rows kernels with at most 8 floats per vector
    pocl = Limits(rows_max_vec=8)
    rows = clattn.Profile(strategy="rows", prefill_vec=8)
    assert values_to_try(by["prefill_vec", ("rows",)], rows, pocl, False) == [4]
    # the default keeps the registry's prefill fields, the decode winner's others
    won = clattn.Profile(strategy="rows", vec=4, tile_rows=2, prefill_qb=3, prefill_vec=4)
    builtin = clattn.Profile(strategy="rows", prefill_kb=8)
    d = prefill_default(won, builtin)
    assert (d.vec, d.tile_rows) == (4, 2)
    assert all(getattr(d, f) == getattr(builtin, f) for f in PREFILL_FIELDS)


def test_prefill_shapes_and_flops():
    shapes = prefill_shapes_for(((1, 512, 0), (1, 128, 4096)))
    assert len(shapes) == 4 and shapes == sorted(shapes, key=lambda s: (s.flops, s.key))
    llama = next(s for s in shapes if s.model == "Llama-3-8B" and s.cached == 4096)
    assert llama.key == "Llama-3-8B B=1 new=128 cached=4096"
    assert llama.flops == 4 * 32 * 128 * (128 * 4096 + 128 * 129 / 2)
    assert Settings.make(True, None).prefill_points != Settings.make(False, None).prefill_points
    assert Settings.make(True, None).prefill_max_kernels < Settings.make(False, None) \
        .prefill_max_kernels
    assert math.isinf(Settings(quick=True, budget_s=search.NO_BUDGET).decode_budget_s)


# -- a run on a device -------------------------------------------------------------------------

def _plant(monkeypatch, seen):
    """The first new kernel after the default fails to build, the second answers wrong
    (one value of ``out`` off by 0.5 on host calls, the verification's); ``seen`` records
    each run as (profile, "verify" or "time")."""
    order: list = []
    real_build, real_run = BatchPrefill.build, BatchPrefill.run

    def ordinal(self):
        if self.profile not in order:
            order.append(self.profile)
        return order.index(self.profile)

    def build(self):
        if ordinal(self) == 1:
            raise runtime.BuildError("building a clattn kernel failed: error: boom")
        return real_build(self)

    def run_(self, *a, **kw):
        res = real_run(self, *a, **kw)
        host = isinstance(res.out, np.ndarray)
        seen.append((self.profile, "verify" if host else "time"))
        if host and ordinal(self) == 2:
            res.out[1, 0, 0] += np.asarray(0.5, res.out.dtype)  # a query of sequence 1
        return res

    monkeypatch.setattr(BatchPrefill, "build", build)
    monkeypatch.setattr(BatchPrefill, "run", run_)
    return order


def _tuner(device, max_kernels=4):
    info = device_info(device)
    base = match(info, user=False).profile
    settings = Settings(quick=True, budget_s=search.NO_BUDGET, prefill_points=TINY,
                        prefill_max_kernels=max_kernels, passes=1, target_s=0.005, reps=3)
    rt = runtime.Runtime.for_device(device)
    tuner = PrefillTuner(rt, info, prefill_default(base, base), settings,
                         search.Progress(60, enabled=False), search.NO_BUDGET)
    tuner.t0 -= 1e6  # as if a slow machine had spent a million seconds: no verdict changes
    return tuner


def test_quick_run_verifies_every_candidate_before_timing_it(device, monkeypatch):
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)
    seen: list = []
    order = _plant(monkeypatch, seen)
    tuner = _tuner(device)
    res = tuner.run()
    cands = res.candidates
    assert 3 <= len(cands) <= 4 and not res.skipped_shapes
    assert cands[0].origin == "default" and cands[0].status == "ok"
    by_profile = {c.profile: c for c in cands}
    broken, wrong = by_profile[order[1]], by_profile[order[2]]
    assert broken.status == "skipped" and broken.reason.startswith("build failed") \
        and "boom" in broken.reason
    assert wrong.status == "skipped" and "wrong result" in wrong.reason \
        and "max error" in wrong.reason
    keys = {s.key for s in res.shapes}
    assert len(keys) == len(MODELS)
    for c in cands:
        assert c.status in ("ok", "skipped")
        assert c.origin == "default" or c.origin.split("=")[0] in PREFILL_FIELDS
        changed = [f for f in PREFILL_FIELDS if getattr(c.profile, f) != getattr(
            cands[0].profile, f)]
        assert c.id == 0 or len(changed) == 1  # one field at a time, from the default
        timed = [i for i, (p, what) in enumerate(seen) if p == c.profile and what == "time"]
        if c.status == "ok":
            assert set(c.times) == keys and all(t > 0 for t in c.times.values())
            # verified on every model, causal and not, before its first timed call
            checked = [i for i, (p, what) in enumerate(seen) if p == c.profile
                       and what == "verify"]
            assert len(checked) == 2 * len(MODELS) and max(checked) < min(timed)
        else:
            assert not timed and not c.times  # never timed
    assert res.chosen is not None and res.chosen.status == "ok"
    assert [r.shape.key for r in res.per_shape] and {r.shape.key for r in res.per_shape} == keys
    for r in res.per_shape:
        assert r.default_s > 0 and r.tuned_s > 0 and r.tuned_gflops > 0
    if res.chosen is not cands[0]:  # the winner was timed again round-robin with the default
        assert res.confirmation.scores and res.confirmation.times[0]
    assert not tuner._workloads  # released


# -- the report and the saved profile -----------------------------------------------------------

def _prefill_result(tuned: clattn.Profile, base: clattn.Profile) -> TuningResult:
    shapes = prefill_shapes_for(TINY)
    default = Candidate(0, base, "default", status="ok", times={s.key: 2e-3 for s in shapes},
                        score=4.0)
    win = Candidate(1, tuned, "prefill_qb=4", status="ok", times={s.key: 1e-3 for s in shapes},
                    score=2.0)
    return TuningResult(Settings.make(True, None), shapes, {}, [default, win], 1.0,
                        chosen=win, default=default,
                        per_shape=[PrefillShapeResult(s, 2e-3, 1e-3) for s in shapes],
                        budget_s=6.0)


def test_report_shows_prefill_beside_decode():
    rep = _fake_report()
    base = rep.tuning.chosen.profile
    tuned = base.with_(prefill_qb=4, prefill_kb=16)
    rep.prefill = _prefill_result(tuned, base)
    assert rep.chosen == tuned  # the prefill stage's choice carries the decode stage's
    text = format_report(rep)
    assert "Default (pocl-cpu) vs tuned" in text  # decode's table stays
    assert "Prefill tuning: 2 shapes, 2 candidates (2 ok), 1 s of a 6 s budget" in text
    assert "Prefill default vs tuned (#1)" in text and "2.00x" in text
    assert "tuned: prefill rows kb 16, qb 4, vec auto" in text
    j = rep.to_json()
    rows = j["prefill"]["per_shape"]
    assert len(rows) == 2 and all(r["speedup"] == 2.0 for r in rows)
    assert all(r["shape"]["key"].endswith("new=16 cached=48") for r in rows)
    flops = PrefillShape("Llama-3-8B", 32, 8, 128, 1, 16, 48).flops
    llama = next(r for r in rows if r["shape"]["model"] == "Llama-3-8B")
    assert math.isclose(llama["tuned_gflops"], flops / 1e-3 * 1e-9)
    assert all(r["fraction_of_fma_peak"] > 0 for r in rows)
    assert j["chosen"]["prefill_qb"] == 4


@needs_pocl
def test_saved_profile_round_trips_the_prefill_fields(tmp_path, monkeypatch):
    """--save writes the prefill stage's fields; the registry hands them back to decode
    and prefill alike."""
    _isolate(monkeypatch, tmp_path / "cfg")
    rep = _fake_report()
    rep.device = device_info(POCL)
    base = match(rep.device, user=False).profile
    tuned = base.with_(prefill_qb=4, prefill_kb=16, prefill_vec=4)
    rep.tuning.chosen = Candidate(0, base, "default", status="ok", score=1.0)
    rep.prefill = _prefill_result(tuned, base)
    _stub_run(monkeypatch, rep)
    assert _main("--save") == 0
    saved, = (tmp_path / "cfg").glob("*.json")
    entry = json.loads(saved.read_text())
    assert {f: entry["params"][f] for f in ("prefill_qb", "prefill_kb", "prefill_vec")} == \
        {"prefill_qb": 4, "prefill_kb": 16, "prefill_vec": 4}
    assert "; prefill Qwen2.5-0.5B B=1 new=16 cached=48: 2.00x, Llama-3-8B" in entry["notes"]
    m = match(device_info(POCL))
    assert m.level == "user"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pre = BatchPrefill(spec_for(MODELS[0]), POCL, backend="opencl")
    for f in PREFILL_FIELDS:
        assert getattr(m.profile, f) == getattr(tuned, f) == getattr(pre.profile, f), f
    assert (pre.geometry.qb, pre.geometry.kb, pre.geometry.vec) == (4, 16, 4)


def test_tuned_prefill_profile_matches_the_default_within_the_oracle_bound(device):
    """A tuned prefill profile (other query tiles, key blocks and vectors than the
    registry's) computes what the default does: both within the float64 oracle's bound."""
    info = device_info(device)
    base = fit_device(match(info, user=False).profile, info).profile
    if base.strategy == "rows":
        tuned = base.with_(prefill_qb=2, prefill_kb=4, prefill_vec=4)
    else:
        tuned = base.with_(prefill_tc=8, prefill_rm=2, prefill_kb=16, prefill_qb=4)
    m = MODELS[1]
    sc = spec_scenario("tuned", m.num_qo_heads, m.num_kv_heads, m.head_dim,
                       dtype="float16", page_size=16)
    case = prefill_case(sc.spec, [0, 40, 5], [7, 9, 1], seed=4)
    ref = naive_prefill(sc, case)
    got = []
    for prof in (base, tuned):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            pre = BatchPrefill(sc.spec, device, backend="opencl", profile=prof)
        res = run(pre, case)
        compare(res.out, res.lse, *ref, sc.spec.dtype, what=f"{prof.prefill_qb}: ")
        got.append(pre.geometry)
    assert got[0] != got[1]  # two kernels, not one


@needs_pocl
def test_session_tunes_prefill_from_the_decode_winner_in_the_budget_left(monkeypatch):
    """The prefill stage starts from the decode winner with the registry's prefill fields,
    the winner's own (a user profile's) as a seed, in the budget the decode stage left."""
    seen = {}

    class FakePrefill:
        def __init__(self, rt, info, base, settings, progress, budget_s, seeds=()):
            seen.update(base=base, budget=budget_s, seeds=list(seeds))

        def run(self):
            return _prefill_result(seen["base"], seen["base"])

    builtin = match(device_info(POCL), user=False).profile
    won = builtin.with_(vec=4, prefill_qb=3)  # decode winner: a user profile's prefill field
    monkeypatch.setattr(session, "PrefillTuner", FakePrefill)
    rt = runtime.Runtime.for_device(POCL)
    settings = Settings.make(True, 20.0)
    res = session._tune_prefill(rt, device_info(POCL), won, builtin, settings, 20.0 - 13.0,
                                False, lambda text: None)
    assert res.chosen is not None and seen["budget"] == 7.0
    assert seen["base"].vec == 4 and seen["base"].prefill_qb == builtin.prefill_qb
    assert seen["seeds"] == [(won, "current")]
    assert math.isclose(settings.decode_budget_s, 20.0 * (1 - settings.prefill_share))
