"""Reliability defects of issue 16, each with the test that covers it: exact RoPE over
the int32 range, float32-finite scalars, no partial writes, errors that name the
argument, thread safety of the merges and of BatchDecode's caches."""
import sys
import threading
import warnings

import numpy as np
import pytest
from cases import decode_args, make_case

import clattn
from clattn import runtime

WHERE = [("cpu", None), ("pocl", None), ("pocl", "adreno-7xx"), ("intel", None),
         ("intel", "adreno-7xx")]


def _decoder(spec, where, prof):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if where == "cpu":
            return clattn.BatchDecode(spec, backend="cpu")
        return clattn.BatchDecode(spec, where, profile=prof)


@pytest.mark.parametrize("where,prof", WHERE[1:])
@pytest.mark.parametrize("base", [2**24 + 12345, 2**30 + 777, 2**31 - 200])
def test_rope_positions_exact_over_int32(where, prof, base):
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    # RoPE is relative: positions whose high 16 bits differ between q and the keys, so
    # an angle that lost any part of the absolute position shows
    case = make_case(spec, [50, 7], seed=1, rope=True, pos_offset=[base, base - 2**20],
                     q_pos=[base - 9 - 2**17, base + 3])
    args, kw = decode_args(case)
    kw["rotary_mode"] = 1
    ref = _decoder(spec, "cpu", None).run(*args, **kw)   # float64 angles
    got = _decoder(spec, where, prof).run(*args, **kw)
    np.testing.assert_allclose(got.out, ref.out, atol=3e-6, rtol=0)
    np.testing.assert_allclose(got.lse, ref.lse, atol=3e-6, rtol=0)


@pytest.mark.parametrize("where,prof", WHERE[:2])
def test_key_positions_past_int32_are_refused(where, prof):
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    case = make_case(spec, [50], seed=1, rope=True, pos_offset=2**31 - 10, q_pos=[0])
    args, kw = decode_args(case)
    with pytest.raises(ValueError, match=r"k_pos_offset\[0\]=2147483638.*int32"):
        _decoder(spec, where, prof).run(*args, rotary_mode=1, **kw)


@pytest.mark.parametrize("where,prof", WHERE[:2])
@pytest.mark.parametrize("bad,name", [(dict(sm_scale=1e39), "sm_scale"),
                                      (dict(rope_scale=1e39), "rope_scale")])
def test_scalars_must_be_finite_in_float32(where, prof, bad, name):
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    args, kw = decode_args(make_case(spec, [5], seed=1, rope=True))
    with pytest.raises(ValueError, match=f"{name}=1e\\+39: must be finite as a float32"):
        _decoder(spec, where, prof).run(*args, rotary_mode=1, **kw, **bad)


@pytest.mark.parametrize("rtype", ["linear", "yarn"])
def test_rope_scaling_factor_zero_is_refused(rtype):
    with pytest.raises(ValueError, match="factor=0.*positive"):
        clattn.AttentionSpec(8, 2, 64, rope_scaling={"rope_type": rtype, "factor": 0,
                                                     "original_max_position_embeddings": 4096})


_YARN = {"rope_type": "yarn", "factor": 2.0}
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [1.0] * 32,
             "original_max_position_embeddings": 16}


@pytest.mark.parametrize("kw, exc, match", [
    (dict(rope_scaling=dict(_LONGROPE, short_factor=[1.0] * 3)), ValueError,
     "short_factor has 3 values; rotary_dim=64 needs 32"),
    (dict(rope_scaling=dict(_LONGROPE, long_factor=[float("nan")] * 32)), ValueError,
     "long_factor=.*positive finite"),
    (dict(rope_scaling=dict(_LONGROPE, original_max_position_embeddings=1)), ValueError,
     "original_max_position_embeddings=1"),
    (dict(rope_scaling=_YARN, max_position_embeddings=-5), ValueError,
     "max_position_embeddings=-5"),
    (dict(rope_scaling=dict(_YARN, beta_fast=float("nan")), max_position_embeddings=64),
     ValueError, "beta_fast=nan"),
    (dict(rope_scaling=dict(_YARN, mscale="x", mscale_all_dim=1), max_position_embeddings=64),
     ValueError, "mscale='x'"),
    (dict(rope_scaling=dict(_YARN, attention_factor=float("inf")), max_position_embeddings=64),
     ValueError, "attention_factor=inf"),
    (dict(rope_scaling={"rope_type": "linear", "factor": True}), ValueError, "factor=True"),
    (dict(rope_scaling="linear"), TypeError, "rope_scaling='linear': must be a dict"),
    (dict(max_position_embeddings="abc"), ValueError, "max_position_embeddings='abc'"),
    (dict(sliding_window="False"), TypeError, "sliding_window='False'"),
    (dict(softcap=True), ValueError, "softcap=True"),
    (dict(k_format=""), ValueError, "k_format=''"),
    (dict(page_size=2**24), ValueError, "page_size=16777216.*must each stay below 2"),
])
def test_spec_refuses_what_a_run_would_fail_on(kw, exc, match):
    """Each of these was accepted by AttentionSpec and failed (or gave NaN) only at a run
    with rotary_mode=1, or was silently read as something else (review)."""
    with pytest.raises(exc, match=match):
        clattn.AttentionSpec(8, 2, 64, **kw)


@pytest.mark.parametrize("where,prof", WHERE[:2])
def test_read_only_lse_writes_nothing(where, prof):
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    args, kw = decode_args(make_case(spec, [5, 9], seed=1))
    out = np.zeros((2, 8, 64), np.float32)
    lse = np.zeros((2, 8), np.float32)
    lse.setflags(write=False)
    with pytest.raises(ValueError, match="lse: is read-only"):
        _decoder(spec, where, prof).run(*args, out=out, lse=lse, **kw)
    assert not out.any()


@pytest.mark.parametrize("device_arg", [None, "pocl"])
def test_merge_with_read_only_s_writes_nothing(device_arg):
    rng = np.random.default_rng(0)
    v, vo = (rng.standard_normal((3, 2, 64)).astype(np.float32) for _ in range(2))
    s, so = (rng.standard_normal((3, 2)).astype(np.float32) for _ in range(2))
    v0 = v.copy()
    s.setflags(write=False)
    with pytest.raises(ValueError, match="s: is read-only"):
        clattn.merge_state_(v, s, vo, so, device=device_arg)
    assert np.array_equal(v, v0)


def test_unknown_dtype_is_named():
    with pytest.raises(TypeError, match=r"dtype='bfloat16': must be one of"):
        clattn.AttentionSpec(8, 2, 64, dtype="bfloat16")


def test_list_table_on_cpu_backend_is_a_named_type_error():
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    args, kw = decode_args(make_case(spec, [5, 9], seed=1))
    with pytest.raises(TypeError, match="page_indptr: expected a numpy or pyopencl array"):
        _decoder(spec, "cpu", None).run(args[0], args[1], list(args[2]), *args[3:], **kw)


@pytest.mark.parametrize("name", ["last_page_len", "window_offset", "sink_size", "q_pos",
                                  "k_pos_offset", "page_indices"])
def test_device_table_from_another_context_is_named(name):
    cl = runtime.cl()
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32", sliding_window=True)
    case = make_case(spec, [5, 9], seed=1, window=2, sinks=1, rope=True)
    args, kw = decode_args(case)
    kw["rotary_mode"] = 1
    dec = _decoder(spec, "pocl", None)
    other = cl.CommandQueue(cl.Context([dec.setup.runtime.device]))
    mine = dec.setup.runtime.queue
    names = ["q", "pages", "page_indptr", "page_indices", "last_page_len"]
    dev = {n: cl.array.to_device(other if n == name else mine, a)
           for n, a in list(zip(names, args)) + list(kw.items()) if hasattr(a, "shape")}
    pos = [dev[n] for n in names]
    rest = {k: dev[k] for k in kw if k in dev}
    with pytest.raises(ValueError, match=f"{name}: lives in another OpenCL context"):
        dec.run(*pos, rotary_mode=1, **rest)


def test_queue_from_another_context_is_named():
    cl = runtime.cl()
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    args, kw = decode_args(make_case(spec, [5], seed=1))
    dec = _decoder(spec, "pocl", None)
    other = cl.CommandQueue(cl.Context([dec.setup.runtime.device]))
    with pytest.raises(ValueError, match="queue: belongs to another OpenCL context"):
        dec.run(*args, queue=other, **kw)


def _threads(n, work):
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    errors = []

    def guarded(i):
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    try:
        ts = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors


@pytest.mark.parametrize("device_arg", ["pocl", "intel"])
def test_merges_from_threads(device_arg):
    rng = np.random.default_rng(3)
    cases = []
    for i in range(4):
        v, vo = (rng.standard_normal((64, 4, 64)).astype(np.float16) for _ in range(2))
        s, so = (rng.standard_normal((64, 4)).astype(np.float32) for _ in range(2))
        cases.append((v, s, vo, so))
    want = [clattn.merge_state(*c, device=device_arg) for c in cases]
    wantk = [clattn.merge_states(np.stack([c[0], c[2]], 1), np.stack([c[1], c[3]], 1),
                                 device=device_arg) for c in cases]
    got, gotk = [None] * 4, [None] * 4

    def work(i):
        for _ in range(10):
            got[i] = clattn.merge_state(*cases[i], device=device_arg)
            c = cases[i]
            gotk[i] = clattn.merge_states(np.stack([c[0], c[2]], 1), np.stack([c[1], c[3]], 1),
                                          device=device_arg)
    _threads(4, work)
    for w, g in zip(want + wantk, got + gotk):
        assert np.array_equal(w[0], g[0]) and np.array_equal(w[1], g[1])


@pytest.mark.parametrize("device_arg", ["pocl", "intel"])
def test_one_decoder_from_threads_with_many_plans_and_rope_tables(device_arg):
    """Concurrent run() calls with varying plans and rope scales (the plan-table and
    RoPE-table caches evict while others read them) give the single-threaded results."""
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    dec = _decoder(spec, device_arg, None)
    jobs = []
    for i in range(24):
        case = make_case(spec, [40 + i, 3], seed=i, rope=True)
        args, kw = decode_args(case)
        kw.update(rotary_mode=1, rope_scale=1.0 + i / 8)
        plan = dec.plan(args[2], args[4], split=16)
        jobs.append((args, kw, plan))
    want = [dec.run(*a, plan=p, **k) for a, k, p in jobs]
    got = [None] * len(jobs)

    def work(t):
        for j in range(t, len(jobs), 4):
            a, k, p = jobs[j]
            got[j] = dec.run(*a, plan=p, **k)
    _threads(4, work)
    for w, g in zip(want, got):
        assert np.array_equal(w.out, g.out) and np.array_equal(w.lse, g.lse)


def test_negative_window_offset_is_named():
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32", sliding_window=True)
    args, kw = decode_args(make_case(spec, [5, 9], seed=1, window=[1, 2], sinks=[0, 0]))
    kw["window_offset"] = np.array([-1, 2], np.int32)
    with pytest.raises(ValueError, match=r"window_offset\[0\]=-1: must be >= 0"):
        _decoder(spec, "cpu", None).run(*args, **kw)


def test_user_profile_dir_odd_files(tmp_path, monkeypatch):
    """A non-UTF-8 profile file is named in the error; a directory named x.json is not
    a profile file and is passed over."""
    from clattn.profiles import user_profiles
    monkeypatch.setenv("CLATTN_CONFIG_DIR", str(tmp_path))
    (tmp_path / "dir.json").mkdir()
    assert user_profiles() == {}
    (tmp_path / "bad.json").write_bytes(b'{"name": "x\xff"}')
    with pytest.raises(ValueError, match=r"bad\.json: not UTF-8"):
        user_profiles()


@pytest.mark.parametrize("kw, exc, match", [
    (dict(plan="x"), TypeError, "plan: expected a Plan"),
    (dict(split=-1), ValueError, "split=-1"),
    (dict(queue="q"), TypeError, "queue: expected a pyopencl.CommandQueue"),
    (dict(wait_for=5), TypeError, "wait_for: expected a list of pyopencl events"),
    (dict(wait_for=[42]), TypeError, "wait_for: expected pyopencl events"),
])
def test_cpu_backend_checks_the_device_arguments(kw, exc, match):
    """The CPU backend refuses what the OpenCL one refuses, instead of ignoring it."""
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    args, dkw = decode_args(make_case(spec, [5, 9], seed=1))
    with pytest.raises(exc, match=match):
        clattn.BatchDecode(spec, backend="cpu").run(*args, **dkw, **kw)
    other = clattn.BatchDecode(spec, backend="cpu").plan(np.array([0, 1], np.int32),
                                                        np.array([3], np.int32))
    with pytest.raises(ValueError, match="plan: made for 1 sequences, the call has 2"):
        clattn.BatchDecode(spec, backend="cpu").run(*args, **dkw, plan=other)
    q, pages, *tables = args   # one query per sequence: the same call as a prefill
    with pytest.raises(TypeError, match="plan: expected a PrefillPlan"):
        clattn.BatchPrefill(spec, backend="cpu").run(
            q, pages, np.array([0, 1, 2], np.int32), *tables, **dkw, plan=object())


def test_spec_keeps_hf_zero_defaults():
    """HF reads yarn's mscale, mscale_all_dim and beta_* of 0 as absent: still accepted."""
    spec = clattn.AttentionSpec(8, 2, 64, max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0,
        "beta_fast": 0, "beta_slow": 0})
    assert spec.rope_scaling["mscale_all_dim"] == 0
