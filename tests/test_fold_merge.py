"""The split merge folded into the decode launch (profile field ``fold_merge``): the same
bits as the separate decode and merge launches, in one launch.

Two decoders per device target (rows on each CPU driver, tiled through a GPU profile on
the same devices), one with ``fold_merge`` on and one with it off, run the same split
calls; their outputs and LSEs must be equal bit for bit (the folded kernel runs
clattn_merge_varlen's arithmetic, kernels/merge_state.clh.mako, in the last partition of
each sequence to finish). The separate launches are checked against the float64 oracle
by tests/test_kernels.py and tests/test_sinks.py; here one folded call per scenario is
compared with the oracle too. Every call path is covered: the checked path, the short
path (device arrays, a plan, outputs given), the prepared step (host and per-layer
paths); the cache's (fused append + fold: one launch per layer) is in
tests/test_cache_fused.py. The counters the folded launches share must be back to zero
after every launch (two folded launches back to back give the same bits).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from cases import decode_args, make_case, oracle, spec_scenario
from test_kernels import SPLIT_LENGTHS, WIN, assert_same, check, host, window_case
from test_sinks import sinks_for

import clattn
from clattn import quant
from clattn.profiles import get_profile

cl = pytest.importorskip("pyopencl")
import pyopencl.array as cla  # noqa: E402

F16, F32 = "float16", "float32"
#: small partitions (so every split plan below splits something) wherever planning decides
SPLIT_SMALL = {"min_partition_rows": 16, "split_min_rows": 0, "wgs_per_cu": 4096}


def profile_of(target, fold: bool):
    """The target's profile with ``fold_merge`` set (and small partitions)."""
    extra = dict(SPLIT_SMALL, fold_merge=fold)
    return extra if target.profile is None else get_profile(target.profile).with_(**extra)


def decoders(get_decoder, spec, target):
    """``(folded, separate)`` decoders of ``spec`` on ``target``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        return (get_decoder(spec, target, profile_of(target, True)),
                get_decoder(spec, target, profile_of(target, False)))


def counters_zero(dec, batch):
    """The folded launches' counters of ``dec`` (for ``batch`` sequences) are all 0."""
    rt = dec.setup.runtime
    buf = dec.opencl.counters(batch)
    got = np.empty(buf.size // 4, np.int32)
    cl.enqueue_copy(rt.queue, got, buf)
    return not got.any()


def split_case(spec, seed):
    """SPLIT_LENGTHS (an empty sequence, one-row ones, a long one) with windows and sinks
    and RoPE at large positions."""
    return window_case(spec, SPLIT_LENGTHS, window=[40, 0, 0, 0, 16, 100, 0],
                       sinks=[4, 0, 0, 0, 1, 100, 0], seed=seed, rope=True,
                       pos_offset=[99_000, 0, 5, 6, 7, 8, 9])


def run(dec, case, sc, plan, **call):
    args, kw = decode_args(case)
    return dec.run(*args, **kw, plan=plan, **dict(sc.call, **call))


@pytest.mark.parametrize("dtype", [F32, F16])
def test_folded_equals_separate(device_target, get_decoder, dtype):
    """Split plans of every shape (mixed batches of split and direct sequences, empty
    and one-row sequences), windows with sinks, RoPE in the kernel, learned sinks: one
    launch, the separate launches' bits; the counters back at zero after each."""
    sc = WIN[dtype]
    fold, sep = decoders(get_decoder, sc.spec, device_target)
    case = split_case(sc.spec, seed=31)
    B = len(SPLIT_LENGTHS)
    ref = oracle(sc, case, rotary_mode=1)
    for split in (16, 32, 64, None):
        plan = sep.plan(case["page_indptr"], case["last_page_len"],
                        window_offset=case["window_offset"], sink_size=case["sink_size"],
                        split=split)
        assert plan.split, f"split={split}: {plan}"
        a = run(fold, case, sc, plan, rotary_mode=1)
        b = run(sep, case, sc, plan, rotary_mode=1)
        assert_same(a, b, f"split={split}: ")
        assert (len(a.events), len(b.events)) == (1, 2), (a.events, b.events)
        assert counters_zero(fold, B), f"split={split}: a counter was left set"
        again = run(fold, case, sc, plan, rotary_mode=1)   # back to back: counters reset
        assert_same(a, again, f"split={split}, again: ")
    check(fold, sc, case, ref=ref, rotary_mode=1, lib=dict(plan=plan), what="folded: ")
    sinks = sinks_for(sc.spec.num_qo_heads, 3)
    for split in (16, None):
        plan = sep.plan(case["page_indptr"], case["last_page_len"],
                        window_offset=case["window_offset"], sink_size=case["sink_size"],
                        split=split)
        a = run(fold, case, sc, plan, rotary_mode=1, sink_logits=sinks)
        b = run(sep, case, sc, plan, rotary_mode=1, sink_logits=sinks)
        assert_same(a, b, f"learned sinks, split={split}: ")
        assert counters_zero(fold, B)
    check(fold, sc, case, ref=oracle(sc, case, rotary_mode=1, sink_logits=sinks),
          rotary_mode=1, lib=dict(plan=plan, sink_logits=sinks), what="folded, sinks: ")


def test_folded_quantized_tiny_partitions(device_target, get_decoder):
    """q8_0 pages, group 8, page_size 1: partitions of one to three rows, every sequence
    split (and the unsplit call, which the folded build runs as the plain one)."""
    sc = spec_scenario("q8-ps1", 16, 2, 64, page_size=1, dtype=F16, k_format="q8_0",
                       v_format="q8_0")
    spec = sc.spec
    fold, sep = decoders(get_decoder, spec, device_target)
    fspec = clattn.AttentionSpec(16, 2, 64, page_size=1, dtype=F32)
    case = make_case(fspec, [9, 2, 0, 5, 1], seed=32)
    case["pages"] = quant.pack_pool(case["pages"][:, 0], case["pages"][:, 1], spec.layout)
    case["q"] = case["q"].astype(F16)
    for split in (False, 1, 2, 3):
        plan = sep.plan(case["page_indptr"], case["last_page_len"], split=split)
        a, b = run(fold, case, sc, plan), run(sep, case, sc, plan)
        assert_same(a, b, f"split={split}: ")
        assert len(a.events) == 1 and len(b.events) == (2 if plan.split else 1)
    assert counters_zero(fold, 5)


def split_step_setup(get_decoder, spec, target, seed: int) -> tuple:
    """``(fold, sep, case, args, kw, plan)``: the folded and separate decoders, a split
    case of ``seed`` with RoPE in the kernel, its arguments and a plan split in 16."""
    fold, sep = decoders(get_decoder, spec, target)
    case = split_case(spec, seed=seed)
    args, kw = decode_args(case)
    kw.update(rotary_mode=1)
    plan = sep.plan(case["page_indptr"], case["last_page_len"],
                    window_offset=case["window_offset"], sink_size=case["sink_size"], split=16)
    return fold, sep, case, args, kw, plan


def test_folded_short_path_and_prepared_step(device_target, get_decoder):
    """BatchDecode.run's short path (device arrays, a plan, outputs given) and a prepared
    step (host arrays; device arrays with outputs: its per-layer path), two layers each:
    the separate launches' bits, one launch per call."""
    sc = WIN[F16]
    fold, sep, case, args, kw, plan = split_step_setup(get_decoder, sc.spec, device_target, 33)
    rng = np.random.default_rng(34)
    qs = [rng.standard_normal(case["q"].shape).astype(F16) for _ in range(2)]
    results = {}
    for name, dec in (("fold", fold), ("sep", sep)):
        queue = dec.setup.runtime.queue
        dev = {k: cla.to_device(queue, v) for k, v in zip(
            ("pages", "page_indptr", "page_indices", "last_page_len"), args[1:])}
        dkw = {k: cla.to_device(queue, v) for k, v in kw.items() if k != "rotary_mode"}
        step = dec.prepare(*args[2:], num_pages=case["pages"].shape[0], plan=plan, **kw)
        got = []
        for q in qs:
            dq = cla.to_device(queue, q)
            out, lse = cla.empty(queue, q.shape, F16), cla.empty(queue, q.shape[:2], np.float32)
            short = dec.run(dq, dev["pages"], dev["page_indptr"], dev["page_indices"],
                            dev["last_page_len"], **dkw, rotary_mode=1, plan=plan,
                            out=out, lse=lse)
            got.append((host(short.out), host(short.lse), len(short.events)))
            out2, lse2 = cla.empty(queue, q.shape, F16), cla.empty(queue, q.shape[:2],
                                                                  np.float32)
            fast = step.run(dq, dev["pages"], out=out2, lse=lse2)
            got.append((out2.get(), lse2.get(), len(fast.events)))
            slow = step.run(q, case["pages"])
            got.append((slow.out, slow.lse, len(slow.events)))
        results[name] = got
    for i, (a, b) in enumerate(zip(results["fold"], results["sep"])):
        assert_same(a[:2], b[:2], f"call {i}: ")
        assert (a[2], b[2]) == (1, 2), f"call {i}: launches {a[2]} folded, {b[2]} separate"
    assert counters_zero(fold, len(SPLIT_LENGTHS))


def test_folded_head_slices(tiled_target, get_decoder):
    """Group 16: the tiled kernel splits a KV head's query heads over two work-groups
    (gdz 2), each counting on a counter of its own head slice. Mixed batch, split plans
    and a learned sink. (Rows keep a KV head's heads in one work-item: the tests above.)"""
    sc = spec_scenario("g16", 16, 1, 64, page_size=16, dtype=F32)
    fold, sep = decoders(get_decoder, sc.spec, tiled_target)
    assert fold.geometry.gdz == 2, fold.geometry
    case = make_case(sc.spec, SPLIT_LENGTHS, seed=35)
    sinks = sinks_for(16, 5)
    for split, extra in ((16, {}), (64, {}), (None, {"sink_logits": sinks})):
        plan = sep.plan(case["page_indptr"], case["last_page_len"], split=split)
        a, b = run(fold, case, sc, plan, **extra), run(sep, case, sc, plan, **extra)
        assert_same(a, b, f"split={split}: ")
        assert len(a.events) == 1
    assert counters_zero(fold, len(SPLIT_LENGTHS))
    check(fold, sc, case, lib=dict(plan=plan, sink_logits=sinks), what="folded: ",
          ref=oracle(sc, case, sink_logits=sinks))


def test_fold_build_refused_keeps_the_merge_launch(device_target, monkeypatch):
    """A driver that allows the fold build fewer work-items per group than the geometry
    launches (registers: a GPU's limit depends on the code) is never launched: a split
    call keeps the merge's own launch, with the same bits, and no error."""
    from clattn.opencl_backend import OpenCLBackend
    sc = WIN[F32]
    real = OpenCLBackend.decode_kernels

    class Refused:  # a fold build the driver allows no work-item (never launchable)
        def work_group_size(self, device):
            return 0

    def decode_kernels(self, sinks=False, fold=False):
        decode, merge = real(self, sinks, fold)
        return (Refused(), merge) if fold else (decode, merge)
    monkeypatch.setattr(OpenCLBackend, "decode_kernels", decode_kernels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        fold = clattn.BatchDecode(sc.spec, device_target.device,
                                  profile=profile_of(device_target, True))
        sep = clattn.BatchDecode(sc.spec, device_target.device,
                                 profile=profile_of(device_target, False))
    case = split_case(sc.spec, seed=36)
    plan = sep.plan(case["page_indptr"], case["last_page_len"],
                    window_offset=case["window_offset"], sink_size=case["sink_size"], split=16)
    a, b = run(fold, case, sc, plan, rotary_mode=1), run(sep, case, sc, plan, rotary_mode=1)
    assert_same(a, b)
    assert len(a.events) == 2 and not fold.opencl.folds(plan)


def test_folded_prepared_step_with_sinks(device_target, get_decoder):
    """A prepared split step with learned sinks runs the folded build with the sink
    epilogue (one launch per layer, the separate launches' bits), on the host path and on
    the per-layer path (device arrays, outputs given, device sinks)."""
    sc = WIN[F32]
    fold, sep, case, args, kw, plan = split_step_setup(get_decoder, sc.spec, device_target, 35)
    sinks = sinks_for(sc.spec.num_qo_heads, 36)
    results = {}
    for name, dec in (("fold", fold), ("sep", sep)):
        queue = dec.setup.runtime.queue
        step = dec.prepare(*args[2:], num_pages=case["pages"].shape[0], plan=plan, **kw)
        slow = step.run(case["q"], case["pages"], sink_logits=sinks)
        dq, dp = cla.to_device(queue, case["q"]), cla.to_device(queue, case["pages"])
        out, lse = cla.empty(queue, dq.shape, F32), cla.empty(queue, dq.shape[:2], np.float32)
        fast = step.run(dq, dp, out=out, lse=lse, sink_logits=cla.to_device(queue, sinks))
        results[name] = [(slow.out, slow.lse, len(slow.events)),
                         (out.get(), lse.get(), len(fast.events))]
    for i, (a, b) in enumerate(zip(results["fold"], results["sep"])):
        assert_same(a[:2], b[:2], f"{('host', 'per-layer')[i]} path: ")
        assert (a[2], b[2]) == (1, 2), f"launches {a[2]} folded, {b[2]} separate"
    check(fold, sc, case, ref=oracle(sc, case, rotary_mode=1, sink_logits=sinks),
          rotary_mode=1, lib=dict(plan=plan, sink_logits=sinks), what="folded, sinks: ")
    assert counters_zero(fold, len(SPLIT_LENGTHS))


def test_folded_counters_grow_with_the_batch(device_target):
    """A fresh folded decoder's first split launch has one sequence, its next seven: the
    counters grow with the batch (one per sequence and KV head), the results are the
    separate launches' bits and every counter is back at zero."""
    sc = WIN[F32]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        fold, sep = (clattn.BatchDecode(sc.spec, device_target.device,
                                        profile=profile_of(device_target, f))
                     for f in (True, False))
    big = split_case(sc.spec, seed=37)
    small = window_case(sc.spec, [SPLIT_LENGTHS[-2]], window=[100], sinks=[100], seed=38,
                        rope=True, pos_offset=[8])
    for case in (small, big):
        plan = sep.plan(case["page_indptr"], case["last_page_len"],
                        window_offset=case["window_offset"], sink_size=case["sink_size"],
                        split=16)
        assert plan.split
        assert_same(run(fold, case, sc, plan, rotary_mode=1), run(sep, case, sc, plan,
                                                                   rotary_mode=1))
        assert counters_zero(fold, len(case["last_page_len"]))
    assert counters_zero(fold, len(SPLIT_LENGTHS))
