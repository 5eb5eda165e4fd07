"""Verify a tree of draft tokens (tree speculative decoding) in one masked prefill.

A sequence's prefix is cached in a ``PagedKVCache``; a draft tree (two roots, depth up to
4) is appended after it in topological order in one step begun with the tree's mask
(``cache.begin(..., masks=[clattn.tree_mask(parents, prefix)])``), so that one masked
prefill attends every draft token to the whole prefix and to its own ancestors only. The
same step is also run by ``BatchPrefill.run`` on the cache's pool with the packed mask
(``clattn.pack_mask``). Every query's output and lse, both ways, are compared with a
float64 oracle that attends exactly prefix + ancestors (found by walking the parents);
then the step is rolled back (``cache.cancel()``), the accepted path is appended as an
ordinary causal chunk, and its outputs are compared with the tree's for the same tokens.
Prints the largest errors and their bounds; exits non-zero when one is exceeded.

    python examples/tree_verify.py                     # clattn's default device
    python examples/tree_verify.py --device intel --prefix 300 --dtype float16
    python examples/tree_verify.py --device cpu        # the numpy CPU backend

The app owns RoPE here (``rope=None``): a draft token's position is its depth after the
prefix, not its row, so q and k come rotated.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

import clattn

#: the draft tree: parent of each node (-1: a root), parents before children
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5, -1, 8]
ACCEPTED = [0, 2, 5, 7]    # the path the target model accepts (root to leaf)


def ancestors(i: int) -> list[int]:
    """Node i and its ancestors, by the parent chain."""
    out = []
    while i >= 0:
        out, i = out + [i], PARENTS[i]
    return out


def oracle(q, keys, values, rows, group, scale):
    """float64 attention of query q [H, D] over the given rows of keys/values [R, H_kv, D]:
    (out [H, D], lse [H] base 2)."""
    k = np.repeat(keys[rows].astype(np.float64), group, axis=1)     # [r, H, D]
    v = np.repeat(values[rows].astype(np.float64), group, axis=1)
    s = np.einsum("hd,rhd->hr", q.astype(np.float64), k) * scale
    m = s.max(axis=1, keepdims=True)
    w = np.exp(s - m)
    out = np.einsum("hr,rhd->hd", w / w.sum(axis=1, keepdims=True), v)
    return out, (m[:, 0] + np.log(w.sum(axis=1))) / math.log(2)


def bounds(q, keys, values, rows, group, scale, dtype):
    """Error bounds of f32 arithmetic (and the output's storage rounding) for one query:
    each score is a D-term dot product (error <= D eps sum|q k| scale), each weight
    inherits twice that relative error plus the R-term sums' R eps; out adds its
    storage rounding; lse the score error and the sum's."""
    eps = float(np.finfo(np.float32).eps)
    k = np.repeat(keys[rows].astype(np.float64), group, axis=1)
    v = np.repeat(values[rows].astype(np.float64), group, axis=1)
    s_err = q.shape[-1] * eps * np.einsum("hd,rhd->hr", np.abs(q.astype(np.float64)),
                                          np.abs(k)).max(axis=1) * scale
    r = len(rows)
    v_mag = np.abs(v).max(axis=(0, 2))
    out_b = 2 * ((2 * s_err + 2 * r * eps) * v_mag + float(np.finfo(dtype).eps) * v_mag)
    lse_b = 2 * (s_err + r * eps) / math.log(2) + 1e-6
    return out_b, lse_b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", help="OpenCL device (pocl, intel, a name) or 'cpu' for the "
                                     "numpy backend (default: clattn's)")
    ap.add_argument("--prefix", type=int, default=40, help="cached tokens before the tree")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    args = ap.parse_args()

    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype=args.dtype)
    backend = "cpu" if args.device == "cpu" else "auto"
    device = None if args.device == "cpu" else args.device
    n, P, H, Hkv, D = len(PARENTS), args.prefix, 8, 2, 64
    pages = -(-(P + n) // spec.page_size) + 2
    cache = clattn.PagedKVCache(spec, 1, num_pages=pages, device=device, backend=backend)
    pre = clattn.BatchPrefill(spec, device, backend=backend)
    rng = np.random.default_rng(0)
    dt = spec.np_dtype
    k = rng.standard_normal((P + n, Hkv, D)).astype(dt)      # prefix rows, then the tree's
    v = rng.standard_normal((P + n, Hkv, D)).astype(dt)
    q = rng.standard_normal((n, H, D)).astype(dt)            # the tree's queries

    cache.add("s")
    cache.begin(["s"], [P])                                  # the prefix
    cache.append(0, k[:P], v[:P])
    cache.end()

    tree = clattn.tree_mask(PARENTS, P)                      # [n, P + n]
    cache.begin(["s"], [n], masks=[tree])                    # the draft tree, one step
    event = cache.append(0, k[P:], v[P:])
    res = cache.attend(0, q)                                 # the masked prefill
    if event is not None:
        event.wait()
    t = cache.step_tables    # the same by hand: the tree's last token sees every page
    page_indices = t.page_indices[t.page_indptr[n - 1]:t.page_indptr[n]].copy()
    custom_mask, mask_indptr = clattn.pack_mask([tree])
    alone = pre.run(q, cache.pools[0], np.array([0, n], np.int32),
                    np.array([0, len(page_indices)], np.int32), page_indices,
                    t.last_page_len[n - 1:n].copy(), custom_mask=custom_mask,
                    mask_indptr=mask_indptr)
    cache.cancel()                                           # roll the tree back

    scale, group, ok = 1 / math.sqrt(D), H // Hkv, True
    for what, r in (("cache step", res), ("BatchPrefill", alone)):
        err_o = err_l = bound_o = bound_l = 0.0
        for i in range(n):
            rows = list(range(P)) + [P + j for j in sorted(ancestors(i))]
            ro, rl = oracle(q[i], k, v, rows, group, scale)
            bo, bl = bounds(q[i], k, v, rows, group, scale, dt)
            eo = np.abs(np.asarray(r.out[i], np.float64) - ro).max(axis=1)
            el = np.abs(np.asarray(r.lse[i], np.float64) - rl)
            ok &= bool((eo <= bo).all() and (el <= bl).all())
            err_o, err_l = max(err_o, float(eo.max())), max(err_l, float(el.max()))
            bound_o, bound_l = max(bound_o, float(bo.min())), max(bound_l, float(bl.min()))
        print(f"{cache.backend} {what}: tree of {n} drafts over a prefix of {P}: max |out - "
              f"oracle| {err_o:.3g} (bound {bound_o:.3g}), max |lse - oracle| {err_l:.3g} "
              f"(bound {bound_l:.3g})")

    # the accepted path as a plain causal chunk: the same outputs as in the tree
    acc = np.array(ACCEPTED)
    cache.begin(["s"], [len(acc)])
    cache.append(0, k[P + acc], v[P + acc])
    path = cache.attend(0, q[acc])
    cache.end()
    d = np.abs(np.asarray(path.out, np.float64) - np.asarray(res.out[acc], np.float64)).max()
    path_bound = 2 * max(bounds(q[i], k, v, list(range(P)) + [P + j for j in acc[:a + 1]],
                                group, scale, dt)[0].max() for a, i in enumerate(acc))
    ok &= bool(d <= path_bound) and cache.length("s") == P + len(acc)
    print(f"accepted path {ACCEPTED}: cache holds {cache.length('s')} tokens; max |causal "
          f"- tree| {d:.3g} (bound {path_bound:.3g})")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
