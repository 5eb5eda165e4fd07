"""The correctness set of ``clattn tune``: decode, prefill and merge on a device against the
CPU backend.

:func:`correctness` runs every feature a profile's kernels must get right (f16 and f32,
RoPE, sliding window with sinks, soft-cap, split partitions, quantized q8_0 and q4_0 pages,
causal and non-causal prefill, both merges) with a given profile: the registry's before
tuning, the winner before it is saved. Results are compared with :func:`compare` (atol =
rtol = :data:`TOL` for the dtype) to :mod:`clattn.cpu_backend`; the tuner verifies every
new kernel with the same helpers. :func:`kv_bytes` states what each page format stores
per token for the shape the quantized checks run.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import numpy as np

from .. import cpu_backend
from ..decode import BatchDecode
from ..merge import merge_state_, merge_states
from ..prefill import BatchPrefill
from ..profiles.record import Profile
from ..quant import KV_FORMATS, pack_pool
from .timing import first_line
from .workloads import MODELS, spec_for

TOL = {"float16": 2e-3, "float32": 1e-4}
#: sequence lengths of a verification batch: empty, one row, partial and several pages
VERIFY_LENGTHS = [0, 1, 45, 200, 333]
#: new tokens (queries) of each :data:`VERIFY_LENGTHS` sequence in the prefill checks:
#: none, the one row, and tiles that end inside a page
PREFILL_NEW = [0, 1, 17, 40, 64]
#: one group of the correctness set (:func:`check_groups`): its label and what runs it
CheckGroup = tuple[str, Callable[[], list["Check"]]]
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
        ``(q, pages, indptr, indices, last_page_len)`` and the keywords; ``pages`` is a
        byte pool (:func:`clattn.quant.pack_pool`) when the spec quantizes K or V, and a
        pool of key rows alone when its values are in them (``value_in_key``).
    """
    rng = np.random.default_rng(seed)
    ps, dt = spec.page_size, spec.np_dtype
    B, H, Hkv, D = len(lengths), spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    npages = [(n + ps - 1) // ps for n in lengths]
    total = sum(npages)
    P = total + 2
    q = (rng.standard_normal((B, H, D)) * q_scale).astype(dt)
    if spec.value_in_key:
        pages = pack_pool(rng.standard_normal((P, Hkv, ps, D)).astype(dt), None, spec.layout)
    else:
        pages = rng.standard_normal((P, 2, Hkv, ps, D)).astype(dt)
        if spec.byte_pool:
            pages = pack_pool(pages[:, 0], pages[:, 1], spec.layout)
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


def check_call(label: str, dtype: str, run: Callable[[], tuple],
               ref: Callable[[], tuple]) -> Check:
    """Compare ``run()``'s ``(out, lse, ...)`` with ``ref()``'s (the CPU backend's); an
    exception in either is a failed check that names it."""
    try:
        rv, rs = ref()[:2]
        gv, gs = run()[:2]
        ok, err, why = compare(gv, gs, rv, rs, dtype)
        return Check(label, ok, err, TOL[dtype], why)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return Check(label, False, math.inf, TOL[dtype], first_line(exc))


def check_decode(name: str, dec: Any, args: tuple, kw: dict, split: Any = None) -> Check:
    """Run ``dec`` on a host case (``split`` as for ``run``) and compare with the CPU backend."""
    return check_call(name, dec.spec.dtype, lambda: dec.run(*args, **kw, split=split),
                      lambda: cpu_backend.batch_decode(dec.spec, *args, **kw))


def check_prefill(name: str, pre: Any, args: tuple, kw: dict) -> Check:
    """Run the prefill ``pre`` on a host case (:func:`make_prefill_case`'s arguments and
    keywords) and compare with the CPU backend."""
    return check_call(name, pre.spec.dtype, lambda: pre.run(*args, **kw),
                      lambda: cpu_backend.batch_prefill(pre.spec, *args, **kw))


def make_prefill_case(spec: Any, lengths: list[int], new: list[int], seed: int, *,
                      rope: bool = False) -> tuple[tuple, dict]:
    """A random host prefill batch: the positional arguments and keywords of
    ``BatchPrefill.run``.

    Parameters
    ----------
    spec : AttentionSpec
    lengths : list of int
        Rows stored per sequence, the new tokens included.
    new : list of int
        New tokens (queries) per sequence, each at most its stored rows.
    seed : int
    rope : bool
        Pass ``rotary_mode=1`` with key positions (queries at their own rows' positions).

    Returns
    -------
    (args, kw)
        ``(q, pages, qo_indptr, page_indptr, page_indices, last_page_len)`` and the
        keywords; the pages and tables are :func:`make_case`'s.
    """
    if len(new) != len(lengths) or any(not 0 <= n <= m for n, m in zip(new, lengths)):
        raise ValueError(f"new={new}: one count per sequence of lengths={lengths}, each "
                         f"between 0 and its stored rows")
    (_, pages, indptr, indices, last), kw = make_case(spec, lengths, seed, rope=rope)
    kw.pop("q_pos", None)  # a decode query's position; prefill queries sit at their rows
    qo = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    rng = np.random.default_rng(seed + 1)
    q = rng.standard_normal((int(qo[-1]), spec.num_qo_heads, spec.head_dim)).astype(spec.np_dtype)
    return (q, pages, qo, indptr, indices, last), kw


def decoder(spec: Any, device: Any, profile: Profile | None, *, build: bool = True,
            kind: type | None = None) -> Any:
    """An OpenCL :class:`BatchDecode` (or ``kind``, e.g. :class:`BatchPrefill`) with
    ``profile`` (None: the registry's), built unless told otherwise, without the warning
    a profile cut to the device's limits gives."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dec = (kind or BatchDecode)(spec, device, backend="opencl", profile=profile)
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
#: the quantized-page decode cases (one kernel each, checked unsplit and split): (model
#: index, K format, V format); both formats on both sides
QUANT_CASES: tuple[tuple[int, str, str], ...] = ((0, "q8_0", "q4_0"), (0, "q4_0", "q8_0"))
#: the prefill cases, one kernel (RoPE and causality are call arguments): (case options,
#: call keywords, label)
PREFILL_MODEL = 1
PREFILL_CASES: tuple[tuple[dict, dict, str], ...] = (
    ({}, {}, "causal"),
    ({"rope": True}, {}, "causal + RoPE"),
    ({}, {"causal": False}, "non-causal"),
)


def _shape_text(spec: Any) -> str:
    """``f16 32/8/128``."""
    return (f"{spec.dtype.replace('float', 'f')} "
            f"{spec.num_qo_heads}/{spec.num_kv_heads}/{spec.head_dim}")


def _built(label: str, spec: Any, device: Any, profile: Profile | None,
           kind: type) -> tuple[Any, Check | None]:
    """(the built object, None), or (None, the failed check that says why)."""
    try:
        return decoder(spec, device, profile, kind=kind), None
    except Exception as exc:  # noqa: BLE001
        return None, Check(label, False, math.inf, TOL[spec.dtype],
                           "build failed: " + first_line(exc))


def _decode_pair(label: str, spec: Any, device: Any, profile: Profile | None, seed: int,
                 case_kw: dict) -> list[Check]:
    """One decode kernel checked unsplit and split on one :func:`make_case` batch."""
    dec, failed = _built(label, spec, device, profile, BatchDecode)
    if failed:
        return [failed]
    args, kw = make_case(spec, VERIFY_LENGTHS, seed=seed, **case_kw)
    return [check_decode(label, dec, args, kw),
            check_decode(label + ", split", dec, args, kw, split=2 * spec.page_size)]


def _pair_groups(cases: Any, seed: int, device: Any,
                 profile: Profile | None) -> list[CheckGroup]:
    """One group per decode case ((model index, spec fields, case options, label)), each
    checked unsplit and split (:func:`_decode_pair`) on its own seed from ``seed``."""
    groups: list[CheckGroup] = []
    for i, (m, spec_kw, case_kw, what) in enumerate(cases):
        spec = spec_for(MODELS[m], **spec_kw)
        label = f"decode {_shape_text(spec)} {what}"
        groups.append((label, partial(_decode_pair, label, spec, device, profile, seed + i,
                                      case_kw)))
    return groups


def _quantized_groups(device: Any, profile: Profile | None) -> list[CheckGroup]:
    return _pair_groups([(m, {"k_format": kf, "v_format": vf}, {}, f"K {kf} V {vf}")
                         for m, kf, vf in QUANT_CASES], 200, device, profile)


def quantized_checks(device: Any, profile: Profile | None = None) -> list[Check]:
    """Decode over quantized pages (:data:`QUANT_CASES`), unsplit and split, against the
    CPU backend on the same byte pool."""
    return [c for _, group in _quantized_groups(device, profile) for c in group()]


def prefill_checks(device: Any, profile: Profile | None = None) -> list[Check]:
    """:class:`BatchPrefill` (:data:`PREFILL_CASES`: :data:`PREFILL_NEW` queries over
    :data:`VERIFY_LENGTHS` stored rows) against the CPU backend."""
    spec = spec_for(MODELS[PREFILL_MODEL])
    head = f"prefill {_shape_text(spec)}"
    pre, failed = _built(head, spec, device, profile, BatchPrefill)
    if failed:
        return [failed]
    checks = []
    for i, (case_kw, call_kw, what) in enumerate(PREFILL_CASES):
        args, kw = make_prefill_case(spec, VERIFY_LENGTHS, PREFILL_NEW, seed=300 + i, **case_kw)
        checks.append(check_prefill(f"{head} {what}", pre, args, {**kw, **call_kw}))
    return checks


@dataclass(frozen=True)
class KvBytes:
    """Pool bytes one token takes per layer (K and V, every KV head, scales included) in
    each page format (:data:`clattn.quant.KV_FORMATS`), for one shape."""

    shape: str
    per_format: dict[str, float]

    def summary(self) -> str:
        """``Llama-3-8B 32/8/128: f16 4096 B, ..., q4_0 1152 B (0.28x f16)``."""
        base = self.per_format.get("float16")
        parts = [f"{f.replace('float', 'f')} {b:g} B"
                 + (f" ({b / base:.2f}x f16)" if base and f != "float16" else "")
                 for f, b in self.per_format.items()]
        return f"{self.shape}: " + ", ".join(parts)


def kv_bytes(spec: Any = None) -> KvBytes:
    """:class:`KvBytes` of ``spec``'s shape (default: the shape :func:`quantized_checks`
    runs), from :attr:`clattn.AttentionSpec.bytes_per_token` of each format."""
    name = ""
    if spec is None:
        model = MODELS[QUANT_CASES[0][0]]
        spec, name = spec_for(model), model.name + " "
    per = {f: float(replace(spec, k_format=f, v_format=f).bytes_per_token) for f in KV_FORMATS}
    return KvBytes(f"{name}{spec.num_qo_heads}/{spec.num_kv_heads}/{spec.head_dim}", per)


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

        checks.append(check_call(f"merge_state_ {short} [N={N}, H={H}, D={D}]", dt, pair,
                                   lambda: cpu_backend.merge_state(v, s, vo, so)))
        vk = rng.standard_normal((N, K, H, D)).astype(dt)
        sk = (rng.standard_normal((N, K, H)) * 4).astype(np.float32)
        sk[0, :, :] = -np.inf
        sk[1, 1:, :] = -np.inf
        checks.append(check_call(
            f"merge_states {short} [N={N}, K={K}, H={H}, D={D}]", dt,
            lambda: merge_states(vk, sk, device=device, profile=profile),
            lambda: cpu_backend.merge_states(vk, sk)))
    return checks


def check_groups(device: Any, profile: Profile | None = None) -> list[CheckGroup]:
    """The correctness set of :func:`correctness` as groups, in its order: each group
    builds what it checks (one decode kernel, the prefill kernel, the merges) and returns
    its checks when called, so that a caller may stop between two groups.

    Parameters
    ----------
    device : pyopencl.Device or anything :func:`clattn.runtime.select_device` accepts
    profile : Profile, optional
        As for :func:`correctness`.

    Returns
    -------
    list of (label, callable)
        The callables take no argument and return a list of :class:`Check`.
    """
    return (_pair_groups(DECODE_CASES, 100, device, profile)
            + _quantized_groups(device, profile)
            + [("prefill", partial(prefill_checks, device, profile)),
               ("merges", partial(_merge_checks, device, profile))])


def correctness(device: Any, *, profile: Profile | None = None) -> list[Check]:
    """Decode, prefill and merge on ``device`` with ``profile`` against the CPU backend.

    Parameters
    ----------
    device : pyopencl.Device or anything :func:`clattn.runtime.select_device` accepts
    profile : Profile, optional
        The profile under test (fitted to the device as ``BatchDecode`` does); None: the
        registry's choice for the device.

    Returns
    -------
    list of Check
        Every decode case of :data:`DECODE_CASES` unsplit and split, the quantized ones
        (:func:`quantized_checks`), the prefill ones (:func:`prefill_checks`), then
        ``merge_state_`` and ``merge_states`` in f16 and f32 (empty states included).
    """
    return [c for _, group in check_groups(device, profile) for c in group()]


__all__ = ["Check", "CheckGroup", "DECODE_CASES", "KvBytes", "PREFILL_CASES", "PREFILL_NEW",
           "QUANT_CASES", "TOL", "VERIFY_LENGTHS", "check_call", "check_decode", "check_groups",
           "check_prefill", "compare", "correctness", "decoder", "kv_bytes", "make_case",
           "make_prefill_case", "prefill_checks", "quantized_checks"]
