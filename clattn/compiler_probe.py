"""What a device's OpenCL C compiler offers beyond the standard, checked by running it.

* :func:`storage_half_works`: clang's storage-only ``__fp16`` type. Drivers without
  ``cl_khr_fp16`` (PoCL on x86) cannot name ``half`` values, but their clang front end
  still knows ``__fp16``, and on a CPU with F16C (or on Arm) its conversions are single
  instructions. The CPU-style kernels use them instead of integer conversion code where
  the driver builds them and converts every half, and every rounding case of f32 to f16,
  exactly.
* :func:`prefetch_works`: clang's ``__builtin_prefetch``, which the CPU decode kernel
  uses to fetch the rows of its next block (OpenCL's own ``prefetch()`` compiles to
  nothing on the CPU drivers).

Each answer is found once per device and process; any failure means no. The simulator
(Oclgrind) is not asked: it cannot run ``__builtin_prefetch``, and its kernels should be
the plain ones.

A compiler may die on a builtin it does not know instead of reporting a build error (Mesa's
rusticl aborts the process in its SPIR-V writer on ``__builtin_prefetch``). So the probes run
in the caller's process only on the platforms listed in :data:`IN_PROCESS_PLATFORMS`, whose
compilers are known to report failures; on every other platform they run in a child Python
process (``python -m clattn.compiler_probe``), where a crash or a hang means "no" and one
warning names the device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from typing import Any

import numpy as np

from .runtime import cl as _cl
from .runtime import is_simulator

_RESULTS: dict = {}  # (what, device pointer) -> bool
_LOCK = threading.Lock()
#: platform names (lower case, prefixes) whose compilers report a failed probe as a build
#: error instead of ending the process; probes on any other platform run in a child process
IN_PROCESS_PLATFORMS = ("portable computing language", "intel(r) opencl")
#: seconds a child probe may take (start-up, one context, a few small builds and runs)
CHILD_TIMEOUT_S = 120.0
#: the widths the kernels convert at (each probed up to the device's widest, see
#: :func:`storage_half_works`)
PROBE_LANES = (1, 2, 4, 8, 16)


def probe_floats() -> np.ndarray:
    """f32 values covering each f32 -> f16 case: every half, the midpoints between
    neighbours (ties to even) and one f32 ulp either side, overflow, subnormals, nan."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.sort(halves[np.isfinite(halves)].astype(np.float64))
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)),
                           np.nextafter(mids, np.float32(-np.inf))])
    extra = np.array([65504.0, 65519.99, 65520.0, 1e5, 3.4e38, np.inf, -np.inf, np.nan,
                      2.0 ** -25, 2.0 ** -26, 1e-30, -0.0, 0.0], dtype=np.float32)
    out = np.concatenate([finite.astype(np.float32), mids, near, extra, -extra])
    pad = (-out.size) % max(PROBE_LANES)
    return np.concatenate([out, np.zeros(pad, np.float32)])


def _same_halves(got: np.ndarray, want: np.ndarray) -> bool:
    gn, wn = np.isnan(got.view(np.float16)), np.isnan(want.view(np.float16))
    return bool(np.array_equal(gn, wn) and np.array_equal(got[~gn], want[~wn]))


def _same_floats(got: np.ndarray, want: np.ndarray) -> bool:
    gn, wn = np.isnan(got), np.isnan(want)
    return bool(np.array_equal(gn, wn) and
                np.array_equal(got[~gn].view(np.uint32), want[~wn].view(np.uint32)))


def run_kernel(runtime: Any, source: str, kernel: str, inputs: list, outputs: list,
               size: int) -> list:
    """Build ``source`` on ``runtime``'s device, run ``kernel`` over ``size`` work-items
    with the ``inputs`` arrays then empty arrays like ``outputs``, and return those."""
    pcl = _cl()
    ctx, mf = runtime.context, pcl.mem_flags
    queue = pcl.CommandQueue(ctx, runtime.device)
    bufs = [pcl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a) for a in inputs]
    outs = [np.empty_like(a) for a in outputs]
    obufs = [pcl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes) for a in outs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pcl.CompilerWarning)
        prg = pcl.Program(ctx, source).build()
    getattr(prg, kernel)(queue, (size,), None, *bufs, *obufs)
    for a, buf in zip(outs, obufs):
        pcl.enqueue_copy(queue, a, buf)
    queue.finish()
    return outs


def check_half(runtime: Any, lanes: int, source: str | None = None) -> bool:
    """Run the f16 conversion check (``source``: the probe kernel, by default the
    ``__fp16`` one at ``lanes`` values per conversion) on ``runtime``'s device: every
    half to f32, and :func:`probe_floats` to f16, bit for bit (any NaN for a NaN)."""
    from . import codegen

    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = probe_floats()
    n = max(h.size, x.size)
    h, x = np.resize(h, n), np.resize(x, n)
    f, y = run_kernel(runtime, source or codegen.render_half_probe(lanes),
                      "clattn_half_probe", [h, x],
                      [np.empty(n, np.float32), np.empty(n, np.uint16)], n // lanes)
    with np.errstate(over="ignore"):
        want_y = x.astype(np.float16).view(np.uint16)
    return _same_floats(f, h.view(np.float16).astype(np.float32)) and _same_halves(y, want_y)


PREFETCH_SOURCE = """
__kernel void clattn_prefetch_probe(__global const float* x, __global float* y)
{
    const int i = get_global_id(0);
    __builtin_prefetch((const __global uchar*)(x + i) + 64, 0, 2);
    y[i] = x[i];
}
"""


def _check_prefetch(runtime: Any) -> bool:
    x = np.arange(64, dtype=np.float32)
    (y,) = run_kernel(runtime, PREFETCH_SOURCE, "clattn_prefetch_probe", [x], [x], x.size)
    return bool(np.array_equal(x, y))


def _storage_half_check(runtime: Any, max_lanes: int) -> bool:
    return all(check_half(runtime, n) for n in PROBE_LANES if n <= max_lanes)


#: probe name -> check(runtime, max_lanes); what a child process runs by name
_CHECKS = {
    "storage_half": _storage_half_check,
    "prefetch": lambda runtime, max_lanes: _check_prefetch(runtime),
}


def runs_in_process(device: Any) -> bool:
    """Whether the probes run in the caller's process on ``device`` (its platform is one of
    :data:`IN_PROCESS_PLATFORMS`) rather than in a child process."""
    return device.platform.name.strip().lower().startswith(IN_PROCESS_PLATFORMS)


def device_key(device: Any) -> list:
    """What names ``device`` to a child process: platform name and version, device name
    and driver version (a child enumerates the same ICDs, maybe in another order)."""
    return [device.platform.name, device.platform.version, device.name, device.driver_version]


def _find_device(key: list) -> Any:
    from .runtime import all_devices

    for dev in all_devices():
        if device_key(dev) == key:
            return dev
    raise LookupError(f"no OpenCL device {key!r} in the child process")


def child_command(what: str, device: Any, max_lanes: int) -> list[str]:
    """The command line of a child process that runs probe ``what`` on ``device``."""
    return [sys.executable, "-m", "clattn.compiler_probe", what, str(max_lanes),
            json.dumps(device_key(device))]


def _in_child(what: str, device: Any, max_lanes: int) -> tuple[bool, str]:
    """Run probe ``what`` in a child process: ``(answer, why not)``; a crash, a hang or
    any output but the answer means no."""
    cmd = child_command(what, device, max_lanes)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                              env=dict(os.environ), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"the probe did not finish within {CHILD_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return False, f"no child process could be started ({exc})"
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines and lines[-1] in ("yes", "no"):
        return lines[-1] == "yes", ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return False, f"the compiler ended the probe's process (status {done.returncode}: {tail[0]})"


def _answer(what: str, runtime: Any, max_lanes: int = 16) -> bool:
    device = runtime.device
    key = (what, max_lanes, device.int_ptr)
    with _LOCK:
        if key in _RESULTS:
            return _RESULTS[key]
    why = ""
    if is_simulator(device):
        ok = False
    elif runs_in_process(device):
        try:
            ok = bool(_CHECKS[what](runtime, max_lanes))
        except Exception:  # noqa: BLE001 - the compiler lacks it: the standard code
            ok = False
    else:
        ok, why = _in_child(what, device, max_lanes)
    if why:
        warnings.warn(f"clattn: {device.platform.name.strip()} / {device.name.strip()}: the "
                      f"{what} probe failed ({why}); the kernels use the standard form",
                      RuntimeWarning, stacklevel=4)
    with _LOCK:
        _RESULTS[key] = ok
    return ok


def storage_half_works(runtime: Any, max_lanes: int = 16) -> bool:
    """Whether ``runtime``'s device builds the ``__fp16`` conversions and gets every case
    right, at every width up to ``max_lanes`` (the widest its rows kernels use)."""
    return _answer("storage_half", runtime, max_lanes)


def prefetch_works(runtime: Any) -> bool:
    """Whether ``runtime``'s device builds and runs a kernel with ``__builtin_prefetch``."""
    return _answer("prefetch", runtime)


def _child_main(argv: list[str]) -> int:
    """``python -m clattn.compiler_probe WHAT MAX_LANES DEVICE_KEY_JSON``: prints yes or no."""
    from .runtime import Runtime

    what, max_lanes, key = argv[0], int(argv[1]), json.loads(argv[2])
    runtime = Runtime(_find_device(key))
    try:
        ok = bool(_CHECKS[what](runtime, max_lanes))
    except Exception:  # noqa: BLE001 - a build error: no
        ok = False
    print("yes" if ok else "no", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - run in a child by _in_child
    sys.exit(_child_main(sys.argv[1:]))
