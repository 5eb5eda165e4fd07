"""Prefill (clattn.BatchPrefill) on every backend against the float64 oracle.

The oracle is ``naive.naive_decode`` run once per query with the causal row limit
(``prefill_cases.naive_prefill``; docs/prefill.md has the semantics). The matrix tests
take conftest's ``target`` fixture (the CPU backend, each device's own ``rows`` kernel,
each device running the GPU ``tiled`` kernel); one BatchPrefill per (spec, target) serves
every case of a spec. Real models are built from their raw HF configs and the oracle
reads the same configs (``hf_oracle``).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from cases import compare, config_scenario, lse_bound, out_bound, spec_scenario
from conftest import Target
from model_configs import model
from naive import ScoredLse
from prefill_cases import fast_oracle, naive_prefill, prefill_case, run
from test_signatures import _expected, _parsed

import clattn
from clattn import signatures
from clattn.codegen import render_prefill
from clattn.fit import PREFILL_LONG_CACHE, Limits, PrefillGeometry, prefill_geometry
from clattn.prefill import make_prefill_plan, queries_per_unit
from clattn.profiles import builtin_profiles

F16, F32 = "float16", "float32"

# ---------------------------------------------------------------------------- scenarios
#: the real models of the issue, full size (name -> page size, dtype, sliding window)
MODELS = {
    "Llama-3.1-8B": (16, F16, True),    # 32/8/128, llama3 RoPE; window + sinks compiled in
    "Qwen2.5-0.5B": (1, F32, False),    # 14/2/64: group 7, RoPE theta 1e6
    "Gemma-2-2B": (64, F32, True),      # 8/4/256: soft-cap 50, query_pre_attn_scalar
    "Phi-3.5-mini": (16, F16, False),   # 32/32/96: group 1, longrope
}
SCENARIOS = {name: config_scenario(name, model(name), page_size=ps, dtype=dt, sliding_window=w)
             for name, (ps, dt, w) in MODELS.items()}
#: RoPE types the models do not cover, on a small shape (GPT-J: partial rotary, pairs)
ROPE_TYPES = {
    "linear": spec_scenario("linear", 8, 2, 64, dtype=F32, rope_scaling={
        "rope_type": "linear", "factor": 4.0}),
    "yarn": spec_scenario("yarn", 8, 2, 64, dtype=F16, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
        max_position_embeddings=32768),
    "gptj": spec_scenario("gptj", 8, 2, 64, dtype=F32, rotary_dim=32,
                          rope_scaling={"rope_type": "gptj"}),
}

_PREFILLS: dict = {}


def get_prefill(spec, target: Target) -> clattn.BatchPrefill:
    """The session's BatchPrefill for (spec, target), built on first use."""
    key = (spec.key(), target.name)
    pre = _PREFILLS.get(key)
    if pre is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fitting notes (no sub-groups on a CPU driver)
            pre = clattn.BatchPrefill(spec, target.device, profile=target.profile,
                                      backend="cpu" if target.is_cpu else "opencl")
        _PREFILLS[key] = pre.build()
    return pre


def check(pre, sc, case, *, what="", **call):
    causal, q_pos = call.get("causal", True), call.get("q_pos")
    lib = {k: v for k, v in call.items() if k not in ("sm_scale",) or v is not None}
    res = run(pre, case, **lib)
    ref = naive_prefill(sc, case, causal=causal, q_pos=q_pos,
                        **{k: v for k, v in call.items() if k not in ("causal", "q_pos", "plan")})
    compare(res.out, res.lse, *ref, pre.spec.dtype, what=what)
    return res, ref


# ---------------------------------------------------------------------------- real models
#: (cached tokens, new tokens) per sequence: prompt chunks 1, 7 and 128 in one ragged
#: batch over small caches; RoPE on a shorter batch (the oracle rotates in Python)
PLAIN = ([0, 37, 20], [1, 7, 128])
ROPED = ([13, 0, 25], [1, 7, 40])


@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_shapes(target, name, rope):
    sc = SCENARIOS[name]
    pre = get_prefill(sc.spec, target)
    cached, chunks = ROPED if rope else PLAIN
    win = {}
    if sc.spec.sliding_window:  # a window with sinks on one sequence, none on the others
        win = dict(window=[5, 0, 9], sinks=[2, 0, 4]) if rope else dict(window=[0, 20, 0],
                                                                         sinks=[0, 5, 0])
    pos = [4090, 4000, 5] if name == "Phi-3.5-mini" else None   # longrope: both tables
    case = prefill_case(sc.spec, cached, chunks, seed=len(name), rope=rope, pos_offset=pos, **win)
    call = dict(sc.call, rotary_mode=1) if rope else {"sm_scale": sc.call.get("sm_scale")}
    check(pre, sc, case, what=f"{name} {target}: ", **call)


@pytest.mark.parametrize("key", list(ROPE_TYPES))
def test_rope_types(target, key):
    sc = ROPE_TYPES[key]
    pre = get_prefill(sc.spec, target)
    case = prefill_case(sc.spec, [5, 0, 30], [9, 1, 17], seed=3, rope=True,
                        pos_offset=[70000, 0, 123456])
    check(pre, sc, case, what=f"{key}: ", rotary_mode=1, rope_theta=5e5)


def test_one_query_per_sequence_equals_decode(target, get_decoder):
    """n = 1 everywhere: decode with q_pos at the chunk's last row, within f32 rounding."""
    sc = SCENARIOS["Llama-3.1-8B"]
    pre, dec = get_prefill(sc.spec, target), get_decoder(sc.spec, target)
    case = prefill_case(sc.spec, [0, 16, 40, 200], [1, 1, 1, 1], seed=5, rope=True,
                        window=[0, 5, 17, 150], sinks=[0, 1, 17, 3])
    call = dict(sc.call, rotary_mode=1)
    res = run(pre, case, **call)
    q_pos = case["k_pos_offset"] + case["rows"] - 1
    d = dec.run(case["q"], case["pages"], case["page_indptr"], case["page_indices"],
                case["last_page_len"], window_offset=case["window_offset"],
                sink_size=case["sink_size"], q_pos=q_pos, k_pos_offset=case["k_pos_offset"],
                split=False, **call)
    ref_o, ref_l = naive_prefill(sc, case, **call)
    compare(res.out, res.lse, ref_o, ref_l, sc.spec.dtype, what="prefill: ")
    # the two kernels differ in the order of their f32 sums only
    assert np.all(np.abs(res.lse - d.lse) <= 2 * lse_bound(ref_o, ref_l))
    diff = np.abs(res.out.astype(np.float64) - d.out.astype(np.float64))
    assert np.all(diff <= 2 * out_bound(ref_o, ref_l, sc.spec.dtype))


def test_cascade_shared_prefix_merges_to_whole(target):
    """Prefix (not causal) + suffix (causal, the window skipping the prefix), merged with
    merge_state, equals the prefill over the whole sequence (f32: no double rounding)."""
    sc = SCENARIOS["Gemma-2-2B"]
    spec, pre = sc.spec, get_prefill(sc.spec, target)
    L, suffix, n = 128, [9, 30], [9, 12]     # a page-aligned 128-token shared prefix
    case = prefill_case(spec, [L + s - k for s, k in zip(suffix, n)], n, seed=11, rope=True,
                        window=[0, 0], sinks=[0, 0], pos_offset=[0, 0])
    pi, ind = case["page_indices"], case["page_indptr"]
    ps = spec.page_size
    # both sequences use the first sequence's prefix pages (the shared prefix)
    shared = pi[ind[0]:ind[0] + L // ps]
    pi[ind[1]:ind[1] + L // ps] = shared
    call = dict(sc.call, rotary_mode=1)
    whole = run(pre, case, **call)
    zeros = np.zeros(2, np.int32)
    pre_tables = dict(page_indptr=np.array([0, L // ps, 2 * L // ps], np.int32),
                      page_indices=np.concatenate([shared, shared]).astype(np.int32),
                      last_page_len=np.full(2, ps, np.int32))
    first = (L + np.array(suffix) - np.array(n)).astype(np.int32)
    prefix = pre.run(case["q"], case["pages"], case["qo_indptr"], **pre_tables,
                     window_offset=zeros, sink_size=zeros, k_pos_offset=zeros, q_pos=first,
                     causal=False, **call)
    suf = pre.run(case["q"], case["pages"], case["qo_indptr"], case["page_indptr"], pi,
                  case["last_page_len"], window_offset=np.full(2, L, np.int32), sink_size=zeros,
                  k_pos_offset=np.full(2, L, np.int32), **call)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, s = clattn.merge_state(prefix.out, prefix.lse, suf.out, suf.lse)
    ref_o, ref_l = naive_prefill(sc, case, **call)
    compare(whole.out, whole.lse, ref_o, ref_l, spec.dtype, what="whole: ")
    compare(o, s, ref_o, ref_l, spec.dtype, what="merged: ")


def test_not_causal_empty_chunks_and_q_pos(target):
    """causal=False: every query sees the whole chunk; a sequence with queries but no
    pages gives out 0 and lse -inf exactly; q_pos places the queries."""
    sc = SCENARIOS["Qwen2.5-0.5B"]
    pre = get_prefill(sc.spec, target)
    case = prefill_case(sc.spec, [0, 0, 30], [0, 0, 5], seed=2, rope=True)
    extra = np.random.default_rng(0).standard_normal((3,) + case["q"].shape[1:])
    case["q"] = np.concatenate([extra.astype(case["q"].dtype), case["q"]])
    case["qo_indptr"] = np.array([0, 3, 3, 8], np.int32)
    case["chunks"] = np.array([3, 0, 5])
    q_pos = np.array([7, 0, 2**20], np.int32)
    res, _ = check(pre, sc, case, what="not causal: ", causal=False, q_pos=q_pos,
                   **dict(sc.call, rotary_mode=1))
    assert (res.out[:3] == 0).all() and np.isneginf(res.lse[:3]).all()


def test_masked_nonfinite_rows_do_not_leak(target):
    """A NaN key and inf values in the last rows: the queries before them are exact,
    the queries that attend them NaN. Row 12 is query 7's own: with 7 heads a query's
    rows share the kernel's value tiles with the next query's, whose keys they must not
    multiply (0 * inf)."""
    sc = SCENARIOS["Qwen2.5-0.5B"]
    case = prefill_case(sc.spec, [5], [9], seed=6)
    pi = case["page_indices"]                  # page size 1: row r is page pi[r]
    case["pages"][pi[13], 1] = np.inf
    case["pages"][pi[12], 1] = np.inf
    case["pages"][pi[12], 0] = np.nan
    res = run(get_prefill(sc.spec, target), case)
    ref_o, ref_l = naive_prefill(sc, case)
    compare(res.out[:7], res.lse[:7], ref_o[:7], ref_l[:7], sc.spec.dtype, what="before: ")
    assert np.isnan(res.out[7:]).all() and np.isnan(res.lse[7:]).all()


def test_quantized_pages(target):
    """q8_0 keys and q4_0 values: the oracle reads the dequantized pool."""
    from clattn import quant
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype=F16, k_format="q8_0",
                                v_format="q4_0", sliding_window=True)
    fsc = spec_scenario("q-float", 8, 2, 64, page_size=16, dtype=F32, sliding_window=True)
    case = prefill_case(fsc.spec, [20, 0], [11, 40], seed=4, window=[6, 0], sinks=[2, 0])
    case["pages"] = np.nan_to_num(case["pages"])        # packing needs finite values
    pool = quant.pack_pool(case["pages"][:, 0], case["pages"][:, 1], spec.layout)
    dk, dv = quant.unpack_pool(pool, spec.layout)
    case["q"] = case["q"].astype(np.float16)
    res = get_prefill(spec, target).run(case["q"], pool, case["qo_indptr"], case["page_indptr"],
                                        case["page_indices"], case["last_page_len"],
                                        window_offset=case["window_offset"],
                                        sink_size=case["sink_size"])
    case["pages"] = np.stack([dk, dv], 1).astype(np.float64)
    compare(res.out, res.lse, *naive_prefill(fsc, case), F16, what="quantized: ")


#: longrope switching at position 64 (short factors 1, long 4): chunks straddle it
LONGROPE = spec_scenario("longrope-64", 4, 2, 32, dtype=F32, max_position_embeddings=256,
                         rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 16,
                                       "long_factor": [4.0] * 16,
                                       "original_max_position_embeddings": 64})


def test_longrope_switch_inside_a_chunk(target):
    """A sequence's queries at positions 60-69 straddle longrope's switch: its last query
    (69 + 1 > 64) selects the long factors for all its queries and keys (docs/prefill.md);
    queries 54-63 keep the short ones, and 64-73 are long throughout."""
    pre = get_prefill(LONGROPE.spec, target)
    case = prefill_case(LONGROPE.spec, [20, 14, 24], [10, 10, 10], seed=11, rope=True,
                        pos_offset=[40, 40, 40])
    first = case["k_pos_offset"] + case["rows"] - case["chunks"]
    assert first.tolist() == [60, 54, 64]
    check(pre, LONGROPE, case, what="longrope switch: ", rotary_mode=1)


def test_query_positions_up_to_the_int32_limit(target):
    """q_pos places a sequence's queries at q_pos + i: a last query at 2**31 - 1 runs (the
    oracle's positions are exact), one past it is refused before anything runs, whichever
    query of the sequence crosses."""
    sc = SCENARIOS["Qwen2.5-0.5B"]
    pre = get_prefill(sc.spec, target)
    case = prefill_case(sc.spec, [4, 2], [1, 5], seed=12, rope=True)
    call = dict(sc.call, rotary_mode=1, causal=False)
    top = 2**31 - 1
    check(pre, sc, case, what="int32 limit: ", q_pos=np.array([top, top - 4], np.int32), **call)
    out = np.full(case["q"].shape, 7, case["q"].dtype)
    with pytest.raises(ValueError, match=r"q_pos\[1\]=2147483644: the sequence's last query "
                                         r"position 2147483648 exceeds the int32 range"):
        run(pre, case, q_pos=np.array([0, top - 3], np.int32), out=out, **call)
    assert (out == 7).all(), "a refused call wrote out"


def test_causal_queries_must_be_rows_inside_the_window(target):
    """Causal queries are the last rows of the attended chunk: 12 stored rows with
    window_offset 9 and 2 sinks (a chunk of 5 rows with a gap) take at most 3 queries, so
    4 are refused before anything runs although they fit the chunk's 5 rows; 3 queries,
    4 not causal, and 11 over a chunk without a gap (window_offset == sink_size) run."""
    sc = SCENARIOS["Llama-3.1-8B"]
    pre = get_prefill(sc.spec, target)
    call = {"sm_scale": sc.call.get("sm_scale")}
    for n, wo, causal in ((4, 9, None), (3, 9, True), (4, 9, False), (11, 2, True)):
        case = prefill_case(sc.spec, [12 - n], [n], seed=n, window=[wo], sinks=[2])
        if causal is not None:
            check(pre, sc, case, causal=causal, what=f"{n} queries, wo {wo}: ", **call)
            continue
        out = np.full(case["q"].shape, 7, case["q"].dtype)
        kept = {k: np.copy(v) for k, v in case.items() if isinstance(v, np.ndarray)}
        with pytest.raises(ValueError, match=r"sequence 0 has 4 queries but its attended chunk "
                                             r"has 5 rows \(stored 12, window_offset 9, "
                                             r"sink_size 2\).*inside the window"):
            run(pre, case, out=out, **call)
        assert (out == 7).all(), "a refused call wrote out"
        for k, v in kept.items():
            assert np.array_equal(case[k], v, equal_nan=True), f"the call changed {k}"


# ---------------------------------------------------------------------------- API
def test_plan_units_and_checks():
    pre = clattn.BatchPrefill(SCENARIOS["Qwen2.5-0.5B"].spec, backend="cpu")
    qo = np.array([0, 3, 3, 10], np.int32)
    plan = pre.plan(qo)
    assert plan.units.tolist() == [[0, 0, 3, 0], [0, 1, 3, 1], [0, 2, 3, 2]] + \
        [[2, i, 7, 3 + i] for i in range(7)]
    assert "10 work units" in str(plan) and not plan.units.flags.writeable
    with pytest.raises(ValueError, match="qo_indptr: decreases at sequence 1"):
        pre.plan(np.array([0, 3, 2], np.int32))
    with pytest.raises(ValueError, match="page_indptr: 1 sequences, qo_indptr has 3"):
        pre.plan(qo, np.array([0, 2], np.int32), np.array([3], np.int32))
    with pytest.raises(ValueError, match="^last_page_len: required"):
        pre.plan(qo, np.array([0, 1, 1, 2], np.int32))


def test_plan_order_keeps_a_sequence_together_longest_first():
    # 2 queries per unit; sequence 1's tiles read 7, 9 and 10 key rows, sequence 0's 2 and 3
    plan = make_prefill_plan(np.array([3, 5]), np.array([3, 10]), 2)
    assert plan.units.tolist() == [[1, 4, 5, 7], [1, 2, 5, 5], [1, 0, 5, 3], [0, 2, 3, 2],
                                   [0, 0, 3, 0]]
    assert plan.rows_read == 2 + 3 + 7 + 9 + 10
    rng = np.random.default_rng(5)
    for _ in range(50):
        B, qb = int(rng.integers(1, 7)), int(rng.integers(1, 9))
        n_q = rng.integers(0, 40, B)
        chunk = n_q + rng.integers(0, 300, B)
        u = make_prefill_plan(n_q, chunk, qb).units.astype(np.int64)
        work = chunk[u[:, 0]] - n_q[u[:, 0]] + u[:, 1] + np.minimum(qb, u[:, 2] - u[:, 1])
        seqs = [int(b) for i, b in enumerate(u[:, 0]) if i == 0 or b != u[i - 1, 0]]
        assert len(seqs) == len(set(seqs)) == int((n_q > 0).sum()), "a sequence was split"
        longest = [int(work[u[:, 0] == b].max()) for b in seqs]
        assert longest == sorted(longest, reverse=True)
        for b in seqs:
            mine = u[u[:, 0] == b]
            assert sorted(mine[:, 1].tolist()) == list(range(0, int(n_q[b]), qb))
            assert (np.diff(work[u[:, 0] == b]) <= 0).all()


def test_queries_per_unit_take_long_units_over_long_caches():
    """Units of qb_long where the new queries follow PREFILL_LONG_CACHE cached rows or
    more on average and fill one such unit per sequence; qb otherwise, and always where
    the geometry has no qb_long (a wish, the tiled kernel) or the chunks are unknown."""
    g = PrefillGeometry("rows", 16, 8, 16, qb_long=16)
    L = PREFILL_LONG_CACHE
    assert queries_per_unit(g, np.array([16]), np.array([16 + L])) == 16
    assert queries_per_unit(g, np.array([16]), np.array([16 + L - 1])) == 8   # mean below
    assert queries_per_unit(g, np.array([15]), np.array([15 + 4 * L])) == 8   # no full unit
    # the mean weighs each sequence by its queries: 40 over 2L and 20 over none
    assert queries_per_unit(g, np.array([40, 20]), np.array([40 + 2 * L, 20])) == 16
    assert queries_per_unit(g, np.array([20, 40]), np.array([20 + 2 * L, 40])) == 8
    assert queries_per_unit(g, np.array([64, 0]), np.array([64 + L, 0])) == 16
    assert queries_per_unit(g, np.array([64]), None) == 8
    assert queries_per_unit(PrefillGeometry("rows", 16, 8, 16), np.array([64]),
                            np.array([64 + 4 * L])) == 8
    # the fit: the derived qb doubled where twice it fits the kernel's 64 rows; a wish pins it
    cpu = builtin_profiles()["generic-cpu"]
    lim = Limits(native_float=16)
    assert prefill_geometry(clattn.AttentionSpec(32, 8, 128), cpu, lim).qb_long == 16
    assert prefill_geometry(clattn.AttentionSpec(14, 2, 64), cpu, lim).qb_long == 0  # 9 x 7
    assert prefill_geometry(clattn.AttentionSpec(32, 8, 128), cpu.with_(prefill_qb=8),
                            lim).qb_long == 0


def test_units_over_long_caches(device_target):
    """New queries over caches of 2100 and 2600 rows: the rows kernel's plan takes units
    of qb_long (its second build); over short caches units of qb; exact either way."""
    sc = SCENARIOS["Llama-3.1-8B"]
    target = device_target
    pre = get_prefill(sc.spec, target)
    win = dict(window=[0, 0], sinks=[0, 0]) if sc.spec.sliding_window else {}
    for cached, far in (([2100, 2600], True), ([300, 0], False)):
        case = prefill_case(sc.spec, cached, [40, 19], seed=21, **win)
        plan = pre.plan(case["qo_indptr"], case["page_indptr"], case["last_page_len"],
                        **{k: case[k] for k in ("window_offset", "sink_size") if k in case})
        g = pre.geometry
        assert plan.queries_per_unit == (g.qb_long if far and g.qb_long else g.qb), plan
        assert (g.qb_long > 0) == (g.strategy == "rows")
        check(pre, sc, case, what=f"{cached} cached: ", plan=plan,
              sm_scale=sc.call.get("sm_scale"))


def test_validation_names_the_problem():
    sc = SCENARIOS["Llama-3.1-8B"]
    pre = clattn.BatchPrefill(sc.spec, backend="cpu")
    case = prefill_case(sc.spec, [4, 0], [3, 2], window=[0, 0], sinks=[0, 0], rope=True)
    base = (case["q"], case["pages"], case["qo_indptr"], case["page_indptr"],
            case["page_indices"], case["last_page_len"])
    kw = dict(window_offset=case["window_offset"], sink_size=case["sink_size"])

    def bad(match, *args, **over):
        a = list(base)
        for i, v in args:
            a[i] = v
        with pytest.raises((ValueError, TypeError), match=match):
            pre.run(*a, **{**kw, **over})
    bad(r"qo_indptr\[-1\]=4: must equal the number of queries", (2, np.array([0, 3, 4], np.int32)))
    bad("qo_indptr: decreases at sequence 0", (2, np.array([0, -1, 5], np.int32)))
    bad(r"qo_indptr\[0\]=1", (2, np.array([1, 3, 5], np.int32)))
    bad("k_pos_offset: required when rotary_mode=1", rotary_mode=1)
    bad("causal=1: must be True or False", causal=1)
    # more queries than stored rows: the new tokens were not appended
    bad("sequence 1 has 2 queries but its attended chunk has 1 rows",
        (2, np.array([0, 3, 5], np.int32)), (5, np.array([7, 1], np.int32)))
    # the queries must lie in the window (or the chunk must have no gap)
    bad("keep them inside the window", window_offset=np.array([6, 0], np.int32),
        sink_size=np.array([1, 0], np.int32))
    with pytest.raises(TypeError, match="spec: expected an AttentionSpec, got dict"):
        clattn.BatchPrefill({"num_qo_heads": 8}, backend="cpu")
    with pytest.raises(RuntimeError, match="the CPU backend runs numpy code"):
        pre.source()


def test_numpy_out_lse_and_device_arrays(device_target):
    sc = SCENARIOS["Qwen2.5-0.5B"]
    pre = get_prefill(sc.spec, device_target)
    cl = clattn.runtime.cl()
    case = prefill_case(sc.spec, [3, 10], [4, 6], seed=9)
    out = np.full(case["q"].shape, 7, case["q"].dtype)
    lse = np.full(case["q"].shape[:2], 7, np.float32)
    res = run(pre, case, out=out, lse=lse, plan=pre.plan(case["qo_indptr"], case["page_indptr"],
                                                        case["last_page_len"]))
    assert res.out is out and res.lse is lse
    compare(out, lse, *naive_prefill(sc, case), sc.spec.dtype, what="numpy out: ")
    # plans made elsewhere are refused before anything runs
    other = make_prefill_plan(np.array([4, 6]), None, pre.geometry.qb + 1)
    for plan, exc, match in ((case["qo_indptr"], TypeError, "plan: expected a PrefillPlan"),
                             (other, ValueError, "queries per unit, this kernel takes"),
                             (pre.plan(np.array([0, 4, 5, 10], np.int32)), ValueError,
                              "made for 3 sequences and 10 queries")):
        with pytest.raises(exc, match=match):
            run(pre, case, out=out, plan=plan)
    # device arrays, the pool as a view one page into a larger buffer: returns at once
    queue = pre.setup.runtime.queue
    d = lambda a: cl.array.to_device(queue, np.ascontiguousarray(a))  # noqa: E731
    big = d(np.concatenate([case["pages"][:1], case["pages"]]))
    r = pre.run(d(case["q"]), big[1:], d(case["qo_indptr"]), d(case["page_indptr"]),
                d(case["page_indices"]), d(case["last_page_len"]))
    assert r.event is not None and r.events == (r.event,)
    compare(r.out.get(), r.lse.get(), *naive_prefill(sc, case), sc.spec.dtype, what="device: ")


def test_every_profile_renders_the_prefill_table():
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype=F16, sliding_window=True,
                                softcap=30.0)
    limits = Limits(local_mem_size=32768, subgroups="intel", subgroup_sizes=(8, 16))
    for name, prof in builtin_profiles().items():
        geom = prefill_geometry(spec, prof, limits)
        assert geom.local_mem_bytes <= limits.local_mem_size, name
        src = render_prefill(spec, geom)
        assert _parsed(src, "clattn_prefill") == _expected(signatures.PREFILL, "st_t"), name
        if prof.reduction == "subgroup" and geom.strategy == "tiled":
            assert any("reduction subgroup -> local" in n for n in geom.notes), name


# ---------------------------------------------------------------------------- slow
def test_fast_oracle_matches_naive():
    sc = SCENARIOS["Gemma-2-2B"]
    case = prefill_case(sc.spec, [5, 70], [9, 3], seed=1)
    o1, l1 = naive_prefill(sc, case, **sc.call)
    o2, l2 = fast_oracle(sc, case, **sc.call)
    np.testing.assert_allclose(o1, o2, atol=1e-12)
    np.testing.assert_allclose(l1, l2, atol=1e-12)
    for f in ScoredLse.FIELDS:
        np.testing.assert_allclose(getattr(l1, f), getattr(l2, f), rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Qwen2.5-0.5B"])
def test_long_chunks_over_long_caches(target, name):
    """Prompt chunks of 1, 7, 128 and 1000 tokens over caches of 0 to 8192 tokens."""
    sc = SCENARIOS[name]
    pre = get_prefill(sc.spec, target)
    win = dict(window=[0] * 4, sinks=[0] * 4) if sc.spec.sliding_window else {}
    case = prefill_case(sc.spec, [8192, 4000, 0, 1500], [1, 7, 1000, 128], seed=13, **win)
    res = run(pre, case, sm_scale=sc.call.get("sm_scale"))
    compare(res.out, res.lse, *fast_oracle(sc, case, **sc.call), sc.spec.dtype,
            what=f"{name} long: ")
