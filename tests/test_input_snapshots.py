"""Nothing the caller changes after a call returns reaches a result or the cache.

Every public call that takes numpy inputs runs twice on the same backend: once with inputs
the caller never touches again, once with every numpy input (q, k, v, tables, masks, sink
logits, merge operands, step lengths) overwritten with garbage (NaN for floats, zeros for
integers, inverted masks) the moment the call returns. Results, and the pools of a
:class:`clattn.PagedKVCache` after each step, must be the same bits both times: an upload
that reads the caller's memory later than the call (a non-blocking write of a numpy
array, a held append) would show the garbage. The untouched run is itself checked
against the float64 oracle by the other tests (test_kernels, test_cache, test_prefill).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import clattn
from clattn import runtime

F32 = clattn.AttentionSpec(4, 2, 16, page_size=4, dtype="float32")
Q8 = clattn.AttentionSpec(4, 2, 32, page_size=4, k_format="q8_0", v_format="q8_0")
LAYERS = 2


def clobber(*arrays) -> None:
    """Overwrite the caller's arrays as an app reusing its buffers would."""
    for a in arrays:
        if a is None:
            continue
        if a.dtype == bool:
            np.logical_not(a, out=a)
        elif np.issubdtype(a.dtype, np.floating):
            a[...] = np.nan
        else:
            a[...] = 0


def host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def same(got, want, what: str) -> None:
    got, want = host(got), host(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
        f"{what}: differs from the run whose inputs were left alone"


def twice(call, fresh: dict) -> tuple:
    """``(touched, untouched)``: ``call`` on copies of ``fresh``, the first run's copies
    overwritten the moment it returns."""
    want = call(**{k: a.copy() for k, a in fresh.items()})
    given = {k: a.copy() for k, a in fresh.items()}
    got = call(**given)
    clobber(*given.values())
    return got, want


def _where(target) -> dict:
    if target.is_cpu:
        return dict(backend="cpu")
    return dict(device=target.device, profile=target.profile, backend="opencl")


# ---------------------------------------------------------------------------- the cache
def _drive(spec, target, touch: bool, device_out: bool = False,
           appends_first: bool = False) -> list:
    """Three steps over two sequences (prompt chunks, one token each, a masked tree step);
    returns every attend's outputs and the pools after every step. ``device_out``: attend
    writes device out/lse (a host q then goes up with the layer's held k and v in one
    write); ``appends_first``: every layer appended before any is attended (a held
    append goes up alone)."""
    rng = np.random.default_rng(7)
    H, Hkv, D = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    dt = spec.np_dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        cache = clattn.PagedKVCache(spec, LAYERS, num_pages=16, **_where(target))
    cache.add("a")
    cache.add("b")
    seen = []
    steps = [([5, 3], None), ([1, 1], None),
             ([3, 2], [clattn.tree_mask([-1, 0, 0], 6), None])]
    for lengths, masks in steps:
        T = sum(lengths)
        n = np.array(lengths, np.int64)
        m = None if masks is None else [None if x is None else x.copy() for x in masks]
        cache.begin(["a", "b"], n, masks=m)
        if touch:
            clobber(n, *(m or []))
        inputs = []
        for layer in range(LAYERS):
            k, v = (rng.standard_normal((T, Hkv, D)).astype(dt) for _ in range(2))
            q = rng.standard_normal((T, H, D)).astype(dt)
            inputs.append((k, v, q, rng.standard_normal(H).astype(np.float32)))
        for layer in range(LAYERS):
            appends = (range(LAYERS) if layer == 0 else ()) if appends_first else (layer,)
            for i in appends:
                cache.append(i, *inputs[i][:2])
                if touch:
                    clobber(*inputs[i][:2])
            q, sinks = inputs[layer][2:]
            out = lse = None
            if device_out:
                cla = runtime.cl().array
                out = cla.empty(cache.queue, (T, H, spec.head_dim_v), spec.np_dtype)
                lse = cla.empty(cache.queue, (T, H), np.float32)
            res = cache.attend(layer, q, out=out, lse=lse, sink_logits=sinks)
            if touch:
                clobber(q, sinks)
            seen += [host(res.out).copy(), host(res.lse).copy()]
        cache.end()
        seen += [host(p).copy() for p in cache.pools]
    return seen


@pytest.mark.parametrize("spec", [F32, Q8], ids=["f32", "q8_0"])
def test_cache_keeps_what_was_given(target, spec):
    """append's k, v (held for the fused launch in one-token steps of a float pool, or
    quantized on the device), attend's q and sinks, begin's lengths and masks."""
    want = _drive(spec, target, touch=False)
    got = _drive(spec, target, touch=True)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        same(g, w, f"cache result {i}")


@pytest.mark.parametrize("appends_first", [False, True], ids=["interleaved", "appends first"])
@pytest.mark.parametrize("spec", [F32, Q8], ids=["f32", "q8_0"])
def test_cache_with_device_outputs_keeps_what_was_given(device_target, spec, appends_first):
    """attend into device out/lse with a host q: in a one-token step of a float pool the
    q goes up with the layer's held k and v in one write. The results and pools are the
    bits of the host-output run (checked against the oracle elsewhere), and the same
    when the caller overwrites k, v and q once each call returns."""
    target = device_target
    want = _drive(spec, target, touch=False)
    plain = _drive(spec, target, touch=False, device_out=True, appends_first=appends_first)
    got = _drive(spec, target, touch=True, device_out=True, appends_first=appends_first)
    assert len(got) == len(want) == len(plain)
    for i, (g, p, w) in enumerate(zip(got, plain, want)):
        same(p, w, f"cache result {i} (device outputs)")
        same(g, w, f"cache result {i} (device outputs, inputs overwritten)")


# ---------------------------------------------------------------------------- the kernels
def _decode_inputs(rng, spec):
    H, Hkv, D, ps = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, spec.page_size
    return dict(q=rng.standard_normal((2, H, D)).astype(np.float32),
                pages=rng.standard_normal((6, 2, Hkv, ps, D)).astype(np.float32),
                page_indptr=np.array([0, 2, 5], np.int32),
                page_indices=np.array([4, 0, 1, 5, 2], np.int32),
                last_page_len=np.array([3, 2], np.int32),
                sink_logits=rng.standard_normal(H).astype(np.float32))


def test_decode_run_and_prepared_step(target, get_decoder, cl_queue):
    dec = get_decoder(F32, target)
    fresh = _decode_inputs(np.random.default_rng(1), F32)
    got, want = twice(dec.run, fresh)
    same(got.out, want.out, "BatchDecode.run out")
    same(got.lse, want.lse, "BatchDecode.run lse")

    if target.is_cpu:
        return  # the CPU backend has no prepared step (prepare refuses it by name)
    tables = {k: fresh[k].copy() for k in ("page_indptr", "page_indices", "last_page_len")}
    step = dec.prepare(**tables, num_pages=6)
    clobber(*tables.values())  # the step keeps what prepare was given
    q, pages, sinks = (runtime.cl().array.to_device(cl_queue(target.device), fresh[k].copy())
                       for k in ("q", "pages", "sink_logits"))
    res = step.run(q, pages, sink_logits=sinks)
    same(res.out, want.out, "DecodeStep.run out")
    same(res.lse, want.lse, "DecodeStep.run lse")


def test_prefill_with_mask_and_sinks(target):
    spec = F32
    pre = clattn.BatchPrefill(spec, **_where(target)) if target.is_cpu else None
    if pre is None:
        from test_prefill import get_prefill
        pre = get_prefill(spec, target)
    rng = np.random.default_rng(2)
    masks = [rng.random((3, 7)) < 0.6, rng.random((2, 6)) < 0.6]
    bits, indptr = clattn.pack_mask(masks)
    fresh = dict(q=rng.standard_normal((5, 4, 16)).astype(np.float32),
                 pages=rng.standard_normal((4, 2, 2, 4, 16)).astype(np.float32),
                 qo_indptr=np.array([0, 3, 5], np.int32),
                 page_indptr=np.array([0, 2, 4], np.int32),
                 page_indices=np.array([3, 0, 2, 1], np.int32),
                 last_page_len=np.array([3, 2], np.int32),
                 custom_mask=bits, mask_indptr=indptr,
                 sink_logits=rng.standard_normal(4).astype(np.float32))
    got, want = twice(pre.run, fresh)
    same(got.out, want.out, "BatchPrefill.run out")
    same(got.lse, want.lse, "BatchPrefill.run lse")


def test_merges(target):
    rng = np.random.default_rng(3)
    where = {} if target.is_cpu else dict(device=target.device, profile=target.profile)
    v, vo = (rng.standard_normal((3, 4, 16)).astype(np.float32) for _ in range(2))
    s, so = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    want_v, want_s = v.copy(), s.copy()
    clattn.merge_state_(want_v, want_s, vo.copy(), so.copy(), **where)
    got_v, got_s, vo2, so2 = v.copy(), s.copy(), vo.copy(), so.copy()
    clattn.merge_state_(got_v, got_s, vo2, so2, **where)
    clobber(vo2, so2)
    same(got_v, want_v, "merge_state_ v")
    same(got_s, want_s, "merge_state_ s")

    vk = rng.standard_normal((3, 3, 4, 16)).astype(np.float32)
    sk = rng.standard_normal((3, 3, 4)).astype(np.float32)
    got, want = twice(lambda **a: clattn.merge_states(**a, **where), dict(v=vk, s=sk))
    same(got[0], want[0], "merge_states v")
    same(got[1], want[1], "merge_states s")
