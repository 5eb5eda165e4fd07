"""``clattn profile``: ceilings, correctness, tuning, saving the user profile, failure paths.

One quick profile of PoCL runs once for the module (about half a minute); the failure
paths stub the slow steps out.
"""
from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from clattn import checks, cli, profiler, reference, runtime, tuning
from clattn.decode import BatchDecode
from clattn.profiles import device_info, match
from clattn.profiles.record import Profile
from clattn.spec import AttentionSpec


def _pocl():
    for d in runtime.all_devices():
        if "portable computing language" in d.platform.name.lower():
            return d
    return None


POCL = _pocl()
needs_pocl = pytest.mark.skipif(POCL is None, reason="PoCL is not installed")


def _isolate(mp, cfg):
    mp.setenv("CLATTN_CONFIG_DIR", str(cfg))
    mp.delenv("CLATTN_PROFILE", raising=False)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The quick profile of PoCL with --save --json --out: (rc, report, stdout, stderr, paths)."""
    if POCL is None:
        pytest.skip("PoCL is not installed")
    cfg = tmp_path_factory.mktemp("cfg")
    out = tmp_path_factory.mktemp("out") / "report.json"
    with pytest.MonkeyPatch.context() as mp:
        _isolate(mp, cfg)
        cap = _Capture()
        mp.setattr(sys, "stdout", cap.out)
        mp.setattr(sys, "stderr", cap.err)
        rc = cli.main(["profile", "--device", "pocl", "--quick", "--budget", "10", "--save",
                       "--json", "--out", str(out)])
    report = json.loads(cap.out.getvalue())
    return rc, report, cap.out.getvalue(), cap.err.getvalue(), cfg, out


class _Capture:
    def __init__(self):
        import io
        self.out, self.err = io.StringIO(), io.StringIO()


# -- the quick profile -------------------------------------------------------------------------

def test_quick_profile_exit_code_and_json(quick):
    rc, rep, stdout, stderr, cfg, out = quick
    assert rc == 0, stderr
    assert json.loads(out.read_text()) == rep  # --out writes the same report
    assert rep["mode"] == "quick"
    assert rep["device"]["device_name"] == POCL.name
    assert rep["profile"]["rule"] and rep["profile"]["name"]
    assert "tuning [" in stderr  # the progress line


def test_quick_profile_ceilings(quick):
    rep = quick[1]
    c = rep["ceilings"]
    assert not c["errors"]
    assert c["read"]["gbps"] > 0 and c["copy"]["gbps"] > 0
    assert c["launch"]["round_trip_us"] > 0 and c["launch"]["kernel_us"] >= 0
    assert c["transfer"]["h2d"]["gbps"] > 0 and c["transfer"]["d2h"]["gbps"] > 0


def test_quick_profile_correctness(quick):
    cor = quick[1]["correctness"]
    assert cor["passed"]
    names = " | ".join(ch["name"] for ch in cor["checks"])
    for what in ("plain", "split", "RoPE", "sliding window", "merge_state_", "merge_states"):
        assert what in names
    assert all(ch["max_abs_err"] <= ch["tol"] for ch in cor["checks"])


def test_quick_profile_tuning(quick):
    t = quick[1]["tuning"]
    assert t["ran"] and t["best"]
    cands = t["candidates"]
    assert 1 <= len(cands) <= 12
    assert len({json.dumps(c["params"], sort_keys=True) for c in cands}) == len(cands)
    assert cands[0]["origin"] == "default" and cands[0]["status"] == "ok"
    keys = {s["key"] for s in t["shapes"]}
    assert len(keys) == 6
    assert any("llama-3-8b" in k for k in keys) and any("qwen" in k for k in keys)
    ok = [c for c in cands if c["status"] == "ok"]
    for c in ok:
        assert set(c["times_ms"]) == keys and all(v > 0 for v in c["times_ms"].values())
    # CLBlast's rule: the best has the lowest summed relative time; someone is 1.0 per shape
    fastest = {k: min(c["times_ms"][k] for c in ok) for k in keys}
    for c in ok:
        assert math.isclose(c["score"], sum(c["times_ms"][k] / fastest[k] for k in keys))
        assert c["score"] >= len(keys) - 1e-9
    best = min(ok, key=lambda c: (c["score"], c["id"]))
    # the winner is timed again beside the default and kept only if still faster
    conf = t["confirmation"]
    assert conf["scores"] and set(conf["times_ms"]) >= {"#0"}
    assert t["best"]["id"] == (0 if conf.get("kept_default") else best["id"])
    for c in cands:
        assert c["status"] in ("ok", "skipped", "pruned", "stopped")
        if c["status"] != "ok":
            assert c["reason"]
    rows = t["per_shape"]
    assert {r["shape"] for r in rows} == keys
    for r in rows:
        assert r["tuned_gbps"] > 0 and r["default_ms"] > 0 and r["speedup"] > 0
        assert 0 < r["fraction_of_read_bw"] < 5  # measured against the read ceiling


def test_saved_profile_round_trips_through_registry(quick, monkeypatch):
    rc, rep, _, _, cfg, _ = quick
    saved = rep["saved"]
    files = list(cfg.glob("*.json"))
    assert [f.name for f in files] == [f"{saved['name']}.json"]
    entry = json.loads(files[0].read_text())
    assert entry["match"] == {"device": [POCL.name.strip()]}
    assert entry["source"].startswith("measured by clattn profile on ")
    params = entry["params"]
    assert params == {k: v for k, v in rep["tuning"]["best"]["profile"].items()
                      if k not in ("name", "source")}
    _isolate(monkeypatch, cfg)
    m = match(device_info(POCL))
    assert m.level == "user" and m.profile.name == saved["name"]
    for k, v in params.items():
        assert getattr(m.profile, k) == v, k
    # a decoder built afterwards runs with the tuned parameters
    dec = BatchDecode(AttentionSpec(14, 2, 64), POCL, backend="opencl")
    assert dec.profile.name == saved["name"]
    for k, v in params.items():
        assert getattr(dec.profile, k) == v, k


def test_terminal_summary_renders(quick):
    text = profiler.format_report(quick[1])
    for head in ("Device", "Ceilings", "Correctness", "Tuning", "speedup", "of read BW",
                 "Saved user profile"):
        assert head in text
    assert "FAIL" not in text


# -- failure paths (slow steps stubbed) --------------------------------------------------------

def _no_ceilings(monkeypatch):
    monkeypatch.setattr(profiler, "_ceilings", lambda rt, s: ({}, {"read": "stubbed"}))


@needs_pocl
def test_wrong_kernel_result_fails_loudly_and_saves_nothing(tmp_path, monkeypatch, capsys):
    _isolate(monkeypatch, tmp_path / "cfg")
    _no_ceilings(monkeypatch)
    real = reference.batch_decode

    def shifted(*a, **kw):  # the kernel's answer no longer matches "the truth"
        out, lse = real(*a, **kw)
        return out + np.asarray(0.5, out.dtype), lse

    monkeypatch.setattr(reference, "batch_decode", shifted)
    out = tmp_path / "r.json"
    rc = cli.main(["profile", "--device", "pocl", "--quick", "--save", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 1
    assert "CORRECTNESS FAILED" in cap.err and "max error 0.5" in cap.err
    assert "FAIL" in cap.out and "Tuning skipped" in cap.out and "Not saved" in cap.out
    assert not (tmp_path / "cfg").exists() or not list((tmp_path / "cfg").iterdir())
    rep = json.loads(out.read_text())
    assert rep["correctness"]["passed"] is False and "saved" not in rep
    assert rep["tuning"]["ran"] is False


@needs_pocl
def test_ctrl_c_during_tuning_saves_nothing(tmp_path, monkeypatch, capsys):
    _isolate(monkeypatch, tmp_path / "cfg")
    _no_ceilings(monkeypatch)
    monkeypatch.setattr(profiler, "correctness", lambda device, f32=True: [])
    calls = []

    def interrupt(self, *a, **kw):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(tuning.Tuner, "_time", interrupt)
    out = tmp_path / "r.json"
    rc = cli.main(["profile", "--device", "pocl", "--quick", "--save", "--out", str(out)])
    assert rc == 130 and calls
    assert "nothing was saved" in capsys.readouterr().err
    assert not (tmp_path / "cfg").exists() or not list((tmp_path / "cfg").iterdir())
    assert not out.exists()


def _tiny_tuner(quiet=True):
    settings = tuning.Settings(quick=True, budget_s=60, points=((1, 64),), max_kernels=4,
                               max_plans=1, passes=1, target_s=0.005, reps=1)
    rt = runtime.Runtime.for_device(POCL)
    info = device_info(POCL)
    base = match(info, user=False).profile
    return tuning.Tuner(rt, info, base, settings, tuning.Progress(60, enabled=not quiet))


@needs_pocl
def test_candidate_that_fails_to_build_or_is_wrong_is_skipped(monkeypatch):
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)
    real_build, real_run = BatchDecode.build, BatchDecode.run

    def build(self):
        if self.profile.vec == 2:
            raise runtime.BuildError("building a clattn kernel failed: error: boom")
        return real_build(self)

    def run(self, *a, **kw):
        res = real_run(self, *a, **kw)
        if self.profile.vec == 4 and isinstance(res.out, np.ndarray):
            res.out[...] = res.out + np.asarray(1, res.out.dtype)
        return res

    monkeypatch.setattr(BatchDecode, "build", build)
    monkeypatch.setattr(BatchDecode, "run", run)
    tuner = _tiny_tuner()
    try:
        ok = tuner.evaluate(tuner.base, "default", force=True)
        broken = tuner.evaluate(tuner.base.with_(vec=2), "vec=2")
        wrong = tuner.evaluate(tuner.base.with_(vec=4), "vec=4")
        again = tuner.evaluate(tuner.base.with_(vec=2), "vec=2")
    finally:
        tuner.release()
    assert ok.status == "ok" and set(ok.times) == {s.key for s in tuner.shapes}
    assert broken.status == "skipped" and broken.reason.startswith("build failed") \
        and "boom" in broken.reason
    assert wrong.status == "skipped" and "wrong result" in wrong.reason \
        and "max error" in wrong.reason
    assert again is None  # the same parameters are never tried twice
    assert tuner.best() is ok


@needs_pocl
def test_plan_only_candidates_reuse_identical_launches(monkeypatch):
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)
    tuner = _tiny_tuner()
    try:
        a = tuner.evaluate(tuner.base, "default", force=True)
        # a partition floor that changes no plan at 64 rows: every time is reused, nothing built
        b = tuner.evaluate(tuner.base.with_(min_partition_rows=a.profile.min_partition_rows * 2),
                           "min_partition_rows")
    finally:
        tuner.release()
    assert b.status == "ok" and b.reused == len(tuner.shapes) and b.times == a.times


# -- output pieces --------------------------------------------------------------------------

def _fake_report():
    prof = Profile(name="pocl-cpu", strategy="rows", vec=8).to_dict()
    rows = [{"shape": f"m B={b} ctx={c}", "model": "m", "batch": b, "context": c, "bytes": 1,
             "default_ms": 2.0, "tuned_ms": 1.0, "speedup": 2.0, "default_gbps": 1.0,
             "tuned_gbps": 2.0, "fraction_of_read_bw": 0.2, "tuned_plan": "no split"}
            for b in (1, 8) for c in (1024, 8192)]
    params = {k: prof[k] for k in tuning.TUNED_FIELDS}
    return {
        "mode": "quick", "date": "today", "device": {"device_name": "Fake", "platform_name": "P"},
        "device_report": "  device  Fake",
        "profile": {"name": "pocl-cpu", "level": "vendor", "rule": "vendor: x", "fit_notes": []},
        "builtin_profile": {"name": "pocl-cpu", "params": prof},
        "ceilings": {"read": {"gbps": 10.0, "best": "float8", "median_gbps": 9.0}, "errors": {}},
        "correctness": {"passed": True, "profile": "pocl-cpu", "checks": []},
        "tuning": {"ran": True, "settings": {"budget_s": 25},
                   "shapes": [{"key": r["shape"]} for r in rows],
                   "elapsed_s": 1.0, "stopped": None,
                   "candidates": [{"id": 0, "origin": "default", "status": "ok", "reason": "",
                                   "score": 4.0, "params": params}],
                   "best": {"id": 0, "score": 4.0, "params": params, "profile": prof,
                            "default_score": 4.0},
                   "per_shape": rows},
    }


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    why = profiler.plot_report(_fake_report(), str(tmp_path / "p.png"))
    assert why and "pip install clattn[plot]" in why
    assert not (tmp_path / "p.png").exists()


@needs_pocl
def test_missing_matplotlib_fails_only_the_plot(tmp_path, monkeypatch, capsys):
    _isolate(monkeypatch, tmp_path / "cfg")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(profiler, "profile_device", lambda *a, **kw: _fake_report())
    rc = cli.main(["profile", "--device", "pocl", "--quick", "--save", "--plot",
                   str(tmp_path / "p.png"), "--out", str(tmp_path / "r.json")])
    cap = capsys.readouterr()
    assert rc == 3
    assert "pip install clattn[plot]" in cap.err
    assert list((tmp_path / "cfg").glob("*.json"))  # everything else still happened
    assert json.loads((tmp_path / "r.json").read_text())["plot_error"]


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    assert profiler.plot_report(_fake_report(), str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_rules():
    ref_o = np.ones((2, 2, 4), np.float32)
    ref_s = np.array([[0.5, -np.inf], [1.0, 2.0]], np.float32)
    assert checks.compare(ref_o, ref_s, ref_o, ref_s, "float16")[:2] == (True, 0.0)
    ok, err, why = checks.compare(ref_o + 0.01, ref_s, ref_o, ref_s, "float16")
    assert not ok and math.isclose(err, 0.01, rel_tol=1e-3) and "outside" in why
    bad_s = ref_s.copy()
    bad_s[0, 1] = 3.0
    assert "-inf" in checks.compare(ref_o, bad_s, ref_o, ref_s, "float16")[2]
    nan_o = ref_o.copy()
    nan_o[0, 0, 0] = np.nan
    assert "NaN" in checks.compare(nan_o, ref_s, ref_o, ref_s, "float16")[2]


def test_quick_settings_are_bounded():
    s = tuning.Settings.make(True, None)
    assert s.max_kernels <= 8 and s.budget_s < 60 and s.passes == 1
    full = tuning.Settings.make(False, 120)
    assert full.budget_s == 120 and full.max_kernels > s.max_kernels
    shapes = tuning.shapes_for(tuning.FULL_POINTS)
    assert len(shapes) == 8
    assert shapes == sorted(shapes, key=lambda x: (x.bytes_moved, x.key))
    llama = [x for x in shapes if x.model == "llama-3-8b" and x.batch == 1 and x.context == 1024][0]
    assert llama.bytes_moved == 1024 * 2 * 8 * 128 * 2 + 2 * 32 * 128 * 2


def test_profile_entry_is_accepted_by_the_registry(tmp_path, monkeypatch):
    from clattn.profiles import save_user_profile
    _isolate(monkeypatch, tmp_path)
    best = Profile(strategy="rows", vec=16, tile_rows=2, wgs_per_cu=4)
    entry = profiler.profile_entry("measured-x", "Some Device", best, "generic-cpu", "notes")
    path = save_user_profile(entry)
    info = {"device_name": "Some Device", "device_type": "CPU"}
    m = match(info)
    assert path.exists() and m.level == "user"
    assert (m.profile.vec, m.profile.tile_rows, m.profile.wgs_per_cu) == (16, 2, 4)


@needs_pocl
def test_confirmation_keeps_the_default_when_the_winner_does_not_hold_up(monkeypatch):
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)
    tuner = _tiny_tuner()
    base_vec = tuner.base.vec
    # deterministic clock (a loaded machine must not prune the candidate): the default
    # really is twice as fast as the other candidate
    monkeypatch.setattr(tuning.Tuner, "_time", lambda self, dec, *a, **kw:
                        1e-3 if dec.profile.vec == base_vec else 2e-3)
    try:
        default = tuner.evaluate(tuner.base, "default", force=True)
        other = tuner.evaluate(tuner.base.with_(vec=base_vec // 2), "vec")
        assert other.status == "ok"
        other.times = {k: v / 2 for k, v in default.times.items()}  # a lucky search
        tuner._rescore()
        assert tuner.best() is other
        tuner.confirm()
    finally:
        tuner.release()
    assert tuner.chosen is default
    assert "not faster than the default" in tuner.confirmation["kept_default"]
    rep = profiler._tuning_report(tuner, read_gbps=10.0)
    assert rep["best"]["id"] == default.id
    assert all(math.isclose(r["speedup"], 1.0) for r in rep["per_shape"])
