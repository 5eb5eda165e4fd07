"""Split-KV planning (host side, once per batch, reused by every layer of a step).

Rule (FlashInfer's): no split when the unsplit launch already fills the device
(``work-groups >= compute_units * wgs_per_cu``) or when the batch has too little work
to pay for the merge pass (``max(work-groups, compute_units) * longest chunk * row weight
< split_min_rows``: with fewer work-groups than units, the split also puts the idle units
to work; :func:`row_weight` counts a row that does more work than the reference row as
that many reference rows);
otherwise the smallest partition that fills it, rounded up to whole pages and at least
``min_partition_rows`` rows, with at most ``max_partitions`` partitions per sequence.
CPU profiles ask for very many work-groups per unit, so long sequences are always cut
into ``min_partition_rows`` pieces: finer pieces balance the cores (measured).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .profiles.record import Profile

#: multiply-adds of the row ``split_min_rows`` counts: one KV head's key and value rows at
#: Llama-3-8B's shape (4 query heads, head_dim 128: 4 x (128 + 128)), the shape the CPU
#: profiles' threshold was measured at (the models it serves do 512-1024 per row)
REFERENCE_ROW_MACS = 1024


def row_weight(group_size: int, head_dim: int, head_dim_v: int) -> float:
    """Reference rows (:data:`REFERENCE_ROW_MACS`) that one KV row of a shape counts as in
    the ``split_min_rows`` test: its multiply-adds, ``group_size x (head_dim +
    head_dim_v)``, over the reference's, and never below 1 (the threshold was measured no
    lower). A latent-form MLA row (one KV head for every query head: MiniCPM3's 40 x
    (288 + 256), DeepSeek-V2-Lite's 16 x (576 + 512)) weighs 17-22: unsplit, one sequence
    is one work-group, and a second core sat idle below 16k rows (measured on 2 cores at
    1k-4k rows: split 1.7-1.9x faster)."""
    return max(1.0, group_size * (head_dim + head_dim_v) / REFERENCE_ROW_MACS)


@dataclass(frozen=True)
class Plan:
    """How one batch is decoded. ``part_rows == 0`` means no split."""

    part_rows: int
    num_parts: int  # partitions launched per (sequence, head): the max over the batch
    part_indptr: np.ndarray  # [B + 1] workspace states of each sequence (1 = written directly)
    n_ws: int  # workspace states needed
    chunk: np.ndarray  # attended rows per sequence
    reason: str

    @property
    def split(self) -> bool:
        return self.part_rows > 0 and self.num_parts > 1

    def __str__(self) -> str:
        if not self.split:
            return f"no split ({self.reason})"
        return (f"split: {self.part_rows} rows per partition, up to {self.num_parts} partitions "
                f"per sequence, {self.n_ws} workspace states ({self.reason})")


def _no_split(chunk: np.ndarray, reason: str) -> Plan:
    indptr = np.arange(len(chunk) + 1, dtype=np.int32)
    indptr.setflags(write=False)
    return Plan(0, 1, indptr, 0, chunk, reason)


def make_plan(chunk: np.ndarray, work_groups: int, compute_units: int, profile: Profile,
              page_size: int, *, split: bool | int | None = None,
              weight: float = 1.0, max_rows: int | None = None) -> Plan:
    """Plan a batch whose sequences attend to ``chunk[b]`` rows.

    ``work_groups``: work-groups of the unsplit launch. ``split``: None = decide,
    False = never, an int = force that many rows per partition. ``weight``: the
    :func:`row_weight` of the shape's rows. ``max_rows``: the most rows a partition may
    hold on this device (whole pages; :func:`clattn.loop_budget.decode_partition_rows`),
    which overrides every other choice, ``split=False`` included: a longer partition
    computes wrong there.
    """
    plan = _make_plan(np.asarray(chunk, dtype=np.int64), work_groups, compute_units, profile,
                      page_size, split, weight)
    longest = int(plan.chunk.max()) if len(plan.chunk) else 0
    if max_rows is None or longest <= max_rows or 0 < plan.part_rows <= max_rows:
        return plan
    return _split(plan.chunk, max_rows, f"at most {max_rows} rows per partition: this "
                                        f"device ends a work-item's loops after a fixed "
                                        f"count ({plan.reason} otherwise)")


def _split(chunk: np.ndarray, rows: int, reason: str) -> Plan:
    parts = np.maximum(1, -(-chunk // rows))
    if int(parts.max()) <= 1:
        return _no_split(chunk, f"every sequence fits one partition of {rows} rows")
    indptr = np.concatenate([[0], np.cumsum(parts)]).astype(np.int32)
    indptr.setflags(write=False)  # a plan is cached on the device: it must not change
    return Plan(int(rows), int(parts.max()), indptr, int(indptr[-1]), chunk, reason)


def _make_plan(chunk: np.ndarray, work_groups: int, compute_units: int, profile: Profile,
               page_size: int, split: bool | int | None, weight: float) -> Plan:
    longest = int(chunk.max()) if len(chunk) else 0
    if split is False or split is None and longest == 0:
        return _no_split(chunk, "splitting disabled" if split is False else "empty batch")
    if split is None or split is True:
        # the rows the device could take in the unsplit launch's time: its work-groups'
        # rows, or every compute unit's share when some would sit idle
        busy = max(work_groups, compute_units)
        if split is None and busy * longest * weight < profile.split_min_rows:
            rows = f"{longest} rows" if weight == 1 else f"{longest} rows x {weight:.3g}"
            return _no_split(chunk, f"max({work_groups} work-groups, {compute_units} compute "
                                    f"units) x {rows} < {profile.split_min_rows}: a "
                                    f"merge pass would cost more")
        target = max(1, compute_units) * profile.wgs_per_cu
        if work_groups >= target:
            return _no_split(chunk, f"{work_groups} work-groups fill {compute_units} compute units "
                                    f"x {profile.wgs_per_cu}")
        want = math.ceil(target / max(work_groups, 1))
        rows = math.ceil(longest / want)
        rows = max(rows, profile.min_partition_rows)
        reason = f"{work_groups} work-groups < {target}: {want} partitions wanted"
    else:
        rows = int(split)
        if rows < 1:
            raise ValueError(f"split={split!r}: rows per partition must be >= 1")
        reason = "forced partition size"
    rows = max(rows, math.ceil(longest / profile.max_partitions))
    return _split(chunk, math.ceil(rows / page_size) * page_size, reason)
