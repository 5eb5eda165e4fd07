"""clattn.tune.ceilings and clattn.tune.timing return honest numbers, and tools/bench.py
runs end to end, checked against the CPU backend (PoCL)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from clattn import cpu_backend, runtime
from clattn.tune import ceilings, timing
from clattn.tune.checks import TOL
from clattn.tune.workloads import (
    MODELS,
    PagePool,
    Workload,
    pool_pages,
    rotating_tables,
    spec_for,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _pocl():
    try:
        return runtime.select_device("pocl")
    except runtime.NoDeviceError:
        return None


POCL = _pocl()
needs_pocl = pytest.mark.skipif(POCL is None, reason="PoCL is not installed")


def _finite_positive(*xs: float) -> bool:
    return all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in xs)


# -- sizing: past every cache --------------------------------------------------------------------

def _host_cache_dir(tmp_path, sizes):
    for i, (level, kind, size) in enumerate(sizes):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return str(tmp_path)


def _device(cache, *, cpu=True, max_alloc=64 << 30, glob=256 << 30):
    cl = runtime.cl()
    return SimpleNamespace(global_mem_cache_size=cache, max_mem_alloc_size=max_alloc,
                           global_mem_size=glob,
                           type=cl.device_type.CPU if cpu else cl.device_type.GPU)


def test_parse_size():
    assert ceilings.parse_size("32K") == 32 << 10
    assert ceilings.parse_size("32768K\n") == 32 << 20
    assert ceilings.parse_size("1M") == 1 << 20 and ceilings.parse_size("512") == 512
    with pytest.raises(ValueError):
        ceilings.parse_size("lots")


def test_host_caches_read_sysfs_without_instruction_caches(tmp_path):
    root = _host_cache_dir(tmp_path, [(1, "Data", "32K"), (1, "Instruction", "32K"),
                                      (2, "Unified", "512K"), (3, "Unified", "300M")])
    got = ceilings.host_caches(root)
    assert [(c.where, c.size_bytes) for c in got] == [
        ("host L1", 32 << 10), ("host L2", 512 << 10), ("host L3", 300 << 20)]


def test_working_set_is_4x_the_largest_cache_of_device_or_host(tmp_path, monkeypatch):
    monkeypatch.setattr(ceilings, "host_available_bytes", lambda: 64 << 30)
    root = _host_cache_dir(tmp_path, [(3, "Unified", "300M")])
    # the CI machine: PoCL reports 32 MiB, the host's L3 is 300 MiB -> 1200 MiB
    s = ceilings.sizing(_device(32 << 20), host_root=root)
    assert s.working_set_bytes == 4 * (300 << 20) and not s.cap
    assert s.largest_cache.where == "host L3"
    assert "4x the largest cache, host L3 300 MiB" in s.summary()
    # a GPU: only its own cache counts; small caches still get the minimum working set
    gpu = ceilings.sizing(_device(2 << 20, cpu=False), host_root=root)
    assert gpu.working_set_bytes == ceilings.MIN_WORKING_SET
    assert [c.where for c in gpu.caches] == ["device global memory cache"]
    big = ceilings.sizing(_device(64 << 20, cpu=False), host_root=root)
    assert big.working_set_bytes == 256 << 20


def test_working_set_capped_by_allocation_and_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(ceilings, "host_available_bytes", lambda: 64 << 30)
    root = _host_cache_dir(tmp_path, [(3, "Unified", "300M")])
    s = ceilings.sizing(_device(0, max_alloc=512 << 20), host_root=root)
    assert s.working_set_bytes == 512 << 20 and "max_mem_alloc_size" in s.cap
    s = ceilings.sizing(_device(0, glob=2 << 30), host_root=root)
    assert s.working_set_bytes == 512 << 20 and "global_mem_size" in s.cap
    assert "capped by" in s.summary()


def test_working_set_capped_by_the_host_memory_available(tmp_path, monkeypatch):
    """A CPU device's buffers are host memory: a 300 MiB L3 on a host with 2 GiB free gets
    a quarter of what is free, not 1.2 GiB; a GPU's does not depend on the host."""
    monkeypatch.setattr(ceilings, "host_available_bytes", lambda: 2 << 30)
    root = _host_cache_dir(tmp_path, [(3, "Unified", "300M")])
    s = ceilings.sizing(_device(480 << 20), host_root=root)
    assert s.working_set_bytes == 512 << 20 and "host's available memory" in s.cap
    gpu = ceilings.sizing(_device(480 << 20, cpu=False), host_root=root)
    assert gpu.working_set_bytes == 4 * (480 << 20) and not gpu.cap


# -- the timing helper ----------------------------------------------------------------------------

def test_warmup_runs_are_never_samples():
    seen = []

    def call():
        seen.append(1)
        return {"s": 100.0 if len(seen) == 1 else 1.0}  # the first run compiles

    res = timing.sample({"x": call}, warmup=1, min_runs=5, max_runs=5, seconds=0)
    s = res["x"]["s"]
    assert len(seen) == 6 and s.runs == 5 and s.values == (1.0,) * 5 and s.best == s.median == 1.0


def test_warmup_seconds_keep_slow_first_runs_out_of_the_samples(monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    seen = []
    calls = {k: (lambda k=k: seen.append(k) or {"s": 9.0 if len(seen) <= 6 else 1.0})
             for k in "ab"}
    res = timing.sample(calls, warmup=1, min_runs=2, max_runs=2, seconds=0,
                        warmup_seconds=2.5)
    # 2 grouped warm-ups, then rounds until 2.5 "seconds" passed: the 9.0s stay untimed
    assert seen[:2] == ["a", "b"] and len(seen) == 6 + 4
    assert res["a"]["s"].values == (1.0, 1.0) and res["b"]["s"].values == (1.0, 1.0)


def test_sample_runs_variants_round_robin_and_observes():
    order, seen = [], []
    calls = {k: (lambda k=k: order.append(k) or {"s": len(order)}) for k in "ab"}
    res = timing.sample(calls, warmup=2, min_runs=3, max_runs=3, seconds=0,
                        observe=lambda name, r, warm: seen.append((name, warm)))
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert seen.count(("a", True)) == 2 and seen.count(("b", False)) == 3
    assert res["a"]["s"].values == (5, 7, 9) and res["b"]["s"].median == 8


def test_event_seconds_sums_device_time():
    class Evt:
        def __init__(self, start, end):
            self.profile = SimpleNamespace(start=start, end=end)
            self.waited = False

        def wait(self):
            self.waited = True

    evts = [Evt(0, 1_000_000), None, Evt(5_000_000, 5_500_000)]
    assert math.isclose(timing.event_seconds(evts), 1.5e-3)
    assert evts[0].waited and evts[2].waited


def test_one_table_printer_text_and_markdown():
    text = timing.table(["name", "ms"], [["a", "1.50"], ["bbb", "10.00"]], right={1})
    assert text == ["  name     ms", "  a      1.50", "  bbb   10.00"]
    md = timing.table(["name", "ms"], [["a", "1.50"]], right={1}, markdown=True)
    assert md == ["| name | ms |", "|---|---:|", "| a | 1.50 |"]
    assert [timing.cell(v, ".2f") for v in (None, "x", math.inf, 1.234)] == \
        ["-", "x", "inf", "1.23"]


def test_rotating_page_sets_are_disjoint_and_cover_the_pool():
    rng = np.random.default_rng(0)
    indptr, last, sets = rotating_tables(rng, pool=100, batch=2, context=40, page_size=16)
    assert indptr.tolist() == [0, 3, 6] and last.tolist() == [8, 8]
    assert sets.shape == (16, 6) and sets.dtype == np.int32  # 16 sets of 6 pages in 100
    for k, s in enumerate(sets):
        assert sorted(s.tolist()) == list(range(6 * k, 6 * k + 6))  # region k, shuffled
    assert pool_pages(6, 8192, 128 * MiB) == 16384 and pool_pages(20000, 8192, MiB) == 20000
    with pytest.raises(ValueError):
        rotating_tables(rng, pool=5, batch=2, context=40, page_size=16)


# -- measurements on PoCL -------------------------------------------------------------------------

@needs_pocl
def test_cold_calls_of_variants_in_turns_share_one_rotation():
    """Two variants timed in turns (as every suite and the tuner's confirmation do) must
    not read the same page set one after the other: the second would read what the first
    brought into the caches. Cold calls walk sets 1..n-1 in turn whoever asks; hot calls
    always take set 0, which no cold call reads."""
    rt = runtime.Runtime.for_device(POCL)
    (spec,) = [spec_for(m) for m in MODELS if m.name == "Qwen2.5-0.5B"]
    pool = PagePool(rt, spec, pages=4 * 3, seed=1)  # 4 sets of 3 pages (B=1, 40 rows)
    w = Workload(rt, pool, batch=1, context=40, seed=2)
    try:
        assert w.n_sets == 4
        sets = {a.offset: k for k, a in enumerate(w.d_indices)}

        def set_of(args: tuple) -> int:
            return sets[args[3].offset]

        taken = []
        for _ in range(4):  # variants a and b in turns, each with a hot call beside
            taken += [set_of(w.args()), set_of(w.args(hot=True)), set_of(w.args())]
        cold = [k for i, k in enumerate(taken) if i % 3 != 1]
        assert cold == [1, 2, 3] * 2 + [1, 2]
        assert all(k == 0 for i, k in enumerate(taken) if i % 3 == 1)
    finally:
        w.release()
        pool.release()


@needs_pocl
def test_read_bandwidth():
    m = ceilings.read_bandwidth(POCL, size_bytes=8 << 20, target_s=0.01, widths=(1, 4, 16))
    assert m.kind == "read"
    assert _finite_positive(m.gbps, m.seconds, m.median_gbps)
    assert len(m.variants) == 6 and m.best in dict(m.variants)
    assert m.bytes_moved == m.sizing.working_set_bytes and m.repetitions >= 3
    assert m.sizing.cap == "size given by the caller" and m.sizing.caches
    assert math.isclose(m.gbps, m.bytes_moved / m.seconds * 1e-9)
    assert "GB/s" in m.summary() and m.best in m.summary() and "working set" in m.summary()


@needs_pocl
def test_streaming_ceiling_takes_the_fastest_round_of_its_best_variant(monkeypatch):
    """The sweep times every variant once; the best variant then gets STREAM_ROUNDS - 1
    more rounds, and the round with the fastest median is the ceiling's median."""
    timed = []
    fake = iter([(4.0, 4.0, 4.0), (2.0, 3.0, 3.0),           # the sweep: float4, float16
                 (2.5, 2.5, 2.6), (2.2, 2.4, 2.6)])           # float16 again, twice
    monkeypatch.setattr(ceilings, "_timed", lambda launch, s: timed.append(launch) or next(fake))
    monkeypatch.setattr(ceilings, "STREAM_ROUNDS", 3)
    m = ceilings.read_bandwidth(POCL, size_bytes=8 << 20, target_s=0.01, widths=(4, 16),
                                patterns=("strided",))
    assert m.best == "float16, strided" and len(timed) == 4
    assert timed[2] is timed[1] and timed[3] is timed[1]      # the rounds are the best's
    assert math.isclose(m.median_gbps, m.bytes_moved / 2.4 * 1e-9)   # median of round 3
    assert math.isclose(m.gbps, m.bytes_moved / 2.0 * 1e-9) and m.seconds == 2.0
    assert m.repetitions == 3


@needs_pocl
def test_default_working_set_is_past_every_cache():
    plan = ceilings.sizing(POCL)
    assert plan.largest_cache is not None
    assert plan.working_set_bytes >= 4 * plan.largest_cache.size_bytes or plan.cap
    m = ceilings.read_bandwidth(POCL, target_s=0.0, widths=(16,), patterns=("strided",))
    assert m.sizing.working_set_bytes == m.bytes_moved >= 0.99 * plan.working_set_bytes


@needs_pocl
def test_copy_bandwidth_counts_both_directions():
    m = ceilings.copy_bandwidth(POCL, size_bytes=8 << 20, target_s=0.01, widths=(4,),
                                patterns=("blocked",))
    assert m.kind == "copy" and m.best == "float4, blocked"
    assert _finite_positive(m.gbps)
    assert m.bytes_moved >= (8 << 20) * 0.9  # read + written: the working set


@needs_pocl
def test_launch_latency():
    lat = ceilings.launch_latency(POCL, target_s=0.01, min_reps=10)
    assert lat.repetitions >= 10
    assert _finite_positive(lat.round_trip_us, lat.round_trip_min_us, lat.queued_to_end_us)
    assert lat.kernel_us >= 0 and math.isfinite(lat.kernel_us)
    assert "latency" in lat.summary()


@needs_pocl
def test_transfer_bandwidth():
    t = ceilings.transfer_bandwidth(POCL, size_bytes=4 << 20, target_s=0.01)
    assert _finite_positive(t.h2d.gbps, t.d2h.gbps)
    assert t.h2d.kind == "h2d" and t.d2h.kind == "d2h"
    assert "host->device" in t.summary()


@needs_pocl
def test_fill_random_is_pseudo_random():
    import pyopencl.array as cla
    rt = ceilings.as_runtime(POCL)
    for dt in (np.float32, np.float16):
        a = cla.empty(rt.queue, (1 << 16,), dt)
        ceilings.fill_random(rt, a, seed=3, scale=2.0)
        x = a.get().astype(np.float64)
        assert np.all(np.isfinite(x)) and x.min() >= -2 and x.max() <= 2
        assert abs(x.mean()) < 0.05 and 1.0 < x.std() < 1.3  # uniform on [-2, 2): std 1.155
        assert len(np.unique(x)) > 1000
        b = cla.empty(rt.queue, (1 << 16,), dt)
        ceilings.fill_random(rt, b, seed=4, scale=2.0)
        assert not np.array_equal(a.get(), b.get())


@needs_pocl
def test_runtime_accepted_in_every_form():
    rt = ceilings.as_runtime("pocl")
    assert ceilings.as_runtime(rt) is rt
    assert ceilings.as_runtime(rt.queue).queue is rt.queue
    assert ceilings.as_runtime(POCL).device == POCL


def test_source_mentions_every_width():
    src = ceilings.source()
    for w in ("float", "float2", "float4", "float8", "float16"):
        assert f"read_strided_{w}(" in src and f"copy_blocked_{w}(" in src


# -- tools/bench.py -------------------------------------------------------------------------------

def _load_bench():
    tools = os.path.join(ROOT, "tools")
    if tools not in sys.path:  # bench imports its sibling tools/common.py
        sys.path.insert(0, tools)
    spec = importlib.util.spec_from_file_location("clattn_bench", os.path.join(tools, "bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _decode_ok(data, rows):
    d = [r for r in rows if "page_sets" in r]
    assert d and all(r["page_sets"] >= 4 and r["hot_ms"] > 0 and r["kernel_ms"] > 0 for r in d)
    assert data["ceilings"]["fma"]["gflops"] > 0
    for r in d:  # the roofline of the row's shape, and the achieved fraction of it
        assert r["roof_bound"] in ("memory", "compute") and r["roof_ms"] > 0
        assert r["roof_frac"] == pytest.approx(r["roof_ms"] / r["kernel_ms"])
    # past every cache, unless the sizing says what capped it (the device's allocation or
    # memory, or the host memory available: a large L3 on a host with little free memory)
    # or the run was given its cold set (--cold-mib)
    assert data["ceilings"]["cold_bytes"] >= 4 * max(c["size_bytes"]
                                                     for c in data["ceilings"]["caches"]) \
        or data["ceilings"]["cold_cap"].startswith("capped by") \
        or data["args"]["cold_mib"] == data["ceilings"]["cold_bytes"] / 2**20
    if data["args"]["formats"]:  # every format on the row, each timed against float16 pages
        assert sorted(r["format"] for r in d) == sorted(data["args"]["formats"])
        assert all(r["vs_f16"] > 0 for r in d)
        cost = next(rows for title, rows in data["sections"].items() if title.startswith("GPU"))
        assert {r["format"]: r["row"] for r in cost} == {"float16": 128, "q8_0": 68, "q4_0": 36}


def _prefill_ok(data, rows):
    assert all(r["kernel_ms"] > 0 and r["gflops"] > 0 and r["peak"] > 0 and
               0 < r["peak_frac"] for r in rows)
    if importlib.util.find_spec("torch") is not None:  # torch's SDPA timed beside it
        assert all(r["vs_torch"] > 0 and r["torch-float32_ms"] > 0 for r in rows)
    assert data["ceilings"]["fma_gflops"]


def _cache_ok(data, rows):
    assert all(r["step_ms"] > 0 and r["attend_ms"] > 0 and
               r["begin_alone_ms"] > 0 and r["tables_bytes"] > 0 and
               r["steady_host_ms"] >= r["steady_begin_ms"] + r["steady_layers_ms"] > 0
               for r in rows)
    # the append fused into the decode launch (float pages): one launch per layer, no
    # append kernel; separate: an append and a decode launch per layer (unsplit rows),
    # quantized pages' device k and v also the append's check
    for r in rows:
        floats = r["format"] in ("float16", "float32")
        fused = r["append"] == "fused" and floats
        assert (r["append_ms"] == 0) == fused, r
        assert r["launches_per_layer"] == (1 if fused else 2 if floats else 3), r
    assert sorted({r["append"] for r in rows}) == ["fused", "separate"]


SUITE_CHECKS = {"decode": _decode_ok, "prefill": _prefill_ok, "cache": _cache_ok}


#: a smoke run's verdict is what it checks, never how fast the machine is: its time budget
#: (``--budget-s``, after which bench.py skips rows) is out of reach, and the subprocess
#: limit only ends a hang (a smoke run takes 10-100 s, busier machines several times more)
NO_BUDGET = ("--budget-s", "1e9")
HANG_S = 3600
#: the formats' smoke rows rotate over a small cold set (the cold set's sizing past every
#: cache is checked by the plain decode smoke): each format fills a pool of it
SMALL_COLD = ("--cold-mib", "64")


@needs_pocl
@pytest.mark.parametrize("suite,extra", [
    ("decode", ()), ("split", ()), ("fallback", ()), ("prefill", ()), ("cache", ()),
    ("decode", ("--formats", "float16,q8_0,q4_0", *SMALL_COLD)),
    ("cache", ("--formats", "float16,q8_0"))],
    ids=["decode", "split", "fallback", "prefill", "cache", "decode-formats", "cache-formats"])
def test_bench_smoke(suite, extra, tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--suite", suite, "--smoke",
           "--device", "pocl", "--json", str(out), *NO_BUDGET, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| model |" in proc.stdout or "| N |" in proc.stdout
    assert "|---" in proc.stdout
    data = json.loads(out.read_text())
    assert data["suite"] == suite and data["mismatches"] == []
    rows = [r for rows in data["sections"].values() for r in rows]
    assert rows and not any(r.get("skipped") for r in rows)
    timed = [r for title, rows in data["sections"].items() if not title.startswith("GPU")
             for r in rows]
    for r in timed:  # every timed row was checked against the CPU backend first
        assert r["max_err"] <= 2 * TOL[r.get("dtype", "float16")], r
    SUITE_CHECKS.get(suite, lambda *a: None)(data, timed)


@needs_pocl
@pytest.mark.parametrize("suite,reference", [("decode", "batch_decode"),
                                             ("prefill", "batch_prefill"),
                                             ("cache", "batch_decode")])
def test_bench_exits_nonzero_on_a_wrong_result(suite, reference, monkeypatch, capsys):
    bench = _load_bench()
    real = getattr(cpu_backend, reference)

    def shifted(*a, **kw):
        out, lse = real(*a, **kw)
        return out + np.asarray(0.25, out.dtype), lse

    monkeypatch.setattr(bench.cpu_backend, reference, shifted)  # the cache's twin reads it too
    monkeypatch.setattr(bench, "merge_sections", lambda *a: [])
    timed = []
    monkeypatch.setattr(bench, "sample_interleaved", lambda *a, **kw: timed.append(1))
    rc = bench.main(["--suite", suite, "--smoke", "--device", "pocl", "--no-markdown"])
    err = capsys.readouterr().err
    assert rc == 1 and "disagree with the CPU backend" in err and "max error 0.25" in err
    assert not timed  # nothing wrong is timed


def test_bench_skips_rows_that_do_not_fit():
    bench = _load_bench()
    db = bench.DeviceBench.__new__(bench.DeviceBench)
    db.args = SimpleNamespace(max_pool_gib=4.0)
    db.cold_bytes = 128 * MiB
    db.dev = _device(32 * MiB, cpu=False, max_alloc=1 << 30)
    q8 = bench.model_spec("Llama-3-8B", "float16", "q8_0")
    f16 = bench.model_spec("Llama-3-8B", "float16")
    assert db.no_room(q8, 1, 16384) is None
    assert "largest allocation" in db.no_room(q8, 8, 65536)  # 1.06 GiB of q8_0 pages
    assert "--max-pool-gib" in db.no_room(f16, 32, 65536)    # 8 GiB of f16 pages
    db.args.max_pool_gib, db.dev = 1e6, _device(32 * MiB, max_alloc=1 << 50)
    assert "host memory" in db.no_room(f16, 1024, 65536)     # 256 GiB


def test_bench_gpu_model_suite(oclgrind_device, tmp_path):
    """``--suite gpu-model`` prints the counts, the verdict against the baseline and the
    modelled times."""
    out = tmp_path / "g.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--suite", "gpu-model",
           "--smoke", "--json", str(out), *NO_BUDGET]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| profile | shape |" in proc.stdout and "est. us/token/layer" in proc.stdout
    counts, verdicts, model = json.loads(out.read_text())["sections"].values()
    assert [(r["profile"], r["shape"]) for r in counts] == [("mali-valhall", "Qwen2.5-0.5B")]
    assert 1.0 <= counts[0]["glob"] <= 1.05 and counts[0]["barriers"] > 0
    assert verdicts[0]["ok"] == "yes"
    assert model and all(r["est_us"] >= r["floor_us"] > 0 for r in model)
