#!/usr/bin/env python3
"""Loading a saved sequence against prefilling it again.

One sequence of ``--tokens`` tokens (Llama-3-8B's attention: 32 query heads, 8 KV heads,
head_dim 128, pages of 16; ``--layers`` 32) per page format: its prompt goes through
``PagedKVCache`` as one prefill step (``begin``, each layer's ``append`` and ``attend``
on device arrays, ``end``; the model's own matmuls are not counted, so the ratio below
is the smallest an app sees), then ``save`` writes it, and ``load`` reads it back into
the emptied cache. Prints, per format: the prefill time (measured on ``--prefill-layers``
layers and multiplied out to ``--layers`` when fewer: the layers are the same work), the
save time, the load time with the file in the page cache (warm) and after
``posix_fadvise(DONTNEED)`` dropped it (cold, where the OS honours it), the file's bytes
against the pool bytes the sequence holds, and the storage's read speed in the same run
(``readinto`` of the whole file, warm and cold). Medians of ``--reps``.

    PYTHONPATH=. python tools/bench_kv_file.py --device pocl --formats float16,q4_0
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

import numpy as np


def drop_cache(path: str) -> None:
    """Ask the OS to forget the file's cached pages (it may not)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_speed(path: str, cold: bool) -> float:
    """Seconds to read the whole file into memory."""
    if cold:
        drop_cache(path)
    buf = np.ones(os.path.getsize(path), np.uint8)  # touched: no page faults timed
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view, got = memoryview(buf), 0
        while got < buf.nbytes:
            got += f.readinto(view[got:])
    return time.perf_counter() - t


def write_speed(path: str) -> float:
    """Seconds to write the file's bytes to a new file beside it and fsync it."""
    data = np.fromfile(path, np.uint8)
    other = path + ".copy"
    t = time.perf_counter()
    with open(other, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    os.unlink(other)
    return dt


def prefill(cache, n: int, layers: int, arrays: tuple) -> float:
    """Seconds for one sequence's prompt through ``layers`` layers of the cache."""
    q, k, v, out, lse = arrays
    cache.add("s")
    t = time.perf_counter()
    cache.begin(["s"], [n])
    for layer in range(cache.num_layers):
        if layer < layers:
            cache.append(layer, k, v)
            cache.attend(layer, q, out=out, lse=lse)
        else:  # not timed: the layers past --prefill-layers get their rows to save
            cache.append(layer, k, v)
    cache.pools[0].queue.finish()
    dt = time.perf_counter() - t
    cache.end()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="pocl", help="as device= takes it (pocl, intel, P:D)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prefill-layers", type=int, default=None,
                    help="layers the prefill is timed on (default: all)")
    ap.add_argument("--formats", default="float16,q4_0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    args = ap.parse_args()

    import clattn
    from clattn import kv_file, runtime

    n, L = args.tokens, args.layers
    PL = min(L, args.prefill_layers or L)
    folder = args.dir or tempfile.mkdtemp(prefix="clattn-kv-")
    for fmt in args.formats.split(","):
        kw = {} if fmt in ("float16", "float32") else {"k_format": fmt, "v_format": fmt}
        spec = clattn.AttentionSpec(32, 8, 128, page_size=16,
                                    dtype="float32" if fmt == "float32" else "float16", **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            cache = clattn.PagedKVCache(spec, L, device=args.device, backend="opencl",
                                        num_pages=n // 16 + 2, rope="attend")
        cl, queue = runtime.cl(), cache.pools[0].queue
        rng = np.random.default_rng(0)
        dt = spec.np_dtype
        arrays = tuple(cl.array.to_device(queue, rng.standard_normal(s).astype(dt))
                       for s in ((n, 32, 128), (n, 8, 128), (n, 8, 128))) + \
            (cl.array.empty(queue, (n, 32, 128), dt), cl.array.empty(queue, (n, 32), np.float32))
        w = min(n, 64)
        small = tuple(cl.array.to_device(queue, rng.standard_normal(s).astype(dt))
                      for s in ((w, 32, 128), (w, 8, 128), (w, 8, 128))) + \
            (cl.array.empty(queue, (w, 32, 128), dt), cl.array.empty(queue, (w, 32), np.float32))
        prefill(cache, w, 1, small)
        cache.remove("s")  # the warm-up built the kernels
        path = os.path.join(folder, f"seq-{fmt}.clkv")
        pre, save, warm, cold, rwarm, rcold, verify, write = ([] for _ in range(8))
        for _ in range(args.reps):
            pre.append(prefill(cache, n, PL, arrays) * L / PL)
            t = time.perf_counter()
            size = cache.save(path)
            save.append(time.perf_counter() - t)
            write.append(write_speed(path))
            pool_bytes = cache.stats().pages_used * cache.page_bytes * L
            cache.remove("s")
            for cold_run, times, reads in ((False, warm, rwarm), (True, cold, rcold)):
                reads.append(read_speed(path, cold_run))
                if cold_run:
                    drop_cache(path)
                t = time.perf_counter()
                cache.load(path)
                queue.finish()
                times.append(time.perf_counter() - t)
                cache.remove("s")
            t = time.perf_counter()
            kv_file.open_verified(path).close()
            verify.append(time.perf_counter() - t)
        med = statistics.median
        row = {"format": fmt, "device": cache.pools[0].queue.device.name.strip(),
               "tokens": n, "layers": L, "prefill_layers_timed": PL,
               "prefill_s": round(med(pre), 4), "save_s": round(med(save), 4),
               "load_warm_s": round(med(warm), 4), "load_cold_s": round(med(cold), 4),
               "verify_warm_s": round(med(verify), 4), "write_fsync_s": round(med(write), 4),
               "read_warm_s": round(med(rwarm), 4), "read_cold_s": round(med(rcold), 4),
               "file_bytes": size, "pool_bytes": pool_bytes,
               "read_warm_GBps": round(size / med(rwarm) / 1e9, 2),
               "read_cold_GBps": round(size / med(rcold) / 1e9, 2),
               "prefill_over_load_warm": round(med(pre) / med(warm), 1),
               "prefill_over_load_cold": round(med(pre) / med(cold), 1),
               "load_over_read_warm": round(med(warm) / med(rwarm), 2),
               "load_over_read_cold": round(med(cold) / med(rcold), 2)}
        print(json.dumps(row), flush=True)
        os.unlink(path)
        del cache, arrays


if __name__ == "__main__":
    main()
