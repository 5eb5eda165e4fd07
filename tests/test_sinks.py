"""Learned attention sinks (``sink_logits``, gpt-oss) on every backend against the float64 oracle.

A sink is one more logit per query head in the softmax's denominator, with no value
(docs/contract.md section 5). ``naive.naive_decode`` computes it as transformers' eager
attention does (the sink concatenated to the scores, softmax, its column dropped); the
kernels fold it into the final state as a merge with the state (v = 0, lse = sink *
log2 e). The scenarios are the ones test_kernels.py and test_prefill.py build already
(``WIN``: group 4, window, Llama-3 RoPE, f16 and f32; the prefill scenarios yarn f16 and
linear f32); the sinks add one build of the decode and merge kernels (the epilogue
compiled in) and none of the prefill (a run-time flag). Targets: the CPU backend, each device's
``rows`` kernels and each device running the GPU ``tiled`` kernels (conftest ``target``).
The bounds are cases.TOLERANCE's: the sink is one more term of the sum (its f32 base-2
form is within an f32 rounding of the float64 one, covered by the lse bound's |lse| term).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from cases import compare, oracle
from naive import naive_decode, naive_merge
from prefill_cases import naive_prefill, prefill_case, run
from test_kernels import SPLIT_LENGTHS, WIN, check, run_case, window_case
from test_prefill import ROPE_TYPES, get_prefill

import clattn
from clattn.validate import SINK_LOGIT_MAX

F16, F32 = "float16", "float32"
LOG2E = 1.4426950408889634


def sinks_for(H, seed):
    """Sinks of every kind: ordinary (N(0, 2)), -30 (weighs nothing), +30 (outweighs every
    row: out near 0, lse the sink's), and -inf on the last head (no sink)."""
    s = (np.random.default_rng(seed).standard_normal(H) * 2).astype(np.float32)
    s[0], s[1], s[-1] = -30.0, 30.0, -np.inf
    return s


def _window_case(spec, seed):
    # an empty sequence (index 1), one-row sequences and a long one that splits
    return window_case(spec, SPLIT_LENGTHS, window=[40, 0, 0, 0, 16, 100, 0],
                       sinks=[4, 0, 0, 0, 1, 100, 0], seed=seed, rope=True,
                       pos_offset=[99_000, 0, 5, 6, 7, 8, 9])


# ---------------------------------------------------------------------------- oracle
def test_oracle_sink_is_a_merge_with_an_empty_valued_state():
    """The oracle's sink (a softmax column) equals the merge of the sink-free result with
    the state (0, sink * log2 e): two independent formulas of the contract."""
    sc = WIN[F32]
    case = _window_case(sc.spec, seed=3)
    sinks = sinks_for(sc.spec.num_qo_heads, 1)
    with_o, with_l = oracle(sc, case, rotary_mode=1, sink_logits=sinks)
    free_o, free_l = oracle(sc, case, rotary_mode=1)
    B, H = free_l.shape
    t = np.broadcast_to(sinks.astype(np.float64) * LOG2E, (B, H))
    mo, ml = naive_merge(free_o, np.asarray(free_l), np.zeros_like(free_o), t)
    np.testing.assert_allclose(np.asarray(with_l), ml, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(with_o, mo, rtol=1e-9, atol=1e-12)
    assert (with_o[1] == 0).all() and np.array_equal(np.asarray(with_l)[1], t[1])


# ---------------------------------------------------------------------------- decode
@pytest.mark.parametrize("dtype", [F32, F16])
def test_decode_sinks_unsplit_and_split(target, get_decoder, dtype):
    """Rows or tiled, unsplit (the decode kernel's epilogue) and split (the merge adds the
    sink once); an empty chunk gives (0, sink * log2 e)."""
    sc = WIN[dtype]
    dec = get_decoder(sc.spec, target)
    case = _window_case(sc.spec, seed=21)
    sinks = sinks_for(sc.spec.num_qo_heads, 2)
    ref = oracle(sc, case, rotary_mode=1, sink_logits=sinks)
    for split in (False, 16, None):
        res, _ = check(dec, sc, case, ref=ref, rotary_mode=1,
                       lib=dict(split=split, sink_logits=sinks), what=f"split={split}: ")
    assert (res.out[1] == 0).all()
    np.testing.assert_array_equal(res.lse[1][:-1], sinks[:-1] * np.float32(LOG2E))
    assert np.isneginf(res.lse[1][-1])


def test_no_sink_is_bitwise_sink_free(target, get_decoder):
    """-inf on every head is the sink-free result, bit for bit, split or not."""
    sc = WIN[F32]
    dec = get_decoder(sc.spec, target)
    case = _window_case(sc.spec, seed=22)
    none = np.full(sc.spec.num_qo_heads, -np.inf, np.float32)
    for split in (False, 16):
        a, _ = check(dec, sc, case, rotary_mode=1, lib=dict(split=split))
        b, _ = check(dec, sc, case, rotary_mode=1, lib=dict(split=split, sink_logits=none))
        np.testing.assert_array_equal(a.out, b.out)
        np.testing.assert_array_equal(a.lse, b.lse)


def test_decode_step_sinks_per_layer(device_target, get_decoder):
    """A prepared step: each layer's run takes its own sinks (numpy, then device arrays on
    the per-layer fast path)."""
    sc = WIN[F16]
    dec = get_decoder(sc.spec, device_target)
    case = _window_case(sc.spec, seed=23)
    kw = dict(window_offset=case["window_offset"], sink_size=case["sink_size"],
              q_pos=case["q_pos"], k_pos_offset=case["k_pos_offset"], rotary_mode=1)
    step = dec.prepare(case["page_indptr"], case["page_indices"], case["last_page_len"],
                       num_pages=case["pages"].shape[0], split=False, **kw, **sc.call)
    q = dec.setup.runtime.queue
    cla = pytest.importorskip("pyopencl.array")
    dq, dp = cla.to_device(q, case["q"]), cla.to_device(q, case["pages"])
    dout = cla.empty(q, case["q"].shape, case["q"].dtype)
    dlse = cla.empty(q, case["q"].shape[:2], np.float32)
    for layer in range(3):
        sinks = sinks_for(sc.spec.num_qo_heads, 10 + layer)
        ref = oracle(sc, case, rotary_mode=1, sink_logits=sinks)
        res = step.run(case["q"], case["pages"], sink_logits=sinks)
        compare(res.out, res.lse, *ref, sc.spec.dtype, what=f"step layer {layer}: ")
        step.run(dq, dp, out=dout, lse=dlse, sink_logits=cla.to_device(q, sinks))
        compare(dout.get(), dlse.get(), *ref, sc.spec.dtype, what=f"fast layer {layer}: ")


# ---------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("key", ["yarn", "linear"], ids=["yarn-f16", "linear-f32"])
def test_prefill_sinks(target, key):
    """Rows or tiled prefill (causal, ragged, RoPE: yarn as gpt-oss in f16, linear in f32)
    and a not-causal call where a sequence with queries has an empty chunk: (0, sink *
    log2 e)."""
    sc = ROPE_TYPES[key]
    pre = get_prefill(sc.spec, target)
    sinks = sinks_for(sc.spec.num_qo_heads, 4)
    case = prefill_case(sc.spec, [0, 5, 20], [1, 7, 30], seed=5, rope=True)
    res = run(pre, case, rotary_mode=1, sink_logits=sinks)
    ref = naive_prefill(sc, case, rotary_mode=1, sink_logits=sinks)
    compare(res.out, res.lse, *ref, sc.spec.dtype, what="causal: ")
    case = prefill_case(sc.spec, [0, 12], [0, 3], seed=6)
    extra = np.random.default_rng(1).standard_normal((2,) + case["q"].shape[1:])
    case["q"] = np.concatenate([extra.astype(case["q"].dtype), case["q"]])
    case["qo_indptr"] = np.array([0, 2, 5], np.int32)
    case["chunks"] = np.array([2, 3])
    res = run(pre, case, causal=False, sink_logits=sinks)
    ref = naive_prefill(sc, case, causal=False, sink_logits=sinks)
    compare(res.out, res.lse, *ref, sc.spec.dtype, what="not causal: ")
    assert (res.out[:2] == 0).all()
    np.testing.assert_array_equal(res.lse[:2, :-1],
                                  np.broadcast_to(sinks[:-1] * np.float32(LOG2E), (2, 7)))


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("bad, err, words", [
    (np.zeros(7, np.float32), ValueError, "shape"),
    (np.zeros(8, np.float64), TypeError, "dtype"),
    (np.zeros((1, 8), np.float32), ValueError, "dimensions"),
    (np.array([0, 0, np.nan, 0, 0, 0, 0, 0], np.float32), ValueError, "sink_logits[2]"),
    (np.array([0, 0, 0, np.inf, 0, 0, 0, 0], np.float32), ValueError, "sink_logits[3]"),
    # finite, but sink * log2(e) overflows f32 (either sign): the bound is named
    (np.array([0, 0, 0, 0, 2.4e38, 0, 0, 0], np.float32), ValueError, "sink_logits[4]"),
    (np.array([0, 0, 0, 0, 0, -3e38, 0, 0], np.float32), ValueError, "log2(e)"),
    ([0.0] * 8, TypeError, "numpy or pyopencl"),
])
def test_bad_sinks_refused_before_launch(target, get_decoder, bad, err, words):
    sc = WIN[F32]
    dec = get_decoder(sc.spec, target)
    case = _window_case(sc.spec, seed=24)
    out = np.full(case["q"].shape, 7, np.float32)
    with pytest.raises(err, match="sink_logits") as info:
        check(dec, sc, case, rotary_mode=1, lib=dict(sink_logits=bad, out=out))
    assert words in str(info.value)
    assert (out == 7).all()
    pre = get_prefill(ROPE_TYPES["yarn"].spec, target)
    pcase = prefill_case(pre.spec, [0], [3], seed=7)
    with pytest.raises(err, match="sink_logits"):
        run(pre, pcase, sink_logits=bad)


def test_paged_cache_sinks_per_layer(target):
    """PagedKVCache.attend: each layer's sinks, on decode steps and a prompt chunk
    (prefill kernel), against BatchDecode/the oracle through the same tokens."""
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype=F32)
    kw = dict(backend="cpu") if target.is_cpu else dict(device=target.device,
                                                        profile=target.profile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fitting notes (no sub-groups on a CPU driver)
        cache = clattn.PagedKVCache(spec, 2, num_pages=16, **kw)
    rng = np.random.default_rng(9)
    sinks = [sinks_for(8, 30), sinks_for(8, 31)]
    cache.add("a")
    cache.add("b")
    keys = {s: [[], []] for s in "ab"}
    for lengths in ([5, 9], [1, 1]):
        cache.begin(["a", "b"], lengths)
        T = sum(lengths)
        for layer in range(2):
            k, v = (rng.standard_normal((T, 2, 64)).astype(np.float32) for _ in range(2))
            q = rng.standard_normal((T, 8, 64)).astype(np.float32)
            cache.append(layer, k, v)
            res = cache.attend(layer, q, sink_logits=sinks[layer])
            at = 0
            for s, n in zip("ab", lengths):
                keys[s][layer].append((k[at:at + n], v[at:at + n]))
                kk = np.concatenate([x[0] for x in keys[s][layer]])
                vv = np.concatenate([x[1] for x in keys[s][layer]])
                for i in range(n):  # query i of this sequence sees rows [0, len - n + i]
                    rows = len(kk) - n + i + 1
                    pages = np.zeros((1, 2, 2, rows, 64), np.float32)
                    pages[0, 0] = kk[:rows].transpose(1, 0, 2)
                    pages[0, 1] = vv[:rows].transpose(1, 0, 2)
                    ro, rl = naive_decode(q[at + i:at + i + 1], pages, np.array([0, 1]),
                                          np.array([0]), np.array([rows]),
                                          sink_logits=sinks[layer])
                    compare(res.out[at + i:at + i + 1], res.lse[at + i:at + i + 1], ro, rl,
                            F32, what=f"cache {lengths} layer {layer} {s}{i}: ")
                at += n
        cache.end()


# ---------------------------------------------------------------------------- non-finite
def test_every_row_minus_inf_with_a_sink(target, get_decoder):
    """Every score -inf (a -inf key dim against a positive q dim): broken (NaN) without a
    sink, but with a finite sink the softmax has its sink term: out 0, lse the sink's
    (docs/contract.md section 11), unsplit and split; -inf sink heads stay broken."""
    sc = WIN[F32]
    dec = get_decoder(sc.spec, target)
    case = window_case(sc.spec, [40, 3], window=[0, 0], sinks=[0, 0], seed=25)
    case["q"][..., 0] = np.abs(case["q"][..., 0]) + 0.5
    case["pages"][:, 0, :, :, 0] = -np.inf
    sinks = sinks_for(sc.spec.num_qo_heads, 5)
    # the largest finite sinks accepted: their base-2 form stays finite (section 5)
    sinks[2], sinks[3] = SINK_LOGIT_MAX, -SINK_LOGIT_MAX
    args = {k: case[k] for k in ("window_offset", "sink_size")}
    for split in (False, 16):
        res = dec.run(case["q"], case["pages"], case["page_indptr"], case["page_indices"],
                      case["last_page_len"], split=split, sink_logits=sinks, **args)
        assert (res.out[:, :-1] == 0).all(), f"split={split}"
        np.testing.assert_array_equal(res.lse[:, :-1],
                                      np.broadcast_to(sinks[:-1] * np.float32(LOG2E), (2, 7)))
        assert np.isnan(res.out[:, -1]).all() and np.isnan(res.lse[:, -1]).all()
    pre = get_prefill(ROPE_TYPES["yarn"].spec, target)
    pcase = prefill_case(pre.spec, [4], [3], seed=8, poison=False)
    pcase["q"][..., 0] = np.abs(pcase["q"][..., 0]) + 0.5
    pcase["pages"][:, 0, :, :, 0] = -np.inf
    res = run(pre, pcase, sink_logits=sinks)
    assert (res.out[:, :-1] == 0).all()
    np.testing.assert_array_equal(res.lse[:, :-1],
                                  np.broadcast_to(sinks[:-1] * np.float32(LOG2E), (3, 7)))
    assert np.isnan(res.lse[:, -1]).all()


def test_device_nan_and_inf_sinks_break_their_heads(device_target, get_decoder):
    """Device sinks are not read on the host: a NaN or +inf sink breaks its head (NaN out
    and lse, the empty sequence too), split or not; the other heads are exact."""
    sc = WIN[F32]
    dec = get_decoder(sc.spec, device_target)
    case = _window_case(sc.spec, seed=26)
    sinks = sinks_for(sc.spec.num_qo_heads, 6)
    ref = oracle(sc, case, rotary_mode=1, sink_logits=sinks)
    bad = sinks.copy()
    bad[2], bad[3] = np.nan, np.inf
    cla = pytest.importorskip("pyopencl.array")
    dbad = cla.to_device(dec.setup.runtime.queue, bad)
    for split in (False, 16):
        res = run_case(dec, sc, case, rotary_mode=1, lib=dict(split=split, sink_logits=dbad))
        assert np.isnan(res.out[:, 2:4]).all() and np.isnan(res.lse[:, 2:4]).all()
        keep = [0, 1, 4, 5, 6, 7]
        compare(res.out[:, keep], res.lse[:, keep], ref[0][:, keep], ref[1][:, keep],
                sc.spec.dtype, what=f"split={split}: ")


# ---------------------------------------------------------------------------- builds
def test_builds_without_sinks_carry_no_sink_code():
    """The decode and merge kernels fold the sink in only in their build with sinks."""
    from clattn.codegen import render_decode, render_merge
    from clattn.fit import Limits, decode_geometry, merge_geometry
    from clattn.profiles import get_profile
    spec = WIN[F32].spec
    fold = "sink_ml = clattn_with_sink("
    for name in ("pocl-cpu", "generic"):
        prof = get_profile(name)
        geom = decode_geometry(spec, prof, Limits())
        assert fold not in render_decode(spec, geom)
        assert fold in render_decode(spec, geom, sinks=True)
        mg = merge_geometry(spec.head_dim, spec.dtype, prof, Limits())
        assert fold not in render_merge(spec.head_dim, spec.dtype, "float32", mg)
        assert fold in render_merge(spec.head_dim, spec.dtype, "float32", mg, sinks=True)


#: split every step into partitions of one page
SPLIT_EVERY_STEP = {"min_partition_rows": 4, "split_min_rows": 0, "wgs_per_cu": 4096}


def _mixed_on(step, layer):
    """Layer 0 has sinks from step 2 on (a one-token step: its sink kernels are made while
    its append is held for the fused launch), layer 1 every other step."""
    return step >= 2 if layer == 0 else step % 2 == 1


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_cache_layers_with_and_without_sinks(device_target, split, prefill):
    """Layers and steps with learned sinks and without, interleaved: each attend runs the
    build for its case on the step's one set of tables (fused appends, split plans, and
    with ``prefill`` steps whose decode rows share a launch sequence with prefill runs).
    Every result equals, bit for bit, a cache with those sinks on every layer and step or
    one with none (both checked against the oracle elsewhere)."""
    from clattn.profiles import get_profile
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype=F32)
    extra = dict(SPLIT_EVERY_STEP) if split else {}
    profile = extra if device_target.profile is None else \
        get_profile(device_target.profile).with_(**extra)
    s = sinks_for(4, 40)
    steps = ([9, 1], None, [7, 1], None, [1, 8], None, None) if prefill else \
        ([6, 3], None, None, [2, 1], None, None, None)
    runs = {}
    for name, on in (("mixed", _mixed_on), ("all", lambda i, layer: True),
                     ("none", lambda i, layer: False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
            cache = clattn.PagedKVCache(spec, 2, device=device_target.device, profile=profile,
                                        backend="opencl", num_pages=48, prefill=prefill)
        rng = np.random.default_rng(3)
        seen = runs[name] = []
        cache.add("a")
        cache.add("b")
        for i, lengths in enumerate(steps):
            T = sum(lengths) if lengths else 2
            cache.begin(["a", "b"], lengths)
            for layer in range(2):
                k, v = (rng.standard_normal((T, 2, 16)).astype(np.float32) for _ in range(2))
                q = rng.standard_normal((T, 4, 16)).astype(np.float32)
                cache.append(layer, k, v)
                res = cache.attend(layer, q, sink_logits=s if on(i, layer) else None)
                seen.append((i, layer, res.out.copy(), res.lse.copy()))
            cache.end()
    for (i, layer, out, lse), a, n in zip(runs["mixed"], runs["all"], runs["none"]):
        want = a if _mixed_on(i, layer) else n
        np.testing.assert_array_equal(out, want[2], err_msg=f"step {i} layer {layer}")
        np.testing.assert_array_equal(lse, want[3], err_msg=f"step {i} layer {layer}")
    assert not np.array_equal(runs["all"][-1][3], runs["none"][-1][3])  # the sinks count


def test_step_and_one_call_switch_builds(device_target, get_decoder):
    """A prepared step and BatchDecode.run's short path, called with sinks and then
    without (and again with), give the results of calls that never had sinks, bit for
    bit, split or not."""
    sc = WIN[F32]
    dec = get_decoder(sc.spec, device_target)
    plain_k, with_k = dec.opencl.decode_kernels(), dec.opencl.decode_kernels(sinks=True)
    assert with_k[1] is not plain_k[1]  # the merge: a build each
    assert (with_k[0] is plain_k[0]) == (dec.geometry.strategy == "tiled")  # tiled: one build
    case = _window_case(sc.spec, seed=27)
    cla = pytest.importorskip("pyopencl.array")
    q = dec.setup.runtime.queue
    sinks = cla.to_device(q, sinks_for(sc.spec.num_qo_heads, 8))
    kw = dict(window_offset=case["window_offset"], sink_size=case["sink_size"],
              q_pos=case["q_pos"], k_pos_offset=case["k_pos_offset"], rotary_mode=1)
    dq, dp = cla.to_device(q, case["q"]), cla.to_device(q, case["pages"])
    tables = {n: cla.to_device(q, case[n]) for n in ("page_indptr", "page_indices",
                                                     "last_page_len")}
    dkw = {n: cla.to_device(q, v) if isinstance(v, np.ndarray) else v for n, v in kw.items()}
    for split in (False, 16):
        plan = dec.plan(case["page_indptr"], case["last_page_len"],
                        window_offset=case["window_offset"], sink_size=case["sink_size"],
                        split=split)
        plain = run_case(dec, sc, case, rotary_mode=1, lib=dict(split=split))
        withs = run_case(dec, sc, case, rotary_mode=1, lib=dict(split=split, sink_logits=sinks))
        step = dec.prepare(case["page_indptr"], case["page_indices"], case["last_page_len"],
                           num_pages=case["pages"].shape[0], plan=plan, **kw, **sc.call)
        outs = [(cla.empty(q, case["q"].shape, np.float32),
                 cla.empty(q, case["q"].shape[:2], np.float32)) for _ in range(6)]
        for i, sk in enumerate((sinks, None, sinks)):
            o, s = outs[i]
            step.run(dq, dp, out=o, lse=s, sink_logits=sk)
            o2, s2 = outs[3 + i]
            dec.run(dq, dp, tables["page_indptr"], tables["page_indices"],
                    tables["last_page_len"], out=o2, lse=s2, plan=plan, sink_logits=sk,
                    **dkw, **sc.call)
            want = withs if sk is not None else plain
            for got_o, got_s in ((o, s), (o2, s2)):
                np.testing.assert_array_equal(got_o.get(), want.out, err_msg=f"split={split} {i}")
                np.testing.assert_array_equal(got_s.get(), want.lse, err_msg=f"split={split} {i}")
