"""The rows decode in head slices (``clattn.fit.rows_head_slices``): a KV head whose query
heads' scores would spill the vector registers is cut over ``gdz`` work-items, each
reading the KV rows for its slice of heads. The last slice's padded heads store nothing,
a folded merge counts per slice, and a cache's one-token steps append in a launch of
their own (another slice would read the new row unordered). Every result is checked
against the float64 oracle; the Oclgrind variants ``rows-fold-head-slices-*`` and
``rows-head-slices-latent-q4-split`` check the same builds for races and bounds.

The profiles below ask 8-float vectors (16 registers: at most 15 heads per slice) so that
every machine gets the same slices: 17 heads (9 + 8) and 40 (14 + 14 + 12).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from cases import compare, decode_args, oracle, spec_scenario
from test_cache import simulate
from test_widths import case_for

import clattn
from clattn.fit import rows_head_slices, rows_vector_registers, slice_heads

VEC8 = clattn.Profile(name="rows-vec8", strategy="rows", vec=8, tile_rows=16)
#: split every sequence into partitions of one page, the merge folded in or not
SPLIT = {"min_partition_rows": 16, "split_min_rows": 0, "wgs_per_cu": 4096}
#: (scenario, head slices at 8 floats, sm_scale)
SHAPES = {
    # a multi-query-style group of 17 heads per KV head, f16 pages with RoPE in the kernel
    "g17-f16": (spec_scenario("g17-f16", 34, 2, 64, dtype="float16"), 2, None),
    # MiniCPM3's latent form in small: 40 heads on one row of [latent | rope key], q8_0
    "latent-g40-q8": (spec_scenario("latent-g40-q8", 40, 1, 96, head_dim_v=64,
                                    dtype="float32", k_format="q8_0", value_in_key=True),
                      3, 0.1),
}


@pytest.mark.parametrize("group, vec, slices", [
    (1, 8, 1), (15, 8, 1), (16, 8, 2), (17, 8, 2), (40, 8, 3), (71, 8, 5),
    (16, 16, 1), (31, 16, 1), (32, 16, 2), (40, 16, 2), (128, 16, 5),
])
def test_slices_keep_a_slices_scores_and_a_key_chunk_in_the_registers(group, vec, slices):
    assert rows_head_slices(group, vec) == slices
    heads = slice_heads(group, slices)
    assert heads + 1 <= rows_vector_registers(vec)
    assert slices == 1 or slice_heads(group, slices - 1) + 1 > rows_vector_registers(vec)
    assert (slices - 1) * heads < group   # no slice is empty


def _decoder(spec, device, fold):
    prof = VEC8.with_(fold_merge=fold, **SPLIT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        return clattn.BatchDecode(spec, device, profile=prof)


@pytest.mark.parametrize("fold", [False, True], ids=["merge-launch", "fold"])
@pytest.mark.parametrize("key", list(SHAPES))
def test_decode_in_head_slices(device, key, fold):
    sc, slices, sm = SHAPES[key]
    spec = sc.spec
    dec = _decoder(spec, device, fold)
    assert (dec.geometry.strategy, dec.geometry.vec, dec.geometry.gdz) == ("rows", 8, slices)
    ps = spec.page_size
    for seed, lengths in enumerate(([0, 1, ps + 1, 5 * ps + 3], [3 * ps, 2])):
        case = case_for(sc, lengths, seed=seed, poison=True)
        args, kw = decode_args(case)
        for split in (False, ps):
            res = dec.run(*args, **kw, split=split, sm_scale=sm)
            compare(res.out, res.lse, *oracle(sc, case, sm_scale=sm), spec.dtype,
                    what=f"{key} {lengths} split={split}: ")
    if not spec.byte_pool:
        # RoPE in the kernel, and learned sinks joined once per head of every slice
        case = case_for(sc, [4 * ps + 3, 2], seed=9, rope=True, pos_offset=[70_000, 3])
        args, kw = decode_args(case)
        sinks = np.linspace(-2.0, 3.0, spec.num_qo_heads).astype(np.float32)
        for split in (False, ps):
            res = dec.run(*args, **kw, rotary_mode=1, split=split)
            compare(res.out, res.lse, *oracle(sc, case, rotary_mode=1), spec.dtype,
                    what=f"{key} rope split={split}: ")
            res = dec.run(*args, **kw, rotary_mode=1, split=split, sink_logits=sinks)
            compare(res.out, res.lse, *oracle(sc, case, rotary_mode=1, sink_logits=sinks),
                    spec.dtype, what=f"{key} rope sinks split={split}: ")


def test_a_cache_in_head_slices_steps_without_the_fused_append(device):
    """A cache whose decode runs in head slices: its one-token steps (the fused append's
    case) append in a launch of their own, and every attend agrees with the oracle."""
    sc, slices, _ = SHAPES["g17-f16"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes
        cache = clattn.PagedKVCache(sc.spec, 2, device=device, num_pages=64, backend="opencl",
                                    profile=VEC8.with_(fold_merge=True, **SPLIT))
    assert cache.opencl.decode_geometry.gdz == slices
    assert cache.opencl.fused_decode_kernel() is None
    simulate(cache, steps=40, seed=3, rope=False)
