"""Storage edge cases the kernels' own f16 conversion must get exactly right."""
import numpy as np
import pytest
from conftest import get_decoder

from clattn.spec import AttentionSpec

SPECIAL = np.array([0.0, -0.0, 6.0e-8, -6.0e-8, 3.0e-5, -4.0e-5, 6.1e-5, 1.0, -2.5,
                    1000.0, 65504.0, -65504.0, 0.33325195, 1.0009766, 2.0e-7, -1.0e-6],
                   dtype=np.float16)  # zeros, subnormals, the smallest normal, the largest


@pytest.mark.parametrize("profile", [None, "generic"])
def test_f16_values_convert_exactly(device, profile):
    """K = 0 makes every weight equal: out is the exact mean of V rows (subnormals too)."""
    spec = AttentionSpec(4, 1, 16, page_size=4, dtype="float16")
    rows = 8
    pages = np.zeros((3, 2, 1, 4, 16), np.float16)
    v = np.resize(SPECIAL, (rows, 16)).astype(np.float16)
    v[1::2] = np.roll(v[1::2], 3, axis=1)
    pages[1, 1, 0] = v[:4]
    pages[0, 1, 0] = v[4:]
    q = np.ones((1, 4, 16), np.float16)
    indptr = np.array([0, 2], np.int32)
    indices = np.array([1, 0], np.int32)
    last = np.array([4], np.int32)
    out, lse, _ = get_decoder(spec, device, profile).run(q, pages, indptr, indices, last)
    want = v.astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(out[0].astype(np.float64), np.broadcast_to(want, (4, 16)),
                               rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(lse, np.log2(rows), rtol=1e-6)
    # means in the f16 subnormal range are not flushed to zero
    want16 = want.astype(np.float16)
    tiny = np.abs(want16) < 6.1e-5
    assert tiny.any()
    np.testing.assert_array_equal(out[0][:, tiny] != 0, np.broadcast_to(want16[tiny] != 0,
                                                                        (4, int(tiny.sum()))))


@pytest.mark.parametrize("profile", [None, "generic"])
def test_f16_merge_roundtrip_and_rounding(device, profile):
    """Merges read and write f16 exactly: identity for K = 1 (inf, nan, subnormals
    included; a zero may come back as +0) and round-to-nearest-even for the mean of two
    equal-weight states."""
    import clattn

    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 16, size=(64, 4, 32), dtype=np.uint16)
    v = bits.view(np.float16)
    v[0, 0, :3] = [np.inf, -np.inf, np.nan]
    s = np.zeros((64, 1, 4), np.float32)
    out, lse = clattn.merge_states(v[:, None], s, device=device, profile=profile)
    keep = ~np.isnan(v) & (v != 0)
    np.testing.assert_array_equal(out.view(np.uint16)[keep], bits[keep])
    assert (out[v == 0] == 0).all()
    assert np.isnan(out[np.isnan(v)]).all()

    finite = bits.view(np.float16).copy()
    finite[~np.isfinite(finite)] = 1.0
    a, b = finite[:32], finite[32:]
    ref = (a.astype(np.float32) * 0.5 + b.astype(np.float32) * 0.5).astype(np.float16)
    va, sa = a.copy(), np.zeros((32, 4), np.float32)
    clattn.merge_state_(va, sa, b.copy(), np.zeros((32, 4), np.float32), device=device,
                        profile=profile)
    np.testing.assert_array_equal(va.view(np.uint16), ref.view(np.uint16))
    np.testing.assert_allclose(sa, 1.0)


@pytest.mark.parametrize("K", [1, 2, 3, 17, 64])
def test_merge_weights_and_lse_are_accurate(device, K):
    """The state math of the merges (on CPU drivers: common.clh.mako's inline exp2 and
    log2) against float64: lse differences from 0 to past the f32 weight range, sums of
    weights from 1 to K, lse values far from 0; within 3 + sqrt(K) ulp of the lse
    (1.5 measured at K = 2, 4.5 at K = 17), f32 rounding of out."""
    import clattn

    rng = np.random.default_rng(K)
    N, H, D = 96, 2, 8
    s = rng.uniform(-24.0, 24.0, (N, K, H)).astype(np.float32)
    s[: N // 4] = np.round(s[: N // 4])                  # ties: sums of exactly 2, 3, ...
    s[N // 4: N // 2] *= 8.0                             # weights down to 2^-384 (zero)
    s[N // 2: 3 * N // 4] += rng.choice([-3e4, -100.0, 100.0, 3e4],
                                       (N // 4, 1, H)).astype(np.float32)
    lead = s[3 * N // 4:]                                 # max 0: lse = log2(sum) in [0, 6]
    lead -= lead.max(axis=1, keepdims=True)
    v = rng.standard_normal((N, K, H, D)).astype(np.float32)
    out, lse = clattn.merge_states(v, s, device=device)
    s64 = s.astype(np.float64)
    mx = s64.max(axis=1, keepdims=True)
    w = np.exp2(s64 - mx)
    ref_lse = mx[:, 0] + np.log2(w.sum(axis=1))
    ref_out = (w[..., None] * v).sum(axis=1) / w.sum(axis=1)[..., None]
    ulp = np.maximum(np.spacing(np.abs(ref_lse).astype(np.float32)), 2.0 ** -24)
    err = np.abs(lse - ref_lse) / ulp
    bound = 3 + np.sqrt(K)   # the f32 sum of K weights rounds too
    assert err.max() <= bound, \
        f"lse {err.max():.1f} ulp off at {np.unravel_index(err.argmax(), err.shape)}"
    np.testing.assert_allclose(out, ref_out, rtol=2e-6 * K, atol=2e-6 * K)
    if K == 2:   # the pairwise merge, in place
        va, sa = v[:, 0].copy(), s[:, 0].copy()
        clattn.merge_state_(va, sa, v[:, 1].copy(), s[:, 1].copy(), device=device)
        assert np.all(np.abs(sa - ref_lse) <= bound * ulp)
        np.testing.assert_allclose(va, ref_out, rtol=4e-6, atol=4e-6)


def test_merge_of_zero_states_is_the_empty_state(device):
    import clattn

    v = np.zeros((5, 0, 3, 16), np.float32)
    s = np.zeros((5, 0, 3), np.float32)
    for dev in (device, None):  # the kernel and the CPU fallback
        out, lse = clattn.merge_states(v, s, device=dev)
        assert out.shape == (5, 3, 16) and (out == 0).all() and np.isneginf(lse).all()


def test_stale_plan_with_device_tables_still_attends_every_row(device, cl_queue):
    """A plan made for shorter sequences, reused with longer device-side tables: the last
    partition runs to the end of the chunk, so no row is dropped."""
    import pyopencl.array as cla
    from cases import compare, decode_args, make_case
    from conftest import get_decoder
    from naive import naive_decode

    spec = AttentionSpec(4, 2, 16, page_size=4, dtype="float32")
    dec = get_decoder(spec, device)
    old = make_case(spec, [9, 8], seed=1)
    plan = dec.plan(old["page_indptr"], old["last_page_len"], split=4)
    assert plan.split
    case = make_case(spec, [9, 30], seed=2)
    args, kw = decode_args(case)
    queue = cl_queue(device)
    dargs = [cla.to_device(queue, a) for a in args]
    res = dec.run(*dargs, **kw, plan=plan)
    compare(res.out.get(), res.lse.get(), *naive_decode(*args, **kw), "float32")


def test_one_decoder_grows_its_split_workspace(device):
    """A fresh decoder given split plans needing 4, then 16, then 28 workspace states
    (more than its first) attends every row of each batch."""
    import warnings

    from cases import compare, decode_args, make_case
    from naive import naive_decode

    import clattn

    spec = AttentionSpec(2, 1, 16, page_size=4, dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        dec = clattn.BatchDecode(spec, device, backend="opencl")  # its own workspace
    n_ws = []
    for lengths in ([13], [9, 30, 17], [40, 33, 5, 28]):
        args, kw = decode_args(make_case(spec, lengths, seed=len(lengths)))
        plan = dec.plan(args[2], args[4], split=4)
        n_ws.append(plan.n_ws)
        res = dec.run(*args, **kw, plan=plan)
        compare(res.out, res.lse, *naive_decode(*args, **kw), "float32", what=f"{lengths}: ")
    assert n_ws == [4, 16, 28]


def test_host_lse_with_device_q_is_written(device, cl_queue):
    import pyopencl.array as cla
    from cases import decode_args, make_case
    from conftest import get_decoder

    spec = AttentionSpec(4, 2, 16, page_size=4, dtype="float32")
    dec = get_decoder(spec, device)
    args, kw = decode_args(make_case(spec, [5, 0], seed=3))
    lse = np.full((2, 4), 123.0, np.float32)
    res = dec.run(*[cla.to_device(cl_queue(device), a) for a in args], **kw, lse=lse)
    assert res.lse is lse and np.isneginf(lse[1]).all() and np.isfinite(lse[0]).all()
