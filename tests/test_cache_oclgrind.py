"""The KV-cache append and page-copy kernels under the Oclgrind simulator.

Each variant runs in a fresh process (this file is also the runner: ``python
tests/test_cache_oclgrind.py VARIANT``) with Oclgrind's checks switched on, as
tests/test_oclgrind.py does for the decode and merge kernels, and fails on any report:

* a short cache simulation (tests/test_cache.py) on the simulator: appends with prompt
  chunks, forks (copy-on-write launches), windows, checked against the float64 oracle;
* adversarial slot and copy tables launched directly: slots and pages out of the pool,
  negative, at the int32 extremes, row counts out of range, extreme RoPE positions.
  Only what is in the pool may be written, and exactly that is (checked in numpy);
* the decode kernel with the append fused in (one-token steps): tests/test_cache_fused.py's
  scenario, fused and separate launches equal bit for bit, and the fused kernel launched
  with adversarial slots and RoPE positions (the same rules as the append kernel's).
"""
from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from test_oclgrind import _env, _tail, filtered  # noqa: E402

#: benign too: pyopencl's Kernel(program, name) looks up ``program._source``, which a
#: Program answers by asking the driver for a kernel named ``_source`` (a prepared decode
#: step and the cache's bound kernels make their kernel objects that way)
BENIGN_SOURCE = re.compile(
    r"Oclgrind - OpenCL runtime error detected\s*\n\s*Function: clCreateKernel\s*\n"
    r"\s*Error:\s*CL_INVALID_KERNEL_NAME\s*\n\s*Kernel '_source' not found\s*\n?")

#: the generic GPU profile with a small work-group (the simulator is slow)
SMALL_TILED = {"strategy": "tiled", "thread_limit": 32, "merge_threads": 32}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
          "low_freq_factor": 1.0, "original_max_position_embeddings": 64}


def _cache(spec, profile, layers=1, **kw):
    import clattn
    from clattn import runtime
    dev = runtime.select_device("oclgrind")
    assert runtime.is_simulator(dev), dev
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = clattn.PagedKVCache(spec, layers, device=dev, profile=profile,
                                    backend="opencl", **kw)
    print(f"fold_merge: {cache.profile.fold_merge}", flush=True)  # FOLD_MARK
    # Oclgrind 21.10's uninitialised-value plugin does not count clEnqueueFillBuffer (the
    # cache's zeroing of a new pool) as initialising a buffer: zero the pools from the host
    cl = runtime.cl()
    for layer in range(layers):
        cache.pools[layer].finish()
        cache.pools[layer] = cl.array.to_device(cache.queue, np.zeros(spec.pool_shape(
            cache.num_pages), spec.pool_dtype))
    return cache


def simulation_variant(profile, dtype, window, rope, seed=0, formats=None, head_dim_v=None,
                       value_in_key=False):
    from test_cache import simulate

    import clattn
    build = dict(sliding_window=True) if window else {}
    if head_dim_v:  # values of another width (or read from the key rows): a byte pool
        build.update(head_dim_v=head_dim_v, value_in_key=value_in_key)
    if rope == "attend":
        build.update(rope_scaling=LLAMA3, max_position_embeddings=4096)
    D = 16
    if formats:  # quantized pages: blocks of 32 along head_dim
        build.update(k_format=formats[0], v_format=formats[1])
        D = 32
    spec = clattn.AttentionSpec(2, 1, D, page_size=4, dtype=dtype, **build)
    cache = _cache(spec, profile, num_pages=12, rope=rope)
    counts = simulate(cache, 14, seed=seed, rope=rope == "attend")
    # seeds chosen so that a prompt chunk and a copy-on-write happen
    assert counts["step"] >= 8 and counts["cow"] and counts["chunk"], counts
    print(f"simulation: {counts}", flush=True)


def growing_split_variant(profile):
    """Steps whose split plans need more workspace than the cache's first
    (tests/test_cache.py), every step split into one-page partitions (every token on the
    decode kernel, whose plans use the workspace)."""
    from test_cache import SPLIT_EVERY_STEP, growing_split_steps

    import clattn
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype="float32")
    cache = _cache(spec, dict(profile, **SPLIT_EVERY_STEP), num_pages=24, prefill=False)
    print(f"workspace states per step: {growing_split_steps(cache)}", flush=True)


def adversarial_variant(profile, dtype, rope):
    import clattn
    from clattn import runtime
    cl = runtime.cl()
    spec = clattn.AttentionSpec(2, 2, 16, page_size=4, dtype=dtype, rotary_dim=8)
    P, ps, T = 5, 4, 10
    cache = _cache(spec, profile, num_pages=P, rope="append" if rope else None)
    queue = cache.queue
    rng = np.random.default_rng(0)
    dt = spec.np_dtype
    k = rng.standard_normal((T, 2, 16)).astype(dt)
    v = rng.standard_normal((T, 2, 16)).astype(dt)
    slots = np.array([-1, P * ps, 2**31 - 1, -2**31, 0, P * ps - 1, 7, -ps, 13, 2**30], np.int32)
    k_pos = np.array([2**31 - 1, -2**31, 0, -1, 5, 2**31 - 64, 70000, 3, 1, 2], np.int32)
    d = lambda a: cl.array.to_device(queue, a)  # noqa: E731
    pool = cache.pools[0]
    geom = cache.geometry
    cache.device.append_k.launch(queue, *geom.sizes(T * 2, 16), list(pool.events), k=d(k), v=d(v),
                         pages=pool, slots=d(slots), n_tokens=T, k_pos=d(k_pos))
    got = pool.get()
    want = np.zeros_like(got)
    for t, s in enumerate(slots):
        if 0 <= s < P * ps:
            want[s // ps, 1, :, s % ps] = v[t]
            want[s // ps, 0, :, s % ps] = k[t]
    assert np.array_equal(got[:, 1], want[:, 1]), "values written where they should not be"
    if rope:  # rotated keys: written exactly where they belong, unrotated dims bit for bit
        assert np.array_equal(got[:, 0] != 0, want[:, 0] != 0)
        assert np.array_equal(got[:, 0, :, :, 8:], want[:, 0, :, :, 8:])
        assert np.isfinite(got.astype(np.float32)).all()
    else:
        assert np.array_equal(got, want)
    print("adversarial append ok", flush=True)
    # copies: (src, dst, rows) with sources and row counts out of range, and destinations
    # out of the pool (nothing written). The valid destinations are distinct and no source
    # (clamped to 0 or P - 1) is a destination: such tables would race (the cache's
    # copy-on-write tables copy into fresh pages only)
    copies = np.array([[-5, 1, 3], [P + 3, 2, 99], [0, -1, 2], [1, P, 2],
                       [2**31 - 1, 3, -4], [-2**31, -2**31, 2**31 - 1],
                       [2, 2**31 - 1, 4]], np.int32)
    before = got.copy()
    C = len(copies)
    cache.device.copy_k.launch(queue, *geom.sizes(C * 2 * 2 * ps, 16), None, pages=pool,
                       copies=d(copies.ravel()), n_copies=C)

    def copy_rows(want, src, dst, rows):
        want[dst, :, :, :rows] = before[src, :, :, :rows]
    assert np.array_equal(pool.get(), _copied(before, copies, P, ps, copy_rows)), \
        "page copy wrote the wrong rows"
    print("adversarial copy ok", flush=True)


def fused_variant(profile, dtype, rope, split, device_out=False):
    """tests/test_cache_fused.py's scenario on the simulator: the fused launches write
    and read the same bits as the separate ones."""
    from test_cache_fused import LLAMA3 as SCALING
    from test_cache_fused import SPLIT_EVERY_STEP as SPLIT
    from test_cache_fused import equal, scenario

    import clattn
    window = rope is not None
    spec = clattn.AttentionSpec(2, 1, 16, page_size=4, dtype=dtype, sliding_window=window,
                                rope_scaling=SCALING if rope else None,
                                max_position_embeddings=4096)
    runs = []
    for fuse in (True, False):
        prof = dict(profile, fuse_append=fuse, **(SPLIT if split else {}))
        cache = _cache(spec, prof, num_pages=40, rope=rope, prefill=False, layers=2)
        runs.append(scenario(cache, 5, window, device_out=device_out and fuse))
    (got, n_fused), (want, n_separate) = runs
    assert all(equal(a, b) for a, b in zip(got, want)), "fused != separate"
    assert sum(n_fused) < sum(n_separate), (n_fused, n_separate)
    print(f"fused launches per step {n_fused}, separate {n_separate}", flush=True)


def adversarial_fused_variant(profile, dtype, rope):
    """The fused kernel of a one-token step launched with slots out of the pool (negative,
    past it, int32 extremes) beside one valid slot no sequence reads, and extreme RoPE
    positions: exactly the valid slot's rows are written."""
    import clattn
    from clattn import runtime
    cl = runtime.cl()
    spec = clattn.AttentionSpec(2, 2, 16, page_size=4, dtype=dtype, rotary_dim=8)
    P, ps, B = 8, 4, 4
    cache = _cache(spec, profile, num_pages=P, rope="append" if rope else None)
    rng = np.random.default_rng(3)
    dt = spec.np_dtype
    ids = list("abcd")
    for sid in ids:
        cache.add(sid)
    cache.begin(ids, [2] * B)  # pages 0-3 hold the sequences; pages 4-7 are free
    x = rng.standard_normal((2 * B, 2, 16)).astype(dt)
    cache.append(0, x, x)
    cache.end()
    cache.begin(ids)
    dev = cache.device
    assert dev.fuse and dev.fused is not None
    queue = cache.queue
    d = lambda a: cl.array.to_device(queue, a)  # noqa: E731
    k = rng.standard_normal((B, 2, 16)).astype(dt)
    v = rng.standard_normal((B, 2, 16)).astype(dt)
    q = rng.standard_normal((B, 2, 16)).astype(dt)
    slots = np.array([-1, P * ps, 2**31 - 1, 6 * ps + 1], np.int32)
    k_pos = np.array([2**31 - 1, -2**31, 70000, 2**31 - 64], np.int32)
    pool = cache.pools[0]
    before = pool.get()
    out = cl.array.empty(queue, (B, 2, 16), dt)
    lse = cl.array.empty(queue, (B, 2), np.float32)
    dev.fused.launch(queue, *dev.decode_sizes, list(pool.events), q=d(q), pages=pool,
                     out=out, lse=lse, k=d(k), v=d(v), slots=d(slots), k_pos=d(k_pos))
    got = pool.get()
    want = before.copy()
    want[6, :, :, 1] = np.stack([k[3], v[3]])
    if rope:  # the rotated key's dims: written and finite; the rest bit for bit
        assert np.isfinite(got[6, 0, :, 1].astype(np.float32)).all()
        want[6, 0, :, 1, :8] = got[6, 0, :, 1, :8]
        assert not np.array_equal(got[6, 0, :, 1, :8], before[6, 0, :, 1, :8])
    assert np.array_equal(got, want), "the fused append wrote outside its valid slot"
    assert np.isfinite(out.get().astype(np.float32)).all()
    cache.cancel()
    print("adversarial fused append ok", flush=True)


def _copied(before, copies, P, ps, copy_rows):
    """The pool the copy table should leave: valid destinations get their clamped
    source's rows (``copy_rows(want, src, dst, rows)``), nothing else changes."""
    want = before.copy()
    for src, dst, rows in copies:
        if 0 <= dst < P:
            copy_rows(want, min(max(src, 0), P - 1), dst, min(max(rows, 0), ps))
    return want


def adversarial_bytes_variant(profile, dtype, rope):
    """The byte-pool append, check and copy kernels with the same garbage tables."""
    import clattn
    from clattn import quant, runtime
    cl = runtime.cl()
    spec = clattn.AttentionSpec(2, 2, 32, page_size=4, dtype=dtype, rotary_dim=8,
                                k_format="q8_0", v_format="q4_0")
    P, ps, T = 5, 4, 10
    cache = _cache(spec, profile, num_pages=P, rope="append" if rope else None)
    dev = cache.device
    queue = cache.queue
    rng = np.random.default_rng(0)
    k = rng.standard_normal((T, 2, 32)).astype(spec.np_dtype)
    v = rng.standard_normal((T, 2, 32)).astype(spec.np_dtype)
    slots = np.array([-1, P * ps, 2**31 - 1, -2**31, 0, P * ps - 1, 7, -ps, 13, 2**30], np.int32)
    k_pos = np.array([2**31 - 1, -2**31, 0, -1, 5, 2**31 - 64, 70000, 3, 1, 2], np.int32)
    d = lambda a: cl.array.to_device(queue, a)  # noqa: E731
    pool = cache.pools[0]
    flags = d(np.zeros(1, np.int32))
    sizes = ((T * 2 * 2 * 32 // 32,), None)
    args = dict(k=d(k), v=d(v), pages=pool, slots=d(slots), n_tokens=T, k_pos=d(k_pos),
                flags=flags, epoch=7)
    dev.check_k.launch(queue, *sizes, list(pool.events), **args)
    assert flags.get()[0] == 0, "finite values refused"
    dev.append_k.launch(queue, *sizes, None, **args)
    got = pool.get()
    layout = spec.layout
    vd, vs = quant.region_views(got, layout, 1)
    qd, qs = quant.quantize(v.astype(np.float32), "q4_0")
    written = np.zeros((P, ps), bool)
    for t, s in enumerate(slots):
        if 0 <= s < P * ps:
            written[s // ps, s % ps] = True
            assert np.array_equal(vd[s // ps, :, s % ps], qd[t]), f"token {t}'s values"
            assert np.array_equal(vs[s // ps, :, s % ps], qs[t])
    kd, _ = quant.region_views(got, layout, 0)
    assert not vd.transpose(0, 2, 1, 3)[~written].any(), "values written outside the slots"
    assert not kd.transpose(0, 2, 1, 3)[~written].any(), "keys written outside the slots"
    print("adversarial byte append ok", flush=True)
    bad = v.copy()
    bad[3, 1, 30] = np.nan
    before = got.copy()
    args.update(v=d(bad), epoch=8)
    dev.check_k.launch(queue, *sizes, None, **args)
    assert flags.get()[0] == 8, "a NaN was not flagged"
    dev.append_k.launch(queue, *sizes, None, **args)
    assert np.array_equal(pool.get(), before), "a refused append wrote"
    copies = np.array([[-5, 1, 3], [P + 3, 2, 99], [0, -1, 2], [1, P, 2],
                       [2**31 - 1, 3, -4], [-2**31, -2**31, 2**31 - 1],
                       [2, 2**31 - 1, 4]], np.int32)
    C = len(copies)
    dev.copy_k.launch(queue, (C * 2 * 2 * ps,), None, None, pages=pool,
                      copies=d(copies.ravel()), n_copies=C)

    def copy_rows(want, src, dst, rows):
        for kind in (0, 1):
            for w, b in zip(quant.region_views(want, layout, kind),
                            quant.region_views(before, layout, kind)):
                w[dst, :, :rows] = b[src, :, :rows]
    assert np.array_equal(pool.get(), _copied(before, copies, P, ps, copy_rows)), \
        "page copy wrote the wrong bytes"
    print("adversarial byte copy ok", flush=True)


VARIANTS = {
    "cache-rows-f16-window": lambda: simulation_variant("generic-cpu", "float16", True, None),
    "cache-rows-f32": lambda: simulation_variant("generic-cpu", "float32", False, None,
                                                     seed=5),
    "cache-tiled-f32-window": lambda: simulation_variant(SMALL_TILED, "float32", True, None),
    "cache-tiled-f16-rope-attend": lambda: simulation_variant(SMALL_TILED, "float16", True,
                                                              "attend"),
    "cache-rows-f16-widths-window": lambda: simulation_variant(
        "generic-cpu", "float16", True, None, seed=3, head_dim_v=40),
    "cache-tiled-f32-latent-window": lambda: simulation_variant(
        SMALL_TILED, "float32", True, None, seed=3, head_dim_v=8, value_in_key=True),
    "cache-rows-growing-split": lambda: growing_split_variant({"strategy": "rows"}),
    "cache-tiled-growing-split": lambda: growing_split_variant(SMALL_TILED),
    "append-adversarial-rows-f16": lambda: adversarial_variant("generic-cpu", "float16", False),
    "append-adversarial-rows-f32-rope": lambda: adversarial_variant("generic-cpu", "float32",
                                                                    True),
    "append-adversarial-tiled-f32": lambda: adversarial_variant(SMALL_TILED, "float32", False),
    "append-adversarial-tiled-f16-rope": lambda: adversarial_variant(SMALL_TILED, "float16",
                                                                     True),
    "cache-rows-f16-q8-q4-window": lambda: simulation_variant(
        "generic-cpu", "float16", True, None, seed=1, formats=("q8_0", "q4_0")),
    "cache-tiled-f32-q4-q8-rope-attend": lambda: simulation_variant(
        SMALL_TILED, "float32", True, "attend", seed=1, formats=("q4_0", "q8_0")),
    "append-adversarial-bytes-f16": lambda: adversarial_bytes_variant("generic-cpu", "float16",
                                                                      False),
    "append-adversarial-bytes-f32-rope": lambda: adversarial_bytes_variant(SMALL_TILED,
                                                                           "float32", True),
    "fused-rows-f16-rope-append": lambda: fused_variant({"strategy": "rows"}, "float16",
                                                        "append", False),
    "fused-tiled-f32-split": lambda: fused_variant(SMALL_TILED, "float32", None, True),
    "fused-rows-f32-host-q": lambda: fused_variant({"strategy": "rows"}, "float32", None,
                                                   False, device_out=True),
    "fused-tiled-f16-rope-append": lambda: fused_variant(SMALL_TILED, "float16", "append",
                                                         False),
    "fused-adversarial-rows-f32-rope": lambda: adversarial_fused_variant("generic-cpu",
                                                                         "float32", True),
    "fused-adversarial-tiled-f16": lambda: adversarial_fused_variant(SMALL_TILED, "float16",
                                                                     False),
}
#: variants whose decode launches use sincos (in-kernel RoPE): Oclgrind's uninitialised-
#: value plugin stops on its private pointer (tests/test_oclgrind.py); the append kernel
#: itself calls sin and cos apart, so every other variant runs with the plugin too
WITH_SINCOS = ("cache-tiled-f16-rope-attend", "cache-tiled-f32-q4-q8-rope-attend")
#: variants whose split workspace is replaced by a larger one: the plugin then flags the
#: merge's stores of later split launches, although every workspace state they read was
#: written (tests/oclgrind_runner.py, the growing-workspace variants)
GROWING = ("cache-rows-growing-split", "cache-tiled-growing-split", "fused-tiled-f32-split")


def _run(name: str, uninit: bool) -> None:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), name],
                          env=_env(uninit), cwd=str(HERE.parent), capture_output=True,
                          text=True, timeout=600)
    err, found = filtered(proc, BENIGN_SOURCE)
    assert not found, f"Oclgrind reported {found} for {name!r} (uninit={uninit}):\n{_tail(err)}"
    assert proc.returncode == 0, (f"{name!r} failed (rc={proc.returncode}):\n"
                                  f"{_tail(proc.stdout, 1500)}\n{_tail(err)}")
    assert f"CLATTN-OCLGRIND-OK {name}" in proc.stdout, _tail(proc.stdout)


@pytest.mark.oclgrind
@pytest.mark.parametrize("name", list(VARIANTS))
def test_cache_kernels_clean_under_oclgrind(oclgrind_device, name):
    _run(name, uninit=False)


@pytest.mark.oclgrind
@pytest.mark.parametrize("name", [n for n in VARIANTS if n not in WITH_SINCOS + GROWING])
def test_cache_kernels_no_uninitialised_values(oclgrind_device, name):
    _run(name, uninit=True)


if __name__ == "__main__":  # the runner: one variant in this process
    _name = sys.argv[1] if len(sys.argv) == 2 else ""
    if _name not in VARIANTS:
        sys.exit(f"usage: {sys.argv[0]} VARIANT; variants: {', '.join(VARIANTS)}")
    VARIANTS[_name]()
    print(f"CLATTN-OCLGRIND-OK {_name}", flush=True)
