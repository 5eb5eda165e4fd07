"""``clattn tune`` (alias ``clattn profile``): ceilings, correctness, tuning, the outputs,
failure paths and exit codes.

One quick run on PoCL serves the module (about 15 s); the failure paths stub the slow steps.
"""
from __future__ import annotations

import io
import json
import math
import sys
import time

import numpy as np
import pytest

from clattn import cli, cpu_backend, runtime
from clattn.decode import BatchDecode
from clattn.profiles import device_info, match, save_user_profile
from clattn.profiles.record import Profile
from clattn.spec import AttentionSpec
from clattn.tune import checks, command, search, session
from clattn.tune.ceilings import Cache, FmaPeak, Measurement, Sizing
from clattn.tune.checks import Check
from clattn.tune.report import CeilingsResult, ProfileChoice, Report, format_report, plot_report
from clattn.tune.search import Candidate, Parameter, Settings, ShapeResult, Tuner, TuningResult
from clattn.tune.workloads import FULL_POINTS, Shape, shapes_for


def _pocl():
    """A usable PoCL device (a PoCL build whose compiler fails is passed over), or None."""
    try:
        dev = runtime.select_device("pocl")
    except runtime.NoDeviceError:
        return None
    return dev if runtime.device_problem(dev) is None else None


POCL = _pocl()
needs_pocl = pytest.mark.skipif(POCL is None, reason="PoCL is not installed")


def _isolate(mp, cfg):
    mp.setenv("CLATTN_CONFIG_DIR", str(cfg))
    mp.delenv("CLATTN_PROFILE", raising=False)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``clattn profile --quick --save --json --out --plot`` on PoCL:
    (rc, stdout JSON, stderr, config dir, --out path, --plot path)."""
    if POCL is None:
        pytest.skip("PoCL is not installed")
    pytest.importorskip("matplotlib")
    cfg = tmp_path_factory.mktemp("cfg")
    outdir = tmp_path_factory.mktemp("out")
    out, png = outdir / "report.json", outdir / "plot.png"
    with pytest.MonkeyPatch.context() as mp:
        _isolate(mp, cfg)
        stdout, stderr = io.StringIO(), io.StringIO()
        mp.setattr(sys, "stdout", stdout)
        mp.setattr(sys, "stderr", stderr)
        rc = cli.main(["profile", "--device", "pocl", "--quick", "--budget", "10", "--save",
                       "--json", "--out", str(out), "--plot", str(png)])
    return rc, json.loads(stdout.getvalue()), stderr.getvalue(), cfg, out, png


# -- the quick run ----------------------------------------------------------------------------

def test_quick_run_exit_code_json_and_outputs(quick):
    rc, rep, stderr, cfg, out, png = quick
    assert rc == 0, stderr
    written = json.loads(out.read_text())
    outputs = written.pop("outputs")
    assert written == rep  # --out holds the printed report, plus what was written
    assert outputs["saved"]["path"].startswith(str(cfg)) and outputs["plot"] == str(png)
    assert not outputs["errors"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot path runs in CI
    assert rep["mode"] == "quick" and rep["device"]["device_name"] == POCL.name
    assert rep["profile"]["rule"] and rep["profile"]["name"]
    assert "tuning [" in stderr  # the progress line
    assert "Saved user profile" in stderr  # --json: the outcome lines go to stderr


def test_quick_run_ceilings_past_every_cache(quick):
    c = quick[1]["ceilings"]
    assert not c["errors"]
    for kind in ("read", "copy"):
        m = c[kind]
        assert 0 < m["median_gbps"] <= m["gbps"]
        sz = m["sizing"]
        big = sz["largest_cache"]
        assert big and big["size_bytes"] > 0
        # 4x the largest cache the device or the host reports, unless a stated cap
        assert sz["working_set_bytes"] >= 4 * big["size_bytes"] * 0.99 or sz["cap"]
    host = [ch for ch in c["read"]["sizing"]["caches"] if ch["where"].startswith("host")]
    assert host  # PoCL is a CPU device: the host's caches count too
    assert c["launch"]["round_trip_us"] > 0 and c["launch"]["kernel_us"] >= 0
    assert c["transfer"]["h2d"]["gbps"] > 0 and c["transfer"]["d2h"]["gbps"] > 0
    fma = c["fma"]  # the f32 multiply-add peak beside the bandwidth ceilings
    assert 0 < fma["gflops"] <= fma["best_gflops"] and fma["repetitions"] >= 3
    assert fma["flops"] > 0 and len(fma["samples"]) == fma["repetitions"]


def test_quick_run_correctness_covers_every_feature(quick):
    rep = quick[1]
    assert rep["correctness_passed"]
    names = " | ".join(ch["name"] for ch in rep["correctness"])
    for what in ("f16", "f32", "plain", "split", "RoPE", "sliding window + sinks", "soft-cap",
                 "K q8_0 V q4_0", "K q4_0 V q8_0", "prefill f16", "causal + RoPE",
                 "non-causal", "merge_state_ f16", "merge_states f32"):
        assert what in names, what
    assert all(ch["max_abs_err"] <= ch["tol"] for ch in rep["correctness"])
    assert set(rep["kv_bytes"]["per_format"]) == {"float16", "float32", "q8_0", "q4_0"}


def test_quick_run_tuning(quick):
    t = quick[1]["tuning"]
    cands = t["candidates"]
    assert t["chosen"] and 1 <= len(cands) <= 12
    assert len({json.dumps(c["profile"], sort_keys=True) for c in cands}) == len(cands)
    assert cands[0]["origin"] == "default" and cands[0]["status"] == "ok"
    # every shape measured, or (a machine slower than the budget) left out with the reason
    keys = {s["key"] for s in t["shapes"]}
    skipped = t["skipped_shapes"]
    named = keys | set(skipped)
    assert keys and len(named) == 6 and not keys & set(skipped)
    assert all("time budget" in why for why in skipped.values())
    assert any("Llama-3-8B" in k for k in named) and any("Qwen" in k for k in named)
    ok = [c for c in cands if c["status"] == "ok"]
    for c in ok:
        assert set(c["times"]) == keys and all(v > 0 for v in c["times"].values())
    # CLBlast's rule: the best has the lowest summed relative time; someone is 1.0 per shape
    fastest = {k: min(c["times"][k] for c in ok) for k in keys}
    for c in ok:
        assert math.isclose(c["score"], sum(c["times"][k] / fastest[k] for k in keys))
        assert c["score"] >= len(keys) - 1e-9
    best = min(ok, key=lambda c: (c["score"], c["id"]))
    conf = t["confirmation"]  # the winner timed again beside the default, kept if faster
    if conf is None:  # the default won with the budget spent: nothing to time again
        assert best["id"] == 0 and t["chosen"]["id"] == 0
    else:
        assert conf["scores"] and "0" in conf["times"]
        assert t["chosen"]["id"] == (0 if conf["kept_default"] else best["id"])
    for c in cands:
        assert c["status"] in ("ok", "skipped", "pruned", "stopped")
        assert c["status"] == "ok" or c["reason"]
    rows = t["per_shape"]
    assert {r["shape"]["key"] for r in rows} == keys
    for r in rows:
        assert r["tuned_gbps"] > 0 and r["default_s"] > 0 and r["speedup"] > 0
        assert r["page_sets"] >= 2  # timed calls rotate over page sets
        # medians against the median read ceiling: a ratio of two timings, so only its
        # sign is checked (that the pages are read past every cache is checked by sizes:
        # page_sets above, the ceilings' working set in the ceilings test)
        assert r["fraction_of_read_bw"] > 0
        roof = r["roofline"]  # the bound of the shape on the measured ceilings
        assert roof["bound"] in ("memory", "compute") and roof["fraction"] > 0
        assert roof["bound_s"] == max(roof["memory_s"], roof["compute_s"])


def test_quick_run_saved_profile_round_trips_through_registry(quick, monkeypatch):
    rc, rep, _, cfg, out, _ = quick
    saved = json.loads(out.read_text())["outputs"]["saved"]
    files = list(cfg.glob("*.json"))
    assert [f.name for f in files] == [f"{saved['name']}.json"]
    entry = json.loads(files[0].read_text())
    assert entry["match"] == {"device": [POCL.name.strip()]}
    assert entry["source"].startswith("measured by clattn tune on ")
    chosen = next(c for c in rep["tuning"]["candidates"]
                  if c["id"] == rep["tuning"]["chosen"]["id"])
    # the saved profile: the prefill stage's choice, which carries the decode stage's
    assert entry["params"] == {k: v for k, v in rep["chosen"].items()
                               if k not in ("name", "source")}
    assert {k: v for k, v in entry["params"].items() if not k.startswith("prefill_")} == \
        {k: v for k, v in chosen["profile"].items()
         if k not in ("name", "source") and not k.startswith("prefill_")}
    pre = rep["prefill"]  # the prefill stage ran, from the decode stage's choice
    assert pre["candidates"][0]["origin"] == "default" and pre["chosen"]
    assert rep["chosen"] == pre["chosen"]["profile"]
    _isolate(monkeypatch, cfg)
    m = match(device_info(POCL))
    assert m.level == "user" and m.profile.name == saved["name"]
    dec = BatchDecode(AttentionSpec(14, 2, 64), POCL, backend="opencl")
    assert dec.profile.name == saved["name"]
    for k, v in entry["params"].items():
        assert getattr(m.profile, k) == v and getattr(dec.profile, k) == v, k


# -- typed report pieces ----------------------------------------------------------------------

def _fake_report(passed: bool = True, winner_passed: bool | None = None) -> Report:
    prof = Profile(name="pocl-cpu", strategy="rows", vec=8)
    choice = ProfileChoice("pocl-cpu", "vendor", "vendor: x", (), prof)
    shapes = [Shape("m", 8, 2, 64, b, c) for b in (1, 8) for c in (1024, 8192)]
    cand = Candidate(0, prof, "default", status="ok", times={s.key: 1e-3 for s in shapes},
                     score=4.0)
    tuning = TuningResult(Settings.make(True, None), shapes, {}, [cand], 1.0, chosen=cand,
                          default=cand, per_shape=[ShapeResult(s, 2e-3, 1e-3, "no split", 4)
                                                   for s in shapes])
    read = Measurement("read", "Fake", 10.0, "float8, strided", 1 << 27, 0.01, 9.0, 3,
                       sizing=Sizing(1 << 27, (Cache("host L3", 1 << 25),)))
    checks_ = [Check("decode f16 plain", passed, 1e-5 if passed else 0.5, 2e-3,
                     "" if passed else "1 value(s) outside")]
    fma = FmaPeak("Fake", 100.0, 120.0, (0.01, 0.01, 0.01), 10**9)
    rep = Report("today", "quick", {"device_name": "Fake", "platform_name": "P"}, choice, choice,
                 CeilingsResult(read=read, fma=fma), checks_, tuning=tuning if passed else None,
                 tuning_note="" if passed else "skipped: correctness failed")
    if winner_passed is not None:
        rep.winner_checks = [Check("decode f32 RoPE", winner_passed, 0.0 if winner_passed else 1.0,
                                   1e-4)]
    return rep


def test_text_report_renders():
    text = format_report(_fake_report())
    for head in ("Device", "Ceilings", "working set 128 MiB = 4x the largest cache, host L3 32 MiB",
                 "Correctness", "Tuning", "speedup", "of read BW (medians)", "page sets",
                 "roofline ms", "of roofline",
                 "The tuned profile is the profile checked above"):
        assert head in text, head
    assert "FAIL" not in text
    failed = format_report(_fake_report(passed=False))
    assert "CORRECTNESS FAILED" in failed and "Tuning skipped: correctness failed" in failed
    assert "TUNED PROFILE FAILED" in format_report(_fake_report(winner_passed=False))


def test_report_json_is_typed_data_with_derived_figures():
    rep = _fake_report()
    j = rep.to_json()
    json.dumps(j)  # JSON-able
    row = j["tuning"]["per_shape"][0]
    assert row["speedup"] == 2.0 and row["shape"]["key"] == "m B=1 ctx=1024"
    assert math.isclose(row["fraction_of_read_bw"], row["tuned_gbps"] / 9.0)  # median / median
    # the roofline of m B=1 ctx=1024 (8 query heads, head_dim 64, f16): 2 * 8 * 64 multiply-
    # adds per row = 1,048,576 in all, 2 FLOPs each at 100 GFLOP/s: 21.0 us; its bytes
    # (K and V of 2 KV heads x 64 x 2 B per row, q and out 2 x 8 x 64 x 2 B) at 9 GB/s: 58.5 us
    flops, nbytes = 2 * (2 * 1024 * 8 * 64), 1024 * 2 * 2 * 64 * 2 + 2 * 8 * 64 * 2
    roof = row["roofline"]
    assert math.isclose(roof["compute_s"], flops / 100e9)
    assert math.isclose(roof["memory_s"], nbytes / 9e9)
    assert roof["bound"] == "memory" and math.isclose(roof["bound_s"], nbytes / 9e9)
    assert math.isclose(roof["fraction"], nbytes / 9e9 / 1e-3)  # tuned: 1 ms
    assert "kernel_key" not in j["tuning"]["candidates"][0]
    assert j["correctness_passed"] is True and j["winner_passed"] is True


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    why = plot_report(_fake_report(), str(tmp_path / "p.png"))
    assert why and "pip install clattn[plot]" in why
    assert not (tmp_path / "p.png").exists()


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    assert plot_report(_fake_report(), str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the command: outputs and exit codes (measurement stubbed) --------------------------------

def _stub_run(monkeypatch, rep: Report):
    monkeypatch.setattr(session, "tune_device", lambda *a, **kw: rep)


def _main(*extra):
    return cli.main(["profile", "--device", "pocl", "--quick", "--no-progress", *extra])


@needs_pocl
def test_plot_through_the_command(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    _isolate(monkeypatch, tmp_path / "cfg")
    _stub_run(monkeypatch, _fake_report())
    rc = _main("--plot", str(tmp_path / "p.png"))
    assert rc == command.EXIT_OK
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert f"Plot written to {tmp_path / 'p.png'}" in capsys.readouterr().out


@needs_pocl
def test_missing_matplotlib_fails_only_the_plot(tmp_path, monkeypatch, capsys):
    _isolate(monkeypatch, tmp_path / "cfg")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    _stub_run(monkeypatch, _fake_report())
    rc = _main("--save", "--plot", str(tmp_path / "p.png"), "--out", str(tmp_path / "r.json"))
    assert rc == command.EXIT_PLOT
    assert "pip install clattn[plot]" in capsys.readouterr().err
    assert list((tmp_path / "cfg").glob("*.json"))  # everything else still happened
    assert json.loads((tmp_path / "r.json").read_text())["outputs"]["plot_error"]


@needs_pocl
@pytest.mark.parametrize("as_json", [False, True])
def test_write_errors_keep_the_report_and_exit_2(tmp_path, monkeypatch, capsys, as_json):
    """Issue 16: an unusable config dir for --save and a directory as --out."""
    not_a_dir = tmp_path / "cfg"
    not_a_dir.write_text("a file where the config directory should be")
    _isolate(monkeypatch, not_a_dir)
    _stub_run(monkeypatch, _fake_report())
    rc = _main("--save", "--out", str(tmp_path), *(["--json"] if as_json else []))
    cap = capsys.readouterr()
    assert rc == command.EXIT_FAILED != command.EXIT_WRONG
    if as_json:
        assert json.loads(cap.out)["ceilings"]["read"]["gbps"] == 10.0  # printed, valid JSON
    else:
        assert "Ceilings" in cap.out and "Correctness" in cap.out and "speedup" in cap.out
    assert "could not write the user profile (--save)" in cap.err and str(not_a_dir) in cap.err
    assert "could not write the JSON report (--out)" in cap.err and "Error" in cap.err
    assert "2 output(s) could not be written" in cap.err
    assert not_a_dir.read_text().startswith("a file")


@needs_pocl
def test_plot_write_error_exits_2_and_other_outputs_are_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    _isolate(monkeypatch, tmp_path / "cfg")
    _stub_run(monkeypatch, _fake_report())
    rc = _main("--save", "--plot", str(tmp_path / "no" / "such" / "dir" / "p.png"))
    cap = capsys.readouterr()
    assert rc == command.EXIT_FAILED
    assert "could not write the plot (--plot)" in cap.err
    assert "Saved user profile" in cap.out and list((tmp_path / "cfg").glob("*.json"))


@needs_pocl
def test_correctness_failure_outranks_a_write_error(tmp_path, monkeypatch, capsys):
    _isolate(monkeypatch, tmp_path / "cfg")
    _stub_run(monkeypatch, _fake_report(passed=False))
    rc = _main("--save", "--out", str(tmp_path))
    cap = capsys.readouterr()
    assert rc == command.EXIT_WRONG
    assert "CORRECTNESS FAILED" in cap.err and "could not write the JSON report" in cap.err
    assert "Not saved: correctness failed" in cap.out


@needs_pocl
def test_wrong_kernel_result_fails_loudly_and_saves_nothing(tmp_path, monkeypatch, capsys):
    _isolate(monkeypatch, tmp_path / "cfg")
    monkeypatch.setattr(session, "measure_ceilings", lambda rt, s, *cap: CeilingsResult(
        errors={"read": "stubbed"}))
    real = cpu_backend.batch_decode

    def shifted(*a, **kw):  # the kernel's answer no longer matches "the truth"
        out, lse = real(*a, **kw)
        return out + np.asarray(0.5, out.dtype), lse

    monkeypatch.setattr(cpu_backend, "batch_decode", shifted)
    out = tmp_path / "r.json"
    rc = _main("--save", "--out", str(out))
    cap = capsys.readouterr()
    assert rc == command.EXIT_WRONG
    assert "CORRECTNESS FAILED" in cap.err and "max error 0.5" in cap.err
    assert "FAIL" in cap.out and "Tuning skipped" in cap.out and "Not saved" in cap.out
    assert not (tmp_path / "cfg").exists() or not list((tmp_path / "cfg").iterdir())
    rep = json.loads(out.read_text())
    assert rep["correctness_passed"] is False and rep["outputs"]["saved"] is None
    assert rep["tuning"] is None


class _FakePrefillTuner:
    """Stands for prefill_search.PrefillTuner: keeps its default (no prefill kernels)."""

    def __init__(self, rt, info, base, settings, progress, budget_s, seeds=()):
        self.base = base

    def run(self):
        default = Candidate(0, self.base, "default", status="ok", score=1.0)
        return TuningResult(Settings.make(True, None), [], {}, [default], 0.1, chosen=default,
                            default=default)


class _FakeTuner:
    """Stands for search.Tuner: 'finds' a profile with vec=4 (not the one checked first)."""

    def __init__(self, rt, info, base, settings, progress, seeds=(), **budget):
        self.base = base

    def run(self):
        win = Candidate(1, self.base.with_(vec=4), "vec=4", status="ok", score=1.0)
        default = Candidate(0, self.base, "default", status="ok", score=2.0)
        return TuningResult(Settings.make(True, None), [], {}, [default, win], 0.1,
                            chosen=win, default=default)


@needs_pocl
@pytest.mark.parametrize("winner_ok", [True, False])
def test_the_winner_is_verified_on_the_full_set_before_it_is_saved(tmp_path, monkeypatch,
                                                                    capsys, winner_ok):
    _isolate(monkeypatch, tmp_path / "cfg")
    monkeypatch.setattr(session, "measure_ceilings", lambda rt, s, *cap: CeilingsResult())
    monkeypatch.setattr(session, "Tuner", _FakeTuner)
    monkeypatch.setattr(session, "PrefillTuner", _FakePrefillTuner)
    seen = []

    def fake_correctness(device, *, profile=None):
        seen.append(profile)
        ok = winner_ok or profile.vec != 4
        return [Check(f"decode f32 RoPE ({profile.vec})", ok, 0.0 if ok else 0.25, 1e-4)]

    monkeypatch.setattr(session, "correctness", fake_correctness)
    monkeypatch.setattr(session, "check_groups", lambda device, profile=None: [
        ("all", lambda: fake_correctness(device, profile=profile))])
    rc = _main("--save")
    cap = capsys.readouterr()
    assert [p.vec for p in seen][1:] == [4] and seen[0].vec != 4  # the registry's, then the winner
    saved = list((tmp_path / "cfg").glob("*.json")) if (tmp_path / "cfg").exists() else []
    if winner_ok:
        assert rc == command.EXIT_OK and len(saved) == 1
        assert json.loads(saved[0].read_text())["params"]["vec"] == 4
        assert "Correctness of the tuned profile" in cap.out
    else:
        assert rc == command.EXIT_WRONG and not saved
        assert "the tuned profile" in cap.err and "TUNED PROFILE FAILED" in cap.out
        assert "Not saved: correctness failed" in cap.out


@needs_pocl
def test_correctness_runs_the_profile_it_is_given(monkeypatch):
    prof = match(device_info(POCL), user=False).profile
    seen = []
    real_bd, real_m2, real_mk = checks.BatchDecode, checks.merge_state_, checks.merge_states
    real_bp = checks.BatchPrefill

    def spy(fn):
        def wrapped(*a, profile=None, **kw):
            seen.append(profile)
            return fn(*a, profile=profile, **kw)
        return wrapped

    monkeypatch.setattr(checks, "BatchDecode", spy(real_bd))
    monkeypatch.setattr(checks, "merge_state_", spy(real_m2))
    monkeypatch.setattr(checks, "merge_states", spy(real_mk))
    monkeypatch.setattr(checks, "BatchPrefill", spy(real_bp))
    res = checks.correctness(POCL, profile=prof)
    assert all(c.passed for c in res), [c for c in res if not c.passed]
    decoders = len(checks.DECODE_CASES) + len(checks.QUANT_CASES)
    assert len(seen) == decoders + 1 + 4 and all(p is prof for p in seen)


@needs_pocl
def test_ctrl_c_during_tuning_saves_nothing(tmp_path, monkeypatch, capsys):
    _isolate(monkeypatch, tmp_path / "cfg")
    monkeypatch.setattr(session, "measure_ceilings", lambda rt, s, *cap: CeilingsResult())
    monkeypatch.setattr(session, "correctness", lambda device, profile=None: [])
    calls = []

    def interrupt(self, *a, **kw):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(Tuner, "_time", interrupt)
    out = tmp_path / "r.json"
    rc = _main("--save", "--out", str(out))
    assert rc == command.EXIT_INTERRUPTED and calls
    assert "nothing was saved" in capsys.readouterr().err
    assert not (tmp_path / "cfg").exists() or not list((tmp_path / "cfg").iterdir())
    assert not out.exists()


def test_tune_is_the_command_and_profile_its_alias():
    p = cli.build_parser()
    for name in ("tune", "profile"):
        args = p.parse_args([name, "--quick"])
        assert args.func is command.run and args.quick


# -- the tuner on a tiny workload --------------------------------------------------------------

def _tiny_tuner(monkeypatch):
    """A quick tuner on one tiny shape, its time budget off (search.NO_BUDGET): every
    candidate a test evaluates is tried however slow or busy the machine is; its pool a
    32 MiB cold set (filling one past every cache took minutes on one busy core)."""
    monkeypatch.setattr(search, "sizing", lambda dev: Sizing(32 << 20))
    settings = Settings(quick=True, budget_s=search.NO_BUDGET, points=((1, 64),),
                        max_kernels=4, max_plans=1, passes=1, target_s=0.005, reps=3)
    rt = runtime.Runtime.for_device(POCL)
    info = device_info(POCL)
    base = match(info, user=False).profile
    tuner = Tuner(rt, info, base, settings, search.Progress(60, enabled=False))
    tuner.t0 -= 1e6  # as if a slow machine had spent a million seconds: no verdict changes
    return tuner


def narrower_vec(vec: int) -> int:
    """A vector width whose rows kernel differs from the one a profile of ``vec`` builds
    on any CPU: a quarter of it, since a CPU without AVX-512 cuts 16 floats to 8 (so half
    of 16 is the default's own kernel there, and the tuner drops it as a duplicate)."""
    return max(1, vec // 4)


def _sized_tuner(monkeypatch, cold: int, host_available: int, **budget):
    """The quick tuner's shapes on PoCL with a cold-pool wish and a host that has
    ``host_available`` bytes free (what a machine with a large L3 and little free memory
    gives: PoCL reports its L3 as the global cache, 4x that is the cold wish);
    ``budget``: the Tuner's ``budget_s`` and ``fill_rate``."""
    from clattn.tune.workloads import QUICK_POINTS

    monkeypatch.setattr(search, "sizing", lambda dev: Sizing(cold))
    monkeypatch.setattr(search, "host_available_bytes", lambda: host_available)
    settings = Settings(quick=True, budget_s=60, points=QUICK_POINTS)
    rt = runtime.Runtime.for_device(POCL)
    info = dict(device_info(POCL), global_mem_size_bytes=64 << 30,
                max_mem_alloc_size_bytes=16 << 30)
    base = match(info, user=False).profile
    return Tuner(rt, info, base, settings, search.Progress(60, enabled=False), **budget)


@needs_pocl
def test_pools_shrink_before_any_shape_is_dropped(monkeypatch):
    """A 300 MiB L3 (cold wish 4 x 480 MiB per model) on a host with 3 GiB free: every quick
    shape is kept, the pools shrink alike to fit half the free memory, and the report says so."""
    t = _sized_tuner(monkeypatch, cold=1920 << 20, host_available=3 << 30)
    assert not t.skipped_shapes and len(t.shapes) == len(shapes_for(t.settings.points, t.models))
    room = (3 << 30) // 2
    used = sum(n * t.specs[m].layout.page_bytes for m, n in t._pool_pages.items())
    assert used <= room
    assert t.memory_notes and "shrunk" in t.memory_notes[0]
    for s in t.shapes:
        assert t._pool_pages[s.model] >= s.num_pages


@needs_pocl
def test_shapes_drop_only_when_their_pages_do_not_fit(monkeypatch):
    """With less free memory than the page sets need, the largest shapes go first, each
    with its reason, and what is kept fits."""
    t = _sized_tuner(monkeypatch, cold=1920 << 20, host_available=64 << 20)
    assert t.skipped_shapes and t.shapes
    assert all("do not fit" in why for why in t.skipped_shapes.values())
    kept_max = max(s.pages_bytes for s in t.shapes)
    assert all(s.pages_bytes >= kept_max for s in shapes_for(t.settings.points, t.models)
               if s.key in t.skipped_shapes)


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
    tuner = _tiny_tuner(monkeypatch)
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
    tuner = _tiny_tuner(monkeypatch)
    try:
        a = tuner.evaluate(tuner.base, "default", force=True)
        # a partition floor that changes no plan at 64 rows: every time is reused, nothing built
        b = tuner.evaluate(tuner.base.with_(min_partition_rows=a.profile.min_partition_rows * 2),
                           "min_partition_rows")
    finally:
        tuner.release()
    assert b.status == "ok" and b.reused == len(tuner.shapes) and b.times == a.times


@needs_pocl
def test_tuner_times_kernel_events_over_rotating_page_sets(monkeypatch):
    """Host overhead is not scored, and successive calls read different page sets."""
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)
    real_run = BatchDecode.run
    sets = []

    host = []

    def slow_host(self, *a, **kw):
        sets.append(a[3].offset)  # page_indices: a view of the page set
        res = real_run(self, *a, **kw)
        t0 = time.perf_counter()
        sum(range(200_000))  # milliseconds of host time per call, timed here
        host.append(time.perf_counter() - t0)
        return res

    tuner = _tiny_tuner(monkeypatch)
    try:
        shape = tuner.shapes[0]
        w = tuner._workload(shape)
        dec = tuner._decoder(tuner.specs[shape.model], tuner.base).build()
        plan = dec.plan(w.indptr, w.last)
        monkeypatch.setattr(BatchDecode, "run", slow_host)
        t = tuner._time(dec, w, plan, shape, prune=False)
    finally:
        tuner.release()
    # a kernel over 64 rows takes microseconds: the score is well below the host time added
    assert isinstance(t, float) and 0 < t < min(host) / 2
    assert w.n_sets > 1 and len(set(sets)) == len(sets) >= 4  # a new page set every call


@needs_pocl
def test_confirmation_keeps_the_default_when_the_winner_does_not_hold_up(monkeypatch):
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)
    tuner = _tiny_tuner(monkeypatch)
    base_vec = tuner.base.vec
    # deterministic clock (a loaded machine must not prune the candidate): the default
    # really is twice as fast as the other candidate
    monkeypatch.setattr(Tuner, "_time", lambda self, dec, *a, **kw:
                        1e-3 if dec.profile.vec == base_vec else 2e-3)
    try:
        default = tuner.evaluate(tuner.base, "default", force=True)
        other = tuner.evaluate(tuner.base.with_(vec=narrower_vec(base_vec)), "vec")
        assert other is not None, "the other candidate builds the default's kernel"
        assert other.status == "ok"
        other.times = {k: v / 2 for k, v in default.times.items()}  # a lucky search
        tuner._rescore()
        assert tuner.best() is other
        tuner.confirm()
        res = tuner.result()
    finally:
        tuner.release()
    assert tuner.chosen is default and res.chosen is default
    assert "not faster than the default" in res.confirmation.kept_default
    assert all(math.isclose(r.speedup, 1.0) for r in res.per_shape)


@needs_pocl
def test_the_default_stops_between_shapes_when_the_budget_is_spent(monkeypatch):
    """A machine slower than the budget, on a fake clock: building and verifying the
    default's first kernel "takes" longer than the budget, so its other model's kernel is
    not built; the default is timed on its first shape, the shapes left are dropped with
    the reason, and no other seed runs past the budget."""
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)
    now = [0.0]
    settings = Settings(quick=True, budget_s=1.0, points=((1, 64), (2, 64)), max_kernels=4,
                        max_plans=1, passes=1, target_s=0.005, reps=3)
    rt = runtime.Runtime.for_device(POCL)
    info = device_info(POCL)
    base = match(info, user=False).profile
    tuner = Tuner(rt, info, base, settings, search.Progress(1.0, enabled=False),
                  extra_seeds=[(base.with_(vec=narrower_vec(base.vec)), "vec")],
                  clock=lambda: now[0])
    shapes = list(tuner.shapes)
    assert len(shapes) > 1 and len({s.model for s in shapes}) > 1
    verify = Tuner._verify

    def slow_verify(self, dec, name):
        now[0] += 1.5  # longer than the whole budget
        return verify(self, dec, name)

    def slow_time(self, *a, **kw):
        now[0] += 1.5
        return 1e-3
    monkeypatch.setattr(Tuner, "_verify", slow_verify)
    monkeypatch.setattr(Tuner, "_time", slow_time)
    try:
        tuner.search()
        res = tuner.result()
    finally:
        tuner.release()
    default = res.default
    assert default.status == "ok" and list(default.times) == [shapes[0].key]
    assert [s.key for s in res.shapes] == [shapes[0].key]
    assert all("time budget" in res.skipped_shapes[s.key] for s in shapes[1:])
    # the vec seed is a candidate of its own (not the default's kernel again), never timed
    assert len(res.candidates) > 1 and res.stopped
    assert all(c.status != "ok" for c in res.candidates[1:])


@needs_pocl
def test_a_candidate_stops_between_two_models_kernels_once_the_budget_is_spent(monkeypatch):
    """On a fake clock, nothing built: the default's kernels "take" 0.5 s a model, the
    next candidate's 11 s: it passes the 10 s budget on its first model, stops there
    (its other model's kernel not built, nothing timed) and no further candidate starts."""
    now = [0.0]
    tuner = _sized_tuner(monkeypatch, cold=64 << 20, host_available=64 << 30, budget_s=10.0,
                         clock=lambda: now[0])
    built: list[tuple[int, str]] = []

    class Unbuilt:
        def build(self):
            return self

    def verify(self, dec, name):
        cand = self.candidates[-1]
        built.append((cand.id, name))
        now[0] += 11.0 if cand.id else 0.5
        return None

    monkeypatch.setattr(Tuner, "_decoder", lambda self, spec, prof: Unbuilt())
    monkeypatch.setattr(Tuner, "_verify", verify)
    monkeypatch.setattr(Tuner, "_setup_bytes", lambda self, shape: 0)
    monkeypatch.setattr(Tuner, "_measure", lambda self, cand, runner, shape, label: 1e-3)
    tuner.search()
    res = tuner.result()
    models = list(dict.fromkeys(s.model for s in tuner.shapes))
    assert len(models) == 2
    assert built == [(0, models[0]), (0, models[1]), (1, models[0])]
    one = res.candidates[1]
    assert one.status == "stopped" and "time budget" in one.reason and not one.times
    assert len(res.candidates) == 2 and res.not_tried


@needs_pocl
def test_the_re_timing_stops_between_shapes_once_the_stage_is_over(monkeypatch):
    """On a fake clock, nothing built or allocated: the search ends at 9.5 s of a 10 s
    stage; re-timing the default and the winner (1 s a call, four calls a shape) does
    the first shape, passes the end and stops there: the verdict stands on that shape
    (equal times: the default stays), the other shapes keep their search times."""
    now = [0.0]
    tuner = _sized_tuner(monkeypatch, cold=64 << 20, host_available=64 << 30, budget_s=10.0,
                         clock=lambda: now[0])

    class Stub:
        indptr = last = None

        def plan(self, indptr, last):
            return None

    def timed(self, dec, w, plan, shape, prune=True):
        now[0] += 1.0
        return 1e-3

    monkeypatch.setattr(Tuner, "_decoder", lambda self, spec, prof: Stub())
    monkeypatch.setattr(Tuner, "_workload", lambda self, shape: Stub())
    monkeypatch.setattr(Tuner, "_time", timed)
    keys = [s.key for s in tuner.shapes]
    default = Candidate(0, tuner.base, "default", status="ok", times=dict.fromkeys(keys, 1e-3))
    other = Candidate(1, tuner.base.with_(vec=8), "vec=8", status="ok",
                      times=dict.fromkeys(keys, 5e-4))
    tuner.candidates = [default, other]
    tuner._rescore()
    now[0] = 9.5
    tuner.confirm()
    assert now[0] == 13.5 and len(keys) > 1
    assert {i: list(t) for i, t in tuner.confirmation.times.items()} == {0: keys[:1],
                                                                         1: keys[:1]}
    assert tuner.chosen is default and tuner.confirmation.kept_default
    res = tuner.result()
    assert [r.default_s for r in res.per_shape] == [1e-3] * len(keys)


# -- small pieces ---------------------------------------------------------------------------------

def test_search_space_is_declarative():
    from clattn.fit import Limits
    by = {p.field: p for p in search.SEARCH_SPACE}
    assert set(search.TUNED_FIELDS) >= set(by)
    rows, tiled = Profile(strategy="rows", vec=8), Profile(strategy="tiled", thread_limit=256)
    small = Limits(max_work_group_size=128, max_work_item_sizes=(128, 128, 128))
    assert search.values_to_try(by["thread_limit"], rows, small, False) == []  # tiled only
    assert search.values_to_try(by["thread_limit"], tiled, small, False) == [128, 64, 32]
    assert search.values_to_try(by["reduction"], tiled, small, False) == []  # no sub-groups
    assert search.values_to_try(by["vec"], rows, Limits(), True) == [4, 16]  # quick: neighbours
    # a CPU driver's vectors never narrower than 4; a GPU's native 1 allows them all
    assert search.values_to_try(by["vec"], rows, Limits(native_float=16), False) == [4, 16]
    assert search.values_to_try(by["vec"], tiled.with_(vec=4), Limits(native_float=1),
                                False) == [2, 8, 1, 16]
    assert by["reduction"].resets == {"subgroup_size": None}
    assert not by["wgs_per_cu"].kernel and by["vec"].kernel
    assert isinstance(by["vec"], Parameter)


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
    s = Settings.make(True, None)
    assert s.max_kernels <= 8 and s.budget_s < 60 and s.passes == 1 and s.mode == "quick"
    full = Settings.make(False, 120)
    assert full.budget_s == 120 and full.max_kernels > s.max_kernels
    shapes = shapes_for(FULL_POINTS)
    assert len(shapes) == 8
    assert shapes == sorted(shapes, key=lambda x: (x.bytes_moved, x.key))
    llama = [x for x in shapes if x.model == "Llama-3-8B" and x.batch == 1 and x.context == 1024][0]
    assert llama.bytes_moved == 1024 * 2 * 8 * 128 * 2 + 2 * 32 * 128 * 2


def test_profile_entry_is_accepted_by_the_registry(tmp_path, monkeypatch):
    _isolate(monkeypatch, tmp_path)
    best = Profile(strategy="rows", vec=16, tile_rows=2, wgs_per_cu=4)
    entry = command.profile_entry("measured-x", "Some Device", best, "generic-cpu", "notes")
    path = save_user_profile(entry)
    m = match({"device_name": "Some Device", "device_type": "CPU"})
    assert path.exists() and m.level == "user"
    assert (m.profile.vec, m.profile.tile_rows, m.profile.wgs_per_cu) == (16, 2, 4)


def test_roofline_bound_and_errors():
    from clattn.tune.roofline import decode_roofline
    # Gemma-2-2B's shape, B=8, 4096 rows, f16: 8 query heads x 256 dims, 4 KV heads;
    # 1 GFLOP/s makes it compute-bound, without a peak it is memory-bound
    kw = dict(batch=8, context=4096, num_qo_heads=8, head_dim=256,
              bytes_moved=8 * 4096 * 2 * 4 * 256 * 2)
    slow = decode_roofline(read_gbps=20.0, fma_gflops=1.0, **kw)
    assert slow.bound == "compute" and math.isclose(slow.bound_s, 2 * 2 * 8 * 4096 * 8 * 256 / 1e9)
    nopeak = decode_roofline(read_gbps=20.0, fma_gflops=None, **kw)
    assert nopeak.bound == "memory" and nopeak.compute_s is None
    assert math.isclose(nopeak.fraction(2 * nopeak.bound_s), 0.5)
    with pytest.raises(ValueError, match="read_gbps"):
        decode_roofline(read_gbps=0.0, fma_gflops=1.0, **kw)
