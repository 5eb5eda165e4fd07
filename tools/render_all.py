"""Render every kernel variant the fit can choose into a folder, one file per variant.

The variants are the built-in profiles and profile variations (strategy, vec, rows per
block, reduction, native f16, prefill shapes) fitted to a set of specs (dtypes, head_dims,
group sizes, quantized page formats, sliding window, soft-cap, RoPE types, partial
rotary) under several device limits (sub-groups, f16, subnormals, ``__fp16`` storage,
prefetch, vector caps, small local memory). Each distinct (kernel, spec, geometry) is
rendered once; the file name is a hash of that triple, so two runs over different trees
compare with ``diff -r``. A kernel whose geometry the fit refuses is skipped.

Usage: ``python tools/render_all.py OUTDIR``
"""
from __future__ import annotations

import hashlib
import itertools
import sys
from pathlib import Path

from clattn import codegen
from clattn.fit import Limits, append_geometry, decode_geometry, merge_geometry, prefill_geometry
from clattn.profiles.registry import builtin_profiles
from clattn.spec import AttentionSpec

GPTJ = {"rope_type": "gptj"}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

SPECS = [
    AttentionSpec(8, 2, 64),
    AttentionSpec(8, 2, 64, dtype="float32"),
    AttentionSpec(4, 4, 128, page_size=16, sliding_window=True, softcap=30.0),
    AttentionSpec(8, 1, 128, dtype="float32", rope_scaling=GPTJ),
    AttentionSpec(8, 2, 64, rope_scaling=GPTJ, rotary_dim=32),
    AttentionSpec(8, 2, 128, rotary_dim=64, rope_scaling=LLAMA3),
    AttentionSpec(4, 2, 96, dtype="float32", sliding_window=True),
    AttentionSpec(16, 2, 256, softcap=50.0),
    AttentionSpec(8, 2, 64, k_format="q8_0", v_format="q8_0"),
    AttentionSpec(8, 2, 64, k_format="q4_0", v_format="q4_0", rope_scaling=GPTJ),
    AttentionSpec(8, 2, 128, k_format="q8_0", v_format="q4_0", sliding_window=True),
    AttentionSpec(8, 2, 64, dtype="float32", k_format="q4_0", v_format="float32"),
    AttentionSpec(8, 2, 64, k_format="float32", v_format="q8_0", rotary_dim=32),
    AttentionSpec(8, 2, 64, dtype="float32", k_format="float16", v_format="float16"),
    AttentionSpec(4, 1, 32, page_size=8, rope_scaling=GPTJ, softcap=20.0),
]

LIMITS = [
    Limits(),
    Limits(has_fp16=True, denorms=True, storage_half=True, prefetch=True),
    Limits(subgroups="intel", subgroup_sizes=(8, 16, 32), has_fp16=True),
    Limits(subgroups="qcom", subgroup_sizes=(64, 128), khr_subgroups=True),
    Limits(subgroups="free", khr_subgroups=True, local_mem_size=16384),
    Limits(rows_max_vec=8, storage_half=True, prefetch=True, denorms=True),
    Limits(max_work_group_size=64, max_work_item_sizes=(64, 64, 64), tiled_prefill=False),
]


def profiles() -> list:
    """The built-in profiles and variations that reach the templates' other branches."""
    out = list(builtin_profiles().values())
    base = builtin_profiles()["generic"]
    for strategy, vec, tile, red, native in itertools.product(
            ("rows", "tiled"), (1, 2, 4, 8, 16), (1, 4, 8, 16), ("local", "subgroup"),
            (False, True)):
        if strategy == "rows" and red == "subgroup":
            continue
        out.append(base.with_(name="v", strategy=strategy, vec=vec, tile_rows=tile,
                              reduction=red, native_fp16=native,
                              subgroup_size=16 if red == "subgroup" else None))
    for qb, kb, tc, rm in ((4, 16, 8, 2), (8, 32, 16, 4), (2, 8, 32, 1)):
        for strategy in ("rows", "tiled"):
            out.append(base.with_(name="p", strategy=strategy, prefill_qb=qb, prefill_kb=kb,
                                  prefill_tc=tc, prefill_rm=rm))
    return out


def variants():
    """(kind, key, render) per distinct variant; key names the spec and geometry."""
    seen = set()
    for spec, prof, lim in itertools.product(SPECS, profiles(), LIMITS):
        fits = (
            ("decode", lambda: decode_geometry(spec, prof, lim), codegen.render_decode),
            ("prefill", lambda: prefill_geometry(spec, prof, lim), codegen.render_prefill),
            ("append", lambda: append_geometry(spec.head_dim, spec.dtype, prof, lim),
             codegen.render_append),
        )
        for kind, fit, render in fits:
            try:
                geom = fit()
            except ValueError:
                continue
            key = f"{kind} {spec!r} {geom!r}"
            if key not in seen:
                seen.add(key)
                yield kind, key, (lambda s=spec, g=geom, r=render: r(s, g))
                if kind == "decode":  # the build with the learned-sink epilogue
                    yield kind, key + " sinks", (lambda s=spec, g=geom:
                                                 codegen.render_decode(s, g, sinks=True))
        try:
            mg = merge_geometry(spec.head_dim, spec.dtype, prof, lim)
        except ValueError:
            continue
        for vin in (spec.dtype, "float32"):
            key = f"merge {spec.head_dim} {spec.dtype} {vin} {mg!r}"
            if key not in seen:
                seen.add(key)
                yield "merge", key, (lambda s=spec, v=vin, g=mg:
                                     codegen.render_merge(s.head_dim, s.dtype, v, g))
                if vin == "float32":  # split-KV's merge with the learned sinks
                    yield "merge", key + " sinks", (lambda s=spec, g=mg: codegen.render_merge(
                        s.head_dim, s.dtype, "float32", g, sinks=True))
    for lanes, storage_half, denorms in itertools.product((1, 2, 4, 8, 16), (False, True),
                                                          (False, True)):
        yield ("half_probe", f"half_probe {lanes} {storage_half} {denorms}",
               lambda a=lanes, b=storage_half, c=denorms: codegen.render_half_probe(a, b, c))


def main(outdir: str) -> int:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for kind, key, render in variants():
        name = f"{kind}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
        (out / f"{name}.cl").write_text(render())
        (out / f"{name}.key").write_text(key + "\n")
        n += 1
    print(f"{n} variants rendered into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
