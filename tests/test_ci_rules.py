"""CI's rules in tests/conftest.py: a required device that is missing fails, a skip fails
while devices are required, and CLATTN_TEST_DEVICES narrows the backends."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import FULL_DEVICE_IDS

ROOT = Path(__file__).resolve().parent.parent
PROBE = "tests/test_kernel_fit.py"   # one test per device, no CPU target


def _pytest(*args, **env):
    full = {k: v for k, v in os.environ.items()
            if k not in ("CLATTN_REQUIRE_DEVICES", "CLATTN_TEST_DEVICES")}
    full.update(env)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-rA", *args], cwd=ROOT, env=full, capture_output=True, text=True,
                         timeout=300)
    return res.returncode, res.stdout + res.stderr


def test_a_missing_required_device_fails():
    rc, out = _pytest(PROBE, "-k", "missing", CLATTN_REQUIRE_DEVICES="no-such-device")
    assert rc == 1, out
    assert "no-such-device-missing" in out and "is not present" in out


def test_a_skip_fails_while_devices_are_required():
    # no device selected: the device test would be skipped; required devices make it fail
    present = FULL_DEVICE_IDS[0] if FULL_DEVICE_IDS else "pocl"
    rc, out = _pytest(PROBE, CLATTN_TEST_DEVICES="cpu", CLATTN_REQUIRE_DEVICES=present)
    assert rc == 1, out
    assert "in CI every test must run" in out or not FULL_DEVICE_IDS


def test_narrowing_skips_without_requirements():
    rc, out = _pytest(PROBE, CLATTN_TEST_DEVICES="cpu")
    assert rc == 0 and "1 skipped" in out, out
    if not FULL_DEVICE_IDS:
        return  # no OpenCL device: nothing to narrow
    first, others = FULL_DEVICE_IDS[0], FULL_DEVICE_IDS[1:]
    rc, out = _pytest("tests/test_kernels.py", "-k", "test_empty_batches", "--collect-only",
                      CLATTN_TEST_DEVICES=f"cpu,{first}-tiled")
    assert rc == 0, out
    assert "test_empty_batches[cpu]" in out and f"test_empty_batches[{first}-tiled]" in out
    assert f"test_empty_batches[{first}]" not in out
    assert not any(f"[{o}" in out for o in others), out
