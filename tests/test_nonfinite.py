"""Non-finite values (docs/contract.md): NaN in, NaN out; an empty state is never
confused with a broken one; the v of an empty state is ignored. Every backend agrees."""
import warnings

import numpy as np
import pytest
from cases import decode_args, make_case

import clattn

BACKENDS = [("cpu", None), ("pocl", None), ("pocl", "adreno-7xx"), ("intel", None),
            ("intel", "adreno-7xx")]


def _run(where, prof, spec, args, kw):
    dev, backend = (None, "cpu") if where == "cpu" else (where, "opencl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dec = clattn.BatchDecode(spec, dev, backend=backend, profile=prof)
        return dec.run(*args, **kw)


@pytest.mark.parametrize("where,prof", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_decode_nonfinite_inputs_give_nan_not_empty(where, prof, dtype):
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype=dtype)
    case = make_case(spec, [20, 20, 20, 20, 0, 20], seed=5)
    args, kw = decode_args(case)
    q, pages, indptr, indices = args[0].copy(), args[1].copy(), args[2], args[3]
    q[0, 0, 3] = np.nan                                   # NaN query: head 0 of seq 0
    row = lambda b, r: (indices[indptr[b] + r // 16], r % 16)  # noqa: E731
    p, slot = row(1, 7)
    pages[p, 0, 0, slot, :] = np.inf                      # +inf key row: KV head 0 of seq 1
    p, slot = row(2, 3)
    pages[p, 1, 1, slot, 5] = np.nan                      # NaN value: KV head 1 of seq 2
    out, lse, _ = _run(where, prof, spec, (q, pages) + tuple(args[2:]), kw)
    out = np.asarray(out, np.float32)
    G = spec.group_size
    assert np.isnan(lse[0, 0]) and np.isnan(out[0, 0]).all()
    assert np.isfinite(lse[0, 1:]).all() and np.isfinite(out[0, 1:]).all()
    assert np.isnan(lse[1, :G]).all() and np.isnan(out[1, :G]).all()
    assert np.isfinite(lse[1, G:]).all()
    assert np.isnan(out[2, G:, 5]).all() and np.isfinite(lse[2, G:]).all()
    assert np.isfinite(out[2, G:, :5]).all() and np.isfinite(out[2, :G]).all()
    assert np.isfinite(out[3]).all() and np.isfinite(lse[3]).all()
    assert (out[4] == 0).all() and np.isneginf(lse[4]).all()   # empty: exactly (0, -inf)
    assert np.isfinite(out[5]).all()


@pytest.mark.parametrize("where,prof", BACKENDS)
@pytest.mark.parametrize("split", [False, 4], ids=["unsplit", "split4"])
def test_all_scores_minus_inf_is_broken_not_empty(where, prof, split):
    """A chunk that has rows but whose every score is -inf (keys of -inf against a
    positive query) is undefined: NaN, as softmax over all -inf logits, never -inf; also
    when split-KV cuts it into partitions that are each empty to the merge."""
    spec = clattn.AttentionSpec(4, 1, 64, page_size=16, dtype="float32")
    case = make_case(spec, [40, 40], seed=2)
    args, kw = decode_args(case)
    q, pages = np.abs(args[0]) + 0.5, args[1].copy()
    for r in range(40):
        pages[args[3][args[2][0] + r // 16], 0, 0, r % 16, :] = -np.inf
    out, lse, _ = _run(where, prof, spec, (q, pages) + tuple(args[2:]), dict(kw, split=split))
    assert np.isnan(lse[0]).all() and np.isnan(np.asarray(out[0], np.float32)).all()
    assert np.isfinite(lse[1]).all()


@pytest.mark.parametrize("where,prof", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_merges_nonfinite_states(where, prof, dtype):
    rng = np.random.default_rng(1)
    N, H, D = 5, 2, 64
    v = rng.standard_normal((N, H, D)).astype(dtype)
    vo = rng.standard_normal((N, H, D)).astype(dtype)
    s = rng.standard_normal((N, H)).astype(np.float32)
    so = rng.standard_normal((N, H)).astype(np.float32)
    s[0, 0] = np.nan                          # broken -> broken
    so[1, 0] = np.inf                         # +inf is broken too
    s[2, 0], v[2, 0] = -np.inf, np.nan        # empty side's v ignored
    so[3], vo[3] = -np.inf, np.inf            # empty other side: passes v through
    s[4], so[4] = -np.inf, -np.inf            # both empty: (0, -inf)
    v[4], vo[4] = np.nan, np.nan
    dev = None if where == "cpu" else where
    kw = dict(device=dev, profile=prof)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = v.copy(), s.copy()
        clattn.merge_state_(a, b, vo, so, **kw)
        ko, kl = clattn.merge_states(np.stack([v, vo], 1), np.stack([s, so], 1), **kw)
    for o, l_ in ((a, b), (ko, kl)):
        o = o.astype(np.float32)
        assert np.isnan(l_[0, 0]) and np.isnan(o[0, 0]).all()
        assert np.isnan(l_[1, 0]) and np.isnan(o[1, 0]).all()
        assert l_[2, 0] == so[2, 0] and np.array_equal(o[2, 0], vo[2, 0].astype(np.float32))
        assert np.array_equal(l_[3], s[3]) and np.array_equal(o[3], v[3].astype(np.float32))
        assert np.isneginf(l_[4]).all() and (o[4] == 0).all()
        assert np.isfinite(l_[:4, 1]).all() and np.isfinite(o[:4, 1]).all()
