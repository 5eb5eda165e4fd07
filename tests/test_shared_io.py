"""An attend's host q, out and lse in shared memory (clattn.shared_io).

On a CPU device with fine-grained buffer SVM, a :class:`clattn.PagedKVCache` attend given
numpy q (and numpy or no out/lse) copies q, and the layer's held k and v, into one shared
region, launches, waits and copies the results out: no write or read command. Elsewhere,
and for calls past ``MAX_SHARED_BYTES``, the write and read commands remain. Both ways
must give the same bits, the float64 answer, and leave the caller's arrays alone when a
launch fails.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import clattn
from clattn import cache_device
from clattn.shared_io import shares_host_memory

SPEC = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype="float32")
LAYERS = 2
#: (tokens of sequence a, of sequence b) per step: one token each, a prompt chunk (the
#: region grows while kernel objects hold its first memory), one token each, a chunk
STEPS = [(1, 1), (6, 3), (1, 1), (1, 1), (2, 1)]


def _cache(target) -> clattn.PagedKVCache:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        cache = clattn.PagedKVCache(SPEC, LAYERS, num_pages=16, device=target.device,
                                    profile=target.profile, backend="opencl")
    cache.add("a")
    cache.add("b")
    return cache


def _inputs(seed: int = 3) -> list:
    """Per step, per layer: (k, v, q) of the step's tokens."""
    rng = np.random.default_rng(seed)
    H, Hkv, D = SPEC.num_qo_heads, SPEC.num_kv_heads, SPEC.head_dim
    return [[tuple(rng.standard_normal((sum(n), h, D)).astype(np.float32)
                   for h in (Hkv, Hkv, H)) for _ in range(LAYERS)] for n in STEPS]


def _drive(target, given_outputs: bool) -> tuple[list, list, clattn.PagedKVCache]:
    """Every attend's (out, lse) and the pools after the last step."""
    cache = _cache(target)
    H = SPEC.num_qo_heads
    results = []
    for n, step in zip(STEPS, _inputs()):
        T = sum(n)
        cache.begin(["a", "b"], list(n))
        for layer, (k, v, q) in enumerate(step):
            cache.append(layer, k, v)
            out = lse = None
            if given_outputs:
                out = np.full((T, H, SPEC.head_dim), -7.0, np.float32)
                lse = np.full((T, H), -7.0, np.float32)
            res = cache.attend(layer, q, out=out, lse=lse)
            if given_outputs:
                assert res.out is out and res.lse is lse
            assert isinstance(res.out, np.ndarray) and isinstance(res.lse, np.ndarray)
            results.append((res.out.copy(), res.lse.copy()))
        cache.end()
    return results, [p.get() for p in cache.pools], cache


def _oracle() -> list:
    """float64 causal GQA attention of every attend of :func:`_drive` (no RoPE), with
    the base-2 log-sum-exp."""
    H, Hkv, D = SPEC.num_qo_heads, SPEC.num_kv_heads, SPEC.head_dim
    G = H // Hkv
    hist = {(s, layer): ([], []) for s in "ab" for layer in range(LAYERS)}
    want = []
    for n, step in zip(STEPS, _inputs()):
        for layer, (k, v, q) in enumerate(step):
            outs, lses, at = [], [], 0
            for s, count in zip("ab", n):
                ks, vs = hist[s, layer]
                for i in range(count):
                    ks.append(k[at + i].astype(np.float64))
                    vs.append(v[at + i].astype(np.float64))
                    K, V = np.stack(ks), np.stack(vs)         # [t, Hkv, D]
                    qi = q[at + i].astype(np.float64)          # [H, D]
                    kh = K[:, np.arange(H) // G]               # [t, H, D]
                    vh = V[:, np.arange(H) // G]
                    logits = np.einsum("hd,thd->ht", qi, kh) / np.sqrt(D)
                    m = logits.max(axis=1, keepdims=True)
                    w = np.exp(logits - m)
                    outs.append(np.einsum("ht,thd->hd", w / w.sum(axis=1, keepdims=True), vh))
                    lses.append((m[:, 0] + np.log(w.sum(axis=1))) / np.log(2.0))
                at += count
            want.append((np.stack(outs), np.stack(lses)))
    return want


def _same(got: list, want: list, what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g if isinstance(g, tuple) else (g,), w if isinstance(w, tuple) else (w,)):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what}: result {i}"


@pytest.mark.parametrize("given_outputs", [True, False], ids=["out given", "out new"])
def test_shared_memory_gives_the_commands_bits(device_target, monkeypatch, given_outputs):
    """Host q/out/lse through shared memory where the device offers it: the float64
    answer, and the same bits and pools as with write and read commands (forced), as with
    calls too large for the region (forced)."""
    shared, pools, cache = _drive(device_target, given_outputs)
    offers = shares_host_memory(cache.device.queue.device)
    assert (cache.device.shared is not None) == offers
    if offers:  # the region was used, and grew for the prompt chunk's call
        assert cache.device.shared.data is not None
        assert cache.device.shared.data.nbytes >= max(map(sum, STEPS)) * \
            SPEC.num_qo_heads * SPEC.head_dim * 4 * 2
    for (out, lse), (o64, s64) in zip(shared, _oracle()):
        # f32 dot products of 16 N(0,1) terms over at most 11 rows, then a softmax: their
        # rounding is near 1e-6 of values of order 1; 1e-5 leaves room for exp2 on devices
        np.testing.assert_allclose(out, o64, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, s64, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(cache_device, "MAX_SHARED_BYTES", 0)
    big, big_pools, big_cache = _drive(device_target, given_outputs)
    assert big_cache.device.shared is None or big_cache.device.shared.data is None
    monkeypatch.setattr(cache_device.CacheDevice, "shares_host_io", lambda *a: False)
    commands, command_pools, _ = _drive(device_target, given_outputs)
    _same(shared, commands, "shared memory against commands")
    _same(pools, command_pools, "pools, shared memory against commands")
    _same(big, commands, "calls past the region's size against commands")
    _same(big_pools, command_pools, "pools, calls past the region's size")


def test_failed_launch_leaves_out_and_keeps_the_held_append(device_target, monkeypatch):
    """A one-token attend whose launch fails raises, leaves the caller's out and lse as
    they were, and keeps the layer's held append: end() writes it, and the pools are the
    bits of a run whose launch did not fail."""
    _, want_pools, _ = _drive(device_target, given_outputs=False)
    cache = _cache(device_target)
    H = SPEC.num_qo_heads
    steps = _inputs()
    for s, (n, step) in enumerate(zip(STEPS, steps)):
        T = sum(n)
        cache.begin(["a", "b"], list(n))
        for layer, (k, v, q) in enumerate(step):
            cache.append(layer, k, v)
            out = np.full((T, H, SPEC.head_dim), -7.0, np.float32)
            lse = np.full((T, H), -7.0, np.float32)
            if STEPS[s] == (1, 1) and s > 1 and layer == 0:
                launch = cache.device.decode.launch
                monkeypatch.setattr(cache.device.decode, "launch", _fails)
                with pytest.raises(RuntimeError, match="refused"):
                    cache.attend(layer, q, out=out, lse=lse)
                monkeypatch.setattr(cache.device.decode, "launch", launch)
                assert (out == -7.0).all() and (lse == -7.0).all()
                continue
            cache.attend(layer, q, out=out, lse=lse)
        cache.end()
    _same([p.get() for p in cache.pools], want_pools, "pools after a failed launch")


def _fails(*args, **kwargs):
    raise RuntimeError("launch refused (test)")
