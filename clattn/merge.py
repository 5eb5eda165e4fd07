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

from . import cpu_backend, runtime, signatures
from .codegen import render_merge
from .device import device_setup, warn_cpu_fallback, warn_notes
from .fit import merge_geometry
from .profiles.record import Profile
from .spec import LSE_DTYPE
from .staging import Call
from .validate import check_array, check_merge_k, check_merge_pair, host_copy, is_host

_lock = threading.Lock()
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
        warn_notes(hit[1].notes, stacklevel=3)
        with _lock:
            _setups[key] = hit
    return hit[1]


def _setup_for(arrays: dict, device: Any, profile: Any):
    """The device setup to run on, or None for the CPU fallback (``arrays`` by name)."""
    dev_arrays = [a for a in arrays.values() if a is not None and not is_host(a)]
    if dev_arrays:
        host = [n for n, a in arrays.items() if a is not None and is_host(a)]
        if host:
            on_dev = [n for n, a in arrays.items() if a is not None and not is_host(a)]
            raise TypeError(f"{', '.join(host)}: numpy array(s) among pyopencl arrays "
                            f"({', '.join(on_dev)}); pass all of one kind")
        rt = runtime.Runtime.for_device(dev_arrays[0].context)
        return _cached_setup(rt, profile), dev_arrays[0].queue or rt.queue
    if device is None or device == "cpu":
        return None, None
    dev = runtime.select_device(device)
    if dev is None:
        warn_cpu_fallback(runtime.no_device_reason())
        return None, None
    runtime.check_usable(dev)
    rt = runtime.Runtime.for_device(dev)
    return _cached_setup(rt, profile), rt.queue


def _launcher(setup: Any, head_dim: int, dtype: str, table: Any) -> tuple[Any, Any]:
    """(launcher, geometry) of a merge kernel for states of ``dtype`` on ``setup``."""
    geom = merge_geometry(head_dim, dtype, setup.profile, setup.limits)
    launcher = setup.runtime.launcher(
        ("merge", head_dim, dtype, geom), table,
        lambda: render_merge(head_dim, dtype, dtype, geom))
    return launcher, geom


def merge_state_(v: Any, s: Any, v_other: Any, s_other: Any, *, device: Any = None,
                 profile: Any = None, queue: Any = None, wait_for: list | None = None) -> Any:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place.

    Parameters
    ----------
    v, v_other : array of float16 or float32, shape [N, H, D]
        Attention outputs of two disjoint parts of the same chunks.
    s, s_other : float32 array, shape [N, H]
        Their base-2 log-sum-exps; ``-inf`` marks an empty state (its ``v`` is ignored).
    device : None, str or pyopencl device
        For numpy arrays: None runs the CPU backend, a device name runs OpenCL there
        (arrays copied in and back). pyopencl arrays run on their own context.
    profile : None, str, Profile or dict
        As for :class:`~clattn.BatchDecode`.
    queue : pyopencl.CommandQueue, optional
    wait_for : list of pyopencl.Event, optional

    Returns
    -------
    pyopencl.Event or None
        The merge's event (None on the CPU backend or when N x H is 0).

    Examples
    --------
    >>> merge_state_(v, s, v2, s2)   # doctest: +SKIP
    """
    check_merge_pair(v, s, v_other, s_other)
    setup, q0 = _setup_for(dict(v=v, s=s, v_other=v_other, s_other=s_other), device,
                           profile)
    if setup is None:
        cpu_backend.merge_state_(*[host_copy(a) for a in (v, s, v_other, s_other)])
        return None
    N, H, D = v.shape
    call = Call(setup.runtime, queue or q0, wait_for)
    host = is_host(v)
    dv = call.output("v", v, v.shape, v.dtype) if not host else call.input("v", v)
    ds = call.output("s", s, s.shape, s.dtype) if not host else call.input("s", s)
    dvo, dso = call.input("v_other", v_other), call.input("s_other", s_other)  # contexts too
    knl, geom = _launcher(setup, D, str(np.dtype(v.dtype)), signatures.MERGE_PAIR)
    events = []
    if N * H:
        gsz, lsz = geom.sizes(N * H, D)
        events.append(knl(call.queue, gsz, lsz, call.wait_list(), v=dv, s=ds, vo=dvo, so=dso,
                          NH=N * H))
    res = call.finish([dv, ds], events, host=host)
    if host and events:
        v[...], s[...] = res
    return events[-1] if events else None


def merge_state(v: Any, s: Any, v_other: Any, s_other: Any, **kw: Any) -> tuple[Any, Any]:
    """Out-of-place :func:`merge_state_`: returns new ``(v, s)``; keywords as there."""
    check_array("v", v)  # what is copied must be an array (the rest: merge_state_)
    check_array("s", s)
    v2, s2 = v.copy(), s.copy()
    merge_state_(v2, s2, v_other, s_other, **kw)
    return v2, s2


def merge_states(v: Any, s: Any, *, out: Any = None, lse: Any = None, device: Any = None,
                 profile: Any = None, queue: Any = None,
                 wait_for: list | None = None) -> tuple[Any, Any]:
    """Merge K states per row at once.

    Parameters
    ----------
    v : array of float16 or float32, shape [N, K, H, D]
        K attention outputs per row (disjoint parts of the same chunk).
    s : float32 array, shape [N, K, H]
        Their base-2 log-sum-exps (``-inf``: empty, its ``v`` ignored).
    out : array of v's dtype, shape [N, H, D], optional
    lse : float32 array, shape [N, H], optional
        Written in place when given.
    device, profile, queue, wait_for
        As for :func:`merge_state_`.

    Returns
    -------
    (out, lse)
        ``out [N, H, D]`` and ``lse [N, H]``; K = 0 gives ``(0, -inf)``.

    Examples
    --------
    >>> out, lse = merge_states(v, s)   # doctest: +SKIP
    """
    check_merge_k(v, s, out, lse)
    setup, q0 = _setup_for(dict(v=v, s=s, out=out, lse=lse), device, profile)
    if setup is None:
        return cpu_backend.merge_states(*[host_copy(a) for a in (v, s, out, lse)])
    N, K, H, D = v.shape
    call = Call(setup.runtime, queue or q0, wait_for)
    dv, ds = call.input("v", v), call.input("s", s)
    dout = call.output("out", out, (N, H, D), v.dtype)
    dlse = call.output("lse", lse, (N, H), LSE_DTYPE)
    knl, geom = _launcher(setup, D, str(np.dtype(v.dtype)), signatures.MERGE_VARLEN)
    events = []
    if N * H:
        gsz, lsz = geom.sizes(N * H, D)
        events.append(knl(call.queue, gsz, lsz, call.wait_list(), vin=dv, sv=ds, indptr=None,
                          fixed_k=K, skip_single=0, n_states=N * K, out=dout, lse=dlse,
                          N=N, H=H, sink_logits=None, use_sinks=0))
    o, l_ = call.finish([dout, dlse], events, host=is_host(v))
    return o, l_
