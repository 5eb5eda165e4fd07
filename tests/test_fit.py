"""The one fit: for every recorded device and the profile it matches, each wish of the
profile either reaches the rendered kernel or is listed as cut, with its reason."""
import json
from pathlib import Path

import pytest
from cases import config_scenario
from model_configs import load_models, model

import clattn
from clattn import models
from clattn.codegen import render_decode
from clattn.device_fit import fit_device
from clattn.fit import (
    ROWS_BLOCK_BYTES,
    ROWS_DENSE_MACS_PER_BYTE,
    ROWS_MIN_NATIVE_VEC,
    Limits,
    decode_geometry,
    rows_vector_registers,
    slice_heads,
)
from clattn.profiles import builtin_profiles, match

RECORDS = json.loads((Path(__file__).parent / "data" / "devices.json").read_text())["records"]
# Llama-3-8B, Qwen2.5-0.5B (group 7, head_dim 64), Gemma-2 (head_dim 256), Phi-3 (head_dim 96)
SHAPES = [(32, 8, 128), (14, 2, 64), (8, 4, 256), (32, 32, 96)]


@pytest.mark.parametrize("rec", RECORDS, ids=[f"{r['id']}" for r in RECORDS])
def test_every_wish_reaches_the_kernel_or_is_reported(rec):
    m = match(rec, user=False)
    trimmed = fit_device(m.profile, rec)
    fitted, profile_notes = trimmed.profile, trimmed.notes
    limits = Limits.from_info(rec)
    for shape in SHAPES:
        spec = clattn.AttentionSpec(*shape, page_size=16, dtype="float16")
        try:
            geom = decode_geometry(spec, fitted, limits)
        except ValueError as exc:  # an impossible fit must say why
            assert "work-group limit" in str(exc) or "local memory" in str(exc)
            continue
        notes = list(profile_notes) + list(geom.notes)
        src = render_decode(spec, geom)
        wanted_sub = m.profile.reduction == "subgroup"
        if wanted_sub and geom.reduction != "subgroup":
            assert any(n.startswith("reduction subgroup -> local:") for n in notes), notes
        if geom.reduction == "subgroup":
            # a sub-group is exactly one row's head_dim lanes, and its size is required
            assert geom.bdx == geom.subgroup_size
            assert geom.subgroup_attr and geom.subgroup_attr in src
            assert "sub_group_reduce_add" in src
            if fitted.subgroup_size:
                assert geom.subgroup_size == fitted.subgroup_size
        else:
            assert "sub_group_reduce_add" not in src
        if geom.strategy == "rows":
            # cuts down to what the wish asked up to 8 are derived (documented, not noted)
            want = min(fitted.vec, max(limits.native_float, ROWS_MIN_NATIVE_VEC))
            if geom.vec < min(fitted.vec, ROWS_MIN_NATIVE_VEC):
                assert any(n.startswith(f"vec {want} -> {geom.vec}") for n in notes), notes
            else:
                assert not any(n.startswith("vec ") for n in notes), notes
        elif geom.vec != fitted.vec:
            assert any(n.startswith(f"vec {fitted.vec} -> {geom.vec}") for n in notes), notes
        if geom.strategy == "tiled":
            assert geom.threads <= limits.max_work_group_size


def test_adreno_subgroup_wish_reaches_the_kernel():
    """An Adreno that can require its wave size gets the sub-group reduction, with
    Qualcomm's attribute and extension, and head_dim spread over one 64-lane wave."""
    rec = next(r for r in RECORDS
               if "cl_qcom_reqd_sub_group_size" in (r.get("subgroup_extensions") or ()))
    m = match(rec, user=False)
    assert m.profile.reduction == "subgroup" and m.profile.subgroup_size == 64
    spec = clattn.AttentionSpec(32, 8, 128, page_size=16, dtype="float16")
    geom = decode_geometry(spec, fit_device(m.profile, rec).profile, Limits.from_info(rec))
    assert (geom.reduction, geom.subgroup_size, geom.bdx, geom.vec) == ("subgroup", 64, 64, 2)
    src = render_decode(spec, geom)
    assert 'qcom_reqd_sub_group_size("half")' in src
    assert "#pragma OPENCL EXTENSION cl_qcom_reqd_sub_group_size : enable" in src
    assert any(n.startswith("vec 4 -> 2") for n in geom.notes)


def test_free_subgroups_are_cut_with_reason():
    lim = Limits(subgroups="free")
    prof = clattn.Profile(name="t", strategy="tiled", reduction="subgroup", subgroup_size=32)
    geom = decode_geometry(clattn.AttentionSpec(8, 2, 128), prof, lim)
    assert geom.reduction == "local"
    assert any("cannot require a sub-group size" in n for n in geom.notes)


def test_rows_tile_scores_in_vectors_no_wider_than_the_loads():
    """A block of 16 rows is scored as two float8 vectors where the compiler builds at
    most 8-float vectors (PoCL on an AVX-512 host: LLVM aborts the process on 16)."""
    prof = clattn.Profile(name="t", strategy="rows", vec=16, tile_rows=16)
    spec = clattn.AttentionSpec(32, 8, 64, page_size=16, dtype="float16")
    geom = decode_geometry(spec, prof, Limits(rows_max_vec=8, native_float=16))
    assert (geom.vec, geom.tile) == (8, 16) and not geom.notes   # 8: derived, not noted
    src = render_decode(spec, geom)
    assert "float16 " not in src and "float8 sv1" in src
    wide = decode_geometry(spec, prof, Limits(rows_max_vec=16, native_float=16))
    assert (wide.vec, wide.tile) == (16, 16) and "float16 sv0" in render_decode(spec, wide)


@pytest.mark.parametrize("d, dtype, fmt, tile", [
    (64, "float16", None, 16),      # 16 rows x 256 bytes = 4 KiB
    (128, "float16", None, 16),     # 8 KiB
    (128, "float32", None, 8),      # 16 KiB: cut to 8 rows
    (256, "float16", None, 8),      # Gemma-2: 16 KiB
    (256, "float32", None, 8),      # 32 KiB: never below 8 rows
    (256, "float16", "q8_0", 8),    # 16 x 2 x 272 bytes (scales included) = 8.5 KiB
    (256, "float16", "q4_0", 16),   # 16 x 2 x 144 bytes = 4.5 KiB
])
def test_rows_blocks_above_8_rows_fit_the_block_budget(d, dtype, fmt, tile):
    spec = clattn.AttentionSpec(8, 2, d, page_size=16, dtype=dtype, k_format=fmt, v_format=fmt)
    prof = clattn.Profile(name="t", strategy="rows", vec=8, tile_rows=16)
    geom = decode_geometry(spec, prof, Limits(rows_max_vec=8))
    assert geom.tile == tile
    assert geom.notes == ()   # a size the shape derives, not a wish cut: no warning
    assert decode_geometry(spec, prof.with_(tile_rows=4), Limits()).tile == 4


@pytest.mark.parametrize("name, cap, tile, gdz", [
    ("DeepSeek-V2-Lite", 16, 16, 1),   # 16 x (576 + 512) per 1152 bytes: 15 per byte
    ("DeepSeek-V2-Lite", 8, 8, 2),     # 2 slices of 8 heads: 7.6 per byte, 18 KiB: 8 rows
    ("MiniCPM3-4B", 16, 16, 2),        # 20 x (288 + 256) per 576 bytes: 19 per byte
    ("MiniCPM3-4B", 8, 16, 3),         # 14 heads per slice: 13 per byte
])
def test_rows_blocks_of_dense_latent_rows_keep_16_rows(name, cap, tile, gdz):
    """A work-item that does at least ROWS_DENSE_MACS_PER_BYTE multiply-adds per byte of
    its rows keeps 16-row blocks past the block budget (a latent MLA row of 576-1152
    bytes); the rows the budget was measured on (0.25-1 per byte) keep it."""
    prof = clattn.Profile(name="t", strategy="rows", vec=16, tile_rows=16)
    spec = models.mla_shape(name).spec("latent")
    geom = decode_geometry(spec, prof, Limits(rows_max_vec=cap, native_float=cap))
    assert (geom.tile, geom.gdz, geom.notes) == (tile, gdz, ())
    per_row = spec.bytes_per_token / spec.num_kv_heads
    heads = slice_heads(spec.group_size, gdz)
    dense = heads * (spec.head_dim + spec.head_dim_v) >= ROWS_DENSE_MACS_PER_BYTE * per_row
    assert dense == (tile == 16) and 16 * per_row > ROWS_BLOCK_BYTES
    f32 = clattn.AttentionSpec(32, 8, 128, page_size=16, dtype="float32")   # 1 per byte
    assert decode_geometry(f32, prof, Limits(rows_max_vec=16, native_float=16)).tile == 8


@pytest.mark.parametrize("hq, hkv, d, cap, native, chunks", [
    (14, 2, 64, 16, 16, 4),    # Qwen2.5-0.5B, AVX-512: 4 x 7 + 3 = 31 of 32 registers
    (14, 2, 64, 8, 8, 1),      # the same at 8 floats: 8 chunks, 2 x 7 + 3 > 16
    (32, 8, 64, 16, 16, 4),    # Llama-3.2-1B: group 4, all 4 chunks
    (32, 8, 64, 8, 8, 2),      # 8 chunks of 8 floats: 2 x 4 + 3 = 11, 4 x 4 + 3 > 16
    (32, 8, 128, 16, 16, 4),   # Llama-3-8B: 8 x 4 + 3 > 32
    (8, 4, 256, 16, 16, 8),    # Gemma-2: group 2, 8 x 2 + 3 = 19
    (8, 4, 256, 8, 8, 4),
    (32, 2, 64, 16, 16, 1),    # group 16: one chunk's accumulators fill 16 registers
])
def test_rows_value_chunks_fill_the_vector_registers(hq, hkv, d, cap, native, chunks):
    """Chunks of V per pass: the most (dividing the row's chunks) whose G accumulators, a
    value and a weight fit the registers a vector width implies (32 at AVX-512's 16
    floats, else 16)."""
    prof = clattn.Profile(name="t", strategy="rows", vec=16, tile_rows=16)
    spec = clattn.AttentionSpec(hq, hkv, d, page_size=16, dtype="float16")
    geom = decode_geometry(spec, prof, Limits(rows_max_vec=cap, native_float=native))
    assert geom.vec == cap
    assert geom.v_chunks == chunks
    assert chunks * spec.group_size + 3 <= rows_vector_registers(geom.vec)


@pytest.mark.parametrize("name", [m["name"] for m in load_models()])
def test_cpu_profiles_fit_every_model_without_a_note(name):
    """The built-in CPU profiles fit every real model as they stand: a note is a warning
    every user of the default profile would see on each decoder they build."""
    for dtype in ("float16", "float32"):
        spec = config_scenario(f"{name}-{dtype}", model(name), dtype=dtype).spec
        for prof in (builtin_profiles()["generic-cpu"], builtin_profiles()["intel-cpu"]):
            for cap in (8, 16):
                geom = decode_geometry(spec, prof, Limits(rows_max_vec=cap))
                assert geom.notes == (), (prof.name, dtype, cap)


@pytest.mark.parametrize("rec", RECORDS, ids=[f"{r['id']}" for r in RECORDS])
def test_every_command_shows_the_one_fits_notes(rec):
    """``clattn profiles`` and ``clattn tune`` print the notes of one fit, the one
    BatchDecode warns for the same spec: the device's cuts and the decode kernel's."""
    from clattn.device_fit import REPORT_SPEC, report_fit
    from clattn.profiles_report import device_block
    from clattn.tune.session import _choice

    m = match(rec, user=False)
    fit = report_fit(m.profile, rec)
    try:
        geom = decode_geometry(REPORT_SPEC, fit.profile, Limits.from_info(rec))
    except ValueError:
        geom = None
    if geom is not None:
        assert fit.geometry == geom and set(geom.notes) <= set(fit.notes)
    block = device_block(rec, user=False)
    for note in fit.notes:
        assert f"  fitted:  {note}" in block
    if not fit.notes:
        assert "fitted:  no changes needed" in block
    assert _choice(m, rec).fit_notes == fit.notes


def test_batch_decode_warns_the_one_fits_notes(device):
    """BatchDecode shows each note of the one fit (the device's cuts, then the decode
    kernel's) as one warning: a GPU profile on a CPU device cuts several wishes."""
    import warnings

    from clattn.device_fit import fit_device
    spec = clattn.AttentionSpec(32, 8, 128, page_size=16, dtype="float16")
    from clattn.profiles import device_info
    past = 2 ** int(device_info(device)["max_work_group_size"]).bit_length()
    wishes = builtin_profiles()["adreno-7xx"].with_(thread_limit=past, merge_threads=past)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dec = clattn.BatchDecode(spec, device, profile=wishes)
    setup = dec.setup
    fit = fit_device(setup.wishes, setup.info, spec, setup.limits)
    assert fit.notes[0].startswith(f"thread_limit {past} -> ") and len(fit.notes) > 2
    shown = [str(w.message) for w in caught if str(w.message).startswith("clattn: ")]
    assert shown == [f"clattn: {n}" for n in fit.notes]
    assert dec.geometry == fit.geometry and dec.profile == fit.profile
