"""clattn.PagedKVCache: a randomized simulation against the float64 oracle, and its rules.

The simulation keeps each sequence's logical token history (keys and values per layer)
itself and, at every step, runs ``naive_decode`` on the rows each new token must attend
(its sinks and window, positions by chunk row), whatever pages the cache chose. Forks,
pops, removals, prompt chunks, windows with sinks, cancelled steps and a pool small
enough to fill all happen; after every operation the pool's reference counts and free
list are checked, and after removing every sequence the pool must be whole.
"""
from __future__ import annotations

import dataclasses
import warnings
import zlib
from dataclasses import replace

import numpy as np
import pytest
from cases import compare
from naive import naive_decode, naive_inv_freq, naive_rotate

import clattn
from clattn import quant, runtime
from clattn.cache import LayerIndexError, StepError, StepShapeError
from clattn.cache_tables import DuplicateSequenceError, PopTooLongError, UnknownSequenceError

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
          "low_freq_factor": 1.0, "original_max_position_embeddings": 64}


def make_cache(spec, target, layers=2, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        if target.is_cpu:
            return clattn.PagedKVCache(spec, layers, backend="cpu", **kw)
        return clattn.PagedKVCache(spec, layers, device=target.device, profile=target.profile,
                                   backend="opencl", **kw)


def pool_host(cache, layer):
    p = cache.pools[layer]
    return p if isinstance(p, np.ndarray) else p.get()


def check_pool(cache):
    """Reference counts equal the sequences holding each page; the free list is exactly
    the pages nobody holds, once each."""
    t = cache.table
    count = np.zeros(cache.num_pages, np.int64)
    for s in t.seqs.values():
        pages = s.pages[:s.npages]
        assert len(set(pages.tolist())) == len(pages), "a sequence holds a page twice"
        count[pages] += 1
    assert np.array_equal(count, t.refcount), "reference counts disagree with the sequences"
    assert sorted(t.free) == np.flatnonzero(count == 0).tolist(), "free list != unheld pages"


class History:
    """What the app gave the cache: per sequence, keys and values of every layer."""

    def __init__(self, spec, layers):
        self.spec, self.layers = spec, layers
        self.seqs: dict = {}

    def add(self, sid, window=None, sink=0, pos=0):
        shape = (self.layers, 0, self.spec.num_kv_heads)
        dt = np.float32 if self.spec.byte_pool else self.spec.np_dtype
        self.seqs[sid] = dict(k=np.zeros(shape + (self.spec.head_dim,), dt),
                              v=np.zeros(shape + (self.spec.head_dim_v,), dt), window=window,
                              sink=sink, pos=pos)

    def stored(self, x, kind):
        """The values a page of the spec's format holds for rows ``x``: quantized ones
        dequantized (clattn.quant's numpy rules, which test_quant checks)."""
        fmt = (self.spec.k_format, self.spec.v_format)[kind]
        if fmt in quant.QUANTIZED:
            return quant.dequantize(*quant.quantize(x, fmt), fmt)
        return x.astype(fmt) if self.spec.byte_pool else x

    def fork(self, parent, child):
        p = self.seqs[parent]
        self.seqs[child] = dict(p, k=p["k"].copy(), v=p["v"].copy())

    def pop(self, sid, n):
        s = self.seqs[sid]
        s["k"], s["v"] = s["k"][:, :s["k"].shape[1] - n], s["v"][:, :s["v"].shape[1] - n]

    def rows(self, sid, length):
        """Token indices the last of ``length`` tokens attends, in chunk order."""
        s = self.seqs[sid]
        if s["window"] is None:
            return np.arange(length)
        sink = min(s["sink"], length)
        start = max(sink, length - s["window"])
        return np.concatenate([np.arange(sink), np.arange(start, length)])

    def oracle(self, layer, ids, ks, vs, q, rope, cache):
        """float64 (out, lse) of the step's tokens; ks/vs: the step's new [T, H, D(_v)]."""
        kpieces, vpieces, qpos, kpo, t = [], [], [], [], 0
        for sid, n in ids:
            s = self.seqs[sid]
            k = np.concatenate([s["k"][layer], ks[t:t + n]])
            v = np.concatenate([s["v"][layer], vs[t:t + n]])
            base = s["k"].shape[1]
            for i in range(n):
                r = self.rows(sid, base + i + 1)
                kpieces.append(k[r])  # [rows, H, D]
                vpieces.append(v[r])  # [rows, H, D_v]
                qpos.append(s["pos"] + len(r) - 1)
                kpo.append(s["pos"])
            t += n
        pages = tuple(np.concatenate(x)[:, :, None, :] for x in (kpieces, vpieces))  # a row a page
        counts = [len(p) for p in kpieces]
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        kw = {}
        if rope:
            kw = dict(rotary_mode=1, q_pos=np.array(qpos), k_pos_offset=np.array(kpo),
                      rope_scaling=cache.spec.rope_scaling,
                      max_position_embeddings=cache.spec.max_position_embeddings,
                      rope_theta=cache.rope_theta)
        return naive_decode(q, pages, indptr, np.arange(len(pages[0]), dtype=np.int32),
                            np.ones(len(counts), np.int32), **kw)

    def commit(self, layer_k, layer_v, ids):
        t = 0
        for sid, n in ids:
            s = self.seqs[sid]
            s["k"] = np.concatenate([s["k"], layer_k[:, t:t + n]], axis=1)
            s["v"] = np.concatenate([s["v"], layer_v[:, t:t + n]], axis=1)
            t += n


def simulate(cache, steps, seed, rope):
    """Random operations on ``cache``, every attend checked against the oracle."""
    spec, L = cache.spec, cache.num_layers
    rng = np.random.default_rng(seed)
    hist = History(spec, L)
    dt = spec.np_dtype
    H, Hkv, D = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    next_id, counts = 0, dict(step=0, full=0, fork=0, pop=0, pop_refused=0, remove=0,
                              cancel=0, chunk=0, cow=0)

    def new_id():
        nonlocal next_id
        next_id += 1
        return f"s{next_id}"

    for _ in range(steps):
        r = rng.random()
        ids = list(hist.seqs)
        if not ids or (r < 0.08 and len(ids) < 5):
            sid = new_id()
            if spec.sliding_window and rng.random() < 0.6:
                w, sink = int(rng.integers(3, 14)), int(rng.integers(0, 6))
            else:
                w, sink = None, 0
            pos = int(rng.integers(0, 50))
            cache.add(sid, window=w, sink=sink, pos_offset=pos)
            hist.add(sid, w, sink, pos)
        elif r < 0.14 and len(ids) < 6:
            parent, child = ids[int(rng.integers(len(ids)))], new_id()
            cache.fork(parent, child)
            hist.fork(parent, child)
            counts["fork"] += 1
        elif r < 0.20:
            sid = ids[int(rng.integers(len(ids)))]
            n = int(rng.integers(1, 5))
            before = cache.length(sid)
            try:
                cache.pop(sid, n)
            except PopTooLongError:
                assert cache.length(sid) == before
                counts["pop_refused"] += 1
            else:
                hist.pop(sid, n)
                counts["pop"] += 1
        elif r < 0.24 and len(ids) > 1:
            sid = ids[int(rng.integers(len(ids)))]
            cache.remove(sid)
            del hist.seqs[sid]
            counts["remove"] += 1
        else:
            chosen = [i for i in ids if rng.random() < 0.7] or ids[:1]
            ns = [int(rng.integers(2, 8)) if rng.random() < 0.15 else 1 for _ in chosen]
            before = cache.stats()
            try:
                cache.begin(chosen, ns)
            except clattn.CacheFullError as exc:
                assert exc.needed > exc.free
                assert cache.stats() == before, "a refused begin changed the cache"
                longest = max(hist.seqs, key=lambda s: hist.seqs[s]["k"].shape[1])
                cache.remove(longest)
                del hist.seqs[longest]
                counts["full"] += 1
                check_pool(cache)
                continue
            counts["cow"] += cache.step_tables.n_copies
            counts["chunk"] += any(n > 1 for n in ns)
            T = sum(ns)
            assert cache.num_tokens == T
            ks = rng.standard_normal((L, T, Hkv, D)).astype(dt)
            vs = rng.standard_normal((L, T, Hkv, spec.head_dim_v)).astype(dt)
            ks_st, vs_st = hist.stored(ks, 0), hist.stored(vs, 1)
            if spec.value_in_key:   # the values: the stored keys' leading head_dim_v values
                vs_st = ks_st[..., :spec.head_dim_v]
            cancel = rng.random() < 0.05
            for layer in range(L):
                q = rng.standard_normal((T, H, D)).astype(dt)
                cache.append(layer, ks[layer], None if spec.value_in_key else vs[layer])
                res = cache.attend(layer, q)
                ref = hist.oracle(layer, list(zip(chosen, ns)), ks_st[layer], vs_st[layer], q,
                                  rope, cache)
                compare(res.out, res.lse, *ref, dt, what=f"step {counts['step']} layer {layer}: ")
            if cancel:
                cache.cancel()
                counts["cancel"] += 1
            else:
                cache.end()
                hist.commit(ks_st, vs_st, list(zip(chosen, ns)))
            counts["step"] += 1
        check_pool(cache)
        for sid, s in hist.seqs.items():
            assert cache.length(sid) == s["k"].shape[1], sid
    for sid in list(hist.seqs):
        cache.remove(sid)
    check_pool(cache)
    st = cache.stats()
    assert st.pages_free == cache.num_pages and st.pages_used == 0 and st.sequences == 0
    return counts


#: a device's own profile told to split every step into partitions of one page
SPLIT_EVERY_STEP = {"min_partition_rows": 4, "split_min_rows": 0, "wgs_per_cu": 4096}


def growing_split_steps(cache):
    """Steps whose split plans need more workspace states than the cache's first (a
    short prompt, then longer prompts of more sequences, decode steps between), each
    attend checked against the oracle; returns the workspace states each step needed."""
    spec = cache.spec
    rng = np.random.default_rng(8)
    hist = History(spec, 1)
    n_ws = []
    for sid in "abc":
        cache.add(sid)
        hist.add(sid)
    for ids, ns in ((["a"], [5]), (["a", "b"], [1, 14]), (["b", "a"], [1, 1]),
                    (["c", "b", "a"], [30, 1, 20])):
        cache.begin(ids, ns)
        T = sum(ns)
        k, v = (rng.standard_normal((1, T, spec.num_kv_heads, spec.head_dim))
                .astype(spec.np_dtype) for _ in range(2))
        q = rng.standard_normal((T, spec.num_qo_heads, spec.head_dim)).astype(spec.np_dtype)
        cache.append(0, k[0], v[0])
        res = cache.attend(0, q)
        plan = getattr(getattr(cache, "_device", None), "plan", None)
        n_ws.append(plan.n_ws if plan is not None else 0)
        compare(res.out, res.lse, *hist.oracle(0, list(zip(ids, ns)), k[0], v[0], q, False,
                                               cache), spec.dtype, what=f"{ids} {ns}: ")
        cache.end()
        hist.commit(k, v, list(zip(ids, ns)))
    return n_ws


def test_cache_grows_its_split_workspace(device):
    """The cache's split workspace grows with its steps' plans (a device's own profile
    told to split every step into one-page partitions; every token on the decode kernel,
    whose plans use the workspace)."""
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache = clattn.PagedKVCache(spec, 1, device=device, profile=SPLIT_EVERY_STEP,
                                    backend="opencl", num_pages=24, prefill=False)
    n_ws = growing_split_steps(cache)
    assert n_ws[0] > 0 and max(n_ws[1:]) > n_ws[0], n_ws


def test_cache_counts_its_launches(device):
    """stats().launches: per layer of a step the append (unless fused into the decode) and
    the attend's kernels (decode, and the merge of a split plan), as the results' events
    list them."""
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache = clattn.PagedKVCache(spec, 2, device=device, profile=SPLIT_EVERY_STEP,
                                    backend="opencl", num_pages=24, prefill=False)
    rng = np.random.default_rng(2)
    for name in ("a", "b"):
        cache.add(name)
    assert cache.stats().launches == 0
    for n in (9, 1):
        before = cache.stats().launches
        cache.begin(["a", "b"], [n, n])
        events = 0
        for layer in range(2):
            k, v = (rng.standard_normal((2 * n, 1, 16)).astype(np.float32) for _ in "kv")
            appended = cache.append(layer, k, v)
            assert (appended is None) == (n == 1 and cache.profile.fuse_append)
            events += (appended is not None) + len(cache.attend(
                layer, rng.standard_normal((2 * n, 2, 16)).astype(np.float32)).events)
        cache.end()
        assert cache.stats().launches - before == events
    # one token each, split: per layer the decode, the merge unless folded into it, and
    # the append unless fused
    prof = cache.profile
    assert events == 2 * (1 + (not prof.fold_merge) + (not prof.fuse_append))
    twin = clattn.PagedKVCache(spec, 1, backend="cpu", num_pages=4)
    assert twin.stats().launches == 0


SIM_SPECS = {
    # windows with sinks, in-kernel RoPE (llama3 scaling)
    "window-rope": (dict(sliding_window=True, rope_scaling=LLAMA3,
                         max_position_embeddings=4096), "attend"),
    # no window, keys stored as given
    "plain": (dict(), None),
    # quantized pages (byte pool): q8_0 keys rotated in the kernel, q4_0 values, windows
    "q8-q4-window-rope": (dict(head_dim=32, k_format="q8_0", v_format="q4_0",
                               sliding_window=True, rope_scaling=LLAMA3,
                               max_position_embeddings=4096), "attend"),
    # q4_0 keys beside float values of the other storage type (a byte pool all the same)
    "q4-float": (dict(head_dim=32, k_format="q4_0", v_format="float32"), None),
}


@pytest.mark.parametrize("steps", [90, pytest.param(2000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("variant", list(SIM_SPECS))
def test_simulation(target, dtype, variant, steps):
    """A few hundred steps over all targets by default; thousands under ``-m slow``."""
    build, rope = SIM_SPECS[variant]
    build = dict(build)
    spec = clattn.AttentionSpec(4, 2, build.pop("head_dim", 16), page_size=4, dtype=dtype,
                                **build)
    cache = make_cache(spec, target, num_pages=24 if steps < 1000 else 40, rope=rope)
    seed = zlib.crc32(f"{variant}-{dtype}-{steps}".encode()) % 1000
    counts = simulate(cache, steps, seed=seed, rope=rope == "attend")
    assert counts["step"] > steps // 3 and counts["fork"] and counts["chunk"], counts
    if steps >= 1000:
        assert counts["full"] and counts["cow"] and counts["pop_refused"] and counts["cancel"]


# ---------------------------------------------------------------------------- semantics
def _step(cache, ids, ns, rng, layers=None):
    spec = cache.spec
    T = sum(ns)
    cache.begin(ids, ns)
    ks, vs = [], []
    for layer in range(cache.num_layers if layers is None else layers):
        k = rng.standard_normal((T, spec.num_kv_heads, spec.head_dim)).astype(spec.np_dtype)
        v = rng.standard_normal((T, spec.num_kv_heads, spec.head_dim)).astype(spec.np_dtype)
        cache.append(layer, k, v)
        ks.append(k)
        vs.append(v)
    return ks, vs


def _forked(target, layers, seed, parent="p", child="c"):
    """A cache whose ``parent`` holds 6 tokens (a page and a half of 4) and ``child`` its
    fork; returns (cache, rng, the parent's keys per layer)."""
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype="float32")
    cache = make_cache(spec, target, layers=layers, num_pages=8)
    rng = np.random.default_rng(seed)
    cache.add(parent)
    k, _ = _step(cache, [parent], [6], rng)
    cache.end()
    cache.fork(parent, child)
    return cache, rng, k


def test_fork_copies_on_write(target):
    """The child shares the parent's pages; the first write into the shared, partly
    filled page copies it (on the device) and leaves the parent's rows alone."""
    cache, rng, k = _forked(target, 1, 0)
    assert cache.stats().pages_shared == 2
    before = pool_host(cache, 0).copy()
    kc, _ = _step(cache, ["c"], [1], rng)
    assert cache.step_tables.n_copies == 1
    cache.end()
    t = cache.table
    pp, cp = t.seqs["p"].pages[:2], t.seqs["c"].pages[:2]
    assert pp[0] == cp[0] and pp[1] != cp[1]  # full page shared, partial page copied
    after = pool_host(cache, 0)
    assert np.array_equal(after[pp[1]], before[pp[1]]), "the parent's page was written"
    assert np.array_equal(after[cp[1], :, :, :2], before[pp[1], :, :, :2]), "copy lost rows"
    assert np.array_equal(after[cp[1], 0, :, 2], kc[0][0]), "the child's new key"
    # now the parent writes in place (its page is its own again)
    _step(cache, ["p"], [1], rng)
    assert cache.step_tables.n_copies == 0
    cache.end()
    assert cache.stats().pages_shared == 1
    check_pool(cache)


def test_window_gives_pages_back(target):
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype="float16", sliding_window=True)
    cache = make_cache(spec, target, layers=1, num_pages=6)
    rng = np.random.default_rng(1)
    cache.add("s", window=8, sink=2)
    for _ in range(60):  # 60 tokens through 6 pages of 4: only possible if pages come back
        _step(cache, ["s"], [1], rng)
        cache.attend(0, rng.standard_normal((1, 2, 16)).astype(np.float16))
        cache.end()
        assert cache.stats().pages_used <= 4  # a sink page and the window's pages
    assert cache.length("s") == 60
    with pytest.raises(PopTooLongError, match="given back"):
        cache.pop("s", 1)  # the window of 59 tokens starts at 51: its page went back
    # rollback=4 keeps the pages of 4 tokens behind the window: pop 4 works, 9 does not
    cache = make_cache(spec, target, layers=1, num_pages=6, rollback=4)
    cache.add("s", window=8, sink=2)
    for _ in range(60):
        _step(cache, ["s"], [1], rng)
        cache.end()
        assert cache.stats().pages_used <= 5
    with pytest.raises(PopTooLongError, match="at most 4"):
        cache.pop("s", 9)
    cache.pop("s", 4)
    check_pool(cache)


def test_rope_at_append(target):
    """rope="append": the pool holds keys rotated at their absolute positions (float64
    rotation within f32 rounding, then the storage rounding), and attend reads them."""
    for dtype in ("float32", "float16"):
        spec = clattn.AttentionSpec(4, 2, 32, page_size=4, dtype=dtype, rotary_dim=16,
                                    rope_scaling=LLAMA3, max_position_embeddings=4096)
        cache = make_cache(spec, target, layers=1, num_pages=10, rope="append",
                           rope_theta=5e5)
        rng = np.random.default_rng(2)
        cache.add("a", pos_offset=100000)
        cache.add("b")
        ks, _ = _step(cache, ["a", "b"], [5, 3], rng)
        assert cache.positions.tolist() == [100000 + i for i in range(5)] + [0, 1, 2]
        q = rng.standard_normal((8, 4, 32)).astype(spec.np_dtype)
        res = cache.attend(0, q)
        t = cache.step_tables
        cache.end()
        pool = pool_host(cache, 0)
        _check_rotated_keys(pool, t.slots, ks[0], t.k_pos, naive_inv_freq(16, 5e5, LLAMA3, 4096),
                            16, dtype)
        # attend over the stored (rotated) keys, no rotation in the kernel
        pages = np.stack([pool[t.slots // 4, 0, :, t.slots % 4],
                          pool[t.slots // 4, 1, :, t.slots % 4]], axis=1)[:, :, :, None]
        for b, (lo, n) in enumerate(((0, 5), (5, 3))):
            for i in range(n):
                ref = naive_decode(q[lo + i:lo + i + 1], pages[lo:lo + i + 1],
                                   np.array([0, i + 1], np.int32),
                                   np.arange(i + 1, dtype=np.int32), np.ones(1, np.int32))
                compare(res.out[lo + i:lo + i + 1], res.lse[lo + i:lo + i + 1], *ref, dtype)


def _check_rotated_keys(pool, slots, k, positions, inv_att, rotary_dim, dtype):
    """The pool's keys at ``slots`` (one page axis of a float pool) are ``k [T, H, D]``
    rotated at ``positions`` (float64 rotation within the storage rounding and the f32
    rotation's error)."""
    ps = pool.shape[3]
    inv, af = inv_att
    for i, (slot, pos) in enumerate(zip(slots, positions)):
        stored = pool[slot // ps, 0, :, slot % ps].astype(np.float64)
        for h in range(k.shape[1]):
            want = naive_rotate(k[i, h].astype(np.float64), int(pos), inv, af, rotary_dim,
                                False)
            ulp = np.spacing(np.abs(want).astype(dtype)).astype(np.float64)
            assert np.all(np.abs(stored[h] - want) <= ulp + 1e-5 * np.abs(want).max()), \
                (dtype, i, h, int(pos))


def test_rope_append_positions_continue_after_a_chunk(target):
    """rope="append", pos_offset 100: a 3-token chunk, then decode steps of a batch (one
    new token each): token i of a sequence is at pos_offset + i, whatever step wrote it
    (positions, the keys the pool holds), and attend reads the rotated keys."""
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype="float32")
    cache = make_cache(spec, target, layers=1, num_pages=8, rope="append", rope_theta=1e4)
    rng = np.random.default_rng(6)
    cache.add("a", pos_offset=100)
    cache.add("b", pos_offset=7)
    _step(cache, ["a"], [3], rng)
    assert cache.positions.tolist() == [100, 101, 102]
    cache.end()
    for n, ids in enumerate((["a"], ["a", "b"], ["b", "a"])):
        want = [(100 if s == "a" else 7) + cache.length(s) for s in ids]
        ks, _ = _step(cache, ids, [1] * len(ids), rng)
        assert cache.positions.tolist() == want, f"decode step {n}"
        t = cache.step_tables
        q = rng.standard_normal((len(ids), 2, 16)).astype(np.float32)
        res = cache.attend(0, q)
        cache.end()
        pool = pool_host(cache, 0)
        _check_rotated_keys(pool, t.slots, ks[0], want, naive_inv_freq(16, 1e4, None), 16,
                            np.float32)
        for i, s in enumerate(ids):  # attend: q over the sequence's stored keys as given
            pages = cache.table.seqs[s].pages[:cache.table.seqs[s].npages]
            n_rows = cache.length(s)
            rows = np.concatenate([pool[p] for p in pages], axis=2)[:, :, :n_rows]
            ref = naive_decode(q[i:i + 1], rows.transpose(2, 0, 1, 3)[:, :, :, None],
                               np.array([0, n_rows], np.int32), np.arange(n_rows, dtype=np.int32),
                               np.ones(1, np.int32))
            compare(res.out[i:i + 1], res.lse[i:i + 1], *ref, "float32", what=f"{s} step {n}: ")


def test_positions_past_int32_refused_for_every_token_of_a_step(target):
    """A step whose last token would sit past int32 is refused before anything changes,
    whichever token of the step crosses; a step that ends exactly at 2**31 - 1 is
    accepted, and its keys are rotated at the int32 extremes."""
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype="float32")
    cache = make_cache(spec, target, layers=1, num_pages=6, rope="append", rope_theta=1e4)
    rng = np.random.default_rng(7)
    top = 2**31 - 1
    cache.add("a", pos_offset=top - 2)
    cache.add("b")
    snap = _snapshot(cache)
    for ids, ns in ((["a"], [5]), (["a"], [4]), (["b", "a"], [2, 4])):
        with pytest.raises(ValueError,
                           match=f"sequence 'a' would reach position {top + ns[-1] - 3}"):
            cache.begin(ids, ns)
        _same(_snapshot(cache), snap)
    ks, _ = _step(cache, ["b", "a"], [1, 3], rng)
    assert cache.positions.tolist() == [0, top - 2, top - 1, top]
    t = cache.step_tables
    cache.end()
    _check_rotated_keys(pool_host(cache, 0), t.slots, ks[0], [0, top - 2, top - 1, top],
                        naive_inv_freq(16, 1e4, None), 16, np.float32)
    with pytest.raises(ValueError, match="beyond int32"):
        cache.begin(["b", "a"])  # a decode step: its one token would be at 2**31
    assert cache.length("a") == 3


def test_device_arrays_and_events(device_target):
    """Device k/v/q/out/lse: nothing waits on the host; the results complete by events."""
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype="float32")
    cache = make_cache(spec, device_target, layers=2, num_pages=8)
    cl = runtime.cl()
    queue = cache.queue
    rng = np.random.default_rng(3)
    cache.add("a")
    cache.add("b")
    for step in range(3):
        cache.begin(["a", "b"], [2, 1] if step == 0 else [1, 1])
        T = cache.num_tokens
        for layer in range(2):
            k, v, q = (cl.array.to_device(queue, rng.standard_normal(s).astype(np.float32))
                       for s in ((T, 2, 16), (T, 2, 16), (T, 4, 16)))
            out = cl.array.empty(queue, (T, 4, 16), np.float32)
            lse = cl.array.empty(queue, (T, 4), np.float32)
            evt = cache.append(layer, k, v)
            # a step of one token per sequence writes in the attend launch (fused)
            assert (evt is None) == (step > 0)
            res = cache.attend(layer, q, out=out, lse=lse)
            assert res.out is out and res.event is not None
        cache.end()
    res.event.wait()
    assert np.isfinite(out.get()).all()


# ---------------------------------------------------------------------------- errors
def _snapshot(cache):
    t = cache.table
    seqs = {k: (s.length, s.npages, s.pages[:s.npages].tolist()) for k, s in t.seqs.items()}
    # the launch counter counts work done (a step's successful appends), not the cache's state
    stats = dataclasses.replace(cache.stats(), launches=0)
    return stats, seqs, [pool_host(cache, i).copy() for i in range(cache.num_layers)]


def _same(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    assert all(np.array_equal(x, y) for x, y in zip(a[2], b[2]))


def test_errors_change_nothing(target):
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype="float32", sliding_window=True)
    cache = make_cache(spec, target, layers=2, num_pages=5)
    rng = np.random.default_rng(4)
    cache.add("a")
    cache.add("w", window=4, sink=1)
    _step(cache, ["a", "w"], [5, 2], rng)
    cache.end()
    snap = _snapshot(cache)
    cases = [
        (UnknownSequenceError, "not in the cache", lambda: cache.remove("zz")),
        (UnknownSequenceError, "not in the cache", lambda: cache.begin(["a", "zz"])),
        (DuplicateSequenceError, "already", lambda: cache.add("a")),
        (DuplicateSequenceError, "already", lambda: cache.fork("w", "a")),
        (DuplicateSequenceError, "twice", lambda: cache.begin(["a", "a"])),
        (PopTooLongError, "holds 5", lambda: cache.pop("a", 6)),
        (ValueError, "lengths", lambda: cache.begin(["a"], [0])),
        (ValueError, r"add: window=0 must be a positive integer", lambda: cache.add("x", window=0)),
        (ValueError, r"add: window=2.5 must be a positive", lambda: cache.add("x", window=2.5)),
        (ValueError, r"add: sink=-1 must be an integer >= 0",
         lambda: cache.add("x", window=3, sink=-1)),
        (ValueError, r"add: sink=2 without a window", lambda: cache.add("x", sink=2)),
        (ValueError, r"add: pos_offset=2147483648 must be an int32 >= 0",
         lambda: cache.add("x", pos_offset=2**31)),
        (ValueError, r"add: pos_offset=-1 must be", lambda: cache.add("x", pos_offset=-1)),
        (ValueError, r"pop: n=-1 must be an integer >= 0", lambda: cache.pop("a", -1)),
        (ValueError, r"begin: seq_ids is empty", lambda: cache.begin([])),
        (ValueError, "2 lengths", lambda: cache.begin(["a"], [1, 1])),
        (ValueError, "sliding_window", lambda: make_cache(
            clattn.AttentionSpec(2, 1, 16, page_size=4), target, num_pages=2).add("x", window=3)),
        (clattn.CacheFullError, "needs 5 free pages, the pool has 2 of 5",
         lambda: cache.begin(["a", "w"], [20, 1])),
        (StepError, "no step", lambda: cache.append(0, None, None)),
        (StepError, "no step", lambda: cache.end()),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()
        _same(_snapshot(cache), snap)
    # errors inside a step
    cache.begin(["a", "w"], [1, 2])
    k = np.zeros((3, 1, 16), np.float32)
    with pytest.raises(StepShapeError, match="3 new tokens"):
        cache.append(0, k[:2], k[:2])
    with pytest.raises(StepShapeError):
        cache.append(0, k, np.zeros((3, 1, 8), np.float32))
    with pytest.raises(TypeError, match="dtype"):
        cache.append(0, k.astype(np.float16), k)
    with pytest.raises(LayerIndexError, match="layers 0..1"):
        cache.append(2, k, k)
    with pytest.raises(LayerIndexError):
        cache.append(-1, k, k)
    with pytest.raises(StepError, match="not been appended"):
        cache.attend(0, np.zeros((3, 2, 16), np.float32))
    with pytest.raises(StepError, match="in progress"):
        cache.begin(["a"])
    with pytest.raises(StepError, match="in progress"):
        cache.pop("a", 1)
    cache.append(0, k, k)
    with pytest.raises(StepShapeError, match="q"):
        cache.attend(0, np.zeros((2, 2, 16), np.float32))
    with pytest.raises(StepError, match=r"layers \[1\]"):
        cache.end()
    cache.cancel()
    # pools: the cancelled rows are past the ends; launches: the append that ran counts
    after = _snapshot(cache)
    _same((replace(after[0], launches=snap[0].launches), after[1], snap[2]), snap)
    check_pool(cache)


def test_sizing_and_stats(target):
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float16")
    page = 2 * 2 * 16 * 64 * 2
    cache = make_cache(spec, target, layers=3, budget_bytes=3 * page * 10 + 5)
    st = cache.stats()
    assert st.num_pages == 10 and st.pages_free == 10 and st.free_tokens == 160
    assert st.bytes_per_token == 3 * 2 * 2 * 64 * 2 == 3 * spec.bytes_per_token
    assert "10 free" in str(st)
    for kw, match in ((dict(), "exactly one"), (dict(num_pages=1, budget_bytes=1), "exactly one"),
                      (dict(budget_bytes=10), "less than one page"),
                      (dict(num_pages=0), "positive")):
        with pytest.raises(ValueError, match=match):
            make_cache(spec, target, **kw)
    with pytest.raises(ValueError, match="rope"):
        make_cache(spec, target, num_pages=2, rope="sometimes")


def test_out_of_order_queue(device):
    """A cache on a caller's out-of-order queue orders its launches by events."""
    cl = runtime.cl()
    ctx = cl.Context([device])
    try:
        props = cl.command_queue_properties
        queue = cl.CommandQueue(ctx, properties=props.OUT_OF_ORDER_EXEC_MODE_ENABLE |
                                props.PROFILING_ENABLE)
    except cl.Error as exc:
        pytest.skip(f"no out-of-order queues on this device: {exc}")
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype="float32", sliding_window=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache = clattn.PagedKVCache(spec, 2, device=queue, num_pages=24, backend="opencl")
    assert not cache.device.in_order
    counts = simulate(cache, 30, seed=11, rope=False)
    assert counts["step"] > 10, counts


def test_cancel_keeps_a_copy_another_holder_wrote_past(target):
    """A and B share a partly filled page where A holds more rows (B popped one). In one
    step A copies the page and B writes in place over A's old row; cancelling the step
    must leave A its copy, not the shared page B wrote into."""
    cache, rng, k = _forked(target, 2, 5, "a", "b")
    cache.pop("b", 1)
    _step(cache, ["a", "b"], [1, 1], rng, layers=1)  # layer 1 not appended when cancelled
    assert cache.step_tables.n_copies == 1
    cache.cancel()
    check_pool(cache)
    for layer in range(2):
        pool = pool_host(cache, layer)
        pages = cache.table.seqs["a"].pages[:2]
        got = np.concatenate([pool[pages[0], 0, 0], pool[pages[1], 0, 0, :2]])
        assert np.array_equal(got, k[layer][:, 0]), f"layer {layer}: a's keys changed"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_append_renders_for_every_profile(dtype):
    """Every built-in profile renders the append and copy kernels from their tables."""
    from test_signatures import _expected, _parsed

    from clattn import signatures
    from clattn.codegen import render_append
    from clattn.fit import Limits, append_geometry
    from clattn.profiles import builtin_profiles
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype=dtype, rotary_dim=32,
                                rope_scaling={"rope_type": "gptj"})
    for name, prof in sorted(builtin_profiles().items()):
        src = render_append(spec, append_geometry(64, dtype, prof, Limits()))
        for table in (signatures.APPEND, signatures.PAGE_COPY):
            assert _parsed(src, table.kernel) == _expected(table, "st_t"), name


def test_a_step_never_waits_for_the_device(device_target):
    """begin, every layer's append and attend, and end only enqueue (device arrays): with
    the queue held back by a user event they all return. (pyopencl's event of a copy from
    host memory waits for the copy when dropped; the table upload's was dropped at the
    first launch, which made each step wait for the previous step's kernels.)"""
    import faulthandler
    import threading
    # a call that waits holds the GIL inside pyopencl, so this thread could not release
    # the gate: end the run with a traceback rather than hang it
    faulthandler.dump_traceback_later(120, exit=True)
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype="float32")
    cache = make_cache(spec, device_target, layers=3, num_pages=12)
    cl = runtime.cl()
    queue = cache.queue
    rng = np.random.default_rng(0)
    dev = lambda shape: cl.array.to_device(queue, rng.standard_normal(shape).astype(  # noqa: E731
        np.float32))
    k, q = dev((2, 2, 16)), dev((2, 4, 16))
    out, lse = cl.array.empty(queue, (2, 4, 16), np.float32), cl.array.empty(queue, (2, 4),
                                                                             np.float32)
    cache.add("a")
    cache.add("b")
    queue.finish()
    for _ in range(3):  # every ring slot of table buffers, reused
        gate = cl.UserEvent(queue.context)
        cl.enqueue_marker(queue, wait_for=[gate])

        def step():
            cache.begin(["a", "b"])
            for layer in range(3):
                cache.append(layer, k, k)
                cache.attend(layer, q, out=out, lse=lse)
            cache.end()
        th = threading.Thread(target=step, daemon=True)
        th.start()
        th.join(timeout=30)
        returned = not th.is_alive()
        gate.set_status(cl.command_execution_status.COMPLETE)
        th.join()
        queue.finish()
        assert returned, "a step call waited for the device"
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("kw, exc, match", [
    (dict(sm_scale=float("nan")), ValueError, "sm_scale=nan"),
    (dict(sm_scale=1e39), ValueError, "sm_scale=1e\\+39"),
    (dict(sm_scale="0.5"), TypeError, "sm_scale='0.5'"),
    (dict(rope="attend", rope_scale=float("inf")), ValueError, "rope_scale=inf"),
    (dict(rope="append", rope_scale=float("nan")), ValueError, "rope_scale=nan"),
    (dict(rope_scale="x"), TypeError, "rope_scale='x'"),
    (dict(rope="attend", rope_theta=-1.0), ValueError, "rope_theta=-1.0"),
    (dict(rope_theta=True), TypeError, "rope_theta=True"),
])
def test_cache_scalars_checked_at_construction(kw, exc, match):
    """A scalar the kernels would take as NaN or inf is refused when the cache is built,
    not found at attend (review: on OpenCL it gave NaN silently; rope="append" wrote NaN
    keys into the pool)."""
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype="float32")
    with pytest.raises(exc, match=match):
        clattn.PagedKVCache(spec, 1, num_pages=4, backend="cpu", **kw)
