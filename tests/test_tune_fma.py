"""The f32 multiply-add peak of clattn.tune.ceilings: the kernel does the work it is counted
for, the peak is positive and finite, the warm-up launch is not counted, and ``clattn tune``
measures it, prints it beside the bandwidth ceilings and puts it in the JSON report."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from test_profiler import _fake_report

from clattn import runtime
from clattn.tune import ceilings, session
from clattn.tune.ceilings import (
    FMA_ITERS,
    FMA_LANES,
    FMA_UNROLL,
    FMA_WIDTHS,
    FmaPeak,
    fma_launcher,
    fma_peak,
    fma_source,
)
from clattn.tune.report import format_report
from clattn.tune.search import Settings
from clattn.tune.timing import event_seconds


@pytest.mark.parametrize("width", FMA_WIDTHS)
def test_the_kernel_is_independent_chains_of_multiply_adds(width):
    src = fma_source(width)
    chains = FMA_LANES // width
    assert src.count(" * y + y;") == chains * FMA_UNROLL
    assert len({f"x{c} = x{c} * y + y;" for c in range(chains)} & set(
        line.strip() for line in src.splitlines())) == chains
    assert f"i < {FMA_ITERS}" in src and f"float{width} " in src
    # every lane of every chain reaches the output: nothing is dead code
    assert " + ".join(f"x{c}" for c in range(chains)) in src
    assert f"i < {width}; ++i) r += " in src


@pytest.mark.parametrize("width", [None, *FMA_WIDTHS])
def test_launcher_counts_two_flops_per_lane_and_computes_the_chain(device, width):
    rt = ceilings.as_runtime(device)
    launch, flops = fma_launcher(rt, width)
    n = ceilings.FMA_ITEMS_PER_CU * int(device.max_compute_units)
    assert flops == n * FMA_ITERS * FMA_UNROLL * FMA_LANES * 2
    evt = launch()
    assert isinstance(evt, runtime.cl().Event) and event_seconds([evt]) > 0
    if width is None:
        return
    # the launch writes what the chains compute: x <- x * a + a from x0 = i * 1e-9 + c
    cl = runtime.cl()
    out = np.empty(n, np.float32)
    knl = cl.Kernel(rt.program(fma_source(width), ceilings.FMA_OPTIONS), "clattn_fma")
    buf = cl.Buffer(rt.context, cl.mem_flags.WRITE_ONLY, out.nbytes)
    knl(rt.queue, (n,), None, buf, np.float32(0.999)).wait()
    cl.enqueue_copy(rt.queue, out, buf)
    a, steps = 0.999, FMA_ITERS * FMA_UNROLL
    want = 0.0
    for c in range(FMA_LANES // width):  # closed form of the recurrence, in float64
        x0 = c + 0.0
        want += width * (x0 * a ** steps + a * (1 - a ** steps) / (1 - a))
    assert math.isclose(float(out[0]), want, rel_tol=1e-3), (out[0], want)


def test_peak_is_positive_finite_and_excludes_the_warm_up(device, monkeypatch):
    launches = []
    real = ceilings.fma_launcher

    def counting(rt, width=None):
        launch, flops = real(rt, width)

        def counted():
            launches.append(1)
            return launch()
        return counted, flops

    rounds = []
    real_timed = ceilings._timed

    def recorded(*a, **k):
        rounds.append(real_timed(*a, **k))
        return rounds[-1]

    monkeypatch.setattr(ceilings, "fma_launcher", counting)
    monkeypatch.setattr(ceilings, "_timed", recorded)
    peak = fma_peak(device, target_s=0.05)
    assert isinstance(peak, FmaPeak) and peak.device == device.name.strip()
    assert math.isfinite(peak.gflops) and peak.gflops > 0
    assert math.isfinite(peak.best_gflops) and peak.best_gflops >= peak.gflops
    assert peak.repetitions == len(peak.samples) >= 3
    # FMA_ROUNDS rounds of each vector width, each after one warm-up launch that is never
    # counted; the round with the fastest median is the peak (every width does the same
    # FLOPs)
    assert len(rounds) == ceilings.FMA_ROUNDS * len(FMA_WIDTHS)
    assert len(launches) == sum(len(r) + 1 for r in rounds)
    assert peak.samples == min(rounds, key=lambda r: float(np.median(r)))
    assert math.isclose(peak.best_gflops, peak.flops / min(peak.samples) * 1e-9)
    assert math.isclose(peak.gflops, peak.flops / float(np.median(peak.samples)) * 1e-9)
    assert "GFLOP/s" in peak.summary() and f"float{peak.width} a" in peak.summary()
    print(f"\n{peak.summary()}")  # the figure, shown (never asserted against a speed)


def _stub_bandwidth(monkeypatch):
    """The bandwidth, latency and transfer ceilings replaced by failures (fast)."""
    def broken(*a, **kw):
        raise RuntimeError("stubbed")
    for name in ("read_bandwidth", "copy_bandwidth", "launch_latency", "transfer_bandwidth"):
        monkeypatch.setattr(ceilings, name, broken)


def test_tune_measures_prints_and_reports_the_peak(device, monkeypatch):
    _stub_bandwidth(monkeypatch)
    res = session.measure_ceilings(ceilings.as_runtime(device), Settings.make(True, None))
    assert set(res.errors) == {"read", "copy", "launch", "transfer"}
    assert res.fma is not None and res.fma.gflops > 0
    rep = _fake_report()
    rep.ceilings = res
    text = format_report(rep)
    line = next(ln for ln in text.splitlines() if "f32 multiply-add" in ln)
    assert f"{res.fma.gflops:.1f} GFLOP/s median" in line and f"float{res.fma.width} a" in line
    assert text.index("Ceilings") < text.index("f32 multiply-add") < text.index("Correctness")
    j = json.loads(json.dumps(rep.to_json()))
    assert j["ceilings"]["fma"]["gflops"] == pytest.approx(res.fma.gflops)
    assert j["ceilings"]["fma"]["repetitions"] == len(j["ceilings"]["fma"]["samples"])


def test_measure_all_includes_the_peak(monkeypatch):
    def fake(name):
        return lambda *a, **kw: SimpleNamespace(summary=lambda: f"<{name}>")
    for name in ("read_bandwidth", "copy_bandwidth", "launch_latency", "transfer_bandwidth",
                 "fma_peak"):
        monkeypatch.setattr(ceilings, name, fake(name))
    monkeypatch.setattr(ceilings, "as_runtime", lambda x: SimpleNamespace(device=None))
    monkeypatch.setattr(ceilings, "sizing", lambda dev: ceilings.Sizing(1 << 26))
    got = ceilings.measure_all(None, transfers=False)
    assert got.transfer is None and got.fma.summary() == "<fma_peak>"
    assert got.summary().splitlines()[-1] == "<fma_peak>"
