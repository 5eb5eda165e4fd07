"""Devices that end a work-item's loops after a fixed count, and how far each kernel may go.

Mesa's llvmpipe (rusticl, Clover) counts every loop iteration of a work-item, all loops
together, against one budget of 65535 (gallivm's ``LP_MAX_TGSI_LOOP_ITERATIONS``); once it
is spent, every loop the work-item is in or enters stops after its current iteration. Nothing
reports it: a decode over a long partition or a prefill unit over many keys returns wrong
numbers. :func:`loop_budget` finds the budget by running a loop longer than any budget
known; the bounds below give, from a kernel's geometry, the most rows (decode) or keys
(prefill) one work-item may walk within it, and the planners keep every launch inside.

The bounds count every C loop of the kernel templates as it is written, each entered loop
of ``t`` iterations as ``t + 1`` (the final test), none unrolled: an upper bound of what the
compiler's loops count, kept at most :data:`SAFETY` of the budget (builtins such as
``sincos`` may loop inside). The row (decode) and key (prefill) loops dominate; what is
spent once per work-item is counted generously.
"""
from __future__ import annotations

import math
import threading
import warnings
from typing import Any

import numpy as np

from .fit import DecodeGeometry, PrefillGeometry, slice_heads
from .kernel_exprs import LaneChunks, prefill_rows_tiles
from .runtime import is_simulator
from .spec import AttentionSpec

#: iterations the probe loop asks for: a device that stops it earlier has a budget
PROBE_ITERATIONS = 1 << 20
#: the share of the budget a launch's counted loops may use
SAFETY = 0.5

PROBE_SOURCE = """
__kernel void clattn_loop_probe(__global const uint* n, __global uint* out)
{
    const uint stop = n[0];
    uint i = 0, acc = n[1];
    for (; i < stop; ++i) acc = acc * 3u + (i ^ n[1]);
    out[0] = i;
    out[1] = acc;
}
"""
_PROBE_SEED = 5

_RESULTS: dict = {}  # device pointer -> budget (0: none)
_LOCK = threading.Lock()


def _probe_acc(iterations: int) -> int:
    """The probe's accumulator after ``iterations`` iterations (uint arithmetic)."""
    acc = _PROBE_SEED
    for i in range(iterations):
        acc = (acc * 3 + (i ^ _PROBE_SEED)) & 0xFFFFFFFF
    return acc


def loop_budget(runtime: Any) -> int:
    """The loop iterations a work-item of ``runtime``'s device may run in all (0: no limit
    found up to :data:`PROBE_ITERATIONS`). Found once per device and process; the simulator
    (Oclgrind) is not asked (it has no budget). A probe that fails to build or run means no
    budget; one whose loop stopped early but whose result does not match the iterations
    it reports (or that ran none) is taken at its word, with a warning."""
    device = runtime.device
    with _LOCK:
        if device.int_ptr in _RESULTS:
            return _RESULTS[device.int_ptr]
    budget = 0
    if not is_simulator(device):
        from .compiler_probe import run_kernel

        n = np.array([PROBE_ITERATIONS, _PROBE_SEED], np.uint32)
        try:
            (got,) = run_kernel(runtime, PROBE_SOURCE, "clattn_loop_probe", [n],
                                [np.zeros(2, np.uint32)], 1)
        except Exception:  # noqa: BLE001 - a driver that cannot run it: no budget known
            got = None
        if got is not None and int(got[0]) < PROBE_ITERATIONS:
            budget = max(int(got[0]), 1)
            if int(got[0]) == 0 or int(got[1]) != _probe_acc(int(got[0])):
                warnings.warn(f"clattn: {device.platform.name.strip()} / {device.name.strip()}"
                              f": a loop of {PROBE_ITERATIONS} iterations stopped after "
                              f"{int(got[0])} with an inconsistent result; taken as the "
                              f"device's loop budget (clattn.loop_budget)", RuntimeWarning,
                              stacklevel=2)
    with _LOCK:
        _RESULTS[device.int_ptr] = budget
    return budget


def _allowed(budget: int) -> int:
    return int(budget * SAFETY)


# ------------------------------------------------------------------------------ decode
def _decode_costs(spec: AttentionSpec, geom: DecodeGeometry, parts: int) -> tuple[int, int, int]:
    """(rows per step, counted iterations per step, counted iterations once per work-item)
    of the decode kernel of ``geom`` whose split sequences have up to ``parts``
    partitions (the fold merges them)."""
    G, D, DV = spec.group_size, spec.head_dim, spec.head_dim_v
    half = (spec.rotary_dim or D) // 2
    gi = slice_heads(G, geom.gdz)
    vec, tile = geom.vec, geom.tile
    # the merges: of the row slices (tiled), and of a split sequence's partitions (the
    # fold: three passes over them per head and value chunk)
    nc = LaneChunks(DV, geom.bdx, vec).count if geom.strategy == "tiled" else 1
    merge = (gi + 1) * (nc + 1) * (3 * (parts + 2) + 2 * (geom.bdz + 2))
    if geom.strategy == "tiled":
        bdx, bdz = geom.bdx, geom.bdz
        rows, pairs = bdz * tile, tile * gi
        step = 1 + (tile + 1) + tile * ((gi + 1) + (vec + 1))            # K, RoPE
        if geom.reduction == "subgroup":
            step += (-(-tile // bdx) + 1) * (bdx + 1)                    # the pages
        else:
            step += ((-(-pairs // bdx) + 1) * (bdx + 1) + (-(-rows // (bdx * bdz)) + 1)
                     + (tile + 1) + tile * (gi + 1))                    # sums, pages
        step += (gi + 1) + gi * (2 * (tile + 1) + nc + 1)                # softmax
        step += (tile + 1) + tile * nc * (gi + 1)                        # V
        once = 4 * (gi + 1) * (nc + 2) * (vec + 2) + 2 * (D + 2) + merge
        return rows, step, once
    nv, nvv = D // vec, DV // vec
    cpb, nbv = max(32 // vec, 1), max(DV // 32, 1)
    block = (1 + 4 * (tile + 1) + (half + 1) + (tile + 1) * (half + 2)
             + (tile + 1) * (nvv + nbv * (cpb + 1) + 2))
    once = (gi * (D + half + 4) + tile * (half + 1) * (nv + 1) + 2 * (D + 2) + merge)
    return tile, block, once


def decode_rows_limit(spec: AttentionSpec, geom: DecodeGeometry, budget: int,
                      parts: int = 1) -> int:
    """The most rows one decode work-group (one partition) may walk on a device with a
    loop ``budget`` (0: no limit, returns a huge number), for sequences split into up
    to ``parts`` partitions."""
    if not budget:
        return 2**62
    rows, step, once = _decode_costs(spec, geom, parts)
    return max(0, (_allowed(budget) - once) // step) * rows


def decode_partition_rows(spec: AttentionSpec, geom: DecodeGeometry, budget: int,
                          longest: int, page_size: int, min_parts: int = 1) -> int | None:
    """Rows per partition (whole pages) that keep a decode of sequences up to ``longest``
    rows within a loop ``budget``, for plans of at least ``min_parts`` partitions per
    sequence (a planner's own splits go up to its ``max_partitions``: the fold merges them
    all); None where no split is needed. A page is kept spare: a plan stays in use while
    its sequences grow by less than a page, the last partition taking the new rows.
    Raises ValueError where no split does."""
    if not budget or longest + page_size <= decode_rows_limit(spec, geom, budget, min_parts):
        return None
    parts = max(1, min_parts)
    while True:   # the fold's cost grows with the partitions: settle them
        rows = (decode_rows_limit(spec, geom, budget, parts) - page_size) // page_size \
            * page_size
        if rows < page_size:
            raise ValueError(f"a sequence of {longest} rows: this device ends a work-item's "
                             f"loops after {budget} iterations (clattn.loop_budget), and "
                             f"no split of it into partitions of whole {page_size}-row "
                             f"pages stays within that; use backend='cpu'")
        need = math.ceil(longest / rows)
        if need <= parts:
            return rows
        parts = need


def plan_within(spec: AttentionSpec, geom: DecodeGeometry, budget: int, plan: Any,
                chunk: np.ndarray) -> bool:
    """Whether a decode ``plan`` (:class:`clattn.plan.Plan`) keeps every partition of
    sequences of ``chunk`` rows within a loop ``budget`` (a plan is reused while its
    sequences grow: the last partition of each takes the rows past the plan's)."""
    if not budget or not len(chunk):
        return True
    chunk = np.asarray(chunk, np.int64)
    if plan.split:
        parts = np.diff(np.asarray(plan.part_indptr, np.int64))
        last = chunk - (parts - 1) * plan.part_rows
        longest = int(max(plan.part_rows, int(last.max())))
    else:
        longest = int(chunk.max())
    return longest <= decode_rows_limit(spec, geom, budget, plan.num_parts)


# ------------------------------------------------------------------------------ prefill
def _prefill_costs(spec: AttentionSpec, geom: PrefillGeometry, qb: int, nq: int,
                   masked: bool, rotary: bool) -> tuple[int, int, int]:
    """(counted iterations per key block, extra per block on the causal diagonal, once per
    work unit) of the rows prefill kernel built for ``qb`` queries per unit (its row
    arrays and most loops span them all), in a unit of ``nq`` of them. A loop in a branch
    not taken still costs its entry (llvmpipe runs both sides, masked): the slack per
    block and the RoPE loops' entries without ``rotary``."""
    G, D, DV = spec.group_size, spec.head_dim, spec.head_dim_v
    rope = (spec.rotary_dim or D) // 2 + 1 if rotary else 1   # one RoPE loop
    kb, vec = geom.kb, geom.vec
    nv, nvv = D // vec, DV // vec
    m, nrv, rg, nk, mv, ni = prefill_rows_tiles(qb * G, kb, nvv, vec)
    rows = min(nq, qb) * G
    rows_v = -(-rows // mv) * mv
    load = (kb + 1) * (1 + 2 * rope + nv + nvv + 2) + rope
    mask = (nq + 1) * (kb + 1) * (G + 1) + 8 * (nq + 1) if masked else 0
    score = (nrv + 1) + (kb // nk + 1) * (nrv // rg + 1) * (D + 1)
    soft = (nrv + 1) * (kb + 1)
    whole = (rows_v // mv + 1) * (nvv // ni + 1) * (kb + 1)
    by_row = (rows + 1) * (nvv + 1) * (kb + 1)
    block = 64 + load + mask + score + soft + (by_row if masked else whole)
    tail = -(-mv // G)   # keys a row of a value tile walks alone on the diagonal
    diagonal = (rows_v // mv + 1) * mv * ((tail + 1) + tail * (nvv + 1))
    once = (m + 1) * (nv + 2 * rope + D + nvv + 4) + (nrv + 1) * (kb + 1) + kb * rope \
        + (rows + 1) * (nvv + 2)
    return block, diagonal, once


def prefill_keys_limit(spec: AttentionSpec, geom: PrefillGeometry, budget: int, qb: int,
                       nq: int, masked: bool = False, rotary: bool = True) -> int:
    """The most key rows a prefill work unit of ``nq`` queries, of a kernel built for
    ``qb`` per unit, may read on a device with a loop ``budget`` (0: no limit, returns a
    huge number); ``masked``: the call passes a custom mask; ``rotary``: it rotates in the
    kernel. Only the rows kernel is bounded: the fit keeps a device with a budget off the
    tiled one."""
    if not budget:
        return 2**62
    if geom.strategy != "rows":
        return 0
    nq = max(1, min(nq, qb))
    block, diagonal, once = _prefill_costs(spec, geom, qb, nq, masked, rotary)
    diag_blocks = -(-nq // geom.kb) + 1
    left = _allowed(budget) - once - diag_blocks * diagonal
    return max(0, left // block) * geom.kb


def prefill_fits(spec: AttentionSpec, geom: PrefillGeometry, budget: int, units: np.ndarray,
                 queries_per_unit: int, chunk: np.ndarray | None, masked: bool,
                 causal: bool = True, rotary: bool = True) -> bool:
    """Whether every unit of a plan (``units``: its ``[n, 4]`` table of up to
    ``queries_per_unit`` queries each; ``chunk``: the rows each sequence attends, None
    when unknown) stays within a loop ``budget``; ``masked``, ``causal``, ``rotary`` as
    the call."""
    if not budget or not len(units):
        return True
    if chunk is None or geom.strategy != "rows":
        return False
    b, first, n_q = (units[:, i].astype(np.int64) for i in range(3))
    nq = np.minimum(n_q - first, queries_per_unit)
    keys = np.asarray(chunk, np.int64)[b]
    if causal:   # a unit reads its sequence's rows up to its last query's own
        keys = np.clip(keys - n_q + first + nq, 0, keys)
    for q in np.unique(nq):
        if int(keys[nq == q].max()) > prefill_keys_limit(spec, geom, budget, queries_per_unit,
                                                          int(q), masked, rotary):
            return False
    return True
