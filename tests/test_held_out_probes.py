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


@pytest.mark.parametrize("index", [[0, 2], [1, -1]])
@pytest.mark.parametrize("method,arg", [("reorder_cache", "beam_idx"),
                                        ("batch_select_indices", "indices")])
def test_batch_remap_past_the_batch_changes_nothing(method, arg, index):
    """An index outside the batch is refused naming the argument, before any row is
    forked: the rows, every sequence's pages and the free pages stay as they were (a
    window model: two layer kinds' caches)."""
    import torch

    from test_cache import check_pool
    from test_transformers import VOCAB, filled_cache

    cache = filled_cache("Gemma-2-2B", torch.randint(3, VOCAB, (2, 20)))

    def state():
        return list(cache.rows), {w: (g.cache.sequences, g.cache.table.refcount.copy(),
                                      sorted(g.cache.table.free), g.cache.stats())
                                  for w, g in cache.groups.items()}

    before = state()
    assert len(before[1]) == 2
    with pytest.raises(IndexError, match=rf"^clattn: {method}: {arg}\[1\]={index[1]} is not a "
                                         r"row of the batch \(0\.\.1\); nothing was changed"):
        getattr(cache, method)(torch.tensor(index))
    after = state()
    assert after[0] == before[0]
    for w, (seqs, refs, free, stats) in before[1].items():
        got = after[1][w]
        assert got[0] == seqs and np.array_equal(got[1], refs) and got[2] == free
        assert got[3] == stats
        check_pool(cache.groups[w].cache)
    getattr(cache, method)(torch.tensor([1, 1]))  # a valid re-map still works
    assert all(g.cache.stats().pages_shared for g in cache.groups.values())
