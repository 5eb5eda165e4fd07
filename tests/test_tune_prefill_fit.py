"""Prefill wishes of the profiles (``prefill_qb``, ``prefill_kb``, ``prefill_tc``,
``prefill_rm``, ``prefill_vec``): for every recorded device x every built-in profile each
wish reaches the geometry or is listed as cut with its reason, the geometry fits the
device, and the values reach the rendered kernel and the plan; a kernel built from them
computes what the float64 oracle does."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from cases import compare, spec_scenario
from prefill_cases import naive_prefill, prefill_case, run

import clattn
from clattn.codegen import render_prefill
from clattn.device_fit import fit_device
from clattn.fit import (
    PREFILL_MAX_KB,
    PREFILL_MIN_ROW_VECTORS,
    PREFILL_ROWS,
    Limits,
    decode_geometry,
    pocl_target_cpu,
    prefill_geometry,
)
from clattn.models import model_shape
from clattn.profiles import builtin_profiles, match
from clattn.profiles.registry import prefill_text

RECORDS = json.loads((Path(__file__).parent / "data" / "devices.json").read_text())["records"]
# Llama-3-8B, Qwen2.5-0.5B (group 7), Gemma-2 (head_dim 256), Phi-3 (head_dim 96), an MQA
# model with more heads than a row-group tile (71 x 64), head_dim 72 (not a multiple of 16)
SHAPES = [(m.num_qo_heads, m.num_kv_heads, m.head_dim)
          for m in map(model_shape, ("Llama-3-8B", "Qwen2.5-0.5B", "Gemma-2-2B", "Phi-3-mini"))]
SHAPES += [(71, 1, 64), (8, 1, 72)]
#: the wishes each strategy takes, and the geometry field that holds each
APPLIES = {"rows": {"prefill_qb": "qb", "prefill_kb": "kb", "prefill_vec": "vec"},
           "tiled": {"prefill_qb": "qb", "prefill_kb": "kb", "prefill_tc": "tc",
                     "prefill_rm": "rm"}}
PROFILES = builtin_profiles()


def _geometry(spec, prof, limits):
    try:
        return prefill_geometry(spec, prof, limits)
    except ValueError as exc:  # an impossible fit must say why
        assert "local memory" in str(exc), exc
        return None


def _check_wishes(prof, geom, where):
    """Each wish of ``prof`` is the geometry's value or is cut with a note (and only then)."""
    for wish, attr in APPLIES[geom.strategy].items():
        want, got = getattr(prof, wish), getattr(geom, attr)
        if wish == "prefill_kb" and want is None and geom.strategy == "rows":
            wish, want = "tile_rows", prof.tile_rows  # the rows kernel's keys per block
        cut = [n for n in geom.notes if n.startswith(f"{wish} ")]
        if want is None or want == got:
            assert not cut, (where, cut)
        else:
            assert cut and cut[0].startswith(f"{wish} {want} -> {got}: "), (where, geom.notes)
            assert len(cut[0].split(": ", 1)[1]) > 10, cut  # a reason, not just the numbers


@pytest.mark.parametrize("rec", RECORDS, ids=[r["id"] for r in RECORDS])
def test_every_prefill_wish_is_honoured_or_cut_on_every_device(rec):
    limits = Limits.from_info(rec)
    for name, prof in PROFILES.items():
        fitted = fit_device(prof, rec).profile
        for shape in SHAPES:
            spec = clattn.AttentionSpec(*shape, page_size=16, dtype="float16")
            geom = _geometry(spec, fitted, limits)
            if geom is None:
                continue
            _check_wishes(fitted, geom, (name, shape))
            assert geom.qb >= 1 and geom.kb >= 1
            if geom.strategy == "rows":
                assert geom.kb <= PREFILL_MAX_KB and geom.kb & (geom.kb - 1) == 0
                assert geom.qb * spec.group_size <= max(PREFILL_ROWS, spec.group_size)
            else:
                assert geom.threads <= limits.max_work_group_size
                assert geom.tc <= limits.max_work_item_sizes[0]
                assert geom.tr <= limits.max_work_item_sizes[1]
                assert spec.head_dim % geom.tc == 0 and geom.kb % geom.tc == 0
                assert geom.tr * geom.rm >= geom.qb * spec.group_size  # every row has a thread
                assert geom.local_mem_bytes <= limits.local_mem_size


@pytest.mark.parametrize("rec", RECORDS, ids=[r["id"] for r in RECORDS])
def test_the_matched_profiles_prefill_values_reach_the_kernel(rec):
    prof = fit_device(match(rec, user=False).profile, rec).profile
    limits = Limits.from_info(rec)
    for shape in SHAPES[:4]:
        spec = clattn.AttentionSpec(*shape, page_size=16, dtype="float16")
        geom = _geometry(spec, prof, limits)
        if geom is not None:
            _assert_rendered(spec, geom)


def _assert_rendered(spec, geom):
    """The geometry's tile sizes are the kernel's array sizes and work-group shape."""
    src = render_prefill(spec, geom)
    if geom.strategy == "rows":
        rows = -(-(geom.qb * spec.group_size) // geom.vec) * geom.vec
        assert f"float pt[{geom.kb}][{rows}]" in src
    else:
        assert f"reqd_work_group_size({geom.tc}, {geom.tr}, 1)" in src
        assert f"__local float k_tile[{geom.kb}][{spec.head_dim + 1}]" in src
        assert f"__local float p_tile[{geom.tr * geom.rm}][{geom.kb + 1}]" in src
        assert re.search(rf"float m\[{geom.rm}\], l\[{geom.rm}\]", src)


def test_defaults_per_device_class():
    cpu, gpu = PROFILES["generic-cpu"], PROFILES["generic"]
    assert (cpu.strategy, cpu.prefill_kb, cpu.prefill_qb) == ("rows", 16, None)
    assert (gpu.prefill_tc, gpu.prefill_rm, gpu.prefill_kb, gpu.prefill_qb) == (16, 4, None, None)
    assert PROFILES["nvidia"].prefill_tc == 16 and PROFILES["intel-cpu"].prefill_kb == 16
    assert prefill_text(cpu) == "kb 16, qb auto, vec auto" and \
        prefill_text(gpu) == "16x4, kb auto, qb auto"
    # a decode tile_rows (what the tuner tunes) does not move the CPU prefill's key blocks
    g = prefill_geometry(clattn.AttentionSpec(32, 8, 128), cpu.with_(tile_rows=2), Limits())
    assert g.kb == 16 and not g.notes
    # the GPU root leaves the key tile to the fit: 2 keys per thread of a row group
    g = prefill_geometry(clattn.AttentionSpec(32, 8, 128), gpu, Limits(local_mem_size=1 << 20))
    assert (g.tc, g.rm, g.kb) == (16, 4, 32) and not g.notes


def test_wishes_are_cut_with_their_reasons():
    lim = Limits(max_work_group_size=256, max_work_item_sizes=(16, 256, 256),
                 local_mem_size=32768)
    wish = clattn.Profile(name="w", prefill_qb=100, prefill_kb=30, prefill_tc=32, prefill_rm=2)
    g = prefill_geometry(clattn.AttentionSpec(8, 1, 72), wish, lim)
    notes = " | ".join(g.notes)
    assert "prefill_tc 32 -> 8: at most 16 work-items across" in notes
    assert "head_dim 72 is not a multiple of 32" in notes
    assert f"prefill_kb 30 -> {g.kb}: a multiple of the 8 threads of a row group" in notes
    assert f"prefill_qb 100 -> {g.qb}: " in notes and "prefill_rm" not in notes
    rows = clattn.Profile(name="r", strategy="rows", vec=8, prefill_qb=100, prefill_kb=12)
    g = prefill_geometry(clattn.AttentionSpec(8, 1, 64), rows, Limits())
    assert (g.qb, g.kb) == (8, 8)
    notes = " | ".join(g.notes)
    assert "prefill_kb 12 -> 8: the rows kernel takes a power of two" in notes
    assert "prefill_qb 100 -> 8: the rows kernel keeps at most 64" in notes
    # one query's 71 heads need more rows than 16 row groups of 4 hold: the rows grow
    mqa = clattn.Profile(name="g", prefill_tc=16, prefill_rm=4)
    g = prefill_geometry(clattn.AttentionSpec(71, 1, 64), mqa, Limits(local_mem_size=1 << 20))
    assert (g.qb, g.rm, g.tr) == (1, 5, 15)
    assert any(n.startswith("prefill_rm 4 -> 5: one query's 71 heads") for n in g.notes)
    # no wishes: the derived geometry, no notes about tile sizes
    bare = clattn.Profile(name="b", prefill_kb=None, prefill_tc=None, prefill_rm=None)
    g = prefill_geometry(clattn.AttentionSpec(32, 8, 128), bare, Limits(local_mem_size=1 << 20))
    assert (g.tc, g.rm, g.kb) == (16, 4, 32) and not g.notes


@pytest.mark.parametrize("shape, native, want", [
    ((32, 8, 128), 16, 8),    # Llama-3-8B: 4096 floats of q give 32 rows, two 16-float vectors
    ((32, 8, 128), 8, 8),
    ((8, 4, 256), 16, 16),    # Gemma-2: 4096 floats are 16 rows, one vector: two need 16 queries
    ((8, 4, 256), 8, 8),      # ... two 8-float vectors already
    ((32, 32, 96), 16, 32),   # Phi-3: 16 queries (the floats' cap) of one head, one vector
    ((32, 32, 96), 8, 16),
    ((14, 2, 64), 16, 9),     # Qwen2.5: 7 heads, at most 64 rows
    ((71, 1, 64), 16, 1),     # a group wider than the row cap: one query
])
def test_rows_queries_fill_two_row_vectors(shape, native, want):
    cpu = PROFILES["generic-cpu"]
    spec = clattn.AttentionSpec(*shape, dtype="float16")
    g = prefill_geometry(spec, cpu, Limits(native_float=native))
    assert g.vec == native and g.qb == want and not g.notes
    rows = g.qb * spec.group_size
    assert rows >= min(PREFILL_MIN_ROW_VECTORS * g.vec, PREFILL_ROWS)


def test_rows_vectors_follow_the_native_width_decode_from_8():
    cpu, spec = PROFILES["generic-cpu"], clattn.AttentionSpec(32, 8, 128, dtype="float16")
    assert cpu.vec == 16 and cpu.prefill_vec is None
    wide = Limits(native_float=16)
    g = prefill_geometry(spec, cpu, wide)
    assert g.vec == 16 and not g.notes
    # decode: the native width (AVX-512: 16, AVX2: 8), never below 8, no note either way
    for native, want in ((16, 16), (8, 8), (4, 8), (1, 8)):
        g = decode_geometry(spec, cpu, Limits(native_float=native))
        assert g.vec == want and not g.notes
    assert decode_geometry(spec, cpu.with_(vec=8), wide).vec == 8   # a wish below it stands
    # head_dim 40 (an MLA latent row of tiny models): 8, derived, no note; below 8: noted
    assert decode_geometry(clattn.AttentionSpec(8, 1, 40), cpu, wide).notes == ()
    cut = decode_geometry(clattn.AttentionSpec(8, 1, 36), cpu, wide)
    assert cut.vec == 4 and cut.notes == ("vec 16 -> 4: head_dim 36",)
    # a compiler capped at 8 (PoCL's PyPI build), a narrower native width, head_dim 72
    assert prefill_geometry(spec, cpu, Limits(native_float=16, rows_max_vec=8)).vec == 8
    assert prefill_geometry(spec, cpu, Limits(native_float=4)).vec == 8
    assert prefill_geometry(clattn.AttentionSpec(8, 1, 72), cpu, wide).vec == 8
    # a native width that is no power of two (OpenCL does not forbid 12, 6, 3): the
    # largest power of two below it that divides head_dim (96), never the odd width
    odd = clattn.AttentionSpec(8, 1, 96)
    for native, want in ((12, 8), (6, 4), (3, 2)):
        assert prefill_geometry(odd, cpu.with_(vec=1), Limits(native_float=native)).vec == want
    # a wish is honoured, or cut with its reason
    assert prefill_geometry(spec, cpu.with_(prefill_vec=4), wide).vec == 4
    g = prefill_geometry(spec, cpu.with_(prefill_vec=16), Limits(rows_max_vec=8))
    assert g.vec == 8 and g.notes == ("prefill_vec 16 -> 8: this platform's compiler builds "
                                      "the rows kernels with at most 8 floats per vector",)


@pytest.mark.parametrize("name, version, cap", [
    ("pthread-AMD EPYC", None, 8),
    ("pthread-skylake-avx512-AMD EPYC", None, 16),
    # PyPI's PoCL (LLVM 14): a Sapphire Rapids Xeon is rocketlake, a Zen 4 znver3
    ("pthread-Intel(R) Xeon(R) Processor",
     "OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-rocketlake", 16),
    ("pthread-AMD EPYC 9R14", "OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-znver3", 8),
    ("pthread-AMD EPYC", "OpenCL 3.0 PoCL HSTR: pthread-x86_64-pc-linux-gnu-skylake-avx512", 16),
    ("cpu-ARM", "OpenCL 3.0 PoCL HSTR: cpu-aarch64-unknown-linux-gnu-neoverse-n1", 8),
    ("pthread-Intel(R) Xeon(R)", "OpenCL 3.0 PoCL HSTR: pthread-x86_64-apple-darwin-x", 8),
])
def test_pocl_keeps_wide_vectors_only_when_it_compiles_for_avx512(name, version, cap):
    info = {"platform_name": "Portable Computing Language", "device_name": name,
            "device_version": version, "native_vector_width_float": 16}
    lim = Limits.from_info(info)
    assert (lim.rows_max_vec, lim.native_float) == (cap, 16)


def test_pocl_target_cpu_is_read_after_the_triple():
    assert pocl_target_cpu({"device_version": "OpenCL 3.0 PoCL HSTR: "
                            "pthread-x86_64-unknown-linux-gnu-skylake-avx512"}) == "skylake-avx512"
    assert pocl_target_cpu({"device_version": "OpenCL 3.0 PoCL"}) is None
    assert pocl_target_cpu({}) is None


@pytest.mark.parametrize("values", [{"prefill_qb": 0}, {"prefill_kb": -1}, {"prefill_tc": 2.0},
                                    {"prefill_rm": True}, {"prefill_vec": 3}])
def test_bad_prefill_wishes_raise_naming_the_field(values):
    (key, value), = values.items()
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        clattn.Profile(name="bad", **values)


#: (strategy, wishes, expected geometry (qb, kb, tc, tr, rm)) on the 8/2/64 shape
FORCED = [
    ("rows", dict(vec=8, prefill_qb=3, prefill_kb=4), (3, 4, 1, 1, 1)),
    ("tiled", dict(prefill_qb=2, prefill_kb=16, prefill_tc=8, prefill_rm=2), (2, 16, 8, 4, 2)),
]


@pytest.mark.parametrize("strategy, wishes, expected", FORCED, ids=[f[0] for f in FORCED])
def test_profile_values_reach_batch_prefill_and_compute_right(device, strategy, wishes, expected):
    sc = spec_scenario("wish", 8, 2, 64, dtype="float32", page_size=16)
    prof = clattn.Profile(name=f"wish-{strategy}", strategy=strategy, **wishes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # e.g. no sub-groups on the driver
        pre = clattn.BatchPrefill(sc.spec, device, backend="opencl", profile=prof)
    g = pre.geometry
    assert (g.qb, g.kb, g.tc, g.tr, g.rm) == expected and not [
        n for n in g.notes if n.startswith("prefill_")]
    _assert_rendered(sc.spec, g)
    assert pre.source() == render_prefill(sc.spec, g)
    case = prefill_case(sc.spec, [0, 40, 5], [7, 9, 1], seed=4)
    plan = pre.plan(case["qo_indptr"], case["page_indptr"], case["last_page_len"])
    assert plan.queries_per_unit == g.qb
    assert len(plan.units) == sum(-(-n // g.qb) for n in (7, 9, 1))
    res = run(pre, case, plan=plan)
    compare(res.out, res.lse, *naive_prefill(sc, case), sc.spec.dtype, what=f"{strategy}: ")
