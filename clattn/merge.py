"""Merging attention states: ``merge_state_`` (pairwise, in place) and ``merge_states`` (K-way).

States are (v, s) with s the base-2 log-sum-exp; ``s = -inf`` is an empty state.
numpy arrays run on the CPU fallback unless a device is named; pyopencl arrays
run on their own context.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any

import numpy as np

from . import reference, runtime
from .codegen import merge_geometry, render_merge
from .profiles.record import Profile
from .setup import device_setup, warn_cpu_fallback
from .spec import LSE_DTYPE
from .validate import check_merge_k, check_merge_pair, is_host

_lock = threading.Lock()
_kernels: dict = {}


_setups: dict = {}


def _cached_setup(rt: Any, profile: Any):
    """The device setup of a runtime for a profile argument, resolved once."""
    if profile is None or isinstance(profile, str):
        pkey = profile
    elif isinstance(profile, Profile):
        pkey = ("Profile", profile)
    else:
        pkey = ("dict", json.dumps(dict(profile), sort_keys=True, default=str))
    key = (id(rt), pkey, os.environ.get("CLATTN_PROFILE"))
    with _lock:
        hit = _setups.get(key)
    if hit is None or hit[0] is not rt:
        hit = (rt, device_setup(rt, profile))
        with _lock:
            _setups[key] = hit
    return hit[1]


def _setup_for(arrays: list, device: Any, profile: Any):
    """The device setup to run on, or None for the CPU fallback."""
    dev_arrays = [a for a in arrays if a is not None and not is_host(a)]
    if dev_arrays:
        if any(is_host(a) for a in arrays if a is not None):
            raise TypeError("merge: mix of numpy and pyopencl arrays; pass all of one kind")
        rt = runtime.Runtime.for_device(dev_arrays[0].context)
        return _cached_setup(rt, profile), dev_arrays[0].queue or rt.queue
    if device is None or device == "cpu":
        return None, None
    dev = runtime.select_device(device)
    if dev is None:
        warn_cpu_fallback("no OpenCL device found")
        return None, None
    rt = runtime.Runtime.for_device(dev)
    return _cached_setup(rt, profile), rt.queue


def _kernel(setup, head_dim: int, dtype: str, vin: str, name: str):
    geom = merge_geometry(head_dim, dtype, setup.profile, setup.limits)
    key = (id(setup.runtime), head_dim, dtype, vin, geom, name)
    with _lock:
        if key not in _kernels:
            prg = setup.runtime.program(render_merge(head_dim, dtype, vin, geom))
            _kernels[key] = (runtime.cl().Kernel(prg, name), geom)
        return _kernels[key]


def _buf(a: Any, dummy: Any = None) -> tuple[Any, np.int32]:
    """(buffer, element offset); a zero-size array (no buffer) gets ``dummy``."""
    if a.base_data is None:
        return dummy, np.int32(0)
    return a.base_data, np.int32(a.offset // np.dtype(a.dtype).itemsize)


def merge_state_(v: Any, s: Any, v_other: Any, s_other: Any, *, device: Any = None,
                 profile: Any = None, queue: Any = None, wait_for: list | None = None) -> Any:
    """``v, s <- merge((v, s), (v_other, s_other))`` in place; returns the event (or None).

    ``v [N, H, D]`` f16/f32, ``s [N, H]`` f32. An empty side passes the other through;
    both empty gives ``v = 0, s = -inf``.
    """
    check_merge_pair(v, s, v_other, s_other)
    setup, q0 = _setup_for([v, s, v_other, s_other], device, profile)
    if setup is None:
        reference.merge_state_(*[a if is_host(a) else a.get() for a in (v, s, v_other, s_other)])
        return None
    cl = runtime.cl()
    host = is_host(v)
    queue = queue or q0
    arrs = [cl.array.to_device(queue, a) if host else a for a in (v, s, v_other, s_other)]
    N, H, D = v.shape
    knl, geom = _kernel(setup, D, str(np.dtype(v.dtype)), str(np.dtype(v.dtype)), "clattn_merge_pair")
    gsz, lsz = geom.sizes(N * H, D)
    waits = list(wait_for or []) + [e for a in arrs for e in (getattr(a, "events", []) or [])]
    evt = None
    if N * H:
        evt = knl(queue, gsz, lsz, *_buf(arrs[0]), *_buf(arrs[1]), *_buf(arrs[2]), *_buf(arrs[3]),
                  np.int32(N * H), wait_for=waits or None)
    if evt is not None:
        arrs[0].add_event(evt)
        arrs[1].add_event(evt)
        if host:  # get() waits for the arrays' events
            v[...] = arrs[0].get(queue=queue)
            s[...] = arrs[1].get(queue=queue)
    return evt


def merge_state(v: Any, s: Any, v_other: Any, s_other: Any, **kw: Any) -> tuple[Any, Any]:
    """Out-of-place :func:`merge_state_`: returns new ``(v, s)``."""
    v2, s2 = v.copy(), s.copy()
    merge_state_(v2, s2, v_other, s_other, **kw)
    return v2, s2


def merge_states(v: Any, s: Any, *, out: Any = None, lse: Any = None, device: Any = None,
                 profile: Any = None, queue: Any = None,
                 wait_for: list | None = None) -> tuple[Any, Any]:
    """Merge K states at once: ``v [N, K, H, D]``, ``s [N, K, H]`` -> ``(out [N, H, D], lse [N, H])``."""
    check_merge_k(v, s, out, lse)
    setup, q0 = _setup_for([v, s, out, lse], device, profile)
    if setup is None:
        return reference.merge_states(*[a if a is None or is_host(a) else a.get()
                                        for a in (v, s, out, lse)])
    cl = runtime.cl()
    host = is_host(v)
    queue = queue or q0
    N, K, H, D = v.shape
    dv, ds = (cl.array.to_device(queue, a) if host else a for a in (v, s))
    dout = out if out is not None and not host else cl.array.empty(queue, (N, H, D), v.dtype)
    dlse = lse if lse is not None and not host else cl.array.empty(queue, (N, H), LSE_DTYPE)
    dt = str(np.dtype(v.dtype))
    knl, geom = _kernel(setup, D, dt, dt, "clattn_merge_varlen")
    gsz, lsz = geom.sizes(N * H, D)
    waits = list(wait_for or []) + [e for a in (dv, ds, dout, dlse)
                                    for e in (getattr(a, "events", []) or [])]
    evt = None
    if N * H:
        dummy = setup.runtime.dummy_int()
        evt = knl(queue, gsz, lsz, *_buf(dv, dummy), *_buf(ds, dummy), dummy, np.int32(0),
                  np.int32(K), np.int32(0), np.int32(N * K), *_buf(dout), *_buf(dlse),
                  np.int32(N), np.int32(H), wait_for=waits or None)
    if evt is not None:
        dout.add_event(evt)
        dlse.add_event(evt)
    if host:  # get() waits for the arrays' events
        o = dout.get(queue=queue) if evt is not None else np.zeros((N, H, D), v.dtype)
        l_ = dlse.get(queue=queue) if evt is not None else np.zeros((N, H), LSE_DTYPE)
        if out is not None:
            out[...] = o
            o = out
        if lse is not None:
            lse[...] = l_
            l_ = lse
        return o, l_
    return dout, dlse
