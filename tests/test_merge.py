"""Merging attention states (clattn.cpu_backend.merge_state[_], merge_states) against the oracle."""
import numpy as np
import pytest
from cases import compare, make_case
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from naive import naive_decode, naive_merge, naive_merge_k

from clattn.cpu_backend import batch_decode, merge_state, merge_state_, merge_states
from clattn.spec import AttentionSpec

DTYPES = ["float32", "float16"]
NEG = -np.inf


def states(rng, N, H, D, dtype, empty_mask=None, spread=8.0):
    v = rng.standard_normal((N, H, D)).astype(dtype)
    s = (rng.standard_normal((N, H)) * spread).astype(np.float32)
    if empty_mask is not None:
        s[empty_mask] = NEG
    return v, s


def assert_state(v, s, ref_v, ref_s, dtype):
    compare(v, s, ref_v, ref_s, dtype)


# --------------------------------------------------------------------------- merge_state / _
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_state_matches_oracle(dtype):
    rng = np.random.default_rng(1)
    N, H, D = 6, 4, 16
    v, s = states(rng, N, H, D, dtype)
    vo, so = states(rng, N, H, D, dtype)
    s[0, :] = NEG          # left empty
    so[1, :] = NEG         # right empty
    s[2, :] = NEG          # both empty
    so[2, :] = NEG
    s[3, 0] = 1e4          # one side dominates completely
    so[3, 0] = -1e4
    v0, s0, vo0, so0 = v.copy(), s.copy(), vo.copy(), so.copy()
    mv, ms = merge_state(v, s, vo, so)
    rv, rs = naive_merge(v, s, vo, so)
    assert_state(mv, ms, rv, rs, dtype)
    # inputs untouched
    for a, b in ((v, v0), (s, s0), (vo, vo0), (so, so0)):
        np.testing.assert_array_equal(a, b)
    # empty sides pass through exactly; both empty -> 0, -inf
    np.testing.assert_array_equal(mv[0], vo[0])
    np.testing.assert_array_equal(ms[0], so[0])
    np.testing.assert_array_equal(mv[1], v[1])
    np.testing.assert_array_equal(ms[1], s[1])
    assert (mv[2] == 0).all() and np.isneginf(ms[2]).all()
    np.testing.assert_array_equal(mv[3, 0], v[3, 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_state_inplace(dtype):
    rng = np.random.default_rng(2)
    N, H, D = 5, 3, 8
    v, s = states(rng, N, H, D, dtype, empty_mask=(rng.random((N, H)) < 0.3))
    vo, so = states(rng, N, H, D, dtype, empty_mask=(rng.random((N, H)) < 0.3))
    rv, rs = naive_merge(v, s, vo, so)
    expect_v, expect_s = merge_state(v, s, vo, so)
    vo0, so0 = vo.copy(), so.copy()
    v_id, s_id = id(v), id(s)
    assert merge_state_(v, s, vo, so) is None
    assert id(v) == v_id and id(s) == s_id
    assert v.dtype == np.dtype(dtype) and s.dtype == np.float32
    assert_state(v, s, rv, rs, dtype)
    np.testing.assert_array_equal(v, expect_v)
    np.testing.assert_array_equal(s, expect_s)
    np.testing.assert_array_equal(vo, vo0)
    np.testing.assert_array_equal(so, so0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_state_inplace_on_views(dtype):
    """In place on a view with a non-zero offset writes only that view."""
    rng = np.random.default_rng(3)
    bigv = rng.standard_normal((4, 2, 8)).astype(dtype)
    bigs = rng.standard_normal((4, 2)).astype(np.float32)
    bigv0, bigs0 = bigv.copy(), bigs.copy()
    vo, so = states(rng, 3, 2, 8, dtype)
    rv, rs = naive_merge(bigv[1:], bigs[1:], vo, so)
    merge_state_(bigv[1:], bigs[1:], vo, so)
    assert_state(bigv[1:], bigs[1:], rv, rs, dtype)
    np.testing.assert_array_equal(bigv[0], bigv0[0])
    np.testing.assert_array_equal(bigs[0], bigs0[0])


def test_merge_state_result_dtypes():
    rng = np.random.default_rng(4)
    for dtype in DTYPES:
        v, s = states(rng, 2, 2, 4, dtype)
        mv, ms = merge_state(v, s, v, s)
        assert mv.dtype == np.dtype(dtype) and ms.dtype == np.float32
        assert mv.shape == v.shape and ms.shape == s.shape
        # merging a state with itself: same v, s + 1
        compare(mv, ms, *naive_merge(v, s, v, s), dtype)


# --------------------------------------------------------------------------- merge_states (K)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 2, 5])
def test_merge_states_matches_oracle(K, dtype):
    rng = np.random.default_rng(10 + K)
    N, H, D = 4, 3, 16
    v = rng.standard_normal((N, K, H, D)).astype(dtype)
    s = (rng.standard_normal((N, K, H)) * 6).astype(np.float32)
    s[0] = NEG                       # everything empty for n = 0
    s[1, 0] = NEG                    # first state empty
    s[2, K - 1, 1] = NEG             # last state empty for one head
    v0, s0 = v.copy(), s.copy()
    mv, ms = merge_states(v, s)
    rv, rs = naive_merge_k(v, s)
    assert mv.shape == (N, H, D) and ms.shape == (N, H)
    assert_state(mv, ms, rv, rs, dtype)
    assert (mv[0] == 0).all() and np.isneginf(ms[0]).all()
    np.testing.assert_array_equal(v, v0)
    np.testing.assert_array_equal(s, s0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_equals_pairwise(dtype):
    rng = np.random.default_rng(20)
    N, K, H, D = 3, 4, 2, 8
    v = rng.standard_normal((N, K, H, D)).astype(dtype)
    s = (rng.standard_normal((N, K, H)) * 4).astype(np.float32)
    s[1, 2] = NEG
    mv, ms = merge_states(v, s)
    compare(mv, ms, *naive_merge_k(v, s), dtype, what="merge_states: ")
    if dtype == "float32":   # (f16 pairwise merges round every intermediate state)
        pv = v[:, 0].copy()
        ps = s[:, 0].copy()
        for k in range(1, K):
            merge_state_(pv, ps, v[:, k].copy(), s[:, k].copy())
        compare(pv, ps, *naive_merge_k(v, s), dtype, what="pairwise: ")


# --------------------------------------------------------------------------- the split identity
def _piece_tables(case, ps, b, a, e):
    """Page table entries for rows [a, e) of sequence b: its first ceil(e/ps) pages, window at a."""
    p0 = int(case["page_indptr"][b])
    n = -(-e // ps)
    pages = case["page_indices"][p0:p0 + n]
    last = e - (n - 1) * ps if n else 0
    return pages, last, (a if n else 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_identity_page_aligned(dtype):
    """States of page-aligned sub-chunks (as separate sequences), merged, equal the whole."""
    ps = 8
    spec = AttentionSpec(8, 2, 32, page_size=ps, dtype="float32" if dtype == "float32" else dtype)
    case = make_case(spec, [45], seed=30)
    whole = batch_decode(spec, case["q"], case["pages"], case["page_indptr"],
                         case["page_indices"], case["last_page_len"])
    pidx = case["page_indices"]
    pieces = [pidx[0:2], pidx[2:2], pidx[2:3], pidx[3:6]]   # 16 rows, empty, 8 rows, 21 rows
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int32)
    last = np.array([ps, 0, ps, 45 - 5 * ps], dtype=np.int32)
    qk = np.repeat(case["q"], len(pieces), axis=0)
    vs, ss = batch_decode(spec, qk, case["pages"], indptr, np.concatenate(pieces).astype(np.int32),
                          last)
    assert np.isneginf(ss[1]).all()
    mv, ms = merge_states(vs[None], ss[None])
    ref = naive_decode(case["q"], case["pages"], case["page_indptr"], case["page_indices"],
                       case["last_page_len"])
    compare(whole[0], whole[1], *ref, dtype, what="whole: ")
    if dtype == "float32":   # (f16 pieces are rounded before they are merged)
        compare(mv, ms, *ref, dtype, what="merged pieces: ")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ps=st.sampled_from([1, 4, 16]), length=st.integers(0, 70),
       seed=st.integers(0, 2**16))
def test_split_identity_arbitrary_rows(data, ps, length, seed):
    """Any split of a chunk into row ranges [a, e) (windowed decode with window_offset a over
    the first e rows), merged with merge_states, equals attending to the whole chunk."""
    nsplit = data.draw(st.integers(0, 4))
    cuts = sorted(data.draw(st.lists(st.integers(0, length), min_size=nsplit, max_size=nsplit)))
    bounds = [0] + cuts + [length]
    spec = AttentionSpec(4, 2, 16, page_size=ps, dtype="float32")
    wspec = AttentionSpec(4, 2, 16, page_size=ps, dtype="float32", sliding_window=True)
    case = make_case(spec, [length], seed=seed)
    whole = batch_decode(spec, case["q"], case["pages"], case["page_indptr"],
                         case["page_indices"], case["last_page_len"])
    tabs = [_piece_tables(case, ps, 0, a, e) for a, e in zip(bounds[:-1], bounds[1:])]
    K = len(tabs)
    indptr = np.concatenate([[0], np.cumsum([len(t[0]) for t in tabs])]).astype(np.int32)
    pidx = np.concatenate([t[0] for t in tabs]).astype(np.int32)
    last = np.array([t[1] for t in tabs], dtype=np.int32)
    wo = np.array([t[2] for t in tabs], dtype=np.int32)
    qk = np.repeat(case["q"], K, axis=0)
    vs, ss = batch_decode(wspec, qk, case["pages"], indptr, pidx, last,
                          window_offset=wo, sink_size=np.zeros(K, np.int32))
    mv, ms = merge_states(vs[None], ss[None])
    ref = naive_decode(case["q"], case["pages"], case["page_indptr"], case["page_indices"],
                       case["last_page_len"])
    compare(mv, ms, *ref, "float32")
    compare(whole[0], whole[1], *ref, "float32")
    # pairwise merging of the same states, in order
    pv, pss = vs[0:1].copy(), ss[0:1].copy()
    for k in range(1, K):
        merge_state_(pv, pss, vs[k:k + 1].copy(), ss[k:k + 1].copy())
    compare(pv, pss, *ref, "float32")


@settings(max_examples=25, deadline=None)
@given(length=st.integers(0, 30), seed=st.integers(0, 2**16), data=st.data())
def test_split_identity_naive_with_sinks(length, seed, data):
    """Oracle-only: sinks + window of a chunk = merge(sinks part, window part)."""
    wo = data.draw(st.integers(0, length))
    sk = data.draw(st.integers(0, wo))
    spec = AttentionSpec(2, 1, 8, page_size=4, dtype="float32", sliding_window=True)
    case = make_case(spec, [length], seed=seed, window=[wo], sinks=[sk])
    args = (case["q"], case["pages"], case["page_indptr"], case["page_indices"],
            case["last_page_len"])
    whole = naive_decode(*args, window_offset=[wo], sink_size=[sk])
    lib = batch_decode(spec, *args, window_offset=case["window_offset"],
                       sink_size=case["sink_size"])
    compare(*lib, *whole, "float32")
    # sinks alone: window at the end (wo = stored) keeps only the sinks
    sinks = naive_decode(*args, window_offset=[length], sink_size=[sk])
    tail = naive_decode(*args, window_offset=[wo], sink_size=[0])
    mv, ms = merge_state(sinks[0].astype(np.float32), sinks[1].astype(np.float32),
                         tail[0].astype(np.float32), tail[1].astype(np.float32))
    compare(mv, ms, *whole, "float32")


# --------------------------------------------------------------------------- algebra, NaN-safety
def _state_strategy(N, H, D, dtype=np.float32):
    s_elem = st.one_of(st.just(-np.inf), st.floats(-200, 200, width=32))
    v = hnp.arrays(dtype, (N, H, D),
                   elements=st.floats(-100, 100, width=16 if dtype == np.float16 else 32))
    s = hnp.arrays(np.float32, (N, H), elements=s_elem)
    return st.tuples(v, s)


@settings(max_examples=60, deadline=None)
@given(a=_state_strategy(3, 2, 4), b=_state_strategy(3, 2, 4))
def test_merge_commutative(a, b):
    """Both orders equal the float64 merge (a wrong base, exp for exp2, would still be
    commutative: only the oracle sees it)."""
    ref = naive_merge(*a, *b)
    compare(*merge_state(*a, *b), *ref, "float32", what="a+b: ")
    compare(*merge_state(*b, *a), *ref, "float32", what="b+a: ")


_TINY = np.full((3, 2, 4), 1e-45, np.float32)   # f32 subnormals: halved, they round to 0


@settings(max_examples=60, deadline=None)
@given(a=_state_strategy(3, 2, 4), b=_state_strategy(3, 2, 4), c=_state_strategy(3, 2, 4))
@example(a=(0 * _TINY, np.full((3, 2), -np.inf, np.float32)),
         b=(0 * _TINY, np.zeros((3, 2), np.float32)), c=(_TINY, np.zeros((3, 2), np.float32)))
def test_merge_associative(a, b, c):
    """Either grouping and the K-way merge equal the float64 merge of all three."""
    ref = naive_merge_k(np.stack([a[0], b[0], c[0]], 1), np.stack([a[1], b[1], c[1]], 1))
    ref_v, ref_s = ref
    # a pairwise merge of merges: its inputs already carry f32 rounding, twice
    for what, (v, s) in (("(a+b)+c", merge_state(*merge_state(*a, *b), *c)),
                         ("a+(b+c)", merge_state(*a, *merge_state(*b, *c)))):
        compare(v, s, ref_v, ref_s, "float32", what=f"{what}: ")
    k = merge_states(np.stack([a[0], b[0], c[0]], 1), np.stack([a[1], b[1], c[1]], 1))
    compare(*k, *ref, "float32", what="K-way: ")


@settings(max_examples=60, deadline=None)
@given(a=_state_strategy(4, 2, 3, np.float16), b=_state_strategy(4, 2, 3, np.float16),
       extreme=st.sampled_from([0.0, 1e4, -1e4, 3e38]))
def test_merge_never_nan(a, b, extreme):
    """Finite inputs (states may be empty, scores may be huge) never produce NaN."""
    va, sa = a
    vb, sb = b
    sa = sa.copy()
    if extreme:
        sa[0, 0] = extreme
        sb = sb.copy()
        sb[0, 1] = -extreme
    for out in (merge_state(va, sa, vb, sb), merge_state(vb, sb, va, sa),
                merge_states(np.stack([va, vb], 1), np.stack([sa, sb], 1))):
        assert not np.isnan(out[0].astype(np.float32)).any()
        assert not np.isnan(out[1]).any()
        both = np.isneginf(sa) & np.isneginf(sb)
        assert np.isneginf(out[1][both]).all() and (out[0][both] == 0).all()
        assert np.isfinite(out[1][~both]).all()
    v2, s2 = va.copy(), sa.copy()
    merge_state_(v2, s2, vb, sb)
    assert not np.isnan(v2.astype(np.float32)).any() and not np.isnan(s2).any()
