"""Every bad input raises (ValueError/TypeError naming the argument) before anything is written."""
import numpy as np
import pytest
from cases import compare, make_case
from naive import naive_decode

from clattn.cpu_backend import batch_decode, merge_state, merge_state_, merge_states
from clattn.spec import AttentionSpec

BAD_SEQ = 3          # the sequence made invalid in per-sequence cases
LENGTHS = [5, 0, 8, 6]
PS = 4
ERR = (ValueError, TypeError)


def base(*, window=False, rope=False, dtype="float32"):
    spec = AttentionSpec(8, 2, 16, page_size=PS, dtype=dtype, sliding_window=window)
    case = make_case(spec, LENGTHS, seed=5, window=[2, 0, 3, 4] if window else None,
                     sinks=[1, 0, 2, 1] if window else None, rope=rope)
    args = [case["q"], case["pages"], case["page_indptr"], case["page_indices"],
            case["last_page_len"]]
    kw = {}
    if window:
        kw.update(window_offset=case["window_offset"], sink_size=case["sink_size"])
    if rope:
        kw.update(q_pos=case["q_pos"], k_pos_offset=case["k_pos_offset"], rotary_mode=1)
    return spec, args, kw


def expect_raise(spec, args, kw, pattern, exc=ERR, seq=None):
    """Call batch_decode; it must raise ``exc`` matching ``pattern`` and leave every array as is."""
    B = 4
    out = kw.pop("out", np.full((B, spec.num_qo_heads, spec.head_dim), 7, dtype=spec.dtype))
    lse = kw.pop("lse", np.full((B, spec.num_qo_heads), 7, dtype=np.float32))
    arrays = [a for a in list(args) + list(kw.values()) + [out, lse] if isinstance(a, np.ndarray)]
    before = [a.copy() for a in arrays]
    with pytest.raises(exc, match=pattern) as ei:
        batch_decode(spec, *args, out=out, lse=lse, **kw)
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a, b, err_msg="an array was modified before the raise")
    if seq is not None:
        assert str(seq) in str(ei.value), f"sequence index {seq} not in message: {ei.value}"
    return ei.value


def test_valid_base_cases_run():
    """The base cases the bad ones are made from are valid: they run and are right."""
    for window in (False, True):
        for rope in (False, True):
            spec, args, kw = base(window=window, rope=rope)
            out, lse = batch_decode(spec, *args, **kw)
            compare(out, lse, *naive_decode(*args, **kw), spec.dtype,
                    what=f"window={window} rope={rope}: ")
            assert np.isneginf(lse[1]).all() and np.isfinite(lse[[0, 2, 3]]).all()


# --------------------------------------------------------------------------- q and pages
def _q(f):
    def mut(args, kw):
        args[0] = f(args[0])
    return mut


def _pages(f):
    def mut(args, kw):
        args[1] = f(args[1])
    return mut


SHAPE_CASES = {
    "q-ndim2": (_q(lambda q: q[0].copy()), r"\bq\b"),
    "q-ndim4": (_q(lambda q: q[..., None].copy()), r"\bq\b"),
    "q-heads": (_q(lambda q: np.zeros((4, 9, 16), q.dtype)), r"\bq\b"),
    "q-heads-kv": (_q(lambda q: np.zeros((4, 2, 16), q.dtype)), r"\bq\b"),
    "q-head_dim": (_q(lambda q: np.zeros((4, 8, 18), q.dtype)), r"\bq\b|\bpages\b"),
    "q-batch": (_q(lambda q: np.zeros((5, 8, 16), q.dtype)), r"\bq\b|page_indptr"),
    "pages-ndim": (_pages(lambda p: p[:, 0].copy()), r"\bpages\b"),
    "pages-kv-heads": (_pages(lambda p: np.zeros(p.shape[:2] + (4,) + p.shape[3:], p.dtype)),
                       r"\bpages\b"),
    "pages-page_size": (_pages(lambda p: np.zeros(p.shape[:3] + (8,) + p.shape[4:], p.dtype)),
                        r"\bpages\b"),
    "pages-head_dim": (_pages(lambda p: np.zeros(p.shape[:4] + (18,), p.dtype)), r"\bpages\b"),
    "pages-kv-axis-3": (_pages(lambda p: np.zeros(p.shape[:1] + (3,) + p.shape[2:], p.dtype)),
                        r"\bpages\b"),
    "pages-kv-axis-1": (_pages(lambda p: p[:, :1].copy()), r"\bpages\b"),
}


@pytest.mark.parametrize("key", list(SHAPE_CASES))
def test_shapes(key):
    spec, args, kw = base()
    mut, pattern = SHAPE_CASES[key]
    mut(args, kw)
    expect_raise(spec, args, kw, pattern)


def test_dtype_mismatch_q_pages():
    spec, args, kw = base()
    args[1] = args[1].astype(np.float16)
    expect_raise(spec, args, kw, r"\bq\b|\bpages\b")
    spec, args, kw = base(dtype="float16")
    args[0] = args[0].astype(np.float32)
    expect_raise(spec, args, kw, r"\bq\b|\bpages\b")


def test_dtype_not_spec_dtype():
    spec, args, kw = base(dtype="float16")
    args[0] = args[0].astype(np.float32)
    args[1] = args[1].astype(np.float32)
    expect_raise(spec, args, kw, r"\bq\b|\bpages\b", exc=TypeError)


def test_float64_q():
    spec, args, kw = base()
    args[0] = args[0].astype(np.float64)
    expect_raise(spec, args, kw, r"\bq\b", exc=TypeError)
    args[1] = args[1].astype(np.float64)
    expect_raise(spec, args, kw, r"\bq\b|\bpages\b", exc=TypeError)


def test_non_contiguous():
    spec, args, kw = base()
    big = np.zeros((4, 16, 16), np.float32)
    big[:, ::2] = args[0]
    args[0] = big[:, ::2]
    assert not args[0].flags.c_contiguous
    expect_raise(spec, args, kw, r"\bq\b")
    spec, args, kw = base()
    args[1] = np.asfortranarray(args[1])
    expect_raise(spec, args, kw, r"\bpages\b")
    spec, args, kw = base()
    bigi = np.zeros(2 * len(args[3]), np.int32)
    bigi[::2] = args[3]
    args[3] = bigi[::2]
    expect_raise(spec, args, kw, r"page_indices")


# --------------------------------------------------------------------------- tables
@pytest.mark.parametrize("pos,name",
                         [(2, "page_indptr"), (3, "page_indices"), (4, "last_page_len")])
@pytest.mark.parametrize("bad", [np.int64, np.uint32, np.int16, np.float32])
def test_table_dtypes(pos, name, bad):
    spec, args, kw = base()
    args[pos] = args[pos].astype(bad)
    expect_raise(spec, args, kw, name, exc=TypeError)


def test_int64_page_indices_is_type_error():
    spec, args, kw = base()
    args[3] = args[3].astype(np.int64)
    expect_raise(spec, args, kw, "page_indices", exc=TypeError)


@pytest.mark.parametrize("key", ["window_offset", "sink_size"])
def test_window_table_dtypes(key):
    spec, args, kw = base(window=True)
    kw[key] = kw[key].astype(np.int64)
    expect_raise(spec, args, kw, key, exc=TypeError)


@pytest.mark.parametrize("key", ["q_pos", "k_pos_offset"])
def test_rope_table_dtypes(key):
    spec, args, kw = base(rope=True)
    kw[key] = kw[key].astype(np.int64)
    expect_raise(spec, args, kw, key, exc=TypeError)


def test_page_indptr_length():
    for n in (4, 6):
        spec, args, kw = base()
        ip = args[2]
        args[2] = np.concatenate([ip, ip[-1:]])[:n].astype(np.int32) if n > 5 else ip[:n].copy()
        expect_raise(spec, args, kw, r"page_indptr|\bq\b")


def test_page_indptr_start():
    spec, args, kw = base()
    args[2] = args[2].copy()
    args[2][0] = 1
    expect_raise(spec, args, kw, "page_indptr")


def test_page_indptr_decreasing():
    spec, args, kw = base()
    ip = args[2].copy()                # [0, 2, 2, 4, 6]
    ip[BAD_SEQ] = ip[BAD_SEQ + 1] + 1   # sequence 3 has negative page count
    args[2] = ip
    expect_raise(spec, args, kw, "page_indptr", seq=BAD_SEQ)


def test_page_indptr_beyond_indices():
    spec, args, kw = base()
    args[3] = args[3][:-1].copy()
    expect_raise(spec, args, kw, r"page_indptr|page_indices")
    spec, args, kw = base()
    ip = args[2].copy()
    ip[-1] += 1
    args[2] = ip
    expect_raise(spec, args, kw, r"page_indptr|page_indices")


@pytest.mark.parametrize("value", [-1, "P", "P+5", -100])
def test_page_id_out_of_range(value):
    spec, args, kw = base()
    P = args[1].shape[0]
    v = {"P": P, "P+5": P + 5}.get(value, value)
    pi = args[3].copy()
    pi[-1] = v                         # the last page of sequence 3
    args[3] = pi
    expect_raise(spec, args, kw, "page_indices")


@pytest.mark.parametrize("value", [0, PS + 1, -1])
def test_last_page_len_range(value):
    spec, args, kw = base()
    lpl = args[4].copy()
    lpl[BAD_SEQ] = value
    args[4] = lpl
    expect_raise(spec, args, kw, "last_page_len", seq=BAD_SEQ)


def test_last_page_len_ignored_for_empty_sequence():
    spec, args, kw = base()
    want = batch_decode(spec, *args, **kw)
    for value in (0, PS + 7, -3):
        lpl = args[4].copy()
        lpl[1] = value                  # sequence 1 owns no page
        got = batch_decode(spec, *args[:4], lpl, **kw)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert (got[0][1] == 0).all() and np.isneginf(got[1][1]).all()


def test_last_page_len_length():
    spec, args, kw = base()
    args[4] = args[4][:3].copy()
    expect_raise(spec, args, kw, "last_page_len")
    spec, args, kw = base()
    args[4] = None
    expect_raise(spec, args, kw, r"last_page_len|length_info")


# --------------------------------------------------------------------------- sliding window
def test_window_offset_beyond_stored():
    spec, args, kw = base(window=True)
    wo = kw["window_offset"].copy()
    wo[BAD_SEQ] = LENGTHS[BAD_SEQ] + 1
    kw["window_offset"] = wo
    expect_raise(spec, args, kw, "window_offset", seq=BAD_SEQ)


def test_window_fields_of_empty_sequence_are_ignored():
    """Like last_page_len, window fields of a sequence that owns no page are ignored
    (TVM's length_info convention): the empty chunk gives out 0, lse -inf."""
    spec, args, kw = base(window=True)
    wo = kw["window_offset"].copy()
    wo[1] = 1                            # sequence 1 stores nothing
    kw["window_offset"] = wo
    out, lse = batch_decode(spec, *args, **kw)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))


def test_window_offset_negative():
    spec, args, kw = base(window=True)
    wo = kw["window_offset"].copy()
    ss = kw["sink_size"].copy()
    wo[BAD_SEQ] = -1
    ss[BAD_SEQ] = 0
    kw.update(window_offset=wo, sink_size=ss)
    expect_raise(spec, args, kw, "window_offset", seq=BAD_SEQ)


def test_sink_size_beyond_window_offset():
    spec, args, kw = base(window=True)
    ss = kw["sink_size"].copy()
    ss[BAD_SEQ] = kw["window_offset"][BAD_SEQ] + 1
    kw["sink_size"] = ss
    expect_raise(spec, args, kw, "sink_size", seq=BAD_SEQ)


def test_sink_size_negative():
    spec, args, kw = base(window=True)
    ss = kw["sink_size"].copy()
    ss[BAD_SEQ] = -1
    kw["sink_size"] = ss
    expect_raise(spec, args, kw, "sink_size", seq=BAD_SEQ)


@pytest.mark.parametrize("key", ["window_offset", "sink_size"])
def test_window_arrays_length(key):
    spec, args, kw = base(window=True)
    kw[key] = kw[key][:3].copy()
    expect_raise(spec, args, kw, key)


def test_window_mode_needs_window_arrays():
    spec, args, kw = base(window=True)
    del kw["window_offset"], kw["sink_size"]
    expect_raise(spec, args, kw, r"window_offset, sink_size: required in sliding-window mode")
    # plain specs take no window arrays
    spec, args, kw = base()
    expect_raise(spec, args, dict(kw, window_offset=np.zeros(4, np.int32),
                                  sink_size=np.zeros(4, np.int32)),
                 r"window_offset/sink_size: given, but the spec has sliding_window=False")


def test_length_info_shapes():
    # plain mode: [B] only
    spec, args, kw = base()
    lpl = args[4]
    expect_raise(spec, args, dict(kw, length_info=lpl), "length_info: pass either length_info "
                 "or last_page_len/window_offset/sink_size, not both")
    args[4] = None
    expect_raise(spec, args, kw, r"last_page_len: required \(or pass the packed length_info\)")
    for bad in (np.stack([lpl, lpl, lpl]), lpl[:3].copy(), np.stack([lpl, lpl])):
        expect_raise(spec, args, dict(kw, length_info=bad.astype(np.int32)), "length_info")
    expect_raise(spec, args, dict(kw, length_info=lpl.astype(np.int64)), "length_info",
                 exc=TypeError)
    # window mode: [3, B] only
    spec, args, kw = base(window=True)
    li = np.stack([args[4], kw.pop("window_offset"), kw.pop("sink_size")]).astype(np.int32)
    args[4] = None
    for bad in (li[0].copy(), li[:2].copy(), li[:, :3].copy(), np.concatenate([li, li[:1]])):
        expect_raise(spec, args, dict(kw, length_info=bad), "length_info")
    # per-sequence rules still apply inside length_info
    bad = li.copy()
    bad[2, BAD_SEQ] = bad[1, BAD_SEQ] + 1
    expect_raise(spec, args, dict(kw, length_info=bad), r"sink_size|length_info", seq=BAD_SEQ)
    bad = li.copy()
    bad[0, BAD_SEQ] = 0
    expect_raise(spec, args, dict(kw, length_info=bad), r"last_page_len|length_info",
                 seq=BAD_SEQ)


# --------------------------------------------------------------------------- RoPE arrays
@pytest.mark.parametrize("key", ["q_pos", "k_pos_offset"])
def test_rope_positions_missing(key):
    spec, args, kw = base(rope=True)
    del kw[key]
    expect_raise(spec, args, kw, f"^{key}: required when rotary_mode=1")


@pytest.mark.parametrize("key", ["q_pos", "k_pos_offset"])
@pytest.mark.parametrize("n", [3, 5])
def test_rope_positions_length(key, n):
    spec, args, kw = base(rope=True)
    kw[key] = np.zeros(n, np.int32)
    expect_raise(spec, args, kw, key)


def test_rotary_mode_value():
    spec, args, kw = base(rope=True)
    kw["rotary_mode"] = 2
    expect_raise(spec, args, kw, r"rotary_mode=2: must be 0 \(no RoPE\) or 1")


@pytest.mark.parametrize("kw,exc,match", [
    (dict(rope_theta="1e4"), TypeError, "rope_theta='1e4': must be a number"),
    (dict(rope_theta=0.0), ValueError, "rope_theta=0.0: must be a positive finite number"),
    (dict(rope_theta=float("inf")), ValueError, "rope_theta=inf: must be a positive finite"),
    (dict(rope_scale=1e39), ValueError, "rope_scale=1e\\+39: must be finite as a float32"),
])
def test_rope_scalars(kw, exc, match):
    spec, args, base_kw = base(rope=True)
    expect_raise(spec, args, dict(base_kw, **kw), match, exc=exc)


# --------------------------------------------------------------------------- out= / lse=
def test_out_wrong_shape_and_dtype():
    spec, args, kw = base()
    expect_raise(spec, args, dict(kw, out=np.zeros((4, 8, 15), np.float32)), r"\bout\b")
    expect_raise(spec, args, dict(kw, out=np.zeros((4, 8, 16), np.float16)), r"\bout\b")
    expect_raise(spec, args, dict(kw, out=np.zeros((4, 8, 16), np.float64)), r"\bout\b")
    nc = np.zeros((4, 8, 32), np.float32)[:, :, ::2]
    expect_raise(spec, args, dict(kw, out=nc), r"\bout\b")


def test_lse_wrong_shape_and_dtype():
    spec, args, kw = base()
    expect_raise(spec, args, dict(kw, lse=np.zeros((4, 8), np.float64)), r"\blse\b")
    expect_raise(spec, args, dict(kw, lse=np.zeros((4, 8), np.float16)), r"\blse\b")
    expect_raise(spec, args, dict(kw, lse=np.zeros((4, 7), np.float32)), r"\blse\b")
    expect_raise(spec, args, dict(kw, lse=np.zeros((4, 8, 1), np.float32)), r"\blse\b")


def test_out_untouched_on_late_error():
    """The failing rule sits in the last sequence: out/lse must still be untouched."""
    spec, args, kw = base(window=True, rope=True)
    ss = kw["sink_size"].copy()
    ss[-1] = -2
    kw["sink_size"] = ss
    expect_raise(spec, args, kw, "sink_size", seq=BAD_SEQ)


# --------------------------------------------------------------------------- merge
def _pair(dtype=np.float32, N=3, H=2, D=4):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((N, H, D)).astype(dtype),
            rng.standard_normal((N, H)).astype(np.float32),
            rng.standard_normal((N, H, D)).astype(dtype),
            rng.standard_normal((N, H)).astype(np.float32))


MERGE_BAD = {
    "v_other-shape": (2, lambda a: a[:, :, :3].copy(), r"v_other|\bv\b"),
    "v_other-rows": (2, lambda a: a[:2].copy(), r"v_other|\bv\b"),
    "v-ndim": (0, lambda a: a[0].copy(), r"\bv\b"),
    "s-shape": (1, lambda a: a[:, :1].copy(), r"\bs\b"),
    "s_other-shape": (3, lambda a: a[:2].copy(), r"s_other"),
    "s-dtype": (1, lambda a: a.astype(np.float64), r"\bs\b"),
    "s_other-dtype": (3, lambda a: a.astype(np.float16), r"s_other"),
    "v_other-dtype": (2, lambda a: a.astype(np.float16), r"v_other|\bv\b"),
    "v-float64": (0, lambda a: a.astype(np.float64), r"\bv\b"),
}


@pytest.mark.parametrize("key", list(MERGE_BAD))
def test_merge_state_bad(key):
    pos, f, pattern = MERGE_BAD[key]
    for fn in (merge_state, merge_state_):
        arrs = list(_pair())
        arrs[pos] = f(arrs[pos])
        before = [a.copy() for a in arrs]
        with pytest.raises(ERR, match=pattern):
            fn(*arrs)
        for a, b in zip(arrs, before):
            np.testing.assert_array_equal(a, b)


def test_merge_states_bad():
    rng = np.random.default_rng(1)
    v = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    s = rng.standard_normal((2, 3, 2)).astype(np.float32)
    with pytest.raises(ERR, match=r"\bv\b"):
        merge_states(v[0], s)
    with pytest.raises(ERR, match=r"\bs\b"):
        merge_states(v, s[:, :2])
    with pytest.raises(ERR, match=r"\bs\b"):
        merge_states(v, s.astype(np.float64))
    with pytest.raises(ERR, match=r"\bv\b"):
        merge_states(v.astype(np.float64), s)


def test_more_rows_than_32_bit_ints_index():
    """The kernels index a sequence's rows with 32-bit ints: a call whose page table could
    name more than 2**31 - 1 rows is refused (review: it overflowed to an empty result on
    PoCL, and a plan made from it read out of bounds), and so is planning for one."""
    from clattn import BatchDecode
    spec = AttentionSpec(1, 1, 2, page_size=1 << 20, dtype="float32")
    pages = np.zeros((1, 2, 1, 1 << 20, 2), np.float32)
    q = np.ones((1, 1, 2), np.float32)
    for n in (2048, 2049):    # 2048 x 2**20 rows = 2**31
        args = [q, pages, np.array([0, n], np.int32), np.zeros(n, np.int32),
                np.array([1], np.int32)]
        expect_raise(spec, args, {}, r"page_indices: %d entries x page_size" % n)
    dec = BatchDecode(spec, backend="cpu")
    with pytest.raises(ValueError, match=r"sequence 0 stores 2147483649 rows"):
        dec.plan(np.array([0, 2049], np.int32), np.array([1], np.int32))
    ok = [q, pages, np.array([0, 2047], np.int32), np.zeros(2047, np.int32),
          np.array([1], np.int32)]
    dec.plan(ok[2], ok[4])   # 2046 x 2**20 + 1 rows: allowed
