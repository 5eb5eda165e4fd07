"""The correctness set of ``clattn tune``: decode and merge on a device against the CPU backend.

:func:`correctness` runs every feature a profile's kernels must get right (f16 and f32,
RoPE, sliding window with sinks, soft-cap, split partitions, both merges) with a given
profile: the registry's before tuning, the winner before it is saved. Results are compared
with :func:`compare` (atol = rtol = :data:`TOL` for the dtype) to :mod:`clattn.cpu_backend`;
the tuner verifies every new kernel with the same helpers.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import cpu_backend
from ..decode import BatchDecode
from ..merge import merge_state_, merge_states
from ..profiles.record import Profile
from .timing import first_line
from .workloads import MODELS, spec_for

TOL = {"float16": 2e-3, "float32": 1e-4}
#: sequence lengths of a verification batch: empty, one row, partial and several pages
VERIFY_LENGTHS = [0, 1, 45, 200, 333]
#: the soft-cap of the soft-cap case, and how much q is scaled so that it bites
SOFTCAP, SOFTCAP_Q_SCALE = 5.0, 4.0


@dataclass(frozen=True)
class Check:
    """One comparison against the CPU backend."""

    name: str
    passed: bool
    max_abs_err: float
    tol: float
    detail: str = ""


def compare(got_out: Any, got_lse: Any, ref_out: Any, ref_lse: Any,
            dtype: str) -> tuple[bool, float, str]:
    """Compare a result with the CPU backend's.

    Parameters
    ----------
    got_out, ref_out : array, shape [B, H, D] (or any shape, equal)
    got_lse, ref_lse : array, shape [B, H]
    dtype : str
        Storage dtype of ``out``: picks the tolerance (:data:`TOL`).

    Returns
    -------
    (ok, max_abs_err, problems)
        ``max_abs_err`` over ``out`` and the finite ``lse``; ``problems`` names NaNs,
        ``-inf`` (empty) in the wrong places and values outside atol = rtol = TOL.
    """
    tol = TOL[str(np.dtype(dtype))]
    o = np.asarray(got_out, dtype=np.float64)
    r = np.asarray(ref_out, dtype=np.float64)
    s = np.asarray(got_lse, dtype=np.float64)
    rs = np.asarray(ref_lse, dtype=np.float64)
    problems = []
    if o.shape != r.shape or s.shape != rs.shape:
        return False, math.inf, f"shape {o.shape}/{s.shape}, expected {r.shape}/{rs.shape}"
    if np.isnan(o).any() or np.isnan(s).any():
        problems.append(f"NaN in {'out' if np.isnan(o).any() else 'lse'}")
    empty, got_empty = np.isneginf(rs), np.isneginf(s)
    if (empty != got_empty).any():
        problems.append(f"lse -inf at {int((empty != got_empty).sum())} wrong place(s)")
    fin = ~empty & ~got_empty & np.isfinite(s)
    with np.errstate(invalid="ignore"):
        d_o = np.abs(o - r)
        d_s = np.abs(s[fin] - rs[fin])
    err = max(float(np.nanmax(d_o, initial=0.0)), float(np.nanmax(d_s, initial=0.0)))
    if np.isnan(d_o).all() and d_o.size:
        err = math.inf
    bad = int((d_o > tol + tol * np.abs(r)).sum()) + int((d_s > tol + tol * np.abs(rs[fin])).sum())
    if bad:
        problems.append(f"{bad} value(s) outside atol=rtol={tol:g}")
    return not problems, err, "; ".join(problems)


def make_case(spec: Any, lengths: list[int], seed: int, *, window: bool = False,
              rope: bool = False, q_scale: float = 1.0) -> tuple[tuple, dict]:
    """A random host batch: the positional arguments and keywords of ``BatchDecode.run``.

    Parameters
    ----------
    spec : AttentionSpec
    lengths : list of int
        Rows stored per sequence.
    seed : int
    window : bool
        Pass ``window_offset`` (a third of each sequence) and ``sink_size`` (up to 4).
    rope : bool
        Pass ``rotary_mode=1`` with positions.
    q_scale : float
        Multiplies q (large scores for the soft-cap case).

    Returns
    -------
    (args, kw)
        ``(q, pages, indptr, indices, last_page_len)`` and the keywords.
    """
    rng = np.random.default_rng(seed)
    ps, dt = spec.page_size, spec.np_dtype
    B, H, Hkv, D = len(lengths), spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    npages = [(n + ps - 1) // ps for n in lengths]
    total = sum(npages)
    P = total + 2
    q = (rng.standard_normal((B, H, D)) * q_scale).astype(dt)
    pages = rng.standard_normal((P, 2, Hkv, ps, D)).astype(dt)
    indices = rng.permutation(P)[:total].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([n - (k - 1) * ps if k else 0 for n, k in zip(lengths, npages)], np.int32)
    kw: dict = {}
    rows = list(lengths)
    if window:
        wo = np.array([n // 3 for n in lengths], np.int32)
        sk = np.array([min(4, int(w)) for w in wo], np.int32)
        kw.update(window_offset=wo, sink_size=sk)
        rows = [n - int(w) + int(s) for n, w, s in zip(lengths, wo, sk)]
    if rope:
        kpo = rng.integers(0, 40, size=B).astype(np.int32)
        kw.update(rotary_mode=1, rope_theta=5e5, k_pos_offset=kpo,
                  q_pos=(kpo + np.array(rows, np.int32)).astype(np.int32))
    return (q, pages, indptr, indices, last), kw


def check_decode(name: str, dec: Any, args: tuple, kw: dict, split: Any = None) -> Check:
    """Run ``dec`` on a host case (``split`` as for ``run``) and compare with the CPU backend."""
    spec = dec.spec
    try:
        ro, rl = cpu_backend.batch_decode(spec, *args, **kw)
        out, lse, _ = dec.run(*args, **kw, split=split)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return Check(name, False, math.inf, TOL[spec.dtype], first_line(exc))
    ok, err, why = compare(out, lse, ro, rl, spec.dtype)
    return Check(name, ok, err, TOL[spec.dtype], why)


def decoder(spec: Any, device: Any, profile: Profile | None, *, build: bool = True) -> BatchDecode:
    """An OpenCL :class:`BatchDecode` with ``profile`` (None: the registry's), built unless
    told otherwise, without the warning a profile cut to the device's limits gives."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dec = BatchDecode(spec, device, backend="opencl", profile=profile)
        return dec.build() if build else dec


#: the decode cases: (model index, spec fields, case options, label)
DECODE_CASES: tuple[tuple[int, dict, dict, str], ...] = (
    (0, {}, {}, "plain"),
    (1, {}, {}, "plain"),
    (1, {}, {"rope": True}, "RoPE"),
    (1, {"sliding_window": True}, {"window": True}, "sliding window + sinks"),
    (1, {"sliding_window": True}, {"window": True, "rope": True}, "sliding window + sinks + RoPE"),
    (0, {"softcap": SOFTCAP}, {"q_scale": SOFTCAP_Q_SCALE}, f"soft-cap {SOFTCAP:g}"),
    (1, {"dtype": "float32"}, {}, "plain"),
    (1, {"dtype": "float32"}, {"rope": True}, "RoPE"),
)


def _decode_checks(device: Any, profile: Profile | None) -> list[Check]:
    checks: list[Check] = []
    for i, (m, spec_kw, case_kw, what) in enumerate(DECODE_CASES):
        spec = spec_for(MODELS[m], **spec_kw)
        label = (f"decode {spec.dtype.replace('float', 'f')} "
                 f"{spec.num_qo_heads}/{spec.num_kv_heads}/{spec.head_dim} {what}")
        try:
            dec = decoder(spec, device, profile)
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(label, False, math.inf, TOL[spec.dtype],
                                "build failed: " + first_line(exc)))
            continue
        args, kw = make_case(spec, VERIFY_LENGTHS, seed=100 + i, **case_kw)
        checks.append(check_decode(label, dec, args, kw))
        checks.append(check_decode(label + ", split", dec, args, kw, split=2 * spec.page_size))
    return checks


def _merge_check(label: str, dtype: str, run: Callable[[], tuple], ref: Callable[[], tuple]) -> Check:
    try:
        rv, rs = ref()
        gv, gs = run()
        ok, err, why = compare(gv, gs, rv, rs, dtype)
        return Check(label, ok, err, TOL[dtype], why)
    except Exception as exc:  # noqa: BLE001
        return Check(label, False, math.inf, TOL[dtype], first_line(exc))


def _merge_checks(device: Any, profile: Profile | None) -> list[Check]:
    rng = np.random.default_rng(7)
    N, K, H, D = 6, 3, 4, 64
    checks = []
    for dt in ("float16", "float32"):
        v, vo = (rng.standard_normal((N, H, D)).astype(dt) for _ in range(2))
        s, so = ((rng.standard_normal((N, H)) * 4).astype(np.float32) for _ in range(2))
        s[0, :] = -np.inf       # this side empty
        so[1, :] = -np.inf      # other side empty
        s[2, :2] = so[2, :2] = -np.inf  # both empty
        short = dt.replace("float", "f")

        def pair(v: Any = v, s: Any = s, vo: Any = vo, so: Any = so) -> tuple:
            gv, gs = v.copy(), s.copy()
            merge_state_(gv, gs, vo, so, device=device, profile=profile)
            return gv, gs

        checks.append(_merge_check(f"merge_state_ {short} [N={N}, H={H}, D={D}]", dt, pair,
                                   lambda: cpu_backend.merge_state(v, s, vo, so)))
        vk = rng.standard_normal((N, K, H, D)).astype(dt)
        sk = (rng.standard_normal((N, K, H)) * 4).astype(np.float32)
        sk[0, :, :] = -np.inf
        sk[1, 1:, :] = -np.inf
        checks.append(_merge_check(
            f"merge_states {short} [N={N}, K={K}, H={H}, D={D}]", dt,
            lambda: merge_states(vk, sk, device=device, profile=profile),
            lambda: cpu_backend.merge_states(vk, sk)))
    return checks


def correctness(device: Any, *, profile: Profile | None = None) -> list[Check]:
    """Decode and merge on ``device`` with ``profile`` against the CPU backend.

    Parameters
    ----------
    device : pyopencl.Device or anything :func:`clattn.runtime.select_device` accepts
    profile : Profile, optional
        The profile under test (fitted to the device as ``BatchDecode`` does); None: the
        registry's choice for the device.

    Returns
    -------
    list of Check
        Every decode case of :data:`DECODE_CASES` unsplit and split, then ``merge_state_``
        and ``merge_states`` in f16 and f32 (empty states included).
    """
    return _decode_checks(device, profile) + _merge_checks(device, profile)


__all__ = ["Check", "DECODE_CASES", "TOL", "VERIFY_LENGTHS", "check_decode", "compare",
           "correctness", "decoder", "make_case"]
