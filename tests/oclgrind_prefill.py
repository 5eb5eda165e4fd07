"""The prefill kernels' variants for the Oclgrind runner (tests/oclgrind_runner.py adds
them to its table; test_oclgrind.py runs each in a fresh process with the simulator's
checkers on). Values are checked against the float64 oracle; garbage device tables must
stay in bounds and give no NaN. Shapes are tiny: the simulator interprets every work-item.
"""
from __future__ import annotations

import warnings

import numpy as np

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
          "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
#: the GPU kernel with 32 work-items per group (the simulator is slow)
SMALL_TILED = {"strategy": "tiled", "thread_limit": 32}


def _prefill(spec, profile):
    import clattn
    from clattn import runtime
    dev = runtime.select_device("oclgrind")
    assert runtime.is_simulator(dev), dev
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # fitting notes (no fp16 / no sub-groups) are expected
        pre = clattn.BatchPrefill(spec, dev, backend="opencl", profile=profile)
    print(f"geometry: {pre.geometry}", flush=True)
    return pre


def values_variant(profile, spec_kw, cached, chunks, *, window=None, sinks=None, rope=False,
                   sink_logits=False):
    """Causal and not causal against the oracle; the plan's units cut every sequence."""
    from cases import compare, spec_scenario
    from oclgrind_runner import learned_sinks
    from prefill_cases import naive_prefill, prefill_case, run
    spec_kw = dict(spec_kw)
    sc = spec_scenario("variant", spec_kw.pop("num_qo_heads"), spec_kw.pop("num_kv_heads"),
                       spec_kw.pop("head_dim"), **spec_kw)
    pre = _prefill(sc.spec, profile)
    case = prefill_case(sc.spec, cached, chunks, seed=1, window=window, sinks=sinks, rope=rope)
    call = dict(rotary_mode=1) if rope else {}
    if sink_logits:
        call["sink_logits"] = learned_sinks(sc.spec.num_qo_heads)
    for causal in (True, False):
        res = run(pre, case, causal=causal, **call)
        compare(res.out, res.lse, *naive_prefill(sc, case, causal=causal, **call),
                sc.spec.dtype, what=f"causal={causal}: ")


def adversarial_variant(profile, rope=True):
    """Garbage tables as device arrays (no host value checks): clamped, no NaN; the
    kernel takes the split of q from the plan, so a garbage qo_indptr changes nothing."""
    from prefill_cases import prefill_case

    from clattn import AttentionSpec, runtime
    cl = runtime.cl()
    spec = AttentionSpec(4, 2, 16, page_size=4, dtype="float32", sliding_window=True,
                         rope_scaling=LLAMA3 if rope else None, max_position_embeddings=131072)
    pre = _prefill(spec, profile)
    good = prefill_case(spec, [5, 0, 9], [4, 6, 3], seed=3, window=[2, 0, 1], sinks=[1, 0, 0],
                        rope=True, poison=False)
    queue = pre.setup.runtime.queue
    d = lambda a: cl.array.to_device(queue, np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    q, pages = cl.array.to_device(queue, good["q"]), cl.array.to_device(queue, good["pages"])
    plan = pre.plan(good["qo_indptr"], good["page_indptr"], good["last_page_len"],
                    window_offset=good["window_offset"], sink_size=good["sink_size"])
    P, nnz, T = good["pages"].shape[0], len(good["page_indices"]), len(good["q"])
    bad_tables = {
        "qo_indptr beyond q / decreasing / negative": dict(qo_indptr=[0, T + 40, 2, -9]),
        "qo_indptr huge": dict(qo_indptr=[-2**31, 2**31 - 1, 0, 2**31 - 1]),
        "more queries than rows": dict(qo_indptr=[0, 12, 12, T], last_page_len=[1, 1, 1]),
        "indices out of range": dict(page_indices=([P + 5, -3, 2**31 - 1, -2**31] * nnz)[:nnz]),
        "indptr beyond nnz": dict(page_indptr=[0, nnz + 10, 1, -5]),
        "last_page_len garbage": dict(last_page_len=[0, 2**31 - 1, -7]),
        "window / sinks garbage": dict(window_offset=[100, -5, 2**31 - 1], sink_size=[-1, 200, 9]),
        "positions extreme": dict(q_pos=[2**31 - 1, -2**31, -1],
                                  k_pos_offset=[2**31 - 64, -2**31, 7]),
    }
    for what, override in bad_tables.items():
        tables = {k: good[k] for k in ("qo_indptr", "page_indptr", "page_indices",
                                       "last_page_len", "window_offset", "sink_size",
                                       "k_pos_offset")}
        tables["q_pos"] = good["k_pos_offset"]
        tables.update(override)
        dt = {k: d(v) for k, v in tables.items()}
        for causal in (True, False):
            res = pre.run(q, pages, dt["qo_indptr"], dt["page_indptr"], dt["page_indices"],
                          dt["last_page_len"], window_offset=dt["window_offset"],
                          sink_size=dt["sink_size"], k_pos_offset=dt["k_pos_offset"],
                          q_pos=dt["q_pos"] if "q_pos" in override else None,
                          rotary_mode=1 if rope else 0, causal=causal, plan=plan)
            out, lse = res.out.get(), res.lse.get()
            tag = f"{what} (causal={causal})"
            assert not np.isnan(out).any(), f"{tag}: NaN in out"
            assert not np.isnan(lse).any() and not np.isposinf(lse).any(), f"{tag}: bad lse {lse}"
            print(f"adversarial ok: {tag}", flush=True)


def mask_variant(profile):
    """A custom mask (odd bit counts, a fully masked query) causal and not against the
    oracle; then garbage device mask tables over a 3-byte mask: clamped, no NaN."""
    from cases import compare, spec_scenario
    from prefill_cases import naive_prefill, prefill_case, run

    import clattn
    from clattn import runtime
    sc = spec_scenario("mask", 4, 2, 16, page_size=4, dtype="float32")
    pre = _prefill(sc.spec, profile)
    case = prefill_case(sc.spec, [6, 1], [5, 2], seed=2)
    rng = np.random.default_rng(5)
    masks = [rng.random((int(n), int(c))) < 0.5 for n, c in zip(case["chunks"], case["rows"])]
    masks[0][1] = False
    bits, indptr = clattn.pack_mask(masks)
    for causal in (True, False):
        res = run(pre, case, causal=causal, custom_mask=bits, mask_indptr=indptr)
        compare(res.out, res.lse, *naive_prefill(sc, case, causal=causal, mask=masks),
                sc.spec.dtype, what=f"mask causal={causal}: ")
    queue = pre.setup.runtime.queue
    d = lambda a, t=np.int32: runtime.cl().array.to_device(  # noqa: E731
        queue, np.ascontiguousarray(a, dtype=t))
    plan = pre.plan(case["qo_indptr"])
    for what, ind in (("beyond the mask", [0, 2**31 - 1, 2**31 - 1]),
                      ("negative", [-2**31, -1, 5]), ("empty mask", None)):
        short = d(bits[:3] if ind else bits[:0], np.uint8)
        res = run(pre, case, custom_mask=short, mask_indptr=d(ind or [0, 0, 0]), plan=plan)
        assert not np.isnan(res.out).any() and not np.isnan(res.lse).any(), f"{what}: NaN"
        print(f"adversarial mask ok: {what}", flush=True)


SMALL = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
PREFILL_VARIANTS = {
    "prefill-rows-f32-window-rope": lambda: values_variant(
        "generic-cpu", dict(SMALL, dtype="float32", sliding_window=True, rope_scaling=LLAMA3,
                            max_position_embeddings=131072),
        [5, 0, 11], [3, 9, 6], window=[2, 0, 4], sinks=[1, 0, 4], rope=True),
    "prefill-rows-vec1-f16-softcap": lambda: values_variant(
        {"strategy": "rows", "vec": 1, "tile_rows": 4}, dict(SMALL, dtype="float16",
                                                             softcap=20.0), [7, 0], [5, 3]),
    # 16-float vectors (AVX-512 CPU drivers): rows padded to 16, head_dim 32 in two vectors
    "prefill-rows-vec16-f16-window": lambda: values_variant(
        {"strategy": "rows", "prefill_vec": 16, "tile_rows": 4},
        dict(SMALL, head_dim=32, dtype="float16", sliding_window=True), [6, 0], [9, 2],
        window=[3, 0], sinks=[1, 0]),
    "prefill-tiled-f16-window-rope": lambda: values_variant(
        SMALL_TILED, dict(SMALL, dtype="float16", sliding_window=True, rope_scaling=LLAMA3,
                          max_position_embeddings=131072),
        [9, 0], [4, 7], window=[3, 0], sinks=[2, 0], rope=True),
    "prefill-tiled-f32-softcap-gptj": lambda: values_variant(
        SMALL_TILED, dict(num_qo_heads=6, num_kv_heads=2, head_dim=32, page_size=8,
                          dtype="float32", softcap=20.0, rope_scaling={"rope_type": "gptj"},
                          rotary_dim=16), [0, 10], [3, 5], rope=True),
    "prefill-tiled-f32-norope": lambda: values_variant(
        SMALL_TILED, dict(SMALL, dtype="float32"), [6, 1], [5, 2]),
    # values of another width than the keys (a byte pool)
    "prefill-rows-widths-f16": lambda: values_variant(
        "generic-cpu", dict(SMALL, head_dim=32, head_dim_v=16, dtype="float16"), [5, 0],
        [3, 6]),
    "prefill-tiled-widths-f32": lambda: values_variant(
        SMALL_TILED, dict(SMALL, head_dim_v=24, dtype="float32"), [6, 1], [5, 2]),
    # values read from the key rows (pages of key regions only)
    "prefill-rows-latent-q4": lambda: values_variant(
        "generic-cpu", dict(SMALL, head_dim=64, head_dim_v=32, dtype="float32",
                            k_format="q4_0", value_in_key=True), [5, 0], [3, 6]),
    "prefill-tiled-latent-f16": lambda: values_variant(
        SMALL_TILED, dict(SMALL, head_dim_v=8, dtype="float16", value_in_key=True), [6, 1],
        [5, 2]),
    "prefill-mask-rows": lambda: mask_variant("generic-cpu"),
    "prefill-mask-tiled": lambda: mask_variant(SMALL_TILED),
    "prefill-rows-f32-learned-sinks": lambda: values_variant(
        "generic-cpu", dict(SMALL, dtype="float32"), [6, 0], [5, 2], sink_logits=True),
    "prefill-tiled-f16-learned-sinks": lambda: values_variant(
        SMALL_TILED, dict(SMALL, dtype="float16"), [6, 0], [5, 2], sink_logits=True),
    "prefill-adversarial-rows": lambda: adversarial_variant("generic-cpu"),
    "prefill-adversarial-tiled": lambda: adversarial_variant(SMALL_TILED),
    "prefill-adversarial-rows-norope": lambda: adversarial_variant("generic-cpu", rope=False),
    "prefill-adversarial-tiled-norope": lambda: adversarial_variant(SMALL_TILED, rope=False),
}
#: without RoPE (sincos on a private pointer stops Oclgrind's uninitialised-value plugin)
PREFILL_NO_ROPE = ("prefill-rows-vec1-f16-softcap", "prefill-rows-vec16-f16-window",
                   "prefill-tiled-f32-norope", "prefill-rows-widths-f16",
                   "prefill-tiled-widths-f32", "prefill-rows-latent-q4",
                   "prefill-tiled-latent-f16", "prefill-mask-rows", "prefill-mask-tiled",
                   "prefill-rows-f32-learned-sinks", "prefill-tiled-f16-learned-sinks",
                   "prefill-adversarial-rows-norope", "prefill-adversarial-tiled-norope")
