"""Every clattn kernel variant under the Oclgrind simulator, with its checkers on.

Oclgrind reports invalid memory accesses, data races, work-group (barrier) divergence,
uninitialised values and API misuse on the stderr of the process that runs the
kernels, so each variant (tests/oclgrind_runner.py) runs in a fresh subprocess and the
test fails on any report, or when the numbers do not match the float64 oracle.

Two passes:

* every variant, optimised build, with ``OCLGRIND_CHECK_API`` and ``OCLGRIND_DATA_RACES``;
* the variants without RoPE again at ``-cl-opt-disable`` with ``OCLGRIND_UNINITIALIZED``
  and ``OCLGRIND_UNIFORM_WRITES`` too. Oclgrind 21.10's uninitialised-value plugin stops
  with a FATAL ERROR on two things clattn's kernels contain but that are not bugs:
  ``sincos(x, &private_float)`` ("Work item needed to access private memory!", any
  optimisation level) and LLVM's ``freeze`` instruction (only in optimised builds).

Self-tests run deliberately broken kernels first: the harness must see those reports,
so a silent Oclgrind (checks not switched on) cannot pass for a clean one.

Benign and filtered: ``clGetDeviceInfo`` returning CL_INVALID_VALUE for a
``param_name``: pyopencl itself probes device queries the OpenCL 1.2 simulator lacks
(during Program.build and kernel launches, with no clattn code involved).

Filtered in runs that fold the split merge into the decode launch (profile ``fold_merge``;
the runner prints :data:`FOLD_MARK`): read-write races on global memory between two
work-groups. The last partition of a sequence to finish reads the other partitions'
workspace states after their stores, a fence and an ``atomic_inc`` on the sequence's
counter (docs/contract.md section 9); Oclgrind's race detector orders no plain access of
one work-group after another's through atomics and fences (OpenCL 1.2 promises
work-groups of a launch memory consistency only through atomics on one location), so it
reports each such read against the store it follows. Its report on the textbook form of
that protocol (``selftest-last-block``: four work-groups, the last one sums their slots)
is the same, with the right sum (:func:`test_oclgrind_reports_the_last_block_protocol`).
Write-write races, races within a work-group or in local memory, and every other report
still fail such a run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.oclgrind

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "oclgrind_runner.py"
sys.path.insert(0, str(HERE))
import oclgrind_runner  # noqa: E402

BENIGN_API = re.compile(
    r"Oclgrind - OpenCL runtime error detected\s*\n\s*Function: clGetDeviceInfo\s*\n"
    r"\s*Error:\s*CL_INVALID_VALUE\s*\n\s*For argument 'param_name'\s*\n?")
#: any of these in the (filtered) stderr is a failure
REPORTS = ("Invalid read", "Invalid write", "Invalid access", "data race", "divergence",
           "Uninitialized", "uninitialized", "Unaligned", "FATAL", "runtime error detected",
           "Kernel:", "Entity:")


def _env(uninit: bool) -> dict:
    env = dict(os.environ)
    for k in ("PYOPENCL_CTX", "CLATTN_PROFILE", "OCLGRIND_QUICK", "OCLGRIND_MAX_ERRORS"):
        env.pop(k, None)
    env.update(OCLGRIND_CHECK_API="1", OCLGRIND_DATA_RACES="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE),
                                           env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if uninit:
        env.update(OCLGRIND_UNINITIALIZED="1", OCLGRIND_UNIFORM_WRITES="1",
                   OCLGRIND_BUILD_OPTIONS="-cl-opt-disable",
                   # the build options travel in the environment, not in pyopencl's cache key
                   PYOPENCL_NO_CACHE="1")
    return env


#: printed by a runner whose decode launches fold the split merge in (see the docstring)
FOLD_MARK = "fold_merge: True"
#: one race report of Oclgrind: its headline and the tab-indented lines under it
RACE = re.compile(r"(Read-write|Write-write) data race at (global|local) memory address "
                  r"0x[0-9a-f]+\n(?:\t[^\n]*\n)*")
GROUP = re.compile(r"(First|Second) entity:.*Group\((\d+,\d+,\d+)\)")


def _fold_race(report: re.Match) -> bool:
    """A read-write race on global memory between two work-groups (see the docstring)."""
    groups = {m.group(2) for m in GROUP.finditer(report.group(0))}
    return report.group(1) == "Read-write" and report.group(2) == "global" and \
        len(groups) == 2


def filtered(proc: subprocess.CompletedProcess, *benign: re.Pattern) -> tuple[str, list[str]]:
    """``(stderr less the benign reports, the reports left in it)`` of a runner: the API
    probes, ``benign`` and, where the runner folds the split merge, its races."""
    err = BENIGN_API.sub("", proc.stderr)
    for pattern in benign:
        err = pattern.sub("", err)
    if FOLD_MARK in proc.stdout:
        err = RACE.sub(lambda m: "" if _fold_race(m) else m.group(0), err)
    return err, sorted({r for r in REPORTS if r in err})


def run_variant(name: str, *, uninit: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
    proc = subprocess.run([sys.executable, str(RUNNER), name], env=_env(uninit),
                          cwd=str(HERE.parent), capture_output=True, text=True, timeout=300)
    return proc, filtered(proc)[1]


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def _assert_clean(name: str, uninit: bool) -> None:
    proc, found = run_variant(name, uninit=uninit)
    err = filtered(proc)[0]
    assert not found, (f"Oclgrind reported {found} for {name!r} (uninit={uninit}):\n"
                       f"{_tail(err)}")
    assert proc.returncode == 0, (f"{name!r} failed (rc={proc.returncode}):\n"
                                  f"{_tail(proc.stdout, 1500)}\n{_tail(err)}")
    assert f"CLATTN-OCLGRIND-OK {name}" in proc.stdout, _tail(proc.stdout)


# ---------------------------------------------------------------------------- the harness
@pytest.mark.parametrize("kind,needle,uninit", [
    ("selftest-oob", "Invalid read", False),
    ("selftest-race", "data race", False),
    ("selftest-uninit", "ninitiali", True),
])
def test_harness_sees_oclgrind_reports(oclgrind_device, kind, needle, uninit):
    proc, found = run_variant(kind, uninit=uninit)
    assert needle in proc.stderr, (f"the broken kernel {kind!r} produced no {needle!r} report: "
                                   f"are Oclgrind's checks on?\n{_tail(proc.stderr)}")
    assert found


def test_oclgrind_reports_the_last_block_protocol(oclgrind_device):
    """The textbook last-block protocol (stores, fence, atomic_inc; the group that reads
    count - 1 reads every group's store): Oclgrind reports read-write races on global
    memory between the groups, and the sum is right. The reports the fold filter drops
    are this protocol's, not a misordering clattn's kernels could fix."""
    proc = subprocess.run([sys.executable, str(RUNNER), "selftest-last-block"],
                          env=_env(False), cwd=str(HERE.parent), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "CLATTN-OCLGRIND-OK" in proc.stdout, _tail(proc.stdout)
    races = list(RACE.finditer(proc.stderr))
    assert races and all(_fold_race(m) for m in races), _tail(proc.stderr)


# ---------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("name", list(oclgrind_runner.VARIANTS))
def test_variant_clean_under_oclgrind(oclgrind_device, name):
    _assert_clean(name, uninit=False)


@pytest.mark.parametrize("name", list(oclgrind_runner.NO_ROPE))
def test_variant_no_uninitialised_values(oclgrind_device, name):
    _assert_clean(name, uninit=True)
