"""clattn.bandwidth returns sane numbers, and tools/bench.py runs end to end (PoCL)."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from clattn import bandwidth, runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pocl():
    try:
        return runtime.select_device("pocl")
    except runtime.NoDeviceError:
        return None


POCL = _pocl()
needs_pocl = pytest.mark.skipif(POCL is None, reason="PoCL is not installed")


def _finite_positive(*xs: float) -> bool:
    return all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in xs)


@needs_pocl
def test_read_bandwidth():
    m = bandwidth.read_bandwidth(POCL, size_bytes=8 << 20, target_s=0.01, widths=(1, 4, 16))
    assert m.kind == "read"
    assert _finite_positive(m.gbps, m.seconds, m.median_gbps)
    assert m.gbps >= m.median_gbps
    assert len(m.variants) == 6 and m.best in dict(m.variants)
    assert m.bytes_moved > 0 and m.repetitions >= 3
    assert "GB/s" in m.summary() and m.best in m.summary()


@needs_pocl
def test_copy_bandwidth_counts_both_directions():
    m = bandwidth.copy_bandwidth(POCL, size_bytes=4 << 20, target_s=0.01, widths=(4,),
                                 patterns=("blocked",))
    assert m.kind == "copy" and m.best == "float4, blocked"
    assert _finite_positive(m.gbps)
    assert m.bytes_moved >= 2 * (4 << 20) * 0.9


@needs_pocl
def test_launch_latency():
    lat = bandwidth.launch_latency(POCL, target_s=0.01, min_reps=10)
    assert lat.repetitions >= 10
    assert _finite_positive(lat.round_trip_us, lat.round_trip_min_us, lat.queued_to_end_us)
    assert lat.kernel_us >= 0 and math.isfinite(lat.kernel_us)
    assert lat.round_trip_min_us <= lat.round_trip_us
    assert "latency" in lat.summary()


@needs_pocl
def test_transfer_bandwidth():
    t = bandwidth.transfer_bandwidth(POCL, size_bytes=4 << 20, target_s=0.01)
    assert _finite_positive(t.h2d.gbps, t.d2h.gbps)
    assert t.h2d.kind == "h2d" and t.d2h.kind == "d2h"
    assert "host->device" in t.summary()


@needs_pocl
def test_fill_random_is_pseudo_random():
    import pyopencl.array as cla
    rt = bandwidth.as_runtime(POCL)
    for dt in (np.float32, np.float16):
        a = cla.empty(rt.queue, (1 << 16,), dt)
        bandwidth.fill_random(rt, a, seed=3, scale=2.0)
        x = a.get().astype(np.float64)
        assert np.all(np.isfinite(x)) and x.min() >= -2 and x.max() <= 2
        assert abs(x.mean()) < 0.05 and 1.0 < x.std() < 1.3  # uniform on [-2, 2): std 1.155
        assert len(np.unique(x)) > 1000
        b = cla.empty(rt.queue, (1 << 16,), dt)
        bandwidth.fill_random(rt, b, seed=4, scale=2.0)
        assert not np.array_equal(a.get(), b.get())


@needs_pocl
def test_runtime_accepted_in_every_form():
    rt = bandwidth.as_runtime("pocl")
    assert bandwidth.as_runtime(rt) is rt
    assert bandwidth.as_runtime(rt.queue).queue is rt.queue
    assert bandwidth.as_runtime(POCL).device == POCL


def test_source_mentions_every_width():
    src = bandwidth.source()
    for w in ("float", "float2", "float4", "float8", "float16"):
        assert f"read_strided_{w}(" in src and f"copy_blocked_{w}(" in src


@needs_pocl
@pytest.mark.parametrize("suite", ["decode", "split", "fallback"])
def test_bench_smoke(suite, tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--suite", suite, "--smoke",
           "--device", "pocl", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| model |" in proc.stdout or "| N |" in proc.stdout
    assert "|---" in proc.stdout
    import json
    data = json.loads(out.read_text())
    assert data["suite"] == suite
    rows = [r for rows in data["sections"].values() for r in rows]
    assert rows and not any(r.get("skipped") for r in rows)
