"""The append fused into the decode launch (one-token steps of float pools), and with it
the split merge folded in: the same bits as the separate append, decode and merge
launches, in one launch per layer.

Two caches on the same device and profile, one with ``fuse_append`` (and ``fold_merge``)
off, run the same
operations (prompt chunks, one-token steps of several sequences, windows with sinks, a
fork whose shared last page both sequences write, layers appended out of order or not
attended); after every attend the outputs and LSEs, and after every step each layer's
pool, must be equal bit for bit. The separate launches are themselves checked against
the float64 oracle by tests/test_cache.py, whose simulation runs fused by default.
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import clattn
from clattn import runtime
from clattn.profiles import get_profile

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
          "low_freq_factor": 1.0, "original_max_position_embeddings": 64}
#: split every step into partitions of one page (the fused write lands in the last one)
SPLIT_EVERY_STEP = {"min_partition_rows": 4, "split_min_rows": 0, "wgs_per_cu": 4096}
LAYERS = 2


def make_cache(spec, target, fuse, split, rope, fold=False):
    extra = dict(SPLIT_EVERY_STEP if split else {}, fuse_append=fuse, fold_merge=fold)
    profile = extra if target.profile is None else get_profile(target.profile).with_(**extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        return clattn.PagedKVCache(spec, LAYERS, device=target.device, profile=profile,
                                   backend="opencl", num_pages=40, rope=rope, prefill=False)


def pools(cache):
    return [p.get() for p in cache.pools]


def scenario(cache, seed, window, device_out=False):
    """The operations, recording every result and the pools after every step.
    ``device_out``: attend writes device out/lse (its host q then goes up with the
    layer's held k and v in one write)."""
    spec = cache.spec
    rng = np.random.default_rng(seed)
    H, Hkv, D = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    seen = []
    launches = []

    def attend_layer(layer, q):
        if not device_out:
            return cache.attend(layer, q)
        cla = runtime.cl().array
        out = cla.empty(cache.queue, q.shape, spec.np_dtype)
        lse = cla.empty(cache.queue, q.shape[:2], np.float32)
        res = cache.attend(layer, q, out=out, lse=lse)
        assert res.out is out and res.lse is lse  # device outputs come back as given
        return SimpleNamespace(out=out.get(), lse=lse.get())

    def step(ids, lengths=None, order="paired", attend=range(LAYERS)):
        T = sum(lengths) if lengths else len(ids)
        k, v = (rng.standard_normal((LAYERS, T, Hkv, D)).astype(spec.np_dtype)
                for _ in range(2))
        q = rng.standard_normal((LAYERS, T, H, D)).astype(spec.np_dtype)
        before = cache.stats().launches
        cache.begin(ids, lengths)
        if order == "paired":
            for layer in range(LAYERS):
                cache.append(layer, k[layer], v[layer])
                if layer in attend:
                    seen.append(attend_layer(layer, q[layer]))
        else:  # every append first: each flushes the one deferred before it
            for layer in range(LAYERS):
                cache.append(layer, k[layer], v[layer])
            for layer in attend:
                seen.append(attend_layer(layer, q[layer]))
        cache.end()
        launches.append(cache.stats().launches - before)
        seen.append(pools(cache))

    for sid in "ab":
        cache.add(sid, **({"window": 7, "sink": 2} if window else {}))
    step(["a", "b"], [6, 3])
    for _ in range(5):
        step(["a", "b"])
    cache.fork("a", "c")            # a's last page is shared and partly filled
    step(["a", "c", "b"])           # both a and c write into it: copy-on-write first
    step(["c"], order="appends-first")
    step(["b", "a"], attend=[1])    # layer 0 appended but not attended
    for _ in range(6):
        step(["a", "b", "c"])
    return seen, launches


def equal(a, b):
    if isinstance(a, list):
        return all(np.array_equal(x, y) for x, y in zip(a, b))
    return np.array_equal(a.out, b.out) and np.array_equal(a.lse, b.lse)


@pytest.mark.parametrize("split,fold", [(False, False), (True, False), (True, True)],
                         ids=["unsplit", "split", "split-folded"])
@pytest.mark.parametrize("rope,dtype,window", [
    (None, "float32", False),
    ("append", "float16", True),
    ("attend", "float16", True),
])
def test_fused_equals_separate(device_target, rope, dtype, window, split, fold):
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype=dtype, sliding_window=window,
                                rope_scaling=LLAMA3 if rope else None,
                                max_position_embeddings=4096)
    fused = make_cache(spec, device_target, True, split, rope, fold)
    separate = make_cache(spec, device_target, False, split, rope)
    # the fused cache attends into device outputs when unsplit: host q then goes up with
    # the held k and v in one write, and must give the same bits
    got, n_fused = scenario(fused, 5, window, device_out=not split)
    want, n_separate = scenario(separate, 5, window)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert equal(a, b), f"result {i} differs between fused and separate launches"
    # one-token steps of two or three sequences: one launch per layer fused (and folded),
    # two apart (each plus the merge when split and not folded; the fork's step adds one
    # page copy per layer)
    assert n_fused[1:6] == [LAYERS * (2 if split and not fold else 1)] * 5, n_fused
    assert n_separate[1:6] == [LAYERS * (3 if split else 2)] * 5, n_separate
    assert n_fused[6] == LAYERS * (3 if split and not fold else 2), n_fused


def test_byte_pools_stay_separate(device):
    """A byte pool's append is checked first, in its own launch: never fused."""
    spec = clattn.AttentionSpec(4, 2, 32, page_size=4, k_format="q8_0", v_format="q8_0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache = clattn.PagedKVCache(spec, 1, device=device, backend="opencl", num_pages=8)
    cache.add("a")
    x = np.ones((1, 2, 32), np.float16)
    cache.begin(["a"])
    before = cache.stats().launches
    assert cache.append(0, x, x) is not None
    cache.attend(0, np.ones((1, 4, 32), np.float16))
    cache.end()
    assert cache.stats().launches - before == 2  # append, decode (host k, v: checked here)


def _device_step(cache, rng, dk, dv, values):
    """A one-token step of sequence "a" whose layers append the same device k/v arrays,
    overwritten with ``values[layer]`` right after each append (legal once append has
    returned); the pools afterwards."""
    cla = __import__("pyopencl").array
    queue = cache.pools[0].queue
    q = cla.to_device(queue, rng.standard_normal((1, 4, 16)).astype(np.float32))
    cache.begin(["a"])
    for layer in range(LAYERS):
        dk.set(np.full(dk.shape, values[layer], np.float32))
        dv.set(np.full(dv.shape, -values[layer], np.float32))
        cache.append(layer, dk, dv)
    for layer in range(LAYERS):
        cache.attend(layer, q)
    cache.end()
    return pools(cache)


def test_held_append_owns_device_kv_and_survives_a_failed_attend(device):
    """A held append copies device k/v when append is called (the caller may then reuse
    them); an attend that fails leaves the held append to end(), which writes it."""
    cla = __import__("pyopencl").array
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype="float32")
    caches = {}
    for fuse in (True, False):
        cache = caches[fuse] = make_cache(spec, type("T", (), dict(device=device, profile=None)),
                                          fuse, False, None)
        cache.add("a")
        queue = cache.pools[0].queue
        dk, dv = (cla.zeros(queue, (1, 2, 16), np.float32) for _ in range(2))
        rng = np.random.default_rng(0)
        after = _device_step(cache, rng, dk, dv, [7.0, 9.0])
        assert after[0][0, 0, 0, 0, 0] == 7.0 and after[1][0, 0, 0, 0, 0] == 9.0
        # a q view the kernels cannot take (2 bytes into its buffer) fails the attend
        cache.begin(["a"])
        big = cla.zeros(queue, 4 * 16 + 1, np.float32)
        bad = cla.empty(queue, (1, 4, 16), np.float32, data=big.base_data, offset=2)
        q = cla.zeros(queue, (1, 4, 16), np.float32)
        for layer in range(LAYERS):
            cache.append(layer, np.full((1, 2, 16), 3.0 + layer, np.float32),
                         np.zeros((1, 2, 16), np.float32))
            with pytest.raises(ValueError):
                cache.attend(layer, bad)  # held append kept for the next append or end()
            if layer == 0:
                cache.attend(layer, q)
        cache.end()
        assert cache.table.seqs["a"].length == 2
    assert equal(pools(caches[True]), pools(caches[False]))
    assert pools(caches[True])[0][0, 0, 0, 1, 0] == 3.0
    assert pools(caches[True])[1][0, 0, 0, 1, 0] == 4.0


def test_fused_only_when_every_sequence_brings_one_token(device_target):
    """Where the fused step is decided (``begin``): a step fuses its append into the
    decode launch only when every sequence brings one token, so the append is held
    (returns None) then and only then; steps where one sequence brings one token and
    another several append apart, and every result and pool equals the separate cache's."""
    spec = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype="float32")
    caches = [make_cache(spec, device_target, fuse, False, None) for fuse in (True, False)]
    seen: list = [[], []]
    rng = np.random.default_rng(41)
    for lengths in ([6, 3], [1, 3], [3, 1], [1, 1], [2, 1]):
        T = sum(lengths)
        k, v = (rng.standard_normal((T, 2, 16)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((T, 4, 16)).astype(np.float32)
        for i, cache in enumerate(caches):
            if "a" not in cache:
                cache.add("a")
                cache.add("b")
            cache.begin(["a", "b"], lengths)
            held = cache.append(0, k, v) is None
            assert held == (i == 0 and lengths == [1, 1]), (lengths, i)
            cache.append(1, k, v)
            seen[i] += [cache.attend(layer, q) for layer in range(LAYERS)]
            cache.end()
            seen[i].append(pools(cache))
    for j, (a, b) in enumerate(zip(*seen)):
        assert equal(a, b), f"result {j} differs between the fused and separate caches"
