"""Run one clattn kernel variant on the Oclgrind simulator (used by test_oclgrind.py).

    python tests/oclgrind_runner.py VARIANT

Oclgrind prints what it detects (invalid memory accesses, data races, barrier divergence,
uninitialised values, API errors) on this process's stderr; test_oclgrind.py runs each
variant in a fresh process with the checks switched on through the environment and
fails on any report. This script checks the numbers itself and exits non-zero on a
mismatch; it prints ``CLATTN-OCLGRIND-OK <variant>`` on stdout when everything matched.

Shapes are tiny (B <= 3, lengths <= 40, head_dim 16/32, page_size 4/8): the simulator
interprets every work-item.
"""
from __future__ import annotations

import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.dirname(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
          "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}


def _cl():
    import pyopencl as cl
    import pyopencl.array  # noqa: F401

    import clattn  # noqa: F401  (ICD set-up before pyopencl looks for platforms)
    return cl


def _device():
    from clattn import runtime
    dev = runtime.select_device("oclgrind")
    assert runtime.is_simulator(dev), dev
    return dev


def _spec(**kw):
    import clattn
    return clattn.AttentionSpec(**kw)


def _decoder(spec, profile):
    import clattn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # fitting notes (no fp16 / no sub-groups) are expected
        dec = clattn.BatchDecode(spec, _device(), backend="opencl", profile=profile)
    print(f"fold_merge: {dec.profile.fold_merge}", flush=True)  # test_oclgrind.FOLD_MARK
    return dec


def _check(dec, sc, case, *, what, **call):
    from cases import compare, decode_args, oracle
    args, kw = decode_args(case)
    lib = {k: call.pop(k) for k in ("split", "plan") if k in call}
    res = dec.run(*args, **kw, **call, **lib)
    compare(res.out, res.lse, *oracle(sc, case, **call), dec.spec.dtype, what=f"{what}: ")
    return res


def learned_sinks(H):
    """Learned attention sinks of every kind: random, one that outweighs the rows (+30) and
    none (-inf) on the last head."""
    s = np.random.default_rng(5).standard_normal(H).astype(np.float32) * 2
    s[0], s[-1] = 30.0, -np.inf
    return s


# ------------------------------------------------------------------------------ decode variants
def decode_variant(profile, spec_kw, lengths, *, window=None, sinks=None, rope=False,
                   splits=(False,), theta=10000.0, seed=0, sink_logits=False,
                   expect_vec=None, expect_gdz=None):
    from cases import make_case, spec_scenario
    spec_kw = dict(spec_kw)
    sc = spec_scenario("variant", spec_kw.pop("num_qo_heads"), spec_kw.pop("num_kv_heads"),
                       spec_kw.pop("head_dim"), **spec_kw)
    spec = sc.spec
    dec = _decoder(spec, profile)
    print(f"geometry: {dec.geometry}", flush=True)
    assert expect_vec in (None, dec.geometry.vec), dec.geometry
    assert expect_gdz in (None, dec.geometry.gdz), dec.geometry
    case = make_case(spec, lengths, seed=seed, window=window, sinks=sinks, rope=rope,
                     poison=False)
    if spec.sliding_window and window is None:
        case.update(window_offset=np.zeros(len(lengths), np.int32),
                    sink_size=np.zeros(len(lengths), np.int32))
    call = dict(rotary_mode=1, rope_theta=theta) if rope else {}
    if sink_logits:
        call["sink_logits"] = learned_sinks(spec.num_qo_heads)
    for split in splits:
        _check(dec, sc, case, what=f"split={split}", split=split, **call)


def merge_variant(profile, dtype, D=16):
    from cases import compare, merge_cases
    from naive import naive_merge, naive_merge_k

    import clattn
    cl = _cl()
    dev = _device()
    rng = np.random.default_rng(1)
    N, H, K = 5, 3, 3
    (v, s, vo, so), (vk, sk) = merge_cases(rng, N, H, D, dtype, K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = v.copy(), s.copy()
        clattn.merge_state_(a, b, vo, so, device=dev, profile=profile)
        compare(a, b, *naive_merge(v, s, vo, so), dtype, what="merge_state_: ")
        out, lse = clattn.merge_states(vk, sk, device=dev, profile=profile)
        compare(out, lse, *naive_merge_k(vk, sk), dtype, what="merge_states: ")
        # device arrays that are views (non-zero offsets)
        from clattn import runtime
        queue = runtime.Runtime.for_device(dev).queue
        big_v = cl.array.to_device(queue, np.concatenate([v[:1], v]))
        big_s = cl.array.to_device(queue, np.concatenate([s[:1], s]))
        dvo = cl.array.to_device(queue, vo)
        dso = cl.array.to_device(queue, so)
        dv, ds = big_v[1:], big_s[1:]
        clattn.merge_state_(dv, ds, dvo, dso, profile=profile)
        compare(dv.get(), ds.get(), *naive_merge(v, s, vo, so), dtype, what="merge views: ")


def growing_workspace_variant(profile):
    """One decoder given split plans that need more workspace states each time (4, 16,
    28): ``BatchDecode.run``'s workspace must grow to hold every partition of the later
    plans (a write past a buffer is an Oclgrind report)."""
    from cases import make_case, spec_scenario
    sc = spec_scenario("growing", 2, 1, 16, page_size=4, dtype="float32")
    dec = _decoder(sc.spec, profile)
    print(f"geometry: {dec.geometry}", flush=True)
    for lengths in ([13], [9, 30, 17], [40, 33, 5, 28]):
        case = make_case(sc.spec, lengths, seed=len(lengths), extra_pages=0)
        plan = dec.plan(case["page_indptr"], case["last_page_len"], split=4)
        print(f"{lengths}: {plan}", flush=True)
        _check(dec, sc, case, what=f"run {lengths}", plan=plan)

# ------------------------------------------------------------------------------ adversarial
def adversarial_variant(profile, dtype="float32", rope=True):
    """Garbage page tables as device arrays (no host value checks): the kernel must clamp.

    Only memory safety is checked here (Oclgrind reports) plus: no NaN, lse finite or -inf.
    """
    from cases import make_case
    cl = _cl()
    spec = _spec(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype=dtype,
                 sliding_window=True, rope_scaling=LLAMA3 if rope else None,
                 max_position_embeddings=131072)
    dec = _decoder(spec, profile)
    print(f"geometry: {dec.geometry}", flush=True)
    B = 3
    good = make_case(spec, [9, 13, 5], seed=3, window=[2, 0, 1], sinks=[1, 0, 0], rope=True)
    queue = dec.setup.runtime.queue
    P = good["pages"].shape[0]
    d = lambda a: cl.array.to_device(queue, np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    q = cl.array.to_device(queue, good["q"])
    pages = cl.array.to_device(queue, good["pages"])
    # a valid plan from the good host tables, reused with garbage device tables
    plan = dec.plan(good["page_indptr"], good["last_page_len"],
                    window_offset=good["window_offset"], sink_size=good["sink_size"], split=4)
    assert plan.split
    nnz = len(good["page_indices"])
    bad_tables = {
        "indices out of range / negative": dict(
            page_indices=np.array([P + 5, -3, 2**31 - 1, -2**31, P, 1, 0, P - 1][:nnz]
                                  + [0] * max(0, nnz - 8))),
        "indptr decreasing / beyond nnz / negative": dict(
            page_indptr=np.array([0, nnz + 10, 1, -5])),
        "indptr huge": dict(page_indptr=np.array([-2**31, 2**31 - 1, 0, 2**31 - 1])),
        "last_page_len 0 / > page_size / negative": dict(
            last_page_len=np.array([0, spec.page_size + 3, -7])),
        "last_page_len huge": dict(last_page_len=np.array([2**31 - 1, -2**31, 0])),
        "window_offset > stored, sinks > window": dict(
            window_offset=np.array([100, 2**31 - 1, 6]), sink_size=np.array([200, 1, 9])),
        "window / sinks negative": dict(
            window_offset=np.array([-5, -2**31, 0]), sink_size=np.array([-1, -2**31, -3])),
        "q_pos / k_pos_offset extreme": dict(
            q_pos=np.array([2**31 - 1, -2**31, -1]),
            k_pos_offset=np.array([2**31 - 64, -2**31, 7])),
    }
    for what, override in bad_tables.items():
        tables = {k: good[k] for k in ("page_indptr", "page_indices", "last_page_len",
                                       "window_offset", "sink_size", "q_pos", "k_pos_offset")}
        tables.update(override)
        dt = {k: d(v) for k, v in tables.items()}
        for run_plan in (None, plan):
            res = dec.run(q, pages, dt["page_indptr"], dt["page_indices"], dt["last_page_len"],
                          window_offset=dt["window_offset"], sink_size=dt["sink_size"],
                          q_pos=dt["q_pos"], k_pos_offset=dt["k_pos_offset"],
                          rotary_mode=1 if rope else 0, plan=run_plan)
            out, lse = res.out.get(), res.lse.get()
            tag = f"{what} ({'split plan' if run_plan is not None else 'no split'})"
            assert out.shape == (B, 4, 16) and lse.shape == (B, 4), tag
            assert not np.isnan(out.astype(np.float32)).any(), f"{tag}: NaN in out"
            assert not np.isnan(lse).any() and not np.isposinf(lse).any(), f"{tag}: bad lse {lse}"
            print(f"adversarial ok: {tag}", flush=True)
    # packed length_info [3, B] as a device view, garbage too
    li = np.array([[0, 99, -1], [50, -50, 3], [60, 0, -9]], np.int32)
    big = d(np.concatenate([[7, 7], li.ravel()]))
    res = dec.run(q, pages, d(good["page_indptr"]), d(good["page_indices"]),
                  length_info=big[2:].reshape(3, B))
    assert not np.isnan(res.out.get().astype(np.float32)).any()


def _native_width(width: int, run):
    """``run()`` with the rows decode's vector floor (clattn.fit.ROWS_MIN_NATIVE_VEC) at
    ``width``: the fit then keeps a profile's ``vec`` up to it on this simulator, whose
    native float width is 1 (each variant runs in a process of its own)."""
    from clattn import fit
    fit.ROWS_MIN_NATIVE_VEC = width
    return run()


# ------------------------------------------------------------------------------ the variants
SMALL_WIN = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4, sliding_window=True,
                 rope_scaling=LLAMA3, max_position_embeddings=131072)
#: the generic GPU profile with 32 threads per work-group (the simulator is slow); the
#: split merge folded into the decode launch (its default)
SMALL_TILED = {"strategy": "tiled", "thread_limit": 32, "fold_merge": True}
#: the CPU profile with the split merge folded into the decode launch (off by default)
ROWS_FOLD = {"strategy": "rows", "vec": 8, "tile_rows": 16, "fold_merge": True}
VARIANTS = {
    # CPU-style: one work-item per (sequence, KV head, partition)
    "rows-f32-split": lambda: decode_variant(
        "generic-cpu", dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                            dtype="float32"), [0, 1, 13], splits=(False, 4)),
    "rows-f16-window-rope-softcap": lambda: decode_variant(
        "pocl-cpu", dict(num_qo_heads=4, num_kv_heads=1, head_dim=32, page_size=8,
                         dtype="float16", sliding_window=True, rope_scaling=LLAMA3,
                         max_position_embeddings=131072, softcap=20.0),
        [17, 0, 40], window=[9, 0, 16], sinks=[2, 0, 16], rope=True, splits=(False, 8)),
    # learned attention sinks: the decode kernel's direct epilogue and the split merge's
    "rows-f32-split-learned-sinks": lambda: decode_variant(
        "generic-cpu", dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                            dtype="float32"), [0, 1, 13], splits=(False, 4), sink_logits=True),
    "tiled-f16-split-learned-sinks": lambda: decode_variant(
        SMALL_TILED, dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                          dtype="float16"), [9, 0, 5], splits=(False, 4), sink_logits=True),
    # the split merge folded into the decode launch: the last partition of a sequence to
    # finish merges (a counter per sequence and KV head, or head slice)
    "rows-fold-f32-split-learned-sinks": lambda: decode_variant(
        ROWS_FOLD, dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                        dtype="float32"), [0, 1, 13, 9], splits=(False, 4, 4),
        sink_logits=True),
    "rows-fold-f16-window-rope": lambda: decode_variant(
        ROWS_FOLD, dict(num_qo_heads=4, num_kv_heads=1, head_dim=32, page_size=8,
                        dtype="float16", sliding_window=True, rope_scaling=LLAMA3,
                        max_position_embeddings=131072),
        [17, 0, 40], window=[9, 0, 16], sinks=[2, 0, 16], rope=True, splits=(8, 16)),
    "tiled-separate-f16-split-learned-sinks": lambda: decode_variant(
        dict(SMALL_TILED, fold_merge=False), dict(num_qo_heads=4, num_kv_heads=2,
                                                  head_dim=16, page_size=4, dtype="float16"),
        [9, 0, 5], splits=(False, 4), sink_logits=True),
    # 16-float vectors: a block's 16 row sums by whole-vector shuffles (a device whose
    # native width is 16 gets them; the simulator reports 1, so the fit's floor is lifted)
    "rows-vec16-f16-split": lambda: _native_width(16, lambda: decode_variant(
        {"strategy": "rows", "vec": 16, "tile_rows": 16}, dict(
            num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=4, dtype="float16"),
        [0, 1, 37], splits=(False, 8), expect_vec=16)),
    # head slices (clattn.fit.rows_head_slices): 17 heads per KV head at 8-float vectors
    # are cut 9 + 8 (the second slice's padded head stores nothing), each slice folding
    # on its own counter; 16 heads of a latent row in two even slices, merged apart
    "rows-fold-head-slices-f16-split-learned-sinks": lambda: decode_variant(
        ROWS_FOLD, dict(num_qo_heads=34, num_kv_heads=2, head_dim=16, page_size=4,
                        dtype="float16"), [0, 1, 13, 9], splits=(False, 4),
        sink_logits=True, expect_gdz=2),
    "rows-head-slices-latent-q4-split": lambda: decode_variant(
        {"strategy": "rows", "vec": 8, "tile_rows": 8}, dict(
            num_qo_heads=16, num_kv_heads=1, head_dim=64, head_dim_v=32, page_size=4,
            dtype="float32", k_format="q4_0", value_in_key=True), [13, 0, 6],
        splits=(False, 4), expect_gdz=2),
    "rows-vec1-f16": lambda: decode_variant(
        {"strategy": "rows", "vec": 1}, dict(num_qo_heads=2, num_kv_heads=1, head_dim=16,
                                             page_size=4, dtype="float16"),
        [6, 11], splits=(False, 4)),
    # GPU-style work-groups: local-memory reduction (the tiled kernel keeps K/V in
    # registers for all the heads of a work-item)
    "tiled-local-f16-window-rope-split": lambda: decode_variant(
        "generic", dict(SMALL_WIN, dtype="float16"), [23, 0, 9], window=[5, 0, 8],
        sinks=[2, 0, 1], rope=True, splits=(False, 4)),
    "tiled-local-f32-g1-tile2": lambda: decode_variant(
        {"strategy": "tiled", "tile_rows": 2, "thread_limit": 64},
        dict(num_qo_heads=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32"),
        [1, 19], splits=(False, 8)),
    # the Mali profile (8 rows per slice and step), soft-cap, GPT-J partial RoPE
    "tiled-global-f32-softcap-gptj": lambda: decode_variant(
        "mali", dict(num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                     dtype="float32", softcap=20.0, rope_scaling={"rope_type": "gptj"},
                     rotary_dim=16), [0, 30, 7], rope=True, splits=(False, 8)),
    # a sub-group profile on a device without sub-groups: local fallback; G=1, tile 2, f16
    "tiled-subgroup-fallback-f16": lambda: decode_variant(
        "intel-gpu", dict(num_qo_heads=2, num_kv_heads=2, head_dim=32, page_size=4,
                          dtype="float16", sliding_window=True), [14, 3],
        window=[4, 0], sinks=[1, 0], splits=(False, 4)),
    "tiled-vec1-f32-window": lambda: decode_variant(
        {"strategy": "tiled", "vec": 1, "thread_limit": 64},
        dict(SMALL_WIN, dtype="float32"), [10, 3], window=[3, 0], sinks=[1, 0],
        rope=True, splits=(False, 4)),
    # one decoder, split plans needing more workspace than its first (not in NO_ROPE:
    # once the workspace has been replaced by a larger one, Oclgrind 21.10's
    # uninitialised-value plugin flags the merge's stores of the next split runs, although
    # every workspace state they read was written: the results match the oracle when the
    # workspace is filled with NaN before each run)
    "rows-growing-split-workspace": lambda: growing_workspace_variant("generic-cpu"),
    "tiled-growing-split-workspace": lambda: growing_workspace_variant(SMALL_TILED),
    # values of another width than the keys (a byte pool): narrower, split and folded; wider,
    # in three V chunks per lane of the tiled kernel (the last one ragged)
    "rows-fold-widths-f32-split": lambda: decode_variant(
        ROWS_FOLD, dict(num_qo_heads=4, num_kv_heads=2, head_dim=32, head_dim_v=16,
                        page_size=4, dtype="float32"), [0, 1, 13], splits=(False, 4)),
    "tiled-widths-f16-split": lambda: decode_variant(
        dict(SMALL_TILED, vec=1), dict(num_qo_heads=4, num_kv_heads=2, head_dim=16,
                                       head_dim_v=40, page_size=4, dtype="float16"),
        [9, 0, 5], splits=(False, 4)),
    # values read from the key rows (MLA's absorbed form: pages of key regions only),
    # split and folded; quantized keys, windows and sinks
    "rows-fold-latent-q8-window-split": lambda: decode_variant(
        ROWS_FOLD, dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, head_dim_v=32,
                        page_size=4, dtype="float32", k_format="q8_0", sliding_window=True,
                        value_in_key=True), [13, 0, 6], window=[6, 0, 0], sinks=[1, 0, 0],
        splits=(False, 4)),
    "tiled-latent-f16-split": lambda: decode_variant(
        dict(SMALL_TILED, vec=1), dict(num_qo_heads=4, num_kv_heads=1, head_dim=24,
                                       head_dim_v=16, page_size=4, dtype="float16",
                                       value_in_key=True), [9, 0, 5], splits=(False, 4)),
    # merges alone
    "merge-rows-f32": lambda: merge_variant("generic-cpu", "float32"),
    "merge-rows-f16": lambda: merge_variant("generic-cpu", "float16"),
    "merge-tiled-f32": lambda: merge_variant("generic", "float32"),
    "merge-tiled-f16": lambda: merge_variant("generic", "float16", D=32),
    # garbage device tables: clamped, never out of bounds
    "adversarial-rows": lambda: adversarial_variant("generic-cpu"),
    "adversarial-rows-fold": lambda: adversarial_variant(ROWS_FOLD),
    "adversarial-tiled-local": lambda: adversarial_variant(SMALL_TILED, "float16"),
    "adversarial-tiled-f32": lambda: adversarial_variant(SMALL_TILED),
    # the same without RoPE, so that Oclgrind's uninitialised-value checker can run on them
    "adversarial-rows-norope": lambda: adversarial_variant("generic-cpu", rope=False),
    "adversarial-rows-fold-norope": lambda: adversarial_variant(ROWS_FOLD, rope=False),
    "adversarial-tiled-local-norope": lambda: adversarial_variant(SMALL_TILED, rope=False),
}

#: variants without RoPE: Oclgrind's uninitialised-value plugin aborts on sincos() with a
#: private pointer ("Work item needed to access private memory!"), so only these run with it
NO_ROPE = ("rows-f32-split", "rows-f32-split-learned-sinks", "tiled-f16-split-learned-sinks",
           "rows-fold-f32-split-learned-sinks", "tiled-separate-f16-split-learned-sinks",
           "adversarial-rows-fold-norope", "rows-vec16-f16-split",
           "rows-fold-head-slices-f16-split-learned-sinks", "rows-head-slices-latent-q4-split",
           "rows-vec1-f16", "tiled-local-f32-g1-tile2", "rows-fold-widths-f32-split",
           "tiled-widths-f16-split", "rows-fold-latent-q8-window-split", "tiled-latent-f16-split",
           "tiled-subgroup-fallback-f16", "merge-rows-f32", "merge-rows-f16", "merge-tiled-f32",
           "merge-tiled-f16", "adversarial-rows-norope", "adversarial-tiled-local-norope")


from oclgrind_prefill import PREFILL_NO_ROPE, PREFILL_VARIANTS  # noqa: E402  (prefill kernels)

VARIANTS.update(PREFILL_VARIANTS)
NO_ROPE += PREFILL_NO_ROPE


# ------------------------------------------------------------------------------ self-tests
BROKEN = """
__kernel void oob(__global const float* a, __global float* b)
{ const int i = get_global_id(0); b[i] = a[i + 1]; }            /* a[4]: one past the end */
__kernel void race(__global float* b)
{ __local float t[4]; const int l = get_local_id(0);
  t[l] = (float)l;                                               /* no barrier before ... */
  b[get_global_id(0)] = t[(l + 1) % 4]; }                        /* ... reading a neighbour's */
__kernel void last_block(__global float* slots, volatile __global int* count,
                         __global float* sum)
{ const int g = get_group_id(0);
  slots[g] = (float)(g + 1);                                     /* each group's store */
  mem_fence(CLK_GLOBAL_MEM_FENCE);
  if (atomic_inc(count) == (int)get_num_groups(0) - 1) {         /* the last to count in */
    mem_fence(CLK_GLOBAL_MEM_FENCE);
    float t = 0.0f;
    for (int i = 0; i < (int)get_num_groups(0); ++i) t += slots[i];
    sum[0] = t; } }
__kernel void uninit(__global float* b)
{ float x[4]; const int i = get_global_id(0);
  if (x[i % 4] > 0.0f) b[i] = 1.0f; }                           /* branch on garbage */
"""


def selftest(kind: str) -> None:
    """Launch a deliberately broken kernel: the harness must see Oclgrind's report."""
    from clattn import runtime
    cl = _cl()
    rt = runtime.Runtime.for_device(_device())
    prg = cl.Program(rt.context, BROKEN).build()
    a = cl.array.to_device(rt.queue, np.arange(4, dtype=np.float32))
    b = cl.array.zeros(rt.queue, 4, np.float32)
    if kind == "oob":
        prg.oob(rt.queue, (4,), (4,), a.data, b.data)
    elif kind == "last-block":
        count = cl.array.zeros(rt.queue, 1, np.int32)
        prg.last_block(rt.queue, (4,), (1,), b.data, count.data, a.data)
        assert a.get()[0] == 10.0 and count.get()[0] == 4, (a.get(), count.get())
    elif kind == "race":
        prg.race(rt.queue, (4,), (4,), b.data)
    else:
        prg.uninit(rt.queue, (4,), (4,), b.data)
    rt.queue.finish()


SELFTESTS = {"selftest-oob": lambda: selftest("oob"), "selftest-race": lambda: selftest("race"),
             "selftest-uninit": lambda: selftest("uninit"),
             "selftest-last-block": lambda: selftest("last-block")}


def main(argv: list[str]) -> int:
    table = {**VARIANTS, **SELFTESTS}
    if len(argv) != 2 or argv[1] not in table:
        print(f"usage: {argv[0]} VARIANT; variants: {', '.join(table)}", file=sys.stderr)
        return 2
    table[argv[1]]()
    print(f"CLATTN-OCLGRIND-OK {argv[1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
