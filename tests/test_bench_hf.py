"""tools/bench_hf.py runs end to end (clattn's CPU backend beside sdpa, a one-layer model)
and prints a table of the figures it measured."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        alike, total = (int(x) for x in re.match(r"\s*(\d+) of (\d+)", r[8]).groups())
        assert total == 4 and 0 <= alike <= total
    summary = [line for line in out.splitlines() if line.startswith("| token ms |")]
    assert len(summary) == 1
