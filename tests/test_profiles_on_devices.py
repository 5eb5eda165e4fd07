"""Every built-in profile, forced onto every device present, renders kernels that build and
compute the right answer; sub-group reduction is used where the device can require the size
and falls back to local memory (with a warning) where it cannot.

Builds are bounded: two small specs x the built-in profiles x the devices, and profiles
that fit to the same geometry share one program (the runtime caches by source).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from cases import compare, decode_args, make_case, merge_cases, oracle, spec_scenario
from model_configs import model
from naive import naive_merge, naive_merge_k

import clattn
from clattn.profiles import builtin_profiles
from clattn.profiles.device_info import subgroup_support

PROFILES = list(builtin_profiles())

# a profile forced onto a device it does not fit warns its cuts when fitted (by design)
pytestmark = pytest.mark.filterwarnings(
    "ignore:clattn. (thread_limit|merge_threads|reduction) :RuntimeWarning")

SCENARIOS = {
    # group 4, f16, sliding window + Llama-3 RoPE: the subgroup-capable shape (bdx 16 at vec 4)
    "g4-d64-f16-win-rope": spec_scenario(
        "g4-d64-f16-win-rope", 8, 2, 64, page_size=16, dtype="float16", sliding_window=True,
        rope_scaling=model("Llama-3.2-1B")["rope_scaling"], max_position_embeddings=131072),
    # group 1 (tile_rows > 1 applies), f32, D 96 (bdx 24), GPT-J partial RoPE, softcap
    "g1-d96-f32-gptj-cap": spec_scenario(
        "g1-d96-f32-gptj-cap", 4, 4, 96, page_size=8, dtype="float32",
        rope_scaling={"rope_type": "gptj"}, rotary_dim=32, softcap=30.0),
}
SPECS = {k: sc.spec for k, sc in SCENARIOS.items()}


@pytest.fixture(autouse=True)
def _isolated_user_config(tmp_path, monkeypatch):
    """No user profile or CLATTN_PROFILE from the environment changes what a name means."""
    monkeypatch.setenv("CLATTN_CONFIG_DIR", str(tmp_path / "user-profiles"))
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)


def _case(spec):
    if spec.sliding_window:
        return make_case(spec, [0, 1, 37, 64, 100], seed=3, window=[0, 0, 16, 10, 90],
                         sinks=[0, 0, 4, 3, 0], rope=True, pos_offset=[0, 5, 99_000, 7, 12])
    return make_case(spec, [0, 1, 9, 16, 45], seed=4, rope=True, pos_offset=[0, 3, 99_000, 8, 1])


def _expect_subgroup(dec) -> bool:
    """Whether the device can run this geometry's sub-group reduction (the library's rule)."""
    g = dec.geometry
    return (dec.profile.reduction == "subgroup" and g.strategy == "tiled"
            and g.bdx in dec.setup.limits.subgroup_sizes)


@pytest.mark.parametrize("spec_key", list(SPECS))
@pytest.mark.parametrize("name", PROFILES)
def test_builtin_profile_on_device(device, get_decoder, name, spec_key):
    spec = SPECS[spec_key]
    dec = get_decoder(spec, device, profile=name)
    assert dec.profile.name == name
    wanted = builtin_profiles()[name]
    assert dec.geometry.strategy == wanted.strategy
    src = dec.source()
    # -- sub-group reduction: really used where possible, else local memory with a warning
    if wanted.reduction == "subgroup" and wanted.strategy == "tiled":
        if _expect_subgroup(dec):
            assert dec.geometry.reduction == "subgroup"
            assert dec.geometry.subgroup_size == dec.geometry.bdx
            assert "sub_group_reduce_add" in src
            assert f"intel_reqd_sub_group_size({dec.geometry.bdx})" in src
        else:
            assert dec.geometry.reduction == "local"
            assert "sub_group_reduce_add" not in src
            if subgroup_support(dec.setup.info) is False:   # e.g. PoCL: the fit warns
                assert any("reduction subgroup -> local" in w for w in dec.build_warnings), \
                    f"no warning about the subgroup fallback: {dec.build_warnings}"
            # (a device with sub-groups but not this size: a geometry note, see
            # test_tiled_geometry_notes_are_notes_and_warned)
    else:
        assert dec.geometry.reduction == "local"
    # -- correctness: plain, windowed + RoPE at large positions, split
    case = _case(spec)
    args, kw = decode_args(case)
    ref = oracle(SCENARIOS[spec_key], case, rotary_mode=1, rope_theta=500000.0)
    for split in (False, 16):
        res = dec.run(*args, **kw, rotary_mode=1, rope_theta=500000.0, split=split)
        compare(res.out, res.lse, *ref, spec.dtype, what=f"{name}/{spec_key} split={split}: ")
    res = dec.run(*args, **kw)
    compare(res.out, res.lse, *oracle(SCENARIOS[spec_key], case), spec.dtype,
            what=f"{name}/{spec_key} no rope: ")


@pytest.mark.parametrize("name", PROFILES)
def test_builtin_profile_merges_on_device(device, name):
    """merge_state_ (pair) and merge_states (K-way) with each profile's merge geometry."""
    rng = np.random.default_rng(7)
    for dtype, D in (("float16", 64), ("float32", 96)):
        (v, s, vo, so), (vk, sk) = merge_cases(rng, 5, 3, D, dtype)
        a, b = v.copy(), s.copy()
        clattn.merge_state_(a, b, vo, so, device=device, profile=name)
        compare(a, b, *naive_merge(v, s, vo, so), dtype, what=f"{name} merge_state_: ")
        out, lse = clattn.merge_states(vk, sk, device=device, profile=name)
        compare(out, lse, *naive_merge_k(vk, sk), dtype, what=f"{name} merge_states: ")


def test_subgroup_profile_uses_subgroups_where_required_size_exists(device, get_decoder):
    """An explicit statement of the rule for the usual subgroup profile on this device."""
    spec = SPECS["g4-d64-f16-win-rope"]
    dec = get_decoder(spec, device, profile="intel-gpu")
    sizes = dec.setup.limits.subgroup_sizes
    if dec.geometry.bdx in sizes:        # e.g. Intel's CPU runtime: required size 16 exists
        assert dec.geometry.reduction == "subgroup" and dec.geometry.subgroup_size == 16
        assert not any("subgroup -> local" in w for w in dec.build_warnings)
    else:                                # e.g. PoCL: no sub-groups at all -> local + warning
        assert dec.geometry.reduction == "local"
        assert dec.build_warnings, "falling back to local memory must warn"


def test_tiled_geometry_notes_are_notes_and_warned():
    """A sub-group profile on a device whose required sizes lack bdx: a note, warned once."""
    import warnings

    from clattn.fit import Limits, decode_geometry

    spec = SPECS["g1-d96-f32-gptj-cap"]                      # bdx = 96 / 4 = 24
    prof = clattn.Profile(reduction="subgroup", subgroup_size=16)
    g = decode_geometry(spec, prof, Limits(subgroups="intel", subgroup_sizes=(8, 16)))
    assert g.reduction == "local"
    assert isinstance(g.denorms, bool), f"denorms={g.denorms!r}"
    cut = "reduction subgroup -> local"
    assert any(cut in n and "head_dim 96" in n for n in g.notes), g
    # and through the public API on a device that has sub-groups (Intel's CPU runtime)
    from clattn import runtime

    for dev in (d for d in runtime.all_devices() if not runtime.is_simulator(d)):
        rt_limits = Limits.from_info(clattn.profiles.device_info(dev))
        if rt_limits.subgroup_sizes and 24 not in rt_limits.subgroup_sizes:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                clattn.BatchDecode(spec, dev, profile=prof)
            assert any(cut in str(w.message) for w in caught)


def test_user_profile_dict_overrides_vec(device, get_decoder):
    spec = SPECS["g4-d64-f16-win-rope"]
    base = get_decoder(spec, device)
    dec = get_decoder(spec, device, profile={"vec": 2})
    assert dec.geometry.vec == 2 and base.geometry.vec != 2
    src, base_src = dec.source(), base.source()
    assert src != base_src
    # the vector width shows in the vector type the kernel loads K/V rows with
    bv = base.geometry.vec
    load = r"typedef (?:float|ushort|half){} __attribute__"
    assert re.search(load.format(2), src), "no 2-wide load type in the vec=2 source"
    assert re.search(load.format(bv), base_src), f"no {bv}-wide load type in the default source"
    assert not re.search(load.format(bv), src), f"{bv}-wide loads still in the vec=2 source"
    # the rest of the profile is still the device's (only vec was overridden)
    assert dec.profile.strategy == base.profile.strategy
    case = _case(spec)
    args, kw = decode_args(case)
    ref = oracle(SCENARIOS["g4-d64-f16-win-rope"], case, rotary_mode=1)
    for split in (False, 16):
        res = dec.run(*args, **kw, rotary_mode=1, split=split)
        compare(res.out, res.lse, *ref, spec.dtype, what=f"vec=2 split={split}: ")


def test_user_profile_object(device, get_decoder):
    """A Profile object (tiled, 2 rows per step, 64 threads) builds and runs."""
    prof = clattn.Profile(name="test-custom", strategy="tiled", thread_limit=64, tile_rows=2,
                          vec=2, merge_threads=32)
    spec = SPECS["g1-d96-f32-gptj-cap"]
    dec = get_decoder(spec, device, profile=prof)
    g = dec.geometry
    assert (g.strategy, g.vec, g.tile, g.use_local) == ("tiled", 2, 2, False)
    assert g.bdx * g.bdy * g.bdz <= 64
    case = _case(spec)
    args, kw = decode_args(case)
    ref = oracle(SCENARIOS["g1-d96-f32-gptj-cap"], case, rotary_mode=1)
    for split in (False, 8):
        res = dec.run(*args, **kw, rotary_mode=1, split=split)
        compare(res.out, res.lse, *ref, spec.dtype, what=f"custom split={split}: ")


def test_unknown_profile_name_and_bad_override_raise(device):
    spec = SPECS["g4-d64-f16-win-rope"]
    with pytest.raises(ValueError, match="unknown profile"):
        clattn.BatchDecode(spec, device, profile="no-such-profile")
    with pytest.raises(ValueError, match="vec"):
        clattn.BatchDecode(spec, device, profile={"vec": 3})
    with pytest.raises(ValueError, match="unknown key"):
        clattn.BatchDecode(spec, device, profile={"vector": 2})
