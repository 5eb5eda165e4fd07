"""The split-KV planner (clattn.plan.make_plan) on its own: decisions and partition tables."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clattn.plan import REFERENCE_ROW_MACS, make_plan, row_weight
from clattn.profiles.record import Profile

GPU = Profile(name="t-gpu", strategy="tiled", wgs_per_cu=4, min_partition_rows=256,
              max_partitions=64, split_min_rows=0)
CPU = Profile(name="t-cpu", strategy="rows", wgs_per_cu=1024, min_partition_rows=512,
              max_partitions=64, split_min_rows=32768)


def _no_split(plan, B, reason):
    assert not plan.split and plan.part_rows == 0 and plan.num_parts == 1 and plan.n_ws == 0
    assert plan.part_indptr.tolist() == list(range(B + 1))
    assert reason in plan.reason, plan.reason


def test_disabled_empty_and_full_devices_do_not_split():
    _no_split(make_plan([5000, 3], 2, 8, GPU, 16, split=False), 2, "disabled")
    _no_split(make_plan([0, 0], 2, 8, GPU, 16), 2, "empty batch")
    _no_split(make_plan([], 0, 8, GPU, 16), 0, "empty batch")
    # 32 work-groups fill 8 compute units x 4
    _no_split(make_plan([5000] * 4, 32, 8, GPU, 16), 4, "fill")
    # a merge pass would cost more than it saves: 2 x 1000 rows < 32768
    _no_split(make_plan([1000], 2, 2, CPU, 16), 1, "merge pass would cost more")


def test_heavy_rows_count_as_that_many_reference_rows():
    """The merge test weighs a row by its multiply-adds: one sequence of 4096 latent MLA
    rows (MiniCPM3: 40 heads x (288 + 256)) on 2 compute units is worth a split that 4096
    rows of a light shape are not, and the partitions are sized as before."""
    w = row_weight(40, 288, 256)
    assert w == 40 * (288 + 256) / REFERENCE_ROW_MACS
    _no_split(make_plan([4096], 1, 2, CPU, 16), 1, "merge pass would cost more")
    _no_split(make_plan([4096], 1, 2, CPU, 16, weight=3.9), 1, "x 3.9 < 32768")
    plan = make_plan([4096], 1, 2, CPU, 16, weight=w)
    # 2 x 4096 x 21.25 >= 32768; target 2 x 1024 work-groups: min_partition_rows (512) rules
    assert plan.split and plan.part_rows == 512 and plan.num_parts == 8
    forced = make_plan([4096], 1, 2, CPU, 16, split=True)
    assert (plan.part_rows, plan.part_indptr.tolist()) == \
        (forced.part_rows, forced.part_indptr.tolist())
    # a weight is never below 1: a lighter row keeps the measured threshold in rows
    assert row_weight(7, 64, 64) == 1.0 and row_weight(1, 64, 64) == 1.0
    assert row_weight(4, 128, 128) == 1.0 and row_weight(8, 128, 128) == 2.0


def test_auto_split_sizes():
    # target 8 CUs x 4 = 32 work-groups; 2 launched -> 16 partitions wanted;
    # 10000 / 16 = 625 rows -> whole pages of 16 -> 640; 10000 / 640 -> 16 partitions
    plan = make_plan([10000, 700, 0], 2, 8, GPU, 16)
    assert plan.split and plan.part_rows == 640 and plan.num_parts == 16
    assert plan.part_indptr.tolist() == [0, 16, 18, 19] and plan.n_ws == 19
    # the partition is never below min_partition_rows (256): 1000 / 16 = 63 -> 256
    plan = make_plan([1000], 2, 8, GPU, 16)
    assert plan.part_rows == 256 and plan.part_indptr.tolist() == [0, 4]
    # nor so small that a sequence needs more than max_partitions: 100000 / 64 -> 1563 -> 1568
    plan = make_plan([100000], 1, 1000, GPU, 16)
    assert plan.part_rows == 1568 and plan.num_parts == 64


def test_idle_compute_units_count_toward_the_work_that_pays_for_a_merge():
    # one work-group (B = 1, one KV head: Gemma-3-1B) on 2 units: 16384 rows leave a unit
    # idle for the whole launch (measured 16k tokens, f16: PoCL 729 -> 551 us split, Intel
    # 660 -> 371 us); 8192 rows do not pay on 2 units, but do on 4
    plan = make_plan([16384], 1, 2, CPU, 16)
    assert plan.split and plan.part_rows == 512 and plan.num_parts == 32
    _no_split(make_plan([8192], 1, 2, CPU, 16), 1, "merge pass would cost more")
    assert make_plan([8192], 1, 4, CPU, 16).split
    # 8 work-groups (Llama-3-8B, B = 1) on a 16-core CPU: half the cores idle unsplit
    assert make_plan([2048], 8, 16, CPU, 16).split
    _no_split(make_plan([2048], 8, 2, CPU, 16), 1, "merge pass would cost more")


def test_cpu_profile_cuts_long_sequences_into_min_partitions():
    plan = make_plan([32768], 2, 2, CPU, 16)
    assert plan.split and plan.part_rows == 512 and plan.num_parts == 64


def test_forced_split():
    plan = make_plan([33, 16, 0, 17], 4, 1, GPU, 16, split=16)
    assert plan.part_rows == 16 and plan.part_indptr.tolist() == [0, 3, 4, 5, 7]
    assert "forced" in plan.reason
    # rounded up to whole pages
    assert make_plan([100], 1, 1, GPU, 16, split=20).part_rows == 32
    # one partition each: no split
    _no_split(make_plan([10, 16], 2, 1, GPU, 16, split=16), 2, "fits one partition")
    with pytest.raises(ValueError, match="split"):
        make_plan([10], 1, 1, GPU, 16, split=0)


def test_plan_tables_are_read_only():
    plan = make_plan([100, 50], 1, 1, GPU, 4, split=8)
    with pytest.raises(ValueError):
        plan.part_indptr[0] = 1


@settings(max_examples=200, deadline=None)
@given(chunk=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
       page_size=st.sampled_from([1, 4, 16, 128]), split=st.one_of(st.none(), st.integers(1, 900)),
       work_groups=st.integers(1, 64), cus=st.integers(1, 64))
def test_partitions_cover_every_row_exactly_once(chunk, page_size, split, work_groups, cus):
    plan = make_plan(chunk, work_groups, cus, GPU, page_size, split=split)
    parts = np.diff(plan.part_indptr)
    assert plan.part_indptr[0] == 0 and (parts >= 1).all() and len(parts) == len(chunk)
    if not plan.split:
        assert (parts == 1).all()
        return
    rows = plan.part_rows
    assert rows % page_size == 0 and rows >= 1
    assert plan.n_ws == int(plan.part_indptr[-1]) and plan.num_parts == int(parts.max())
    assert plan.num_parts <= GPU.max_partitions
    for n, p in zip(chunk, parts):
        assert p == max(1, math.ceil(n / rows)), (n, p, rows)
        assert (p - 1) * rows < max(n, 1) <= p * rows or n == 0
