"""Edges found by held-out reliability probes, each pinned by a test: the CPU backend's
prefill refuses a plan made for another split of q, as OpenCL does; a transformers batch
re-map with an index past the batch is refused before the cache changes; the largest
values quantized pages hold are exactly those docs/cache.md states. (Quantized keys
rotated at append: tests/test_cache_quant.py.)"""
from __future__ import annotations

import numpy as np
import pytest
from prefill_cases import prefill_case, run
from test_cache import make_cache, pool_host
from test_prefill import SCENARIOS, get_prefill

import clattn
from clattn import runtime

#: a block's scale is f16(amax / 127) (q8_0) or f16(m / -8) (q4_0), the quotient rounded
#: to f32 first; f16 rounds 65520 and above to inf, so a block is refused exactly when
#: its largest magnitude reaches 65520 x 127 = 8321040 (an f32 integer; the f32 just
#: below, 8321039.5, divides to 65519.996 in f32) or 65520 x 8 = 524160 (exact division)
LIMITS = {"q8_0": 8321040.0, "q4_0": 524160.0}


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


def _edge_blocks(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``[4, 1, 32]`` whose largest value sits just below the limit (both signs),
    and the same at the limit."""
    lim = np.float32(LIMITS[fmt])
    below = np.nextafter(lim, np.float32(0))
    rng = np.random.default_rng(6)
    ok = rng.uniform(-1, 1, (4, 1, 32)).astype(np.float32)
    bad = ok.copy()
    for t in range(4):
        sign = np.float32(1 if t % 2 else -1)
        ok[t, 0, 5 * t] = sign * below
        bad[t, 0, 5 * t] = sign * lim
    return ok, bad


@pytest.mark.parametrize("fmt", list(LIMITS))
def test_quantized_overflow_limit_is_exact_for_host_arrays(target, fmt):
    """numpy k/v: the f32 just below the limit is stored, the limit itself refused."""
    spec = clattn.AttentionSpec(2, 1, 32, page_size=4, dtype="float32", k_format=fmt,
                                v_format=fmt)
    cache = make_cache(spec, target, layers=1, num_pages=2)
    cache.add("s")
    ok, bad = _edge_blocks(fmt)
    cache.begin(["s"], [4])
    for name, k, v in (("k", bad, ok), ("v", ok, bad)):
        with pytest.raises(ValueError, match=rf"^{name}: a block's scale overflows float16"):
            cache.append(0, k, v)
    cache.append(0, ok, ok)
    cache.end()
    data, scales = clattn.quant.region_views(pool_host(cache, 0), spec.layout, 0)
    page = cache.table.seqs["s"].pages[0]
    assert np.isfinite(scales[page, 0, :4].astype(np.float32)).all()
    assert np.abs(scales[page, 0, :4].astype(np.float32)).max() == 65504


@pytest.mark.parametrize("fmt", list(LIMITS))
def test_quantized_overflow_limit_is_exact_for_device_arrays(device_target, fmt):
    """Device k/v: the device check kernel draws the same line, bit for bit."""
    spec = clattn.AttentionSpec(2, 1, 32, page_size=4, dtype="float32", k_format=fmt,
                                v_format=fmt)
    cache = make_cache(spec, device_target, layers=1, num_pages=2)
    queue = cache.queue
    dev = lambda a: runtime.cl().array.to_device(queue, a)  # noqa: E731
    cache.add("s")
    ok, bad = _edge_blocks(fmt)
    for k, v in ((bad, ok), (ok, bad)):
        cache.begin(["s"], [4])
        cache.append(0, dev(k), dev(v))
        with pytest.raises(ValueError, match=r"layers \[0\].*overflows float16"):
            cache.end()
        cache.cancel()
    cache.begin(["s"], [4])
    cache.append(0, dev(ok), dev(ok))
    cache.end()
    assert cache.length("s") == 4
