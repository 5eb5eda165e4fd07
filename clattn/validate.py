"""Every input rule of docs/contract.md, checked once, before anything is launched or modified.

Each rule raises ``ValueError`` or ``TypeError`` naming the argument, the offending
sequence and value where there is one, and what is allowed. Table *values* are
checked when the tables are host (numpy) arrays; device arrays are checked for
shape, dtype and OpenCL context (the kernels clamp every index, so bad device tables
cannot make them read or write out of bounds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .numbers import is_number
from .spec import DTYPES, INDEX_DTYPE, INT32_MAX, LOG2E, LSE_DTYPE, AttentionSpec


def is_host(a: Any) -> bool:
    return isinstance(a, np.ndarray)


def host_copy(a: Any) -> Any:
    """A numpy copy of a device array (a blocking read); numpy arrays and None as given."""
    return a if a is None or is_host(a) else a.get()


def launchable(a: Any, ctx: Any, shape: tuple, dtype: Any) -> bool:
    """True for a device array the kernels take as it is: of context ``ctx``, exactly
    ``shape`` and ``dtype``, C-contiguous, its view offset a whole number of elements.
    The short host paths ask this field by field, building no message; anything else
    takes the checked path, which says what is wrong."""
    return (not is_host(a) and hasattr(a, "base_data") and a.shape == shape and
            a.dtype == dtype and a.flags.c_contiguous and a.context == ctx and
            a.offset % a.dtype.itemsize == 0)


def _shape(a: Any) -> tuple:
    return tuple(int(s) for s in a.shape)


def _contiguous(a: Any) -> bool:
    return bool(a.flags.c_contiguous)


def check_array(name: str, a: Any, *, ndim: int | None = None, shape: tuple | None = None,
                dtypes: tuple | None = None, writable: bool = False) -> None:
    """Type, dtype, shape and contiguity of one array argument (and, for an array the
    call writes, that a numpy array is writable: checked before anything is written)."""
    if shape is not None and dtypes is not None and None not in shape:
        try:  # the common case, answered without building any message
            if tuple(a.shape) == tuple(shape) and a.dtype in dtypes and a.flags.c_contiguous \
                    and not (writable and is_host(a) and not a.flags.writeable):
                return
        except (AttributeError, TypeError):
            pass
    if a is None or not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name}: expected a numpy or pyopencl array, got {type(a).__name__}")
    if dtypes is not None and np.dtype(a.dtype) not in [np.dtype(d) for d in dtypes]:
        allowed = ", ".join(str(np.dtype(d)) for d in dtypes)
        raise TypeError(f"{name}: dtype {np.dtype(a.dtype)} is not allowed; use {allowed} "
                        f"(e.g. {name}.astype(np.{np.dtype(dtypes[0])}))")
    if ndim is not None and len(a.shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {_shape(a)}")
    if shape is not None:
        want = tuple(shape)
        got = _shape(a)
        if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
            pretty = "(" + ", ".join("*" if w is None else str(w) for w in want) + ")"
            raise ValueError(f"{name}: expected shape {pretty}, got {got}")
    if not _contiguous(a):
        raise ValueError(f"{name}: must be C-contiguous (pass np.ascontiguousarray({name}))")
    if writable and is_host(a) and not a.flags.writeable:
        raise ValueError(f"{name}: is read-only; pass a writable array (e.g. {name}.copy())")


@dataclass
class DecodeArgs:
    """Normalised decode inputs (tables split out of ``length_info``)."""

    B: int
    num_pages: int
    nnz: int
    last_page_len: Any
    window_offset: Any | None
    sink_size: Any | None
    length_info: Any | None  # the packed array when the caller gave one
    q_pos: Any | None
    k_pos_offset: Any | None
    stored: np.ndarray | None  # per-sequence stored length (host tables only)
    chunk: np.ndarray | None  # per-sequence attended rows (host tables only)


def _ints(name: str, a: Any, n: int) -> None:
    check_array(name, a, ndim=1, shape=(n,), dtypes=(INDEX_DTYPE,))


def check_operands(spec: AttentionSpec, q: Any, pages: Any, out: Any = None,
                   lse: Any = None, *, batch: int | None = None,
                   num_pages: int | None = None) -> tuple[int, int]:
    """Check q, the page pool and the outputs; returns ``(B, P)``.

    ``batch``/``num_pages``: what a prepared step was made for (then checked against).
    """
    dt = spec.np_dtype
    check_array("q", q, ndim=3, dtypes=(dt,))
    B = _shape(q)[0]
    check_array("q", q, shape=(B, spec.num_qo_heads, spec.head_dim))
    if batch is not None and B != batch:
        raise ValueError(f"q: {B} sequences, the step was prepared for {batch}")
    if spec.byte_pool:  # quantized (or mixed) pages: a byte pool, clattn.quant's layout
        check_array("pages", pages, ndim=2, dtypes=(np.uint8,))
        P = _shape(pages)[0]
        check_array("pages", pages, shape=spec.pool_shape(P))
    else:
        check_array("pages", pages, ndim=5, dtypes=(dt,))
        P = _shape(pages)[0]
        check_array("pages", pages, shape=spec.pool_shape(P))
    if num_pages is not None and P != num_pages:
        raise ValueError(f"pages: a pool of {P} pages, the step was prepared for {num_pages} "
                         f"(its page_indices were checked against that size); prepare again")
    check_outputs(spec, B, out, lse)
    return B, P


def check_outputs(spec: AttentionSpec, B: int, out: Any = None, lse: Any = None) -> None:
    """``out [B, H_qo, D_v]`` of the spec's dtype and ``lse [B, H_qo]`` f32, writable."""
    if out is not None:
        check_array("out", out, shape=(B, spec.num_qo_heads, spec.head_dim_v),
                    dtypes=(spec.np_dtype,), writable=True)
    if lse is not None:
        check_array("lse", lse, shape=(B, spec.num_qo_heads), dtypes=(LSE_DTYPE,),
                    writable=True)


def check_decode(spec: AttentionSpec, q: Any, pages: Any, page_indptr: Any, page_indices: Any,
                 last_page_len: Any = None, *, length_info: Any = None,
                 window_offset: Any = None, sink_size: Any = None, q_pos: Any = None,
                 k_pos_offset: Any = None, rotary_mode: int = 0, sm_scale: float | None = None,
                 rope_scale: float = 1.0, rope_theta: float = 1e4,
                 out: Any = None, lse: Any = None) -> DecodeArgs:
    """Check one decode call against ``spec``; returns the normalised tables."""
    B, P = check_operands(spec, q, pages)
    args = check_tables(spec, B, P, page_indptr, page_indices, last_page_len,
                        length_info=length_info, window_offset=window_offset,
                        sink_size=sink_size, q_pos=q_pos, k_pos_offset=k_pos_offset,
                        rotary_mode=rotary_mode, sm_scale=sm_scale, rope_scale=rope_scale,
                        rope_theta=rope_theta)
    check_outputs(spec, B, out, lse)  # after the tables: a batch mismatch names q or a table
    return args


def check_tables(spec: AttentionSpec, B: int, P: int, page_indptr: Any, page_indices: Any,
                 last_page_len: Any = None, *, length_info: Any = None,
                 window_offset: Any = None, sink_size: Any = None, q_pos: Any = None,
                 k_pos_offset: Any = None, rotary_mode: int = 0, sm_scale: float | None = None,
                 rope_scale: float = 1.0, rope_theta: float = 1e4,
                 q_pos_optional: bool = False) -> DecodeArgs:
    """Check the page tables and scalars of ``B`` sequences over a pool of ``P`` pages
    (``q_pos_optional``: prefill, where the queries' positions default to their rows')."""
    _ints("page_indptr", page_indptr, B + 1)
    check_array("page_indices", page_indices, ndim=1, dtypes=(INDEX_DTYPE,))
    nnz = _shape(page_indices)[0]
    if nnz * spec.page_size > INT32_MAX:  # bounds every sequence's rows, whatever the tables
        raise ValueError(f"page_indices: {nnz} entries x page_size={spec.page_size} is more "
                         f"than 2**31 - 1 rows, which the kernels index with 32-bit ints; "
                         f"run the batch in parts")

    if length_info is not None:
        if last_page_len is not None or window_offset is not None or sink_size is not None:
            raise ValueError("length_info: pass either length_info or last_page_len/"
                             "window_offset/sink_size, not both")
        want = (3, B) if spec.sliding_window else (B,)
        check_array("length_info", length_info, shape=want, dtypes=(INDEX_DTYPE,))
        if spec.sliding_window:
            last_page_len, window_offset, sink_size = length_info[0], length_info[1], length_info[2]
        else:
            last_page_len = length_info
    if last_page_len is None:
        raise ValueError("last_page_len: required (or pass the packed length_info)")
    if length_info is None:
        _ints("last_page_len", last_page_len, B)
    if spec.sliding_window:
        if window_offset is None or sink_size is None:
            raise ValueError("window_offset, sink_size: required in sliding-window mode "
                             "(the spec has sliding_window=True); or pass length_info of "
                             "shape (3, B)")
        if length_info is None:
            _ints("window_offset", window_offset, B)
            _ints("sink_size", sink_size, B)
    elif window_offset is not None or sink_size is not None:
        raise ValueError("window_offset/sink_size: given, but the spec has sliding_window=False; "
                         "build with AttentionSpec(..., sliding_window=True)")
    if rotary_mode not in (0, 1):
        raise ValueError(f"rotary_mode={rotary_mode!r}: must be 0 (no RoPE) or 1 (RoPE in kernel)")
    if rotary_mode == 1:
        for nm, arr in (("q_pos", q_pos), ("k_pos_offset", k_pos_offset)):
            if arr is None and nm == "q_pos" and q_pos_optional:
                continue
            if arr is None:
                raise ValueError(f"{nm}: required when rotary_mode=1")
            _ints(nm, arr, B)
        check_rope_scalars(rope_theta, rope_scale)
    check_sm_scale(sm_scale)
    stored = chunk = None
    tables = [page_indptr, page_indices, last_page_len] + (
        [window_offset, sink_size] if spec.sliding_window else [])
    if all(is_host(t) for t in tables):
        stored, chunk = _check_table_values(spec, B, P, nnz, page_indptr, page_indices,
                                            last_page_len, window_offset, sink_size)
        if rotary_mode == 1 and is_host(k_pos_offset):
            _check_positions(k_pos_offset, chunk)
    return DecodeArgs(B, P, nnz, last_page_len, window_offset, sink_size, length_info,
                      q_pos, k_pos_offset, stored, chunk)


_F32_MAX = float(np.finfo(np.float32).max)


def check_value_arg(spec: AttentionSpec, v: Any) -> None:
    """``v`` of an append: None exactly when ``spec.value_in_key`` (the values are then
    the key rows' leading ``head_dim_v`` values); ValueError naming ``v`` otherwise."""
    if spec.value_in_key and v is not None:
        raise ValueError(f"v: the spec reads the values from the key rows (value_in_key=True, "
                         f"the first head_dim_v={spec.head_dim_v} values of each key row); "
                         f"pass v=None")
    if not spec.value_in_key and v is None:
        raise ValueError(f"v=None: the spec stores values of their own (value_in_key=False); "
                         f"pass v [T, num_kv_heads, head_dim_v={spec.head_dim_v}]")


def _number(name: str, value: Any) -> float:
    """``value`` as a float; a number only (not a string or a bool)."""
    if not is_number(value):
        raise TypeError(f"{name}={value!r}: must be a number")
    return float(value)


def _f32_finite(name: str, value: Any, hint: str = "") -> None:
    """A scalar the kernel takes as a float: finite as a float32 too."""
    v = _number(name, value)
    if not (math.isfinite(v) and abs(v) <= _F32_MAX):
        raise ValueError(f"{name}={value!r}: must be finite as a float32 (|x| <= {_F32_MAX:.3e})"
                         + (f" {hint}" if hint else ""))


def check_rope_scalars(rope_theta: Any, rope_scale: Any) -> None:
    """``rope_theta`` positive and finite, ``rope_scale`` finite as a float32."""
    theta = _number("rope_theta", rope_theta)
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_theta={rope_theta!r}: must be a positive finite number")
    _f32_finite("rope_scale", rope_scale)


def check_sm_scale(sm_scale: Any) -> None:
    """``sm_scale`` finite as a float32, or None (1/sqrt(head_dim))."""
    if sm_scale is not None:
        _f32_finite("sm_scale", sm_scale, "(or None for 1/sqrt(head_dim))")


def _check_positions(k_pos_offset: np.ndarray, chunk: np.ndarray) -> None:
    """Every key position k_pos_offset + r of the chunk fits an int32."""
    last = k_pos_offset.astype(np.int64) + np.maximum(chunk - 1, 0)
    bad = last > INT32_MAX
    if bad.any():
        i = _first_bad(bad)
        raise ValueError(f"k_pos_offset[{i}]={int(k_pos_offset[i])}: the chunk's last key "
                         f"position {int(last[i])} exceeds the int32 range; positions must "
                         f"stay below 2**31")


def _sink_logit_max() -> float:
    """The largest float32 ``z`` whose base-2 form ``z * log2 e``, rounded to float32 as
    the kernels form it, is finite: a larger finite ``|z|`` would overflow to +-inf."""
    log2e = np.float32(LOG2E)
    z = np.float32(np.finfo(np.float32).max / LOG2E)
    with np.errstate(over="ignore"):
        while np.isinf(z * log2e):
            z = np.nextafter(z, np.float32(0))
        while np.isfinite(np.nextafter(z, np.float32(np.inf)) * log2e):
            z = np.nextafter(z, np.float32(np.inf))
    return float(z)


# Rule: a finite numpy sink logit is within +-SINK_LOGIT_MAX (about 2.36e38), so its
# base-2 form never overflows float32 (docs/contract.md section 5).
SINK_LOGIT_MAX = _sink_logit_max()


def check_sink_logits(spec: AttentionSpec, sink_logits: Any) -> None:
    """``sink_logits``: None, or one learned attention-sink logit per query head (float32
    ``[H_qo]``, natural-log units, docs/contract.md section 5); numpy values must be
    -inf (no sink for that head) or finite within ``+-SINK_LOGIT_MAX``, so that the
    kernels' base-2 form ``z * log2 e`` never overflows float32. Not ``sink_size`` (the
    kept leading tokens)."""
    if sink_logits is None:
        return
    check_array("sink_logits", sink_logits, ndim=1, shape=(spec.num_qo_heads,),
                dtypes=(np.float32,))
    if is_host(sink_logits):
        bad = np.isnan(sink_logits) | (sink_logits == np.inf)
        if bad.any():
            i = _first_bad(bad)
            raise ValueError(f"sink_logits[{i}]={float(sink_logits[i])}: a learned sink logit "
                             f"must be finite, or -inf for no sink on that head")
        huge = np.isfinite(sink_logits) & (np.abs(sink_logits) > SINK_LOGIT_MAX)
        if huge.any():
            i = _first_bad(huge)
            raise ValueError(f"sink_logits[{i}]={float(sink_logits[i])}: a finite learned sink "
                             f"logit must lie within +-{SINK_LOGIT_MAX:.6e} (its base-2 form "
                             f"sink * log2(e) must fit float32); pass -inf for no sink")


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_indptr(name: str, indptr: np.ndarray, end: int | None = None, *,
                 end_name: str = "", exact: bool = False) -> np.ndarray:
    """The rule of every indptr table (``page_indptr``, ``qo_indptr``): B + 1 entries that
    start at 0 and never decrease; sequence ``b`` owns entries ``[indptr[b], indptr[b+1])``.

    Parameters
    ----------
    name : str
        The argument's name, for the messages.
    indptr : numpy.ndarray
        The host table.
    end : int, optional
        The most its last entry may be (``exact``: what it must be), named ``end_name``.

    Returns
    -------
    numpy.ndarray
        The entries each sequence owns (int64, ``[B]``).

    Raises
    ------
    ValueError
        Naming the first entry that breaks the rule.
    """
    if len(indptr) < 1:
        raise ValueError(f"{name}: needs B + 1 entries (at least one)")
    if indptr[0] != 0:
        raise ValueError(f"{name}[0]={int(indptr[0])}: must be 0")
    d = np.diff(indptr.astype(np.int64))
    if (d < 0).any():
        i = _first_bad(d < 0)
        raise ValueError(f"{name}: decreases at sequence {i} ({int(indptr[i])} -> "
                         f"{int(indptr[i + 1])}); it must be non-decreasing")
    last = int(indptr[-1])
    if end is not None and exact and last != end:
        raise ValueError(f"{name}[-1]={last}: must equal {end_name}={end}")
    if end is not None and not exact and last > end:
        raise ValueError(f"{name}[-1]={last} exceeds {end_name}={end}")
    return d


def _lengths(spec: AttentionSpec, npages: np.ndarray, last: np.ndarray, wo: Any,
             sink: Any) -> tuple[np.ndarray, np.ndarray]:
    """(stored, attended) rows per sequence (docs/contract.md), after checking the length rules."""
    owns = npages > 0
    bad = owns & ((last < 1) | (last > spec.page_size))
    if bad.any():
        i = _first_bad(bad)
        raise ValueError(f"last_page_len[{i}]={int(last[i])}: must be in 1..page_size="
                         f"{spec.page_size} for a sequence that owns pages")
    stored = np.where(owns, (npages - 1) * spec.page_size + last.astype(np.int64), 0)
    if (stored > INT32_MAX).any():
        i = _first_bad(stored > INT32_MAX)
        raise ValueError(f"page_indptr/last_page_len: sequence {i} stores {int(stored[i])} "
                         f"rows; at most 2**31 - 1 (the kernels index rows with 32-bit ints)")
    chunk = stored.copy()
    if spec.sliding_window:
        wo64, sink64 = np.asarray(wo).astype(np.int64), np.asarray(sink).astype(np.int64)
        checks = (
            (owns & (wo64 < 0), "window_offset", wo64, "must be >= 0"),
            (owns & (sink64 < 0), "sink_size", sink64, "must be >= 0"),
            (owns & (wo64 > stored), "window_offset", wo64, "must be <= the stored length {s}"),
            (owns & (sink64 > wo64), "sink_size", sink64,
             "must be <= window_offset={w} (sinks are the tokens before the window)"),
        )
        for mask, nm, arr, rule in checks:
            if mask.any():
                i = _first_bad(mask)
                raise ValueError(f"{nm}[{i}]={int(arr[i])}: " +
                                 rule.format(s=int(stored[i]), w=int(wo64[i])))
        chunk = np.where(owns, stored - wo64 + sink64, 0)
    return stored, chunk


def _check_table_values(spec: AttentionSpec, B: int, P: int, nnz: int, indptr: np.ndarray,
                        indices: np.ndarray, last: np.ndarray, wo: Any, sink: Any):
    npages = check_indptr("page_indptr", indptr, nnz, end_name="len(page_indices)")
    used = indices[: int(indptr[-1])]
    bad = (used < 0) | (used >= P)
    if bad.any():
        i = _first_bad(bad)
        seq = int(np.searchsorted(indptr, i, side="right") - 1)
        raise ValueError(f"page_indices[{i}]={int(used[i])} (sequence {seq}) is not a page of the "
                         f"pool: allowed 0..{P - 1}")
    return _lengths(spec, npages, last, wo, sink)


def chunk_lengths(spec: AttentionSpec, page_indptr: Any, last_page_len: Any = None, *,
                  length_info: Any = None, window_offset: Any = None,
                  sink_size: Any = None) -> np.ndarray:
    """Attended rows per sequence from host tables (what planning needs), checked."""
    check_array("page_indptr", page_indptr, ndim=1, dtypes=(INDEX_DTYPE,))
    for nm, arr in (("page_indptr", page_indptr), ("length_info", length_info),
                    ("last_page_len", last_page_len), ("window_offset", window_offset),
                    ("sink_size", sink_size)):
        if arr is not None and not is_host(arr):
            raise TypeError(f"{nm}: planning reads host tables; pass a numpy array "
                            f"(device tables can run without a plan)")
    B = _shape(page_indptr)[0] - 1
    if B < 0:
        raise ValueError("page_indptr: needs B + 1 entries (at least one)")
    if length_info is not None:
        check_array("length_info", length_info, shape=(3, B) if spec.sliding_window else (B,),
                    dtypes=(INDEX_DTYPE,))
        if spec.sliding_window:
            last_page_len, window_offset, sink_size = length_info
        else:
            last_page_len = length_info
    for nm, arr in (("last_page_len", last_page_len),) + (
            (("window_offset", window_offset), ("sink_size", sink_size))
            if spec.sliding_window else ()):
        if arr is None:
            raise ValueError(f"{nm}: required")
        check_array(nm, arr, ndim=1, shape=(B,), dtypes=(INDEX_DTYPE,))
    npages = check_indptr("page_indptr", np.asarray(page_indptr))
    return _lengths(spec, npages, np.asarray(last_page_len), window_offset, sink_size)[1]


def check_merge_pair(v: Any, s: Any, v_other: Any, s_other: Any) -> None:
    """Rules of ``merge_state_``: v [N, H, D] f16/f32, s [N, H] f32, same shapes both sides."""
    check_array("v", v, ndim=3, dtypes=tuple(DTYPES.values()), writable=True)
    N, H, D = _shape(v)
    check_array("s", s, shape=(N, H), dtypes=(LSE_DTYPE,), writable=True)
    check_array("v_other", v_other, shape=(N, H, D), dtypes=(np.dtype(v.dtype),))
    check_array("s_other", s_other, shape=(N, H), dtypes=(LSE_DTYPE,))


def check_merge_k(v: Any, s: Any, out: Any = None, lse: Any = None) -> None:
    """Rules of ``merge_states``: v [N, K, H, D], s [N, K, H] f32."""
    check_array("v", v, ndim=4, dtypes=tuple(DTYPES.values()))
    N, K, H, D = _shape(v)
    check_array("s", s, shape=(N, K, H), dtypes=(LSE_DTYPE,))
    if out is not None:
        check_array("out", out, shape=(N, H, D), dtypes=(np.dtype(v.dtype),), writable=True)
    if lse is not None:
        check_array("lse", lse, shape=(N, H), dtypes=(LSE_DTYPE,), writable=True)


@dataclass
class PrefillArgs:
    """Normalised prefill inputs: the page tables (as for decode) and the query table."""

    tables: DecodeArgs
    total_q: int
    qo_indptr: Any
    n_q: np.ndarray | None  # queries per sequence (host qo_indptr only)


def check_prefill(spec: AttentionSpec, q: Any, pages: Any, qo_indptr: Any, page_indptr: Any,
                  page_indices: Any, last_page_len: Any = None, *, length_info: Any = None,
                  window_offset: Any = None, sink_size: Any = None, q_pos: Any = None,
                  k_pos_offset: Any = None, rotary_mode: int = 0, causal: bool = True,
                  sm_scale: float | None = None, rope_scale: float = 1.0,
                  rope_theta: float = 1e4, out: Any = None, lse: Any = None,
                  custom_mask: Any = None, mask_indptr: Any = None) -> PrefillArgs:
    """Check one prefill call (docs/prefill.md): q ``[total_q, H_qo, D]``, ``qo_indptr
    [B + 1]``, the page tables as for decode; with host tables and ``causal``, every
    sequence's queries are the last rows of its attended chunk; the packed
    ``custom_mask`` and its ``mask_indptr`` as :func:`check_custom_mask` states."""
    total_q, P = check_operands(spec, q, pages, out, lse)
    check_array("qo_indptr", qo_indptr, ndim=1, dtypes=(INDEX_DTYPE,))
    B = _shape(qo_indptr)[0] - 1
    if B < 0:
        raise ValueError("qo_indptr: needs B + 1 entries (at least one)")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal={causal!r}: must be True or False")
    if rotary_mode == 1 and k_pos_offset is None:
        raise ValueError("k_pos_offset: required when rotary_mode=1 (chunk row r of sequence b "
                         "sits at position k_pos_offset[b] + r, its queries included)")
    tables = check_tables(spec, B, P, page_indptr, page_indices, last_page_len,
                          length_info=length_info, window_offset=window_offset,
                          sink_size=sink_size, q_pos=q_pos, q_pos_optional=True,
                          k_pos_offset=k_pos_offset, rotary_mode=rotary_mode,
                          sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)
    n_q = None
    if is_host(qo_indptr):
        n_q = check_indptr("qo_indptr", qo_indptr, total_q, exact=True,
                           end_name="the number of queries, q.shape[0]")
        if tables.chunk is not None and causal:
            _check_query_rows(spec, n_q, tables)
        if rotary_mode == 1 and q_pos is not None and is_host(q_pos):
            last = q_pos.astype(np.int64) + np.maximum(n_q - 1, 0)
            if (last > INT32_MAX).any():
                i = _first_bad(last > INT32_MAX)
                raise ValueError(f"q_pos[{i}]={int(q_pos[i])}: the sequence's last query position "
                                 f"{int(last[i])} exceeds the int32 range")
    check_custom_mask(custom_mask, mask_indptr, B, n_q, tables.chunk)
    return PrefillArgs(tables, total_q, qo_indptr, n_q)


def check_custom_mask(custom_mask: Any, mask_indptr: Any, B: int, n_q: np.ndarray | None,
                      chunk: np.ndarray | None) -> None:
    """The packed custom mask of a prefill (docs/prefill.md, "Custom masks"): a uint8
    ``custom_mask`` of at most 2**31 - 1 bytes with its int32 ``mask_indptr [B + 1]`` of
    byte offsets, both or neither. With a host ``mask_indptr`` it must split the whole
    array, and with host queries and page tables every segment must hold exactly
    ``ceil(n_b * chunk_b / 8)`` bytes."""
    if custom_mask is None and mask_indptr is None:
        return
    if custom_mask is None or mask_indptr is None:
        given, missing = ("custom_mask", "mask_indptr") if mask_indptr is None else \
            ("mask_indptr", "custom_mask")
        raise ValueError(f"{missing}: required with {given}; pack the masks with "
                         f"clattn.pack_mask(masks), which returns both")
    check_array("custom_mask", custom_mask, ndim=1, dtypes=(np.uint8,))
    n_bytes = _shape(custom_mask)[0]
    if n_bytes > INT32_MAX:
        raise ValueError(f"custom_mask: {n_bytes} bytes; at most 2**31 - 1 (the kernels index "
                         f"it with 32-bit ints); run the batch in parts")
    _ints("mask_indptr", mask_indptr, B + 1)
    if not is_host(mask_indptr):
        return
    seg = check_indptr("mask_indptr", mask_indptr, n_bytes, exact=True,
                       end_name="the bytes of custom_mask, custom_mask.shape[0]")
    if n_q is None or chunk is None:
        return
    want = -(-(n_q * np.asarray(chunk, np.int64)) // 8)
    bad = seg != want
    if bad.any():
        i = _first_bad(bad)
        raise ValueError(f"mask_indptr: sequence {i}'s segment has {int(seg[i])} bytes, but "
                         f"its mask [{int(n_q[i])} queries, {int(chunk[i])} chunk rows] packs "
                         f"into {int(want[i])}; pack a [n_b, chunk_b] bool matrix per sequence "
                         f"with clattn.pack_mask(masks)")


def _check_query_rows(spec: AttentionSpec, n_q: np.ndarray, t: DecodeArgs) -> None:
    """The n queries of a sequence are its last n stored rows, all in the attended chunk."""
    over = n_q > t.chunk
    if spec.sliding_window:  # past the window's start only when the chunk has no gap
        wo, sink = np.asarray(t.window_offset, np.int64), np.asarray(t.sink_size, np.int64)
        over |= (n_q > t.stored - wo) & (wo != sink) & (n_q > 0)
    if over.any():
        i = _first_bad(over)
        where = f"its attended chunk has {int(t.chunk[i])} rows"
        if spec.sliding_window:
            where += (f" (stored {int(t.stored[i])}, window_offset {int(t.window_offset[i])}, "
                      f"sink_size {int(t.sink_size[i])})")
        raise ValueError(f"qo_indptr: sequence {i} has {int(n_q[i])} queries but {where}; "
                         f"query j sits at stored row stored - n + j: append the new tokens' "
                         f"keys and values to the cache first (and keep them inside the window)")
