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


def run_variant(name: str, *, uninit: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
    proc = subprocess.run([sys.executable, str(RUNNER), name], env=_env(uninit),
                          cwd=str(HERE.parent), capture_output=True, text=True, timeout=300)
    err = BENIGN_API.sub("", proc.stderr)
    found = sorted({r for r in REPORTS if r in err})
    return proc, found


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def _assert_clean(name: str, uninit: bool) -> None:
    proc, found = run_variant(name, uninit=uninit)
    err = BENIGN_API.sub("", proc.stderr)
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


# ---------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("name", list(oclgrind_runner.VARIANTS))
def test_variant_clean_under_oclgrind(oclgrind_device, name):
    _assert_clean(name, uninit=False)


@pytest.mark.parametrize("name", list(oclgrind_runner.NO_ROPE))
def test_variant_no_uninitialised_values(oclgrind_device, name):
    _assert_clean(name, uninit=True)
