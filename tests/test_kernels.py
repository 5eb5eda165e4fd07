"""Decode scenarios on every backend, and the OpenCL-only behaviour, against the float64 oracle.

The matrix tests take the ``target`` fixture (conftest): clattn's CPU backend, each OpenCL
device with its own profile (the ``rows`` kernel on the CPU drivers CI has) and each device
running the GPU (``tiled``) kernel through a GPU profile. Decoders come from the session
cache (``get_decoder``): one kernel build serves every case of one scenario, since lengths,
windows, RoPE scalars, sm_scale, split and the batch size are run-time values. The
scenarios are few and chosen so that together they cover group sizes 1/4/7/8, head_dim
64/80/96/128/256, page sizes 1/16/64/128, every RoPE scaling type, soft-capping and the
sliding window, in both f16 and f32; real models are built from their raw HF configs and
the oracle reads the same configs itself (``hf_oracle``).

Tolerances are those of ``cases.TOLERANCE`` (f32 rounding scaled by the sizes of each
computation; f16 out correctly rounded), RoPE at large positions included: the kernels
split each angle into whole turns and a remainder, so f32 angles stay exact there.
"""
from __future__ import annotations

import numpy as np
import pytest
from cases import compare, config_scenario, decode_args, lse_bound, make_case, oracle, spec_scenario
from model_configs import load_models, model
from naive import naive_decode, naive_merge, naive_merge_k

import clattn
from clattn.models import MODEL_SHAPES as TABLE

cl = pytest.importorskip("pyopencl")
import pyopencl.array as cla  # noqa: E402

F16, F32 = "float16", "float32"
DTYPES = [F32, F16]
NEG = -np.inf
LLAMA32_ROPE = model("Llama-3.2-1B")["rope_scaling"]   # a complete llama3 dict

# ---------------------------------------------------------------------------- scenarios
#: the small all-features scenario: group 4, D 64, sliding window, Llama-3 RoPE
WIN = {dt: spec_scenario(f"win-{dt}", 8, 2, 64, page_size=16, dtype=dt, sliding_window=True,
                         rope_scaling=LLAMA32_ROPE, max_position_embeddings=131072)
       for dt in DTYPES}

#: real models, full size, from their raw configs
MODEL_SHAPES = {  # name in tests/data/models.json -> (H_qo, H_kv, D, softcap) it must give
    m.config: (m.num_qo_heads, m.num_kv_heads, m.head_dim, m.softcap) for m in TABLE}
MODELS = {(name, dt): config_scenario(f"{name}-{dt}", model(name), dtype=dt)
          for name in MODEL_SHAPES for dt in DTYPES}

#: group size / head_dim / page size coverage (one dtype each; both dtypes overall)
SHAPES = {
    "g8-d80-ps1-win": spec_scenario("g8-d80-ps1-win", 16, 2, 80, page_size=1, dtype=F32,
                                    sliding_window=True),
    "g8-d64-ps64": spec_scenario("g8-d64-ps64", 8, 1, 64, page_size=64, dtype=F16),
    "g1-d128-ps128-win": spec_scenario("g1-d128-ps128-win", 4, 4, 128, page_size=128,
                                       dtype=F32, sliding_window=True),
    "g7-d96-ps16": spec_scenario("g7-d96-ps16", 7, 1, 96, page_size=16, dtype=F16, softcap=30.0),
}

#: one scenario per RoPE type, from a real config (heads shrunk) where one exists
_LLAMA4 = dict(model("Llama-3.1-8B")["rope_scaling"], rope_type="llama4")
ROPE = {
    "llama3": lambda dt: MODELS["Llama-3.2-1B", dt],
    "default": lambda dt: MODELS["Qwen2.5-0.5B", dt],
    "yarn": lambda dt: config_scenario("gpt-oss", model("gpt-oss-20b"), heads=(8, 1), dtype=dt,
                                       sliding_window=False),
    "longrope": lambda dt: config_scenario("phi3.5", model("Phi-3.5-mini"), heads=(4, 4),
                                           dtype=dt, sliding_window=False),
    "gptj": lambda dt: config_scenario("gptj", model("GPT-J-6B"), heads=(4, 4), dtype=dt),
    "linear": lambda dt: config_scenario("gemma3", model("Gemma-3-4B"), heads=(8, 4), dtype=dt,
                                         sliding_window=False),
    "llama4": lambda dt: spec_scenario("llama4", 4, 2, 128, page_size=16, dtype=dt,
                                       rope_scaling=_LLAMA4, max_position_embeddings=131072),
    # half the dims rotate, paired (i, i + 16) (partial_rotary_factor, as Phi-2 and StableLM)
    "partial": lambda dt: config_scenario("partial", dict(model("Qwen2.5-0.5B"),
                                                          partial_rotary_factor=0.5),
                                          heads=(4, 2), dtype=dt),
}
# RoPE types whose extra scenarios run in f32 only (llama3/default run in both via MODELS)
ROPE_PARAMS = [(k, F32) for k in ROPE] + [("llama3", F16), ("default", F16)]


# ---------------------------------------------------------------------------- helpers
def host(a):
    return a if a is None or isinstance(a, np.ndarray) else a.get()


def run_case(dec, sc, case, *, lib=None, **call):
    """``dec.run`` on a case (numpy in, numpy out); ``lib``: library-only keywords."""
    args, kw = decode_args(case)
    return dec.run(*args, **kw, **dict(sc.call, **call), **(lib or {}))


def check(dec, sc, case, *, what="", ref=None, lib=None, **call):
    """Run on the target and compare with the oracle; returns (result, reference)."""
    res = run_case(dec, sc, case, lib=lib, **call)
    if ref is None:
        ref = oracle(sc, case, **call)
    compare(res.out, res.lse, *ref, sc.spec.dtype, what=f"{sc}: {what}")
    return res, ref


def assert_same(a, b, what=""):
    """Bitwise equality of two (out, lse) pairs."""
    np.testing.assert_array_equal(host(a[0]), host(b[0]), err_msg=f"{what}out differs")
    np.testing.assert_array_equal(host(a[1]), host(b[1]), err_msg=f"{what}lse differs")


def window_case(spec, lengths, window, sinks, **kw):
    return make_case(spec, lengths, window=list(window), sinks=list(sinks), **kw)


def plain_case(spec, lengths, **kw):
    """A case without a window; windowed specs get window_offset = sink_size = 0."""
    if spec.sliding_window:
        return make_case(spec, lengths, window=0, sinks=0, **kw)
    return make_case(spec, lengths, **kw)


# a batch of 16 with empty, one-token and page-boundary sequences (page_size 16)
B16_LENGTHS = [0, 1, 15, 16, 17, 31, 32, 33, 47, 64, 5, 100, 2, 0, 48, 9]


# ---------------------------------------------------------------------------- real models
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MODEL_SHAPES))
def test_model_shapes(target, get_decoder, name, dtype):
    sc = MODELS[name, dtype]
    spec = sc.spec
    assert (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
            spec.softcap) == MODEL_SHAPES[name]
    dec = get_decoder(spec, target)
    check(dec, sc, plain_case(spec, B16_LENGTHS, seed=sum(map(ord, name))), what="B=16: ")
    # B = 1 and B = 3 with the same kernel
    check(dec, sc, plain_case(spec, [40], seed=3), what="B=1: ")
    check(dec, sc, plain_case(spec, [1, 0, 33], seed=4), what="B=3: ")
    if spec.sliding_window:
        case = window_case(spec, [50, 40, 17], window=[20, 40, 16], sinks=[4, 0, 16], seed=5)
        check(dec, sc, case, what="window: ")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma2_softcap_binds(target, get_decoder, dtype):
    """Scores large enough that Gemma-2's softcap of 50 changes the result."""
    sc = MODELS["Gemma-2-2B", dtype]
    dec = get_decoder(sc.spec, target)
    case = plain_case(sc.spec, [20, 5, 33], seed=6)
    case["q"] = (case["q"].astype(np.float32) * 8).astype(dtype)
    res, ref = check(dec, sc, case, what="softcap: ")
    nocap = naive_decode(*decode_args(case)[0], **decode_args(case)[1], **sc.call)
    assert np.abs(nocap[1] - res.lse).max() > 0.1, "the softcap did not bind"


# ---------------------------------------------------------------------------- shapes, pages
@pytest.mark.parametrize("key", list(SHAPES))
def test_group_head_dim_page_size(target, get_decoder, key):
    sc = SHAPES[key]
    spec = sc.spec
    ps = spec.page_size
    dec = get_decoder(spec, target)
    lengths = sorted({0, 1, 2, max(ps - 1, 1), ps, ps + 1, 2 * ps, 2 * ps + 1, 3 * ps - 1, 37})
    check(dec, sc, plain_case(spec, lengths, seed=ps))
    # poisoned pool: slots nobody owns (spare pages, tails of last pages) are NaN
    case = plain_case(spec, [ps + 1, 1, 0, 2 * ps - 1], seed=ps + 1, poison=True)
    check(dec, sc, case, what="poisoned: ")
    check(dec, sc, case, what="poisoned, split: ", lib=dict(split=max(ps, 2)))
    # unshuffled pool without spare pages
    case = plain_case(spec, [2 * ps, 3], seed=ps + 2, shuffle_pages=False, extra_pages=0)
    check(dec, sc, case, what="no spare: ")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3, 16])
def test_batch_sizes_and_sm_scale(target, get_decoder, B, dtype):
    sc = WIN[dtype]
    dec = get_decoder(sc.spec, target)
    rng = np.random.default_rng(B)
    lengths = [int(x) for x in rng.integers(0, 70, size=B)]
    if B > 1:
        lengths[0], lengths[1] = 0, 1
    case = plain_case(sc.spec, lengths, seed=B)
    check(dec, sc, case, what=f"B={B}: ")
    check(dec, sc, case, sm_scale=0.3, what=f"B={B} sm_scale=0.3: ")


def test_empty_batches(target, get_decoder):
    """Every sequence empty: out = 0 exactly, lse = -inf, never NaN; and B = 0."""
    for dtype in DTYPES:
        sc = WIN[dtype]
        dec = get_decoder(sc.spec, target)
        case = plain_case(sc.spec, [0, 0, 0], seed=7)
        res, _ = check(dec, sc, case)
        assert (res.out == 0).all() and np.isneginf(res.lse).all()
        for split in (False, 16, None):
            r = run_case(dec, sc, case, lib=dict(split=split))
            assert (r.out == 0).all() and np.isneginf(r.lse).all()
        res, _ = check(dec, sc, plain_case(sc.spec, [], seed=7), what="B=0: ")
        assert res.out.shape == (0, 8, 64) and res.lse.shape == (0, 8)


@pytest.mark.parametrize("dtype,scale", [(F32, 40.0), (F16, 12.0)])
def test_large_scores_stable(target, get_decoder, dtype, scale):
    """Scores in the hundreds (lse 200-1000): no overflow, lse within the f32 bound of
    scores that large (cases.TOLERANCE), not a relative tolerance on |lse|."""
    sc = WIN[dtype]
    dec = get_decoder(sc.spec, target)
    case = plain_case(sc.spec, [40, 3, 17], seed=8)
    case["q"] = (case["q"].astype(np.float32) * scale).astype(dtype)
    res, ref = check(dec, sc, case, sm_scale=1.0, what=f"x{scale}: ")
    assert np.abs(ref[1]).max() > 200


# ---------------------------------------------------------------------------- sliding window
def _window_limits(ps):
    """(lengths, window_offset, sink_size) hitting every limit of the window rule."""
    rows = [
        (0, 0, 0),                  # empty sequence
        (1, 0, 0),                  # one token, full
        (1, 1, 0),                  # one token, window past it: empty chunk
        (1, 1, 1),                  # one token kept as a sink
        (3 * ps, 0, 0),             # window = everything
        (3 * ps, 3 * ps, 0),        # window_offset == stored: nothing attended
        (3 * ps, 3 * ps, 3 * ps),   # everything is a sink
        (3 * ps, 3 * ps, 2),        # sinks only
        (3 * ps, ps, 1),            # window starts on a page boundary
        (3 * ps, ps - 1, ps - 1),   # sinks end just before the window; page boundary next
        (3 * ps + 1, 3 * ps, 0),    # one row, alone on the last page
        (2 * ps + 5, 2 * ps, ps),   # window on a boundary, sinks a whole page
        (2 * ps + 5, 7, 3),         # arbitrary
    ]
    lengths, wo, sk = zip(*rows)
    return list(lengths), list(wo), list(sk)


WINDOW_KEYS = {"win-f16": lambda: WIN[F16], "win-f32": lambda: WIN[F32],
               "g8-d80-ps1-win": lambda: SHAPES["g8-d80-ps1-win"],
               "g1-d128-ps128-win": lambda: SHAPES["g1-d128-ps128-win"],
               "gemma2-f16": lambda: MODELS["Gemma-2-2B", F16]}


@pytest.mark.parametrize("key", list(WINDOW_KEYS))
def test_sliding_window_limits(target, get_decoder, key):
    sc = WINDOW_KEYS[key]()
    dec = get_decoder(sc.spec, target)
    ps = sc.spec.page_size
    lengths, wo, sk = _window_limits(max(ps, 2))
    case = window_case(sc.spec, lengths, wo, sk, seed=9, poison=True)
    res, _ = check(dec, sc, case, what="limits: ")
    empty = case["rows"] == 0
    assert np.isneginf(res.lse[empty]).all() and (res.out[empty] == 0).all()
    # the packed length_info [3, B] gives the same bits
    args, _ = decode_args(case)
    packed = dec.run(*args[:4], length_info=case["length_info"], **sc.call)
    assert_same(res, packed, "length_info: ")


# ---------------------------------------------------------------------------- RoPE
def _rope_case(sc, key, seed):
    """Positions around 100000 (and small ones); longrope on both sides of its switch."""
    if key == "longrope":
        orig = model("Phi-3.5-mini")["original_max_position_embeddings"]
        return plain_case(sc.spec, [20, 20, 20, 20, 7], seed=seed, rope=True,
                          pos_offset=[40, orig - 25, orig - 24, 99_980, 5],
                          q_pos=[60, orig - 1, orig, 100_000, 99_999])
    return plain_case(sc.spec, [37, 0, 16, 1, 20], seed=seed, rope=True,
                      pos_offset=[99_963, 0, 7, 100_000, 1234],
                      q_pos=[100_000, 0, 23, 100_001, 1254])


@pytest.mark.parametrize("key,dtype", ROPE_PARAMS, ids=[f"{k}-{d}" for k, d in ROPE_PARAMS])
def test_rope_types_large_positions(target, get_decoder, key, dtype):
    sc = ROPE[key](dtype)
    dec = get_decoder(sc.spec, target)
    case = _rope_case(sc, key, seed=len(key))
    check(dec, sc, case, rotary_mode=1, what=f"{key} RoPE: ")
    if key == "longrope":
        # the switch is real: short factors only would give other results for q_pos >= orig
        args, kw = decode_args(case)
        short = sc.oracle["inv_freq_fn"](0)
        ref_short = naive_decode(*args, **kw, **dict(sc.oracle, inv_freq_fn=lambda p: short),
                                 **sc.call, rotary_mode=1)
        res = run_case(dec, sc, case, rotary_mode=1)
        assert np.abs(ref_short[1][2:4] - res.lse[2:4]).max() > 1e-3


def test_rope_gptj_pairs_adjacent_dims(target, get_decoder):
    """GPT-J rotates (2i, 2i+1) pairs of its first 64 dims: rotate-half pairing differs."""
    sc = ROPE["gptj"](F32)
    dec = get_decoder(sc.spec, target)
    case = make_case(sc.spec, [12], seed=47, rope=True, pos_offset=[30])
    res = run_case(dec, sc, case, rotary_mode=1)
    args, kw = decode_args(case)
    for wrong in (dict(sc.oracle, interleaved=False), dict(sc.oracle, rotary_dim=256,
                                                          inv_freq_fn=None)):
        other = naive_decode(*args, **kw, **wrong, **sc.call, rotary_mode=1)
        assert np.abs(other[1] - res.lse).max() > 1e-3


def test_rope_runtime_scalars_no_rebuild(device_target, get_decoder):
    """rope_theta / rope_scale / rotary_mode / sm_scale vary per call on one kernel."""
    for dtype in DTYPES:
        sc = WIN[dtype]
        dec = get_decoder(sc.spec, device_target)
        kernels = dec.opencl.decode_kernels()
        case = window_case(sc.spec, [45, 0, 17, 1], window=[10, 0, 16, 0], sinks=[3, 0, 1, 0],
                           seed=11, rope=True, pos_offset=[99_950, 0, 3, 100_000])
        for theta, scale, sm in ((500000.0, 1.0, None), (10000.0, 1.0, None),
                                 (10000.0, 0.5, 0.2), (1e6, 2.5, None),
                                 (500000.0, 1.0 / 3.0, 0.125)):
            check(dec, sc, case, rotary_mode=1, rope_theta=theta, rope_scale=scale, sm_scale=sm,
                  what=f"theta={theta} scale={scale}: ")
        check(dec, sc, case, rotary_mode=0, what="rotary_mode=0: ")
        assert dec.opencl.decode_kernels()[0] is kernels[0], "rebuilt"


# ---------------------------------------------------------------------------- split-KV
SPLIT_LENGTHS = [300, 0, 1, 17, 64, 129, 16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_vs_unsplit(target, get_decoder, dtype):
    sc = WIN[dtype]
    dec = get_decoder(sc.spec, target)
    case = window_case(sc.spec, SPLIT_LENGTHS, window=[40, 0, 0, 0, 16, 100, 0],
                       sinks=[4, 0, 0, 0, 1, 100, 0], seed=12, rope=True,
                       pos_offset=[99_000, 0, 5, 6, 7, 8, 9])
    ref = oracle(sc, case, rotary_mode=1)
    check(dec, sc, case, ref=ref, rotary_mode=1, lib=dict(split=False), what="unsplit: ")
    for split in (16, 32, 64, None):
        plan = dec.plan(case["page_indptr"], case["last_page_len"],
                        window_offset=case["window_offset"], sink_size=case["sink_size"],
                        split=split)
        if split in (16, 64) and not target.is_cpu:
            parts = np.diff(plan.part_indptr)
            assert plan.split and (parts == 1).any() and (parts > 1).any(), \
                f"split={split}: want a mixed batch, got {plan}"
        check(dec, sc, case, ref=ref, rotary_mode=1, lib=dict(split=split),
              what=f"split={split}: ")
        # the same plan, reused (as for every layer of a step)
        check(dec, sc, case, ref=ref, rotary_mode=1, lib=dict(plan=plan),
              what=f"plan reuse {split}: ")


def test_split_tiny_partitions_page_size_1(target, get_decoder):
    """page_size 1: partitions of a single row; every sequence split."""
    sc = SHAPES["g8-d80-ps1-win"]
    dec = get_decoder(sc.spec, target)
    case = window_case(sc.spec, [9, 2, 5], window=[3, 0, 5], sinks=[1, 0, 2], seed=13)
    ref = oracle(sc, case)
    for split in (1, 2, 3):
        check(dec, sc, case, ref=ref, lib=dict(split=split), what=f"split={split}: ")


def test_determinism(target, get_decoder):
    for dtype in DTYPES:
        sc = WIN[dtype]
        dec = get_decoder(sc.spec, target)
        case = window_case(sc.spec, SPLIT_LENGTHS, window=[40, 0, 0, 0, 16, 100, 0],
                           sinks=[4, 0, 0, 0, 1, 100, 0], seed=14, rope=True)
        for split in (False, 16, None):
            a = run_case(dec, sc, case, rotary_mode=1, lib=dict(split=split))
            b = run_case(dec, sc, case, rotary_mode=1, lib=dict(split=split))
            assert_same(a, b, f"{dtype} split={split}: ")


# ---------------------------------------------------------------------------- long contexts
_LONG: dict = {}


def _long(key, make):
    """A long case and its oracle, made once for every target: (case, reference)."""
    if key not in _LONG:
        _LONG[key] = make()
    return _LONG[key]


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context_32k(target, get_decoder, dtype):
    """32768 tokens (Qwen2.5-0.5B with RoPE): auto split, forced split and unsplit."""
    sc = MODELS["Qwen2.5-0.5B", dtype]
    dec = get_decoder(sc.spec, target)

    def make():
        case = make_case(sc.spec, [32768], seed=15, rope=True, pos_offset=[0])
        return case, oracle(sc, case, rotary_mode=1)

    case, ref = _long(("qwen32k", dtype), make)
    if not target.is_cpu:
        assert dec.plan(case["page_indptr"], case["last_page_len"]).split or \
            int(dec.setup.info.get("max_compute_units") or 1) * dec.profile.wgs_per_cu <= \
            sc.spec.num_kv_heads, "auto split expected for one sequence on this device"
    for split in (None, False, 4096):
        check(dec, sc, case, ref=ref, rotary_mode=1, lib=dict(split=split),
              what=f"32k split={split}: ")


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context_32k_window_sinks(target, get_decoder, dtype):
    """32768 stored tokens, a 4000-row window and 4 sinks: the lse check is tight enough
    that one window row less, or no sinks, would fail it (asserted on the oracle)."""
    sc = WIN[dtype]
    dec = get_decoder(sc.spec, target)
    wo, sinks = [32768 - 4000, 0], [4, 0]

    def make():
        case = window_case(sc.spec, [32768, 1000], window=wo, sinks=sinks, seed=16)
        ref = oracle(sc, case)
        args, kw = decode_args(case)
        bound = lse_bound(*ref)
        for what, w, s in (("one window row less", [wo[0] + 1, 0], sinks),
                           ("no sinks", wo, [0, 0])):
            alt = naive_decode(*args, **dict(kw, window_offset=np.array(w, np.int32),
                                             sink_size=np.array(s, np.int32)), **sc.oracle)
            assert (np.abs(alt[1][0] - ref[1][0]) > 3 * bound[0]).any(), \
                f"the check cannot see {what}"
        return case, ref

    case, ref = _long(("win32k", dtype), make)
    for split in (None, False, 2048):
        check(dec, sc, case, ref=ref, lib=dict(split=split), what=f"32k window split={split}: ")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context_128k_window_sinks(target, get_decoder, dtype):
    """131072 stored tokens, an 8192-row window, 4 sinks, RoPE at the far end (-m slow)."""
    sc = WIN[dtype]
    dec = get_decoder(sc.spec, target)
    n = 131072
    case, ref = _long(("win128k", dtype), lambda: (
        lambda c: (c, oracle(sc, c, rotary_mode=1)))(
            window_case(sc.spec, [n], window=[n - 8192], sinks=[4], seed=26, rope=True,
                        pos_offset=[0])))
    for split in (None, False):
        check(dec, sc, case, ref=ref, rotary_mode=1, lib=dict(split=split),
              what=f"128k split={split}: ")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [m["name"] for m in load_models()])
def test_every_model_full_size(target, get_decoder, name, dtype):
    """Every model of tests/data/models.json at full size, RoPE on (-m slow: a build each)."""
    sc = config_scenario(f"{name}-{dtype}", model(name), dtype=dtype)
    dec = get_decoder(sc.spec, target)
    case = plain_case(sc.spec, [0, 1, 33, 70], seed=27, rope=True,
                      pos_offset=[0, 5, 1000, 30000])
    check(dec, sc, case, rotary_mode=1, what="full size: ")


# ---------------------------------------------------------------------------- host / device I/O
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_out_and_lse_given(target, get_decoder, dtype):
    sc = WIN[dtype]
    dec = get_decoder(sc.spec, target)
    case = plain_case(sc.spec, [33, 0, 2], seed=17)
    ref = oracle(sc, case)
    out = np.full((3, 8, 64), 123, dtype=dtype)
    lse = np.full((3, 8), 123, dtype=np.float32)
    res = run_case(dec, sc, case, lib=dict(out=out, lse=lse))
    assert res.out is out and res.lse is lse
    compare(out, lse, *ref, dtype)
    out2 = np.empty_like(out)
    r = run_case(dec, sc, case, lib=dict(out=out2))
    assert r.out is out2 and isinstance(r.lse, np.ndarray) and r.lse.dtype == np.float32
    compare(*r[:2], *ref, dtype)
    lse2 = np.empty_like(lse)
    r = run_case(dec, sc, case, lib=dict(lse=lse2, split=16))
    assert r.lse is lse2 and r.out.dtype == np.dtype(dtype)
    compare(*r[:2], *ref, dtype)


def _pad_view(queue, a, pad=1, fill=0):
    """A device copy of ``a`` that starts ``pad`` rows into a larger buffer (a view)."""
    a = np.asarray(a)
    big = np.empty((a.shape[0] + pad,) + a.shape[1:], dtype=a.dtype)
    big[...] = fill
    big[pad:] = a
    d = cla.to_device(queue, big)
    v = d[pad:]
    assert v.offset > 0 and v.shape == a.shape
    return d, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_arrays_with_offset_views(device_target, get_decoder, cl_queue, dtype):
    sc = WIN[dtype]
    dec = get_decoder(sc.spec, device_target)
    queue = cl_queue(device_target.device)
    case = window_case(sc.spec, [37, 0, 16, 1, 70], window=[5, 0, 16, 1, 33], sinks=[2, 0, 3, 1, 0],
                       seed=18, rope=True, pos_offset=[99_000, 0, 1, 2, 3])
    ref = oracle(sc, case, rotary_mode=1)
    B, H, D = case["q"].shape
    nanf = np.nan
    _, q = _pad_view(queue, case["q"], 1, nanf)
    _, pages = _pad_view(queue, case["pages"], 2, nanf)    # the pool is a view 2 pages in
    tables = {k: _pad_view(queue, case[k], 3, -7)[1]
              for k in ("page_indptr", "page_indices", "last_page_len", "window_offset",
                        "sink_size", "q_pos", "k_pos_offset")}
    out_big, out = _pad_view(queue, np.zeros((B, H, D), dtype), 1, 99)
    lse_big, lse = _pad_view(queue, np.zeros((B, H), np.float32), 1, 99)
    res = dec.run(q, pages, tables["page_indptr"], tables["page_indices"],
                  tables["last_page_len"], window_offset=tables["window_offset"],
                  sink_size=tables["sink_size"], q_pos=tables["q_pos"],
                  k_pos_offset=tables["k_pos_offset"], rotary_mode=1, out=out, lse=lse)
    assert res.out is out and res.lse is lse, "the given device arrays are the results"
    assert res.event is not None
    res.event.wait()
    compare(out.get(), lse.get(), *ref, dtype, what="device views: ")
    assert (out_big.get()[0] == 99).all() and (lse_big.get()[0] == 99).all(), \
        "wrote before the view"
    # device arrays in, no out given -> device arrays out
    r2 = dec.run(q, pages, tables["page_indptr"], tables["page_indices"], tables["last_page_len"],
                 window_offset=tables["window_offset"], sink_size=tables["sink_size"],
                 q_pos=tables["q_pos"], k_pos_offset=tables["k_pos_offset"], rotary_mode=1)
    assert isinstance(r2.out, cla.Array) and isinstance(r2.lse, cla.Array)
    assert_same((r2.out, r2.lse), (out, lse), "fresh outputs: ")
    # packed length_info as a device view [3, B]
    li = cla.to_device(queue,
                       np.concatenate([[5, 5], case["length_info"].ravel()]).astype(np.int32))
    li = li[2:].reshape(3, B)
    r3 = dec.run(q, pages, tables["page_indptr"], tables["page_indices"], length_info=li,
                 q_pos=tables["q_pos"], k_pos_offset=tables["k_pos_offset"], rotary_mode=1)
    assert_same((r3.out, r3.lse), (out, lse), "length_info view: ")
    # split with device tables: a plan made from the host tables
    plan = dec.plan(case["page_indptr"], case["last_page_len"],
                    window_offset=case["window_offset"], sink_size=case["sink_size"], split=16)
    assert plan.split
    r4 = dec.run(q, pages, tables["page_indptr"], tables["page_indices"], tables["last_page_len"],
                 window_offset=tables["window_offset"], sink_size=tables["sink_size"],
                 q_pos=tables["q_pos"], k_pos_offset=tables["k_pos_offset"], rotary_mode=1,
                 plan=plan)
    compare(r4.out.get(), r4.lse.get(), *ref, dtype, what="device split plan: ")
    # numpy q with device pages is not mixed up: all-host gives the same bits
    args, kw = decode_args(case)
    r5 = dec.run(*args, **kw, rotary_mode=1)
    assert_same(r5, (out, lse), "host vs device: ")


def test_event_chaining(device, get_decoder, cl_queue):
    """wait_for and returned events order work across queues (and an out-of-order queue)."""
    dtype = "float32"
    sc = WIN[dtype]
    spec = sc.spec
    dec = get_decoder(spec, device)
    queue = cl_queue(device)
    ctx = queue.context
    case = window_case(spec, [50, 3, 20], window=[10, 0, 4], sinks=[2, 0, 1], seed=19)
    args, kw = decode_args(case)
    ref = oracle(sc, case)
    side = cl.CommandQueue(ctx)
    # q arrives through a non-blocking copy on another queue; the decode waits on its event
    qbuf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, case["q"].nbytes)
    big_host = np.ascontiguousarray(case["q"])
    up = cl.enqueue_copy(side, qbuf, big_host, is_blocking=False)
    q = cla.Array(queue, case["q"].shape, case["q"].dtype, data=qbuf)
    dev_tab = [cla.to_device(queue, a) for a in args[1:]]
    dkw = {k: cla.to_device(queue, v) for k, v in kw.items()}
    res = dec.run(q, *dev_tab, **dkw, wait_for=[up])
    assert isinstance(res.event, cl.Event)
    # chain a merge on the device outputs (events travel with the arrays)
    rng = np.random.default_rng(0)
    vo = rng.standard_normal(res.out.shape).astype(dtype)
    so = (rng.standard_normal(res.lse.shape) * 4).astype(np.float32)
    so[1] = NEG
    dvo, dso = cla.to_device(queue, vo), cla.to_device(queue, so)
    evt = clattn.merge_state_(res.out, res.lse, dvo, dso, wait_for=[res.event])
    assert evt is not None
    want_v, want_s = naive_merge(ref[0], ref[1], vo, so)
    compare(res.out.get(), res.lse.get(), want_v, want_s, dtype, what="decode->merge: ")
    # a second decode reads the first's output as its query, on another queue, via wait_for
    r2 = dec.run(res.out, *dev_tab, **dkw, queue=side, wait_for=[evt])
    r2.event.wait()
    case2 = dict(case, q=res.out.get())
    compare(r2.out.get(queue=side), r2.lse.get(queue=side), *oracle(sc, case2), dtype,
            what="chained decode: ")


def test_wait_for_of_another_context_is_refused_before_launch(device_target, get_decoder,
                                                              cl_queue):
    """An event of another OpenCL context in ``wait_for`` is a ValueError naming it before
    anything is launched (a driver would refuse the enqueue: docs/contract.md section
    10), on every public call taking ``wait_for``: BatchDecode.run (numpy and device
    operands), DecodeStep.run (numpy and device operands), BatchPrefill.run, merge_state_
    and merge_states; the caller's outputs keep their values."""
    from prefill_cases import prefill_case, run
    from test_prefill import ROPE_TYPES, get_prefill

    sc = WIN[F32]
    dec = get_decoder(sc.spec, device_target)
    queue = cl_queue(device_target.device)
    other_ctx = cl.Context([device_target.device])
    other = cl.UserEvent(other_ctx)
    other.set_status(cl.command_execution_status.COMPLETE)
    gate = [cl.UserEvent(queue.context), other]   # the first is fine, the second is not
    gate[0].set_status(cl.command_execution_status.COMPLETE)
    case = window_case(sc.spec, [50, 3], window=[10, 0], sinks=[2, 0], seed=19)
    args, kw = decode_args(case)
    dargs = [cla.to_device(queue, a) for a in args]
    dkw = {k: cla.to_device(queue, v) for k, v in kw.items()}
    out = np.full(case["q"].shape, 7, np.float32)
    dout = cla.to_device(queue, out)
    dlse = cla.to_device(queue, np.full(case["q"].shape[:2], 7, np.float32))
    step = dec.prepare(*args[2:], **kw, num_pages=len(case["pages"]))
    pre = get_prefill(ROPE_TYPES["yarn"].spec, device_target)
    pcase = prefill_case(pre.spec, [0], [3], seed=7)
    v, vo = (np.full((2, 3, 64), 7, np.float32) for _ in "ab")
    s, so = (np.zeros((2, 3), np.float32) for _ in "ab")
    calls = {
        "BatchDecode.run numpy": lambda: dec.run(*args, **kw, out=out, wait_for=gate),
        "BatchDecode.run device": lambda: dec.run(*dargs, **dkw, out=dout, lse=dlse,
                                                  wait_for=gate),
        "DecodeStep.run numpy": lambda: step.run(case["q"], case["pages"], out=out,
                                                 wait_for=gate),
        "DecodeStep.run device": lambda: step.run(dargs[0], dargs[1], out=dout, lse=dlse,
                                                  wait_for=gate),
        "BatchPrefill.run": lambda: run(pre, pcase, wait_for=gate),
        "merge_state_": lambda: clattn.merge_state_(v, s, vo, so, device=device_target.device,
                                                    wait_for=gate),
        "merge_states": lambda: clattn.merge_states(np.stack([v, vo], 1), np.stack([s, so], 1),
                                                    device=device_target.device,
                                                    wait_for=gate),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=r"wait_for\[1\]: an event of another OpenCL "
                                             r"context"):
            call()
        assert (out == 7).all() and (dout.get() == 7).all() and (dlse.get() == 7).all(), what
        assert (v == 7).all() and (s == 0).all(), what


def _ooo_queue(ctx):
    try:
        return cl.CommandQueue(
            ctx, properties=cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE)
    except cl.Error as exc:
        pytest.skip(f"no out-of-order queues on this device: {exc}")


@pytest.mark.parametrize("ooo", [False, True], ids=["in-order", "out-of-order"])
def test_wait_for_user_event_gates_device_run(device, get_decoder, cl_queue, ooo):
    """Device arrays: nothing is written before a wait_for event completes; then all is right.

    (Unsplit: the split path uploads its plan table, see the out-of-order test below.)
    """
    sc = WIN[F32]
    spec = sc.spec
    dec = get_decoder(spec, device)
    queue = cl_queue(device)
    run_q = _ooo_queue(queue.context) if ooo else cl.CommandQueue(queue.context)
    case = window_case(spec, [50, 3, 20], window=[10, 0, 4], sinks=[2, 0, 1], seed=20)
    args, kw = decode_args(case)
    ref = oracle(sc, case)
    dargs = [cla.to_device(queue, a) for a in args]
    dkw = {k: cla.to_device(queue, v) for k, v in kw.items()}
    out = cla.to_device(queue, np.full(case["q"].shape, 42, np.float32))
    lse = cla.to_device(queue, np.full(case["q"].shape[:2], 42, np.float32))
    queue.finish()
    import threading

    gate = cl.UserEvent(queue.context)
    # safety net: a run() that blocked on its own queue would otherwise hang forever
    net = threading.Timer(20.0, lambda: gate.set_status(cl.command_execution_status.COMPLETE))
    net.start()
    res = dec.run(*dargs, **dkw, out=out, lse=lse, queue=run_q, wait_for=[gate], split=False)
    assert net.is_alive(), "run() blocked until its wait_for event completed"
    net.cancel()
    try:
        peek = np.empty(case["q"].shape[:2], np.float32)
        cl.enqueue_copy(queue, peek, lse.base_data, src_offset=lse.offset)
        assert (peek == 42).all(), "the kernel ran before its wait_for event completed"
    finally:
        gate.set_status(cl.command_execution_status.COMPLETE)
    res.event.wait()
    compare(out.get(queue=queue), lse.get(queue=queue), *ref, "float32", what="gated: ")


def test_out_of_order_queue_host_io(device, get_decoder, cl_queue):
    """numpy in/out on an out-of-order queue, with the kernel held back by a wait_for event."""
    import threading

    sc = WIN[F32]
    spec = sc.spec
    dec = get_decoder(spec, device)
    queue = cl_queue(device)
    ooo = _ooo_queue(queue.context)
    case = window_case(spec, [50, 3, 20], window=[10, 0, 4], sinks=[2, 0, 1], seed=21)
    args, kw = decode_args(case)
    ref = oracle(sc, case)
    gate = cl.UserEvent(queue.context)
    timer = threading.Timer(0.5, lambda: gate.set_status(cl.command_execution_status.COMPLETE))
    timer.start()
    try:
        res = dec.run(*args, **kw, queue=ooo, wait_for=[gate])
    finally:
        timer.join()
    compare(res.out, res.lse, *ref, "float32", what="out-of-order host I/O: ")


def test_out_of_order_queue_split_device_tables(request, device, device_id, get_decoder,
                                                cl_queue):
    """Split decode (decode + merge pass) with device tables on an out-of-order queue."""
    sc = WIN[F32]
    spec = sc.spec
    dec = get_decoder(spec, device)
    queue = cl_queue(device)
    ooo = _ooo_queue(queue.context)
    case = window_case(spec, [50, 3, 20, 40], window=[10, 0, 4, 0], sinks=[2, 0, 1, 0], seed=22)
    args, kw = decode_args(case)
    ref = oracle(sc, case)
    dargs = [cla.to_device(queue, a) for a in args]
    dkw = {k: cla.to_device(queue, v) for k, v in kw.items()}
    bad = []
    for it in range(40):
        # a fresh plan each time (as every decode step makes one): its table is uploaded anew
        plan = dec.plan(case["page_indptr"], case["last_page_len"],
                        window_offset=case["window_offset"], sink_size=case["sink_size"],
                        split=(16, 32)[it % 2])
        assert plan.split
        res = dec.run(*dargs, **dkw, plan=plan, queue=ooo)
        res.event.wait()
        try:
            compare(res.out.get(queue=ooo), res.lse.get(queue=ooo), *ref, "float32")
        except AssertionError as exc:
            bad.append((it, str(exc).splitlines()[1:3]))
    assert not bad, f"{len(bad)} of 40 out-of-order split runs wrong, e.g. {bad[:2]}"


# ---------------------------------------------------------------------------- merge kernels
def _states(rng, shape_v, shape_s, dtype, spread=6.0):
    v = rng.standard_normal(shape_v).astype(dtype)
    s = (rng.standard_normal(shape_s) * spread).astype(np.float32)
    return v, s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H,D", [(1, 4, 64), (7, 3, 80), (4096, 2, 64)],
                         ids=["N1", "N7-d80", "N4096"])
def test_merge_state_on_device(device, cl_queue, N, H, D, dtype):
    rng = np.random.default_rng(N + D)
    v, s = _states(rng, (N, H, D), (N, H), dtype)
    vo, so = _states(rng, (N, H, D), (N, H), dtype)
    s[0, 0] = NEG                                 # left empty
    so[0, H - 1] = NEG                            # right empty
    if N > 1:
        s[N - 1, :] = NEG                         # both empty
        so[N - 1, :] = NEG
        s[N // 2, 0], so[N // 2, 0] = 1e4, -1e4   # one side dominates
    want_v, want_s = naive_merge(v, s, vo, so)
    v0, s0 = v.copy(), s.copy()
    # numpy in place, run by the device's kernel
    a, b = v.copy(), s.copy()
    clattn.merge_state_(a, b, vo, so, device=device)
    compare(a, b, want_v, want_s, dtype, what="merge_state_ numpy: ")
    np.testing.assert_array_equal(a[0, 0], vo[0, 0].astype(dtype))   # passes through exactly
    # out of place
    c, d = clattn.merge_state(v, s, vo, so, device=device)
    compare(c, d, want_v, want_s, dtype, what="merge_state: ")
    np.testing.assert_array_equal(v, v0)
    np.testing.assert_array_equal(s, s0)
    # device arrays (views into larger buffers), in place
    queue = cl_queue(device)
    _, dv = _pad_view(queue, v, 1, 5)
    ds_big, ds = _pad_view(queue, s, 1, 5)
    _, dvo = _pad_view(queue, vo, 2, 5)
    _, dso = _pad_view(queue, so, 2, 5)
    evt = clattn.merge_state_(dv, ds, dvo, dso)
    assert evt is not None
    compare(dv.get(), ds.get(), want_v, want_s, dtype, what="merge_state_ device: ")
    assert (ds_big.get()[0] == 5).all()
    if N > 1:
        assert (dv.get()[N - 1] == 0).all() and np.isneginf(ds.get()[N - 1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,H,D", [(1, 1, 2, 64), (7, 3, 4, 80), (4096, 3, 2, 64)],
                         ids=["N1-K1", "N7-K3-d80", "N4096-K3"])
def test_merge_states_on_device(device, cl_queue, N, K, H, D, dtype):
    rng = np.random.default_rng(N * K + D)
    v, s = _states(rng, (N, K, H, D), (N, K, H), dtype)
    s[0, 0, 0] = NEG
    if N > 1:
        s[1, :, :] = NEG                       # every state empty
        s[2, : K - 1, 0] = NEG                 # only the last state
    want_v, want_s = naive_merge_k(v, s)
    out, lse = clattn.merge_states(v, s, device=device)
    compare(out, lse, want_v, want_s, dtype, what="merge_states numpy: ")
    out2 = np.full((N, H, D), 9, dtype=dtype)
    lse2 = np.full((N, H), 9, dtype=np.float32)
    r = clattn.merge_states(v, s, out=out2, lse=lse2, device=device)
    assert r[0] is out2 and r[1] is lse2
    compare(out2, lse2, want_v, want_s, dtype, what="merge_states out=: ")
    queue = cl_queue(device)
    _, dv = _pad_view(queue, v, 1, 3)
    _, ds = _pad_view(queue, s, 1, 3)
    ob, do = _pad_view(queue, np.zeros((N, H, D), dtype), 1, 7)
    lb, dl = _pad_view(queue, np.zeros((N, H), np.float32), 1, 7)
    r = clattn.merge_states(dv, ds, out=do, lse=dl)
    assert r[0] is do and r[1] is dl
    compare(do.get(), dl.get(), want_v, want_s, dtype, what="merge_states device: ")
    assert (ob.get()[0] == 7).all() and (lb.get()[0] == 7).all()


@pytest.mark.parametrize("kind", ["pair", "k-way"])
def test_merge_host_io_on_out_of_order_queue(device, cl_queue, kind):
    import threading

    queue = cl_queue(device)
    ooo = _ooo_queue(queue.context)
    rng = np.random.default_rng(5)
    v, s = _states(rng, (5, 3, 64), (5, 3), "float32")
    vo, so = _states(rng, (5, 3, 64), (5, 3), "float32")
    gate = cl.UserEvent(queue.context)
    timer = threading.Timer(0.5, lambda: gate.set_status(cl.command_execution_status.COMPLETE))
    timer.start()
    try:
        if kind == "pair":
            a, b = v.copy(), s.copy()
            clattn.merge_state_(a, b, vo, so, device=device, queue=ooo, wait_for=[gate])
            want = naive_merge(v, s, vo, so)
        else:
            vk, sk = np.stack([v, vo], 1), np.stack([s, so], 1)
            a, b = clattn.merge_states(vk, sk, device=device, queue=ooo, wait_for=[gate])
            want = naive_merge_k(vk, sk)
    finally:
        timer.join()
    compare(a, b, *want, "float32", what=f"{kind} on an out-of-order queue: ")


@pytest.mark.parametrize("fold", [False, True], ids=["merge-launch", "merge-folded"])
def test_two_split_runs_in_flight(device, get_decoder, cl_queue, fold):
    """Two independent split decodes enqueued back to back on an out-of-order queue, the
    merge in its own launch or folded into the decode's (both share the workspace; the
    folded ones its counters too)."""
    sc = WIN[F32]
    spec = sc.spec
    dec = get_decoder(spec, device, dict(fold_merge=fold))
    queue = cl_queue(device)
    ooo = _ooo_queue(queue.context)
    case = window_case(spec, [300, 3, 200], window=[10, 0, 4], sinks=[2, 0, 1], seed=23)
    q2_host = make_case(spec, [300, 3, 200], window=[10, 0, 4], sinks=[2, 0, 1], seed=24)["q"]
    args, kw = decode_args(case)
    ref1 = oracle(sc, case)
    ref2 = oracle(sc, dict(case, q=q2_host))
    dargs = [cla.to_device(queue, a) for a in args]
    q2 = cla.to_device(queue, q2_host)
    dkw = {k: cla.to_device(queue, v) for k, v in kw.items()}
    plan = dec.plan(case["page_indptr"], case["last_page_len"],
                    window_offset=case["window_offset"], sink_size=case["sink_size"], split=16)
    dec.run(*dargs, **dkw, plan=plan).event.wait()      # workspace and plan table ready
    bad = 0
    for _ in range(30):
        r1 = dec.run(*dargs, **dkw, plan=plan, queue=ooo)
        r2 = dec.run(q2, *dargs[1:], **dkw, plan=plan, queue=ooo)
        r1.event.wait()
        r2.event.wait()
        for r, ref in ((r1, ref1), (r2, ref2)):
            try:
                compare(r.out.get(queue=queue), r.lse.get(queue=queue), *ref, "float32")
            except AssertionError:
                bad += 1
    assert bad == 0, f"{bad} of 60 results wrong"
