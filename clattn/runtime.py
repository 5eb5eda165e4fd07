"""OpenCL discovery, device choice and the program cache.

* Intel's CPU runtime installed from PyPI ships an .icd naming a wrong path: before
  pyopencl first asks for platforms, :func:`ensure_icd` points the ICD loader at the
  installed ``libintelocl.so`` through a private vendors folder (``OCL_ICD_VENDORS``),
  keeping every system .icd too. Set ``CLATTN_NO_ICD_SETUP=1`` to leave it alone.
* Device choice: an explicit argument, else ``PYOPENCL_CTX`` (pyopencl's
  ``platform:device`` convention), else the first usable GPU, else PoCL's CPU device, else
  any usable device but the Oclgrind simulator (run only when named). None usable -> None
  (callers fall back to the CPU and say so once, :func:`no_device_reason`).
* A device whose compiler cannot build and run a one-line kernel (PoCL built against an
  LLVM that does not know the host CPU answers "unknown target CPU 'generic'") is not
  usable: :func:`device_problem` says why, the default choice passes over it, a name
  matching several devices picks a usable one, and :func:`check_usable` refuses one
  named explicitly with :class:`DeviceUnusableError`.
* Programs are built once per (context, source, options), thread-safely, through
  pyopencl's on-disk binary cache; build failures raise :class:`BuildError` with the
  compiler log.
"""
from __future__ import annotations

import glob
import hashlib
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from .launch import Launcher

_ICD_DONE = False


class BuildError(RuntimeError):
    """A kernel failed to build; the message carries the compiler log."""


class NoDeviceError(RuntimeError):
    """No OpenCL device matches the request."""


class DeviceUnusableError(NoDeviceError):
    """The device exists but its driver cannot build and run a kernel."""


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "clattn"


def _pip_intel_lib() -> str | None:
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]):
        for cand in glob.glob(os.path.join(prefix, "lib", "libintelocl.so")):
            return cand
    return None


def ensure_icd() -> str | None:
    """Make a pip-installed Intel CPU runtime visible to the ICD loader (idempotent).

    Returns the vendors folder it set up, or None when nothing was needed.
    """
    global _ICD_DONE
    if _ICD_DONE or os.environ.get("CLATTN_NO_ICD_SETUP") or os.environ.get("OCL_ICD_VENDORS"):
        _ICD_DONE = True
        return None
    _ICD_DONE = True
    lib = _pip_intel_lib()
    if lib is None:
        return None
    system = sorted(glob.glob("/etc/OpenCL/vendors/*.icd"))
    for icd in system:
        try:
            if Path(icd).read_text().strip() == lib:
                return None  # already registered correctly
        except OSError:
            pass
    folder = _cache_root() / ("icd-" + hashlib.sha1(lib.encode()).hexdigest()[:10])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for icd in system:
            if "intel" in os.path.basename(icd).lower():
                continue  # the shipped Intel .icd names a path that does not exist
            target = folder / os.path.basename(icd)
            if not target.exists():
                target.write_text(Path(icd).read_text())
        (folder / "clattn-intel-cpu.icd").write_text(lib + "\n")
    except OSError as exc:  # read-only home: leave the loader alone
        warnings.warn(f"clattn: could not set up the Intel CPU runtime's ICD ({exc})")
        return None
    os.environ["OCL_ICD_VENDORS"] = str(folder)
    return str(folder)


def cl():
    """pyopencl, imported after the ICD set-up."""
    ensure_icd()
    import pyopencl
    import pyopencl.array  # noqa: F401 - makes pyopencl.array available to callers
    return pyopencl


def all_devices() -> list:
    """Every OpenCL device of every platform ([] without any)."""
    pcl = cl()
    try:
        platforms = pcl.get_platforms()
    except Exception:  # noqa: BLE001 - no ICD / no platform
        return []
    out = []
    for p in platforms:
        try:
            out.extend(p.get_devices())
        except Exception:  # noqa: BLE001 - a platform without devices
            pass
    return out


def is_simulator(dev: Any) -> bool:
    return "oclgrind" in dev.platform.name.lower()


_PROBLEMS: dict = {}  # device pointer -> None (usable) or why not
_HEALTH_SOURCE = "__kernel void clattn_health(__global int* x) { x[get_global_id(0)] = 7; }"


def device_problem(dev: Any) -> str | None:
    """None when ``dev`` builds and runs a one-line kernel, else the driver's reason
    (its build log's first error line). Checked once per device and process; the
    simulator (Oclgrind) is taken as usable unchecked."""
    if is_simulator(dev):
        return None
    key = dev.int_ptr
    if key in _PROBLEMS:
        return _PROBLEMS[key]
    import numpy as np
    pcl = cl()
    why = None
    try:
        ctx = pcl.Context([dev])
        queue = pcl.CommandQueue(ctx)
        buf = pcl.Buffer(ctx, pcl.mem_flags.WRITE_ONLY, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prg = pcl.Program(ctx, _HEALTH_SOURCE).build()
        prg.clattn_health(queue, (4,), None, buf)
        got = np.zeros(4, np.int32)
        pcl.enqueue_copy(queue, got, buf)
        queue.finish()
        if not (got == 7).all():
            why = "a one-line kernel ran but wrote wrong values"
    except Exception as exc:  # noqa: BLE001 - any failure makes the device unusable
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        errors = [ln for ln in lines
                  if "error" in ln.lower() and "clbuildprogram" not in ln.lower()]
        why = (errors or lines or [type(exc).__name__])[0]
    _PROBLEMS[key] = why
    return why


def check_usable(dev: Any) -> None:
    """Raise :class:`DeviceUnusableError` naming ``dev``, the driver's reason and what to
    do instead, when :func:`device_problem` finds it cannot run kernels."""
    why = device_problem(dev)
    if why is None:
        return
    others = [f"{d.platform.name} / {d.name}" for d in all_devices()
              if d.int_ptr != dev.int_ptr and not is_simulator(d) and device_problem(d) is None]
    hint = (f"choose another device ({'; '.join(others)})" if others else
            "install another OpenCL driver (e.g. Debian's pocl-opencl-icd, or pip install "
            "'clattn[intel]'), or pass backend='cpu'")
    cause = (" (its LLVM does not know this CPU)" if "unknown target cpu" in why.lower()
             else "")
    raise DeviceUnusableError(
        f"the OpenCL device {dev.platform.name.strip()} / {dev.name.strip()} (driver "
        f"{dev.driver_version}) cannot build a kernel: {why}{cause}; {hint}")


def _match_string(spec: str, devices: list) -> Any:
    pcl = cl()
    if ":" in spec or spec.isdigit():
        parts = spec.split(":")
        try:
            plats = pcl.get_platforms()
            plat = plats[int(parts[0] or 0)]
            devs = plat.get_devices()
            return devs[int(parts[1]) if len(parts) > 1 and parts[1] else 0]
        except (ValueError, IndexError):
            pass
    low = spec.lower()
    aliases = {"pocl": "portable computing language", "intel": "intel(r) opencl"}
    low = aliases.get(low, low)
    hits = [d for d in devices if low in d.platform.name.lower() or low in d.name.lower()]
    if hits:  # a usable one first: one of two PoCL builds may not know the host CPU
        return next((d for d in hits if device_problem(d) is None), hits[0])
    names = [f"{d.platform.name} / {d.name}" for d in devices] or ["(none)"]
    raise NoDeviceError(f"device={spec!r} matches no OpenCL device; present: {'; '.join(names)}. "
                        f"Use a platform or device name fragment, 'pocl', 'intel', 'oclgrind' "
                        f"or 'P:D' indices")


def select_device(device: Any = None) -> Any:
    """The OpenCL device to use, or None when the machine has none."""
    pcl = cl()
    if isinstance(device, pcl.Device):
        return device
    if isinstance(device, pcl.Context):
        return device.devices[0]
    if isinstance(device, pcl.CommandQueue):
        return device.device
    devices = all_devices()
    if isinstance(device, str):
        return _match_string(device, devices)
    if device is not None:
        raise TypeError(f"device={device!r}: pass a pyopencl Device/Context/CommandQueue, a name "
                        f"string, or None")
    env = os.environ.get("PYOPENCL_CTX")
    if env:
        return _match_string(env, devices)
    if not devices:
        return None
    # Rule: the default is a usable real device; the Oclgrind simulator (1000x slower)
    # only when asked for by name, never as the last resort (no_device_reason says so)
    real = [d for d in devices if not is_simulator(d) and device_problem(d) is None]
    gpus = [d for d in real if d.type & pcl.device_type.GPU]
    pocl = [d for d in real if "portable computing language" in d.platform.name.lower()]
    usable = gpus or pocl or real
    return usable[0] if usable else None


def no_device_reason() -> str:
    """Why :func:`select_device` found no default device, in one sentence for the one
    message of the CPU fallback: no device, only unusable ones (each with its driver's
    reason), and that the Oclgrind simulator, when present, runs only when named."""
    devices = all_devices()
    real = [d for d in devices if not is_simulator(d)]
    if not real:
        why = "no OpenCL device found"
    else:
        why = "no usable OpenCL device (" + "; ".join(
            f"{d.platform.name.strip()} / {d.name.strip()}: {device_problem(d)}"
            for d in real) + ")"
    if any(is_simulator(d) for d in devices):
        why += "; the Oclgrind simulator is present but runs only when named (device='oclgrind')"
    return why


class Runtime:
    """One context and queue per device, with its built programs.

    ``programs_built`` counts the programs this runtime has built (each source and
    options once): the difference over a piece of work is how many programs it built.
    """

    _instances: dict = {}
    _lock = threading.Lock()

    def __init__(self, device: Any, context: Any = None, queue: Any = None) -> None:
        pcl = cl()
        self.device = device
        self.context = context or pcl.Context([device])
        self.queue = queue or pcl.CommandQueue(
            self.context, properties=pcl.command_queue_properties.PROFILING_ENABLE)
        self._programs: dict = {}
        self.programs_built = 0
        self._launchers: dict = {}
        self._plock = threading.Lock()
        self._dummies: dict = {}

    @classmethod
    def for_device(cls, device: Any) -> "Runtime":
        """A shared runtime per device (or per context when given one)."""
        pcl = cl()
        key = device.int_ptr if isinstance(device, (pcl.Device, pcl.Context)) else id(device)
        with cls._lock:
            rt = cls._instances.get(key)
            if rt is None:
                if isinstance(device, pcl.Context):
                    rt = cls(device.devices[0], context=device)
                else:
                    rt = cls(device)
                cls._instances[key] = rt
            return rt

    @classmethod
    def for_argument(cls, argument: Any, device: Any) -> "Runtime":
        """The runtime for a ``device=`` argument: a caller's queue is used as given
        (with its context), a context or device gets the shared runtime."""
        pcl = cl()
        if isinstance(argument, pcl.CommandQueue):
            return cls(device, argument.context, argument)
        return cls.for_device(argument if isinstance(argument, pcl.Context) else device)

    def program(self, source: str, options: tuple = ()) -> Any:
        """Build (once) and return the program for ``source``."""
        key = (hashlib.sha256(source.encode()).hexdigest(), options)
        with self._plock:
            prg = self._programs.get(key)
            if prg is None:
                prg = self._build(source, list(options))
                self._programs[key] = prg
                self.programs_built += 1
            return prg

    def launcher(self, key: Any, table: Any, source: Any) -> Any:
        """The :class:`clattn.launch.Launcher` of kernel ``table.kernel`` built from
        ``source()`` (called once per ``key``), cached on this runtime."""
        full = (key, table.kernel)
        with self._plock:
            hit = self._launchers.get(full)
        if hit is None:
            hit = Launcher(self.program(source()), table, self.dummy_int())
            with self._plock:
                hit = self._launchers.setdefault(full, hit)
        return hit

    def _build(self, source: str, options: list) -> Any:
        pcl = cl()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", pcl.CompilerWarning)
                return pcl.Program(self.context, source).build(options=options)
        except (pcl.RuntimeError, pcl.LogicError) as exc:
            fd, path = tempfile.mkstemp(prefix="clattn-failed-", suffix=".cl")
            with os.fdopen(fd, "w") as f:
                f.write(source)
            raise BuildError(f"building a clattn kernel failed on {self.device.name!r} "
                             f"({self.device.platform.name}); source saved to {path}\n"
                             f"{exc}") from exc

    def dummy_int(self) -> Any:
        """A small zeroed int buffer for absent optional tables."""
        if "int" not in self._dummies:
            import numpy as np
            pcl = cl()
            self._dummies["int"] = pcl.Buffer(self.context, pcl.mem_flags.READ_ONLY |
                                              pcl.mem_flags.COPY_HOST_PTR,
                                              hostbuf=np.zeros(4, dtype=np.int32))
        return self._dummies["int"]
