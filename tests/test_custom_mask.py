"""Prefill with a custom mask (tree speculative decoding) against the float64 oracle.

The oracle is ``prefill_cases.naive_prefill`` with ``mask``: one ``naive.naive_decode``
per query over its causal rows, attending only the rows its bool mask keeps (read from the
unpacked matrices, never from clattn's packing). Every target of conftest runs it: the CPU
backend, each device's ``rows`` kernel, each device running the GPU ``tiled`` kernel.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cases import compare, spec_scenario
from conftest import DEVICES
from naive import ScoredLse, naive_decode
from prefill_cases import naive_prefill, prefill_case, run
from test_cache import make_cache
from test_prefill import get_prefill

import clattn

F16, F32 = "float16", "float32"
#: a windowed f32 scenario (group 4, soft-cap) and an f16 one (group 1, page of 4 rows)
SCENARIOS = {
    F32: spec_scenario("mask-f32", 8, 2, 64, dtype=F32, page_size=16, sliding_window=True,
                       softcap=30.0),
    F16: spec_scenario("mask-f16", 4, 4, 32, dtype=F16, page_size=4),
}
#: (cached, new) tokens per sequence: chunks of 3, 7 and 13 queries, segments of an odd
#: number of bits (3 x 3, 7 x 44, 13 x 33)
CACHED, NEW = [0, 37, 20], [3, 7, 13]


def ancestors_mask(parents: list[int], prefix: int) -> np.ndarray:
    """The tree's ``[n, prefix + n]`` mask by walking each node's parent chain (the
    test's own, to check ``clattn.tree_mask``): the prefix, the ancestors, itself."""
    n = len(parents)
    m = np.zeros((n, prefix + n), bool)
    m[:, :prefix] = True
    for i in range(n):
        j = i
        while j >= 0:
            m[i, prefix + j] = True
            j = parents[j]
    return m


def random_masks(case, seed: int, empty_rows: bool = True) -> list[np.ndarray]:
    """One random ``[n_b, chunk_b]`` mask per sequence, about half the bits set; with
    ``empty_rows`` one query of each sequence keeps nothing."""
    rng = np.random.default_rng(seed)
    masks = [rng.random((int(n), int(c))) < 0.5 for n, c in zip(case["chunks"], case["rows"])]
    if empty_rows:
        for m in masks:
            m[rng.integers(len(m))] = False
    return masks


def check(pre, sc, case, masks, *, what="", **call):
    bits, indptr = clattn.pack_mask(masks)
    res = run(pre, case, custom_mask=bits, mask_indptr=indptr, **call)
    ref = naive_prefill(sc, case, mask=masks, **call)
    compare(res.out, res.lse, *ref, pre.spec.dtype, what=what)
    return res, ref


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_random_masks(target, dtype, causal):
    """Random masks with a fully masked query per sequence, B = 3 of different chunks; the
    f32 scenario with a window and sinks on one sequence."""
    sc = SCENARIOS[dtype]
    pre = get_prefill(sc.spec, target)
    win = dict(window=[0, 20, 0], sinks=[0, 5, 0]) if sc.spec.sliding_window else {}
    case = prefill_case(sc.spec, CACHED, NEW, seed=2, **win)
    masks = random_masks(case, 3)
    row = int(case["rows"][2]) - NEW[2]      # sequence 2's query 0 sits at this chunk row
    masks[2][0] = np.arange(masks[2].shape[1]) > row   # keeps only rows after its own
    _, ref = check(pre, sc, case, masks, causal=causal,
                   what=f"{target} {dtype} causal={causal}: ")
    assert np.isneginf(np.asarray(ref[1])).any()  # the masked queries are empty
    assert np.isneginf(np.asarray(ref[1])[NEW[0] + NEW[1]]).all() == causal


@pytest.mark.parametrize("dtype", [F32, F16])
def test_masks_over_several_prefill_units(target, dtype):
    """Sequences of 37 and 50 queries: more than a prefill work unit holds (16 or fewer
    queries), so each unit after a sequence's first reads its mask from its own offset
    into the sequence's segment; every query against the oracle."""
    sc = SCENARIOS[dtype]
    pre = get_prefill(sc.spec, target)
    win = dict(window=[0, 0], sinks=[0, 0]) if sc.spec.sliding_window else {}
    case = prefill_case(sc.spec, [5, 0], [37, 50], seed=15, **win)
    check(pre, sc, case, random_masks(case, 16), what=f"{target} {dtype} 37/50 queries: ")


def test_masks_with_learned_sinks(target):
    """A mask and learned sinks in one call: a query whose mask keeps no row gives its
    head's sink alone (out 0, lse = sink log2 e), every other query the oracle's softmax
    with the sink in its denominator."""
    sc = SCENARIOS[F32]
    pre = get_prefill(sc.spec, target)
    case = prefill_case(sc.spec, CACHED, NEW, seed=5, window=[0, 20, 0], sinks=[0, 5, 0])
    masks = random_masks(case, 6)
    sinks = np.random.default_rng(7).normal(0, 2, sc.spec.num_qo_heads).astype(np.float32)
    res, ref = check(pre, sc, case, masks, sink_logits=sinks, what=f"{target} sinks: ")
    empty = int(np.flatnonzero(~masks[0].any(axis=1))[0])   # sequence 0's query
    np.testing.assert_allclose(np.asarray(ref[1])[empty], sinks * np.log2(np.e), rtol=1e-6)
    assert not res.out[empty].any()


def test_rope_and_tree(target):
    """A draft tree over a cached prefix, RoPE in the kernel, next to a plain sequence
    (an all-ones mask: causal alone) and one whose queries all keep nothing."""
    sc = SCENARIOS[F32]
    pre = get_prefill(sc.spec, target)
    parents = [-1, 0, 0, 1, 1, 2, 5, -1, 7]  # two roots; depth up to 4
    case = prefill_case(sc.spec, [30, 5, 11], [len(parents), 4, 2], seed=4, rope=True,
                        window=[0, 0, 0], sinks=[0, 0, 0])
    rows = [int(r) for r in case["rows"]]
    tree = clattn.tree_mask(parents, rows[0] - len(parents))
    np.testing.assert_array_equal(tree, ancestors_mask(parents, rows[0] - len(parents)))
    with pytest.raises(ValueError, match=r"parents\[1\]=1: must be -1 \(a root\) or an earlier"):
        clattn.tree_mask([-1, 1], 3)
    masks = [tree, np.ones((4, rows[1]), bool),
             np.zeros((2, rows[2]), bool)]
    res, _ = check(pre, sc, case, masks, rotary_mode=1, what=f"{target} tree: ")
    assert np.isneginf(res.lse[-2:]).all() and not res.out[-2:].any()


def test_all_ones_mask_equals_no_mask(target):
    """A mask keeping every row changes nothing: the same results, bit for bit."""
    sc = SCENARIOS[F16]
    pre = get_prefill(sc.spec, target)
    case = prefill_case(sc.spec, CACHED, NEW, seed=6)
    bits, indptr = clattn.pack_mask([np.ones((int(n), int(c)), bool)
                                     for n, c in zip(case["chunks"], case["rows"])])
    for causal in (True, False):
        plain = run(pre, case, causal=causal)
        masked = run(pre, case, causal=causal, custom_mask=bits, mask_indptr=indptr)
        np.testing.assert_array_equal(masked.out, plain.out)
        np.testing.assert_array_equal(masked.lse, plain.lse)


def test_masked_rows_values_never_read(target):
    """Inf in the values of rows no query keeps does not reach the output (a masked
    row's value is never multiplied by its zero weight)."""
    sc = SCENARIOS[F32]
    pre = get_prefill(sc.spec, target)
    case = prefill_case(sc.spec, [40], [5], seed=8, window=[0], sinks=[0])
    masks = random_masks(case, 9, empty_rows=False)
    masks[0][:, 3] = False          # chunk row 3 (one of the cached rows): nobody keeps it
    ps = case["page_size"]
    page = case["page_indices"][3 // ps]
    case["pages"][page, 1, :, 3 % ps] = np.inf
    check(pre, sc, case, masks, what=f"{target} inf values: ")


def test_device_mask_arrays(device_target):
    """custom_mask and mask_indptr as device arrays: the same results as from numpy."""
    sc = SCENARIOS[F16]
    pre = get_prefill(sc.spec, device_target)
    case = prefill_case(sc.spec, CACHED, NEW, seed=10)
    masks = random_masks(case, 11)
    bits, indptr = clattn.pack_mask(masks)
    queue = pre.setup.runtime.queue
    cla = clattn.runtime.cl().array
    host = run(pre, case, custom_mask=bits, mask_indptr=indptr)
    dev = run(pre, case, custom_mask=cla.to_device(queue, bits),
              mask_indptr=cla.to_device(queue, indptr))
    np.testing.assert_array_equal(dev.out, host.out)
    np.testing.assert_array_equal(dev.lse, host.lse)
    with pytest.raises(ValueError, match=r"mask_indptr: expected shape \(4\)"):
        run(pre, case, custom_mask=cla.to_device(queue, bits),
            mask_indptr=cla.to_device(queue, indptr[:3]))


def test_pack_mask_layout():
    """Bit k of a segment is element k of the row-major matrix, least significant bit of
    byte k // 8 first; segments of ceil(n * chunk / 8) bytes one after another."""
    rng = np.random.default_rng(0)
    masks = [rng.random(s) < 0.5 for s in ((3, 3), (0, 5), (7, 44), (1, 1), (2, 0))]
    bits, indptr = clattn.pack_mask(masks)
    assert bits.dtype == np.uint8 and indptr.dtype == np.int32
    assert indptr.tolist() == [0, 2, 2, 41, 42, 42] and len(bits) == 42
    for b, m in enumerate(masks):
        flat = m.reshape(-1)
        seg = bits[indptr[b]:indptr[b + 1]]
        for k, want in enumerate(flat):
            assert bool(seg[k // 8] >> (k % 8) & 1) == bool(want)
        pad = len(seg) * 8 - len(flat)   # the padding bits of the last byte are 0
        assert pad < 8 and (not pad or seg[-1] >> (8 - pad) == 0)
    empty, ind = clattn.pack_mask([])
    assert empty.shape == (0,) and ind.tolist() == [0]
    with pytest.raises(TypeError, match=r"masks\[0\]: expected a numpy bool array"):
        clattn.pack_mask([np.ones((2, 2), np.int8)])
    with pytest.raises(ValueError, match=r"masks\[1\]: expected a 2-d"):
        clattn.pack_mask([np.ones((2, 2), bool), np.ones(4, bool)])


def test_validation():
    """Bad masks are refused before anything runs, naming the argument and the fix."""
    sc = SCENARIOS[F16]
    pre = clattn.BatchPrefill(sc.spec, backend="cpu")
    case = prefill_case(sc.spec, CACHED, NEW, seed=12)
    masks = random_masks(case, 13)
    bits, indptr = clattn.pack_mask(masks)
    out = np.full(case["q"].shape, 7, case["q"].dtype)

    def bad(match, exc=ValueError, **kw):
        with pytest.raises(exc, match=match):
            run(pre, case, out=out, **{"custom_mask": bits, "mask_indptr": indptr, **kw})
        assert (out == 7).all()   # nothing written

    bad("mask_indptr: required with custom_mask; pack the masks with clattn.pack_mask",
        mask_indptr=None)
    bad("custom_mask: required with mask_indptr", custom_mask=None)
    bad("custom_mask: dtype bool is not allowed; use uint8", TypeError,
        custom_mask=bits.astype(bool))
    bad(r"custom_mask: expected 1 dimensions", custom_mask=bits.reshape(1, -1))
    bad(r"mask_indptr: expected shape \(4\)", mask_indptr=indptr[:-1])
    bad("mask_indptr: dtype int64 is not allowed", TypeError, mask_indptr=indptr.astype(np.int64))
    bad(r"mask_indptr\[-1\]=\d+: must equal the bytes of custom_mask", custom_mask=bits[:-1])
    bad(r"mask_indptr: decreases at sequence 1",
        mask_indptr=np.array([0, 5, 2, len(bits)], np.int32))
    # a segment of another size than its [n_b, chunk_b] matrix packs into
    wrong = [masks[0], masks[1][:, :-1], masks[2]]
    wbits, wind = clattn.pack_mask(wrong)
    bad(r"mask_indptr: sequence 1's segment has 38 bytes, but its mask \[7 queries, 44 chunk "
        r"rows\] packs into 39; pack a \[n_b, chunk_b\] bool matrix per sequence",
        custom_mask=wbits, mask_indptr=wind)


@pytest.mark.parametrize("parents, prefix, match", [
    ([-1, 0.5], 2, r"parents\[1\]=0.5: must be -1 \(a root\) or an earlier node \(0..0\), "
                   r"an integer"),
    ([-1, "0"], 2, r"parents\[1\]='0': must be -1"),
    ([-1, True], 2, r"parents\[1\]=True: must be -1"),
    ([-1, 0], 2.5, r"prefix=2.5: must be an integer >= 0"),
    ([-1, 0], "3", r"prefix='3': must be an integer >= 0"),
    ([-1, 0], -1, r"prefix=-1: must be an integer >= 0"),
])
def test_tree_mask_refuses_what_is_not_an_integer(parents, prefix, match):
    """tree_mask takes integers only (Python or numpy): a float or string parent or prefix
    is a ValueError naming the argument, as its docstring promises, never rounded."""
    with pytest.raises(ValueError, match=match):
        clattn.tree_mask(parents, prefix)
    np.testing.assert_array_equal(clattn.tree_mask(np.array([-1, 0, 0]), np.int64(2)),
                                  ancestors_mask([-1, 0, 0], 2))


@pytest.mark.parametrize("where", ["cpu", "device"])
def test_tree_verify_example(where):
    """examples/tree_verify.py at smoke size: the tree against its float64 oracle, then the
    accepted path through the cache; it exits 0 only within its bounds."""
    root = Path(__file__).resolve().parent.parent
    device = "cpu" if where == "cpu" else next(iter(DEVICES), None)
    if device is None:
        pytest.skip("no OpenCL device")
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "examples" / "tree_verify.py"),
                           "--device", device, "--prefix", "20"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), \
        proc.stdout + proc.stderr[-3000:]


def _oracle_rows(q, k, v, keep):
    """naive_decode of one token's queries ``q [H, D]`` over rows ``k, v [R, H_kv, D]``
    (one row a page) keeping ``keep [R]``."""
    R = len(k)
    pages = np.stack([k, v], axis=1)[:, :, :, None, :]     # [R, 2, H_kv, 1, D]
    return naive_decode(q[None], pages, np.array([0, R]), np.arange(R, dtype=np.int32),
                        np.array([1]), keep=[keep])


def test_cache_masks_refused_before_reserving(target):
    """A cache that rotates keys (a draft token sits at its depth, not its row) and a
    wrong number of matrices or rows are refused naming ``masks`` before a page is taken:
    on a full cache too, where reserving would raise CacheFullError first."""
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype=F32,
                                rope_scaling={"rope_type": "linear", "factor": 2.0})
    for rope in ("append", "attend"):
        cache = make_cache(spec, target, layers=1, num_pages=4, rope=rope)
        cache.add("a")
        with pytest.raises(ValueError, match=f"masks: the cache rotates keys \\(rope='{rope}'\\)"):
            cache.begin(["a"], [3], masks=[None])
        assert cache.stats().pages_reserved == 0
    cache = make_cache(spec, target, layers=1, num_pages=1)
    cache.add("a")
    cache.begin(["a"], [4])
    cache.append(0, *(np.zeros((4, 2, 16), np.float32) for _ in "kv"))
    cache.end()                                    # the one page is full
    with pytest.raises(ValueError, match=r"masks\[0\]: expected a numpy bool array of 2 rows"):
        cache.begin(["a"], [2], masks=[np.ones((3, 6), bool)])
    with pytest.raises(ValueError, match="masks: 2 given for a step of 1 sequences"):
        cache.begin(["a"], [2], masks=[None, None])


def test_cache_masks_take_seq_ids_and_lengths_as_begin_does(target):
    """With masks, begin's own mistakes get the named errors they get without masks (a
    lengths list of another size than seq_ids), and seq_ids may be any iterable, a
    generator included, as without masks."""
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype=F32)
    cache = make_cache(spec, target, layers=1, num_pages=4)
    cache.add("a")
    cache.add("b")
    for masks in (None, [None, None]):
        with pytest.raises(ValueError, match=r"begin: 2 seq_ids but 1 lengths"):
            cache.begin(["a", "b"], [2], masks=masks)
    assert cache.stats().pages_reserved == 0
    for masks in (None, [None, clattn.tree_mask([-1, 0], 0)]):
        cache.begin((s for s in ("a", "b")), iter([2, 2]), masks=masks)
        assert cache.num_tokens == 4 and cache.step_kernels == ("prefill",)
        cache.cancel()
    assert cache.stats().pages_reserved == 0


def test_cache_masked_step(target):
    """PagedKVCache.begin(..., masks=): a tree step and a plain one in one masked prefill,
    every token against naive_decode over its kept rows; cancel() rolls the tree back;
    steps that cannot run masked are refused before anything is reserved."""
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype=F32)
    cache = make_cache(spec, target, layers=2, num_pages=16)
    rng = np.random.default_rng(14)
    L, Hkv, H, D = 2, 2, 4, 16
    ids, prefix, new = ["a", "b"], [9, 5], [5, 3]
    kv = {s: rng.standard_normal((L, 2, p + n, Hkv, D)).astype(np.float32)
          for s, p, n in zip(ids, prefix, new)}
    for s in ids:
        cache.add(s)
    cache.begin(ids, prefix)
    for layer in range(L):
        cache.append(layer, *(np.concatenate([kv[s][layer, j, :p] for s, p in zip(ids, prefix)])
                              for j in (0, 1)))
    cache.end()
    masks = [clattn.tree_mask([-1, 0, 0, 1, -1], prefix[0]), None]
    for bad, match in (([None], "masks: 1 given for a step of 2 sequences"),
                       ([None, np.ones((3, 7), bool)],
                        r"masks\[1\]: expected a numpy bool array of shape \(3, 8\)")):
        with pytest.raises(ValueError, match=match):
            cache.begin(ids, new, masks=bad)
    with pytest.raises(ValueError, match="masks: a masked step attends on the prefill kernel "
                                         "alone: every sequence must bring two or more tokens"):
        cache.begin(ids, [5, 1], masks=[None, None])
    assert cache.stats().pages_reserved == 0
    cache.begin(ids, new, masks=masks)
    assert cache.step_kernels == ("prefill",)
    q = rng.standard_normal((L, sum(new), H, D)).astype(np.float32)
    keeps = [masks[0], np.tril(np.ones((new[1], prefix[1] + new[1]), bool), prefix[1])]
    for layer in range(L):
        cache.append(layer, *(np.concatenate([kv[s][layer, j, p:] for s, p in zip(ids, prefix)])
                              for j in (0, 1)))
        res = cache.attend(layer, q[layer])
        refs = [_oracle_rows(q[layer, t0 + i], kv[s][layer, 0], kv[s][layer, 1], keep[i])
                for s, t0, keep in zip(ids, (0, new[0]), keeps) for i in range(len(keep))]
        ref_o = np.concatenate([r[0] for r in refs])
        ref_l = ScoredLse(np.concatenate([np.asarray(r[1]) for r in refs]),
                          **{f: np.concatenate([getattr(r[1], f) for r in refs])
                             for f in ScoredLse.FIELDS})
        compare(np.asarray(res.out), np.asarray(res.lse), ref_o, ref_l, F32,
                what=f"{target} cache layer {layer}: ")
    cache.cancel()
    assert [cache.length(s) for s in ids] == prefix
