"""Devices that end a work-item's loops after a fixed count (Mesa's llvmpipe: 65535 loop
iterations per work-item, every loop together): the probe, the bounds that keep decode
partitions and prefill units within the budget, and the prefill's decode form for units
that would pass it.

On llvmpipe the long cases here computed wrong before the budget was known (a decode of
24000 rows unsplit: lse off by 15; a prefill over 600 cached rows: lse off by 10). Every
value is checked against the float64 oracle.
"""
from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
from cases import compare, decode_args, make_case, oracle, spec_scenario
from prefill_cases import naive_prefill, prefill_case
from prefill_cases import run as run_prefill

import clattn
from clattn import loop_budget as lb
from clattn import prefill_by_decode as by_decode
from clattn import runtime
from clattn.fit import DecodeGeometry, PrefillGeometry
from clattn.plan import make_plan
from clattn.profiles.record import Profile
from clattn.spec import AttentionSpec

F16 = "float16"
#: tests/test_portability.py's shape (its kernels are built already)
SCENARIO = spec_scenario(f"gqa4-d64-win-{F16}", 8, 2, 64, page_size=16, dtype=F16,
                         sliding_window=True)
#: a decode this long passes llvmpipe's budget unsplit in any geometry clattn fits there
LONG_DECODE = 24000

COUNT_SOURCE = """
__kernel void count_loops(__global const int* n, __global int* out)
{
    int total = 0;
    for (int i = 0; i < n[0]; ++i)
        for (int j = 0; j < n[1]; ++j) total += 1 + (j & n[2]);
    out[0] = total;
    out[1] = n[0];
}
"""


def _quiet(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return make()


# ------------------------------------------------------------------------------ the probe
def test_the_budget_counts_every_loop_together(any_device):
    """The probe's answer against a second kernel: two nested loops of 1024 x 1024
    iterations run in full where there is no budget, and stop within the budget (both
    loops' iterations counted) where there is one. llvmpipe has one."""
    rt = runtime.Runtime.for_device(any_device)
    budget = lb.loop_budget(rt)
    from clattn.compiler_probe import run_kernel

    (got,) = run_kernel(rt, COUNT_SOURCE, "count_loops", [np.array([1024, 1024, 0], np.int32)],
                        [np.zeros(2, np.int32)], 1)
    inner = int(got[0])
    if "llvmpipe" in any_device.name.lower():
        assert budget > 0, "llvmpipe ends loops after a fixed count"
    if not budget:
        assert inner == 1024 * 1024
    else:
        # inner iterations done: the budget less, per outer iteration, the inner loop's
        # final test and the outer loop's own iteration (what clattn.loop_budget counts)
        assert budget - 2 * (budget // 1024 + 1) <= inner < budget, (budget, inner)


# ------------------------------------------------------------------------------ decode
def test_a_long_decode_is_split_within_the_budget(any_device, get_decoder):
    """``split=False`` over 24000 rows (window, sinks, RoPE): on a device with a budget the
    plan splits all the same, and every result matches the oracle."""
    dec = _quiet(lambda: get_decoder(SCENARIO.spec, any_device, None))
    case = make_case(SCENARIO.spec, [LONG_DECODE, 40], seed=3, rope=True, window=[5, 0],
                     sinks=[2, 0])
    args, call = decode_args(case)
    plan = dec.plan(args[2], args[4], window_offset=call.get("window_offset"),
                    sink_size=call.get("sink_size"), split=False)
    budget = dec.setup.limits.loop_budget
    if budget:
        cap = lb.decode_rows_limit(SCENARIO.spec, dec.geometry, budget, plan.num_parts)
        assert plan.split and plan.part_rows <= cap and "loops" in plan.reason, str(plan)
    else:
        assert not plan.split
    res = dec.run(*args, **call, rotary_mode=1, plan=plan)
    compare(res.out, res.lse, *oracle(SCENARIO, case, rotary_mode=1), F16,
            what=f"{any_device.name}: ")


def test_a_plan_past_the_budget_is_refused(device):
    """A plan made for short sequences, given to a call over long ones on a device with a
    (pretended) budget, is refused before anything is written; planned again, the call
    runs (split) and matches the oracle."""
    dec = _quiet(lambda: clattn.BatchDecode(SCENARIO.spec, device, backend="opencl"))
    dec.setup.limits = replace(dec.setup.limits, loop_budget=65535)
    short = make_case(SCENARIO.spec, [100, 40], seed=3, window=[5, 0], sinks=[2, 0])
    a, c = decode_args(short)
    plan = dec.plan(a[2], a[4], window_offset=c["window_offset"], sink_size=c["sink_size"])
    case = make_case(SCENARIO.spec, [LONG_DECODE, 40], seed=3, window=[5, 0], sinks=[2, 0])
    args, call = decode_args(case)
    out = np.full(args[0].shape, 7, np.float16)
    with pytest.raises(ValueError, match="plan: .*loop budget"):
        dec.run(*args, **call, plan=plan, out=out)
    assert (out == 7).all()
    plan = dec.plan(args[2], args[4], window_offset=call["window_offset"],
                    sink_size=call["sink_size"], split=False)
    assert plan.split
    res = dec.run(*args, **call, plan=plan, out=out)
    compare(res.out, res.lse, *oracle(SCENARIO, case), F16, what=f"{device.name}: ")


def test_decode_plans_keep_to_max_rows():
    """``max_rows`` overrides every other choice of the planner, ``split=False`` and a
    forced partition size included; a plan within it is left as it is."""
    prof = Profile(name="p", strategy="rows")
    chunk = np.array([5000, 100, 0])
    for split in (False, None, 4096):
        plan = make_plan(chunk, 3, 2, prof, 16, split=split, max_rows=1024)
        assert plan.split and plan.part_rows == 1024
        assert list(np.diff(plan.part_indptr)) == [5, 1, 1]
    plan = make_plan(chunk, 3, 2, prof, 16, split=512, max_rows=1024)
    assert plan.part_rows == 512
    assert not make_plan(chunk, 3, 2, prof, 16, split=False, max_rows=5000).split


def test_decode_bounds():
    """Rows per partition: whole pages, fewer as the fold merges more partitions, None
    where one partition already fits, and a clear refusal where no split fits."""
    spec = AttentionSpec(14, 2, 64, page_size=16)
    for geom in (DecodeGeometry("tiled", 4, 1, bdx=16, bdz=16),
                 DecodeGeometry("rows", 8, 16)):
        limits = [lb.decode_rows_limit(spec, geom, 65535, parts) for parts in (1, 8, 64)]
        assert limits == sorted(limits, reverse=True) and limits[-1] > 0
        assert lb.decode_rows_limit(spec, geom, 0) > 2**40
        assert lb.decode_partition_rows(spec, geom, 65535, limits[0] - 16, 16) is None
        assert lb.decode_partition_rows(spec, geom, 65535, limits[0], 16) is not None
        rows = lb.decode_partition_rows(spec, geom, 65535, 50000, 16)
        assert rows % 16 == 0 and 0 < rows + 16 <= lb.decode_rows_limit(
            spec, geom, 65535, -(-50000 // rows))
        with pytest.raises(ValueError, match="backend='cpu'"):
            lb.decode_partition_rows(spec, geom, 2000, 50000, 16)


def test_the_rows_merge_takes_a_pair_per_work_item_within_a_budget():
    """The separate merge kernel's work-items stride over (row, head) pairs: within a
    budget each takes one, so its loops walk one pair's states."""
    from clattn.fit import Limits, merge_geometry

    prof = Profile(name="p", strategy="rows")
    for budget, want in ((0, 64), (65535, 20000)):
        geom = merge_geometry(64, F16, prof.with_(merge_threads=64), Limits(loop_budget=budget))
        assert geom.sizes(20000, 64)[0] == (want,)


# ------------------------------------------------------------------------------ prefill
def test_prefill_bounds():
    """Keys per unit: fewer for more queries per unit and under a custom mask, none for
    the tiled kernel (the fit keeps a device with a budget off it)."""
    spec = SCENARIO.spec
    geom = PrefillGeometry("rows", 8, 16, 16)
    keys = [lb.prefill_keys_limit(spec, geom, 65535, 4, nq) for nq in (1, 2, 4)]
    assert keys == sorted(keys, reverse=True) and keys[0] > 0
    assert lb.prefill_keys_limit(spec, geom, 65535, 16, 1) < keys[0]   # the kernel's rows
    assert lb.prefill_keys_limit(spec, geom, 65535, 4, 1, masked=True) <= keys[0]
    assert lb.prefill_keys_limit(spec, PrefillGeometry("tiled", 4, 16, 16), 65535, 16, 1) == 0
    assert lb.prefill_keys_limit(spec, geom, 0, 16, 16) > 2**40
    assert by_decode.straddles(np.array([0, 3, 5]), np.array([10, 4095]), 4096)
    assert not by_decode.straddles(np.array([0, 3, 5]), np.array([10, 4096]), 4096)


def _prefill_case(rope: bool = True):
    return prefill_case(SCENARIO.spec, [600, 40, 0], [9, 3, 2], seed=6, rope=rope,
                        window=[300, 0, 0], sinks=[4, 0, 0])


def test_a_long_prefill_runs_within_the_budget(any_device):
    """A prefill over 600 cached rows (window, sinks, RoPE) matches the oracle; on a device
    with a budget its units would pass it, so it runs as a decode per query."""
    pre = _quiet(lambda: clattn.BatchPrefill(SCENARIO.spec, any_device, backend="opencl"))
    case = _prefill_case()
    if pre.setup.limits.loop_budget:
        plan = pre.plan(case["qo_indptr"], case["page_indptr"], case["last_page_len"],
                        window_offset=case["window_offset"], sink_size=case["sink_size"])
        assert not lb.prefill_fits(SCENARIO.spec, pre.geometry, pre.setup.limits.loop_budget,
                                   plan.units, plan.queries_per_unit, case["rows"], False)
    res = _quiet(lambda: run_prefill(pre, case, rotary_mode=1))   # the decode's fit notes
    compare(res.out, res.lse, *naive_prefill(SCENARIO, case, rotary_mode=1), F16,
            what=f"{any_device.name}: ")


def _budgeted(pre: clattn.BatchPrefill, budget: int = 4096) -> clattn.BatchPrefill:
    """``pre`` as on a device with a loop budget (a small one: every unit passes it)."""
    pre.setup.limits = replace(pre.setup.limits, loop_budget=budget, tiled_prefill=False)
    return pre


@pytest.mark.parametrize("causal", [True, False])
def test_the_decode_form_on_every_device(device, causal):
    """The decode form of a prefill, on the suite's devices with a budget pretended (host
    and device arrays, learned sinks): the oracle's values."""
    pre = _budgeted(_quiet(lambda: clattn.BatchPrefill(SCENARIO.spec, device,
                                                       backend="opencl")))
    case = _prefill_case()
    sinks = np.linspace(-1, 2, SCENARIO.spec.num_qo_heads).astype(np.float32)
    want = naive_prefill(SCENARIO, case, causal=causal, rotary_mode=1, sink_logits=sinks)
    res = run_prefill(pre, case, rotary_mode=1, causal=causal, sink_logits=sinks)
    compare(res.out, res.lse, *want, F16, what=f"{device.name} host: ")
    queue = pre.setup.runtime.queue
    to = runtime.cl().array.to_device
    dev_case = dict(case, **{k: to(queue, np.ascontiguousarray(case[k])) for k in (
        "q", "pages", "qo_indptr", "page_indptr", "page_indices", "last_page_len",
        "window_offset", "sink_size", "k_pos_offset")})
    res = run_prefill(pre, dev_case, rotary_mode=1, causal=causal,
                      sink_logits=to(queue, sinks))
    res.event.wait()
    compare(res.out.get(), res.lse.get(), *want, F16, what=f"{device.name} device: ")


def test_a_masked_prefill_past_the_budget_is_refused(device):
    """A custom mask has no decode form: refused by name before anything is written."""
    pre = _budgeted(_quiet(lambda: clattn.BatchPrefill(SCENARIO.spec, device,
                                                       backend="opencl")))
    case = _prefill_case(rope=False)
    rows = case["rows"]
    masks = [np.ones((n, c), bool) for n, c in zip(case["chunks"], rows)]
    mask, indptr = clattn.pack_mask(masks)
    out = np.full((case["q"].shape[0],) + case["q"].shape[1:], 7, np.float16)
    with pytest.raises(ValueError, match="custom_mask: .*loops"):
        run_prefill(pre, case, custom_mask=mask, mask_indptr=indptr, out=out)
    assert (out == 7).all()


# ------------------------------------------------------------------------------ the cache
def _stored_rows(case, b: int = 0):
    """Sequence ``b``'s stored key and value rows, in order ``[n, H_kv, D]``."""
    ps, n = case["page_size"], int(case["stored"][b])
    rows = np.arange(n)
    idx = case["page_indices"][case["page_indptr"][b] + rows // ps]
    return case["pages"][idx, 0, :, rows % ps], case["pages"][idx, 1, :, rows % ps]


def _chunk_step(device, budget: int | None = None):
    """A 600-token chunk through a PagedKVCache (one layer): the cache and the case."""
    cache = _quiet(lambda: clattn.PagedKVCache(SCENARIO.spec, 1, num_pages=64, device=device,
                                               backend="opencl"))
    if budget is not None:
        cache.opencl.setup.limits = replace(cache.opencl.setup.limits, loop_budget=budget,
                                            tiled_prefill=False)
    cache.add("a")
    return cache, prefill_case(SCENARIO.spec, [0], [600], seed=9, poison=False)


def test_a_long_cache_step_within_the_budget(any_device):
    """A 600-token chunk through the cache: where the prefill kernel's units would pass the
    device's budget, its tokens run on the decode kernel (split within it); the oracle's
    values either way."""
    cache, case = _chunk_step(any_device)
    k, v = _stored_rows(case)
    cache.begin(["a"], [600])
    cache.append(0, k, v)
    res = cache.attend(0, case["q"])
    cache.end()
    compare(res.out, res.lse, *naive_prefill(SCENARIO, case), F16,
            what=f"{any_device.name}: ")
    if cache.opencl.setup.limits.loop_budget:
        assert cache.stats().prefill_launches == 0


def test_a_masked_cache_step_past_the_budget_is_refused(device):
    """A masked step needs the prefill kernel: past a (pretended) budget it is refused by
    name at ``begin``, the cache unchanged; unmasked, the same step runs on the decode
    kernel and matches the oracle."""
    cache, case = _chunk_step(device, budget=65535)
    before = cache.stats()
    with pytest.raises(ValueError, match="masks: .*loops"):
        cache.begin(["a"], [600], masks=[None])
    assert cache.stats() == before and cache.length("a") == 0
    k, v = _stored_rows(case)
    cache.begin(["a"], [600])
    cache.append(0, k, v)
    res = cache.attend(0, case["q"])
    cache.end()
    compare(res.out, res.lse, *naive_prefill(SCENARIO, case), F16, what=f"{device.name}: ")
    assert cache.stats().prefill_launches == 0
