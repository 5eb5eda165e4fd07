"""tools/bench_hf.py runs end to end (clattn's CPU backend beside sdpa, a one-layer model)
and prints a table of the figures it measured; its split of a call around the kernel
enqueues."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_tool():
    tools = os.path.join(ROOT, "tools")
    if tools not in sys.path:  # the tool imports its sibling tools/common.py
        sys.path.insert(0, tools)
    spec = importlib.util.spec_from_file_location("clattn_bench_hf",
                                                  os.path.join(tools, "bench_hf.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_call_parts_pairs_each_call_with_its_own_enqueues():
    parts = _load_tool().call_parts
    # three calls (start, end), in seconds, given out of order; the one with two enqueues
    # holds the median of every part, so each part of its own pairing counts
    calls = [(40.0, 40.010), (0.0, 0.010), (20.0, 20.010)]
    launches = [(0.001, 0.002),                      # before 1 ms, enqueue 1, after 8
                (19.9995, 20.0005),                  # straddles a call's start: no call's
                (20.003, 20.004), (20.005, 20.007),  # before 3, enqueue 1 + 2, after 3
                (30.0, 30.5),                        # between calls
                (40.005, 40.010)]                    # before 5, enqueue 5, after 0
    got = parts(calls, launches[::-1])
    assert got == pytest.approx(dict(before_us=3000.0, enqueue_us=3000.0, after_us=3000.0))
    assert parts(calls, [(30.0, 30.5)]) == {} and parts([], launches) == {}


def test_bench_hf_prints_both_backends():
    # a process of its own: the tool registers its timed attention functions globally
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_hf.py"),
                          "--backend", "cpu", "--layers", "1", "--prompt", "24", "--new", "3",
                          "--rounds", "2", "--warmup", "8", "--vocab", "512"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines()
            if re.match(r"^\| [01] \| (clattn|sdpa) \|", line)]
    assert sorted((r[0].strip(), r[1].strip()) for r in rows) == \
        [("0", "clattn"), ("0", "sdpa"), ("1", "clattn"), ("1", "sdpa")]
    for r in rows:
        prompt_s, attn_s, token_ms, call_us = (float(x) for x in r[2:6])
        # the attention calls are timed inside the forward they belong to
        assert 0 < attn_s <= prompt_s and token_ms > 0 and call_us > 0 and float(r[6]) > 0
        # the numpy backend and sdpa enqueue no clattn kernel: no kernel time, no parts
        assert [x.strip() for x in r[7:11]] == ["-"] * 4
        alike, total = (int(x) for x in re.match(r"\s*(\d+) of (\d+)", r[11]).groups())
        assert total == 4 and 0 <= alike <= total
    summary = [line for line in out.splitlines() if line.startswith("| token ms |")]
    assert len(summary) == 1
