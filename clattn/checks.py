"""The ``clattn profile`` correctness checks: decode and merge against the CPU fallback.

Results are compared with :func:`compare` (atol = rtol = :data:`TOL` for the dtype) to
:mod:`clattn.reference`; the tuner uses the same helpers to verify every new kernel.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import reference
from .tuning import MODELS, _first_line, _spec

TOL = {"float16": 2e-3, "float32": 1e-4}


@dataclass
class Check:
    """One comparison against the CPU fallback."""

    name: str
    passed: bool
    max_abs_err: float
    tol: float
    detail: str = ""


def compare(got_out: Any, got_lse: Any, ref_out: Any, ref_lse: Any,
            dtype: str) -> tuple[bool, float, str]:
    """(ok, max abs error over out and finite lse, what is wrong) with atol = rtol = TOL[dtype]."""
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
    err = float(np.nanmax(d_o, initial=0.0))
    err = max(err, float(np.nanmax(d_s, initial=0.0)))
    if np.isnan(d_o).all() and d_o.size:
        err = math.inf
    bad = int((d_o > tol + tol * np.abs(r)).sum()) + int((d_s > tol + tol * np.abs(rs[fin])).sum())
    if bad:
        problems.append(f"{bad} value(s) outside atol=rtol={tol:g}")
    return not problems, err, "; ".join(problems)


def make_case(spec: Any, lengths: list[int], seed: int, *, window: bool = False,
              rope: bool = False) -> tuple[tuple, dict]:
    """A random host batch: positional args and keywords of ``BatchDecode.run``."""
    rng = np.random.default_rng(seed)
    ps, dt = spec.page_size, spec.np_dtype
    B, H, Hkv, D = len(lengths), spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    npages = [(n + ps - 1) // ps for n in lengths]
    total = sum(npages)
    P = total + 2
    q = rng.standard_normal((B, H, D)).astype(dt)
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


VERIFY_LENGTHS = [0, 1, 45, 200, 333]


def _decode_check(name: str, dec: Any, spec: Any, args: tuple, kw: dict,
                  split: Any = None) -> Check:
    try:
        ro, rl = reference.batch_decode(spec, *args, **kw)
        out, lse, _ = dec.run(*args, **kw, split=split)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return Check(name, False, math.inf, TOL[spec.dtype], _first_line(exc))
    ok, err, why = compare(out, lse, ro, rl, spec.dtype)
    return Check(name, ok, err, TOL[spec.dtype], why)


def correctness(device: Any, *, f32: bool = True) -> list[Check]:
    """Decode and merge on ``device`` (its registry profile) against the CPU fallback."""
    from .decode import BatchDecode
    from .merge import merge_state_, merge_states

    checks: list[Check] = []
    llama, qwen = MODELS
    cases = [
        (llama, {}, dict(), "plain"),
        (qwen, {}, dict(), "plain"),
        (qwen, {}, dict(rope=True), "RoPE"),
        (qwen, {"sliding_window": True}, dict(window=True), "sliding window + sinks"),
        (qwen, {"sliding_window": True}, dict(window=True, rope=True),
         "sliding window + sinks + RoPE"),
    ]
    if f32:
        cases.append((qwen, {"dtype": "float32"}, dict(), "plain"))
    for i, (model, spec_kw, case_kw, what) in enumerate(cases):
        spec = _spec(model, **dict(spec_kw))
        label = (f"decode {spec.dtype.replace('float', 'f')} "
                 f"{spec.num_qo_heads}/{spec.num_kv_heads}/{spec.head_dim} {what}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                dec = BatchDecode(spec, device, backend="opencl").build()
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(label, False, math.inf, TOL[spec.dtype],
                                "build failed: " + _first_line(exc)))
            continue
        args, kw = make_case(spec, VERIFY_LENGTHS, seed=100 + i, **case_kw)
        checks.append(_decode_check(label, dec, spec, args, kw))
        checks.append(_decode_check(label + ", split", dec, spec, args, kw,
                                    split=2 * spec.page_size))
    # merge kernels
    rng = np.random.default_rng(7)
    N, H, D = 6, 4, 64
    for dt in ("float16",):
        v = rng.standard_normal((N, H, D)).astype(dt)
        vo = rng.standard_normal((N, H, D)).astype(dt)
        s = (rng.standard_normal((N, H)) * 4).astype(np.float32)
        so = (rng.standard_normal((N, H)) * 4).astype(np.float32)
        s[0, :] = -np.inf       # this side empty
        so[1, :] = -np.inf      # other side empty
        s[2, :2] = so[2, :2] = -np.inf  # both empty
        label = f"merge_state_ {dt.replace('float', 'f')} [N={N}, H={H}, D={D}]"
        try:
            rv, rs = reference.merge_state(v, s, vo, so)
            gv, gs = v.copy(), s.copy()
            merge_state_(gv, gs, vo, so, device=device)
            ok, err, why = compare(gv, gs, rv, rs, dt)
            checks.append(Check(label, ok, err, TOL[dt], why))
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(label, False, math.inf, TOL[dt], _first_line(exc)))
        K = 3
        vk = rng.standard_normal((N, K, H, D)).astype(dt)
        sk = (rng.standard_normal((N, K, H)) * 4).astype(np.float32)
        sk[0, :, :] = -np.inf
        sk[1, 1:, :] = -np.inf
        label = f"merge_states {dt.replace('float', 'f')} [N={N}, K={K}, H={H}, D={D}]"
        try:
            rv, rs = reference.merge_states(vk, sk)
            gv, gs = merge_states(vk, sk, device=device)
            ok, err, why = compare(gv, gs, rv, rs, dt)
            checks.append(Check(label, ok, err, TOL[dt], why))
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(label, False, math.inf, TOL[dt], _first_line(exc)))
    return checks


__all__ = ["Check", "compare", "make_case", "correctness"]
