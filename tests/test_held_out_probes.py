"""Edges found by held-out reliability probes, each pinned by a test: the CPU backend's
prefill refuses a plan made for another split of q, as OpenCL does; a transformers batch
re-map with an index past the batch is refused before the cache changes. (Quantized keys
rotated at append: tests/test_cache_quant.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from prefill_cases import prefill_case, run
from test_prefill import SCENARIOS, get_prefill


@pytest.mark.parametrize("other", [[0, 4, 7], [0, 7], [0, 3, 6]])
def test_prefill_refuses_a_plan_for_another_split_of_q(target, other):
    """A plan cut for other queries per sequence (same total), another batch or another
    total is refused on every backend with one message, before ``out`` is written."""
    spec = SCENARIOS["Qwen2.5-0.5B"].spec
    pre = get_prefill(spec, target)
    case = prefill_case(spec, [2, 5], [3, 4], seed=4)
    plan = pre.plan(np.array(other, np.int32))
    out = np.full(case["q"].shape, 7, case["q"].dtype)
    with pytest.raises(ValueError, match=r"^plan: made for \d+ sequences and \d+ queries, "
                                         r"another split than this call's; plan again$"):
        run(pre, case, plan=plan, out=out)
    assert (out == 7).all(), "a refused call wrote out"
    run(pre, case, plan=pre.plan(case["qo_indptr"]), out=out)  # its own plan runs
    assert (out != 7).any()
