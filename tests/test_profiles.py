"""Device-profile registry: matching real device records, fitting, user overlay, device_info."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from clattn.device_fit import fit_device
from clattn.profiles import (
    FIELDS,
    builtin_profiles,
    device_info,
    get_profile,
    match,
    registry,
    save_user_profile,
    user_profile_dir,
    user_profiles,
)
from clattn.profiles_report import describe, format_profiles_report


def trim(profile, info):
    """The device part of the one fit (the wishes trimmed to the device, no spec), as
    ``(profile, notes)``."""
    f = fit_device(profile, info)
    return f.profile, list(f.notes)


DATA = Path(__file__).parent / "data" / "devices.json"
RECORDS = {r["id"]: r for r in json.loads(DATA.read_text(encoding="utf-8"))["records"]}
BUILTIN_JSON = json.loads(registry.BUILTIN_PATH.read_text(encoding="utf-8"))

# id -> (profile, level, text the rule must quote as its reason)
EXPECTED = {
    "qcom-adreno-8gen2-ggml-log-e031.41.03.44": ("adreno", "vendor", "'QUALCOMM Adreno(TM)'"),
    "qcom-adreno505-e031.36.02.00": ("adreno", "vendor", "'QUALCOMM Adreno(TM)'"),
    "qcom-adreno630-e031.37.03.00": ("adreno-6xx", "architecture", "Adreno(TM) 630"),
    "qcom-adreno640-e031.37.12.01": ("adreno-6xx", "architecture", "Adreno(TM) 640"),
    "qcom-adreno643-ggml-log-e031.50.15.00": ("adreno-6xx", "architecture", "Adreno(TM) 643"),
    "qcom-adreno650-e031.37.12.01": ("adreno-6xx", "architecture", "Adreno(TM) 650"),
    "qcom-adreno735-header-only": ("adreno-7xx", "architecture", "Adreno(TM) 735"),
    "qcom-adreno750-e031.45.02.06": ("adreno-7xx", "architecture", "Adreno(TM) 750"),
    "qcom-adreno830-ggml-log-e031.47.18.23": ("adreno-8xx", "architecture", "Adreno(TM) 830"),
    "mesa-rusticl-freedreno-fd630": ("adreno-6xx", "architecture", "'FD630'"),
    "arm-mali-g310-r54p1-header": ("mali-valhall", "architecture", "Mali-G310"),
    "arm-mali-g52-c8adbf9": ("mali-bifrost", "architecture", "Mali-G52"),
    "arm-mali-g57mc2-r26p0": ("mali-valhall", "architecture", "Mali-G57"),
    "arm-mali-g610-rk3588-g13p0-header": ("mali-valhall", "architecture", "Mali-G610"),
    "arm-mali-g610mc6-r32p1-header": ("mali-valhall", "architecture", "Mali-G610 MC6"),
    "arm-mali-g71-r9p0": ("mali-bifrost", "architecture", "Mali-G71"),
    "arm-mali-g710-pixel7-r51p0": ("mali-valhall", "architecture", "Mali-G710"),
    "arm-mali-lodx-rk3588-g6p0": ("mali-valhall", "device", "Mali-LODX"),
    "img-powervr-ge8320-1.13": ("powervr", "vendor", "PowerVR GE8320"),
    "intel-cpu-runtime-2023.15-win-ryzen5800hs": ("intel-cpu", "vendor", "Intel(R) OpenCL"),
    "intel-cpu-runtime-2023.16-i5-10210u": ("intel-cpu", "vendor", "Intel(R) OpenCL"),
    "intel-arc-a750-win-31.0.101.4826": ("intel-gpu", "vendor", "Intel(R) Corporation"),
    "intel-arc-a770-neo-23.05": ("intel-gpu", "vendor", "Intel(R) Corporation"),
    "intel-hd630-neo-23.43": ("intel-gpu", "vendor", "Intel(R) Corporation"),
    "intel-uhd-0x9b41-cometlake-neo": ("intel-gpu", "vendor", "Intel(R) Corporation"),
    "nvidia-a100-sxm4-40gb-fluidx3d-470.57.02": ("nvidia", "vendor", "NVIDIA"),
    "nvidia-rtx3050-laptop-527.56": ("nvidia", "vendor", "NVIDIA"),
    "nvidia-rtx3090-550.67": ("nvidia", "vendor", "NVIDIA"),
    "nvidia-rtx4070-laptop-enumdevices": ("nvidia", "vendor", "NVIDIA CUDA"),
    "nvidia-tesla-t4-535.161.08": ("nvidia", "vendor", "NVIDIA"),
    "nvidia-tesla-v100-pcie-32gb-460.32.03": ("nvidia", "vendor", "NVIDIA"),
    "amd-gfx90c-apu-amdapp-3516": ("amd", "vendor", "Advanced Micro Devices"),
    "amd-instinct-mi100-amdapp-3212-partial": ("amd", "vendor", "AMD Accelerated Parallel"),
    "amd-radeon-vii-gfx906-rocm-2874": ("amd", "vendor", "Advanced Micro Devices"),
    "amd-rx6800xt-gfx1030-rocm-3452": ("amd", "vendor", "Advanced Micro Devices"),
    "amd-rx7900xtx-gfx1100-rocm-wsl-3649": ("amd", "vendor", "Advanced Micro Devices"),
    "apple-m1-macbookair-ventura": ("apple", "vendor", "Apple"),
    "apple-m1-opencl-1.2": ("apple", "vendor", "Apple"),
    "apple-m2-enumdevices": ("apple", "vendor", "Apple"),
    "apple-m2max-fluidx3d": ("apple", "vendor", "Apple"),
    "apple-m4-opencl-1.2": ("apple", "vendor", "Apple"),
    "pocl-1.8-cpu-cortex-a55": ("pocl-cpu", "vendor", "Portable Computing Language"),
    "pocl-6.0-cpu-haswell-n150": ("pocl-cpu", "vendor", "cpu-haswell"),
}
CPU_PROFILES = {"generic-cpu", "pocl-cpu", "intel-cpu"}


@pytest.fixture(autouse=True)
def _isolated_user_config(tmp_path, monkeypatch):
    """No test sees the real user config or a CLATTN_PROFILE from the environment."""
    monkeypatch.setenv("CLATTN_CONFIG_DIR", str(tmp_path / "user-profiles"))
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)


def _write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


# --- data and built-ins -----------------------------------------------------------------

def test_device_data_copies_every_record_with_device_fields():
    assert len(RECORDS) == 43
    assert set(EXPECTED) == set(RECORDS)
    for rec in RECORDS.values():
        assert set(rec) == {"id", "family", "source", *FIELDS}


def test_builtin_entries_are_documented_data():
    names = [e["name"] for e in BUILTIN_JSON]
    assert len(names) == len(set(names))
    for family in ("adreno-6xx", "adreno-7xx", "adreno-8xx", "mali-bifrost", "mali-valhall",
                   "powervr", "intel-gpu", "nvidia", "amd", "apple", "pocl-cpu", "intel-cpu",
                   "generic"):
        assert family in names
    for e in BUILTIN_JSON:
        assert set(e) <= set(registry.ENTRY_KEYS)
        assert {"name", "source", "match", "params"} <= set(e)
        assert any(s in e["source"] for s in ("seed (TVM)", "vendor docs", "educated guess",
                                              "measured"))
    for name, prof in builtin_profiles().items():
        assert prof.name == name
        if name in CPU_PROFILES:
            assert prof.strategy == "rows" and prof.vec in (8, 16)
        else:
            assert prof.strategy == "tiled"


def test_inheritance_keeps_one_fact_in_one_place():
    raw = {e["name"]: e for e in BUILTIN_JSON}
    profs = builtin_profiles()
    assert "thread_limit" not in raw["adreno-7xx"]["params"]
    assert profs["adreno-7xx"].thread_limit == profs["adreno"].thread_limit == 256
    assert profs["adreno-7xx"].tile_rows == profs["adreno"].tile_rows == 4   # from "adreno"
    assert profs["adreno-8xx"].subgroup_size == 64
    assert profs["nvidia"].thread_limit == 512 and profs["nvidia"].tile_rows == 2
    assert profs["pocl-cpu"].min_partition_rows == profs["generic-cpu"].min_partition_rows
    assert get_profile("adreno-7xx") == profs["adreno-7xx"]


# --- matching ---------------------------------------------------------------------------

@pytest.mark.parametrize("rid", sorted(EXPECTED))
def test_real_device_matches_its_family(rid):
    name, level, evidence = EXPECTED[rid]
    m = match(RECORDS[rid], user=False)
    assert (m.profile.name, m.level) == (name, level), m.rule
    assert m.rule.startswith(f"{level}: ") and evidence in m.rule


def test_rule_reads_like_the_issue_example():
    m = match({"device_name": "QUALCOMM Adreno(TM)", "device_version": "OpenCL 3.0 Adreno(TM) 740"})
    assert m.rule == "architecture: Adreno 7xx (device_version 'OpenCL 3.0 Adreno(TM) 740')"


@pytest.mark.parametrize("info, expected", [
    ({"device_name": "QUALCOMM Adreno (TM) 830"}, "adreno-8xx"),
    ({"device_name": "Qualcomm(R) Adreno(TM) X1-85 GPU"}, "adreno-8xx"),
    ({"device_name": "QUALCOMM Adreno(TM)", "opencl_c_version": "OpenCL C 3.0 Adreno(TM) 660"},
     "adreno-6xx"),
    ({"device_name": "Mali-G720-Immortalis MC12 r0p0", "device_type": "GPU"}, "mali-valhall"),
    ({"device_name": "Mali-G76 MP10"}, "mali-bifrost"),
    ({"device_name": "Mali-T860", "platform_name": "ARM Platform"}, "mali"),
    ({"device_name": "Some CPU", "device_vendor": "Acme", "device_type": "CPU"}, "generic-cpu"),
    ({"device_name": "Acme NPU", "device_type": "ACCELERATOR"}, "generic"),
    ({}, "generic"),
])
def test_parsing_newer_names(info, expected):
    assert match(info, user=False).profile.name == expected


# --- fitting ----------------------------------------------------------------------------

@pytest.mark.parametrize("rid", sorted(RECORDS))
def test_every_profile_fits_every_real_device_after_fit(rid):
    info = RECORDS[rid]
    mwgs, sizes = info["max_work_group_size"], info["max_work_item_sizes"]
    for prof in builtin_profiles().values():
        fitted, warnings = trim(prof, info)
        for n in (fitted.thread_limit, fitted.merge_threads):
            assert mwgs is None or n <= mwgs
            assert not sizes or n <= sizes[0]
        if info["has_fp16"] is False:
            assert not fitted.native_fp16
        if info["subgroup_extensions"] == [] and info["extensions_complete"] and \
                not info["max_sub_groups_per_work_group"]:
            assert fitted.reduction == "local"
        if fitted.reduction == "subgroup" and info["sub_group_sizes"]:
            assert fitted.subgroup_size in info["sub_group_sizes"]
        # native_fp16 is a preference (half loads where the device has them): dropped silently
        changed = [k for k in ("thread_limit", "merge_threads", "reduction")
                   if getattr(fitted, k) != getattr(prof, k)]
        assert all(any(k in w for w in warnings) for k in changed)
        assert bool(warnings) == bool(changed)
    own, warnings = trim(match(info, user=False).profile, info)
    assert warnings == [], f"{rid}: its own profile needed cuts: {warnings}"


def test_fit_reductions_each_warn():
    prof = builtin_profiles()["adreno-7xx"].with_(merge_threads=256)
    info = {"max_work_group_size": 128, "max_work_item_sizes": [64, 64, 64],
            "device_extensions": ["cl_khr_byte_addressable_store"], "extensions_complete": True,
            "local_mem_size_bytes": 4096}
    fitted, warnings = trim(prof, info)
    assert (fitted.thread_limit, fitted.merge_threads) == (64, 64)
    assert (fitted.reduction, fitted.subgroup_size) == ("local", None)
    assert not fitted.native_fp16
    text = "\n".join(warnings)
    for key in ("thread_limit 256 -> 64 (device max_work_item_sizes[0] 64)",
                "merge_threads 256 -> 64", "reduction subgroup -> local"):
        assert key in text
    assert len(warnings) == 3


def test_fit_rounds_to_powers_of_two_and_checks_subgroup_sizes():
    fitted, warnings = trim(builtin_profiles()["nvidia"], {"max_work_group_size": 384})
    assert fitted.thread_limit == 256 and len(warnings) == 1
    intel = builtin_profiles()["intel-gpu"]
    info = {"device_extensions": ["cl_intel_subgroups", "cl_khr_fp16"], "sub_group_sizes": [8, 32]}
    fitted, warnings = trim(intel, info)
    assert fitted.reduction == "local" and "not in the device's [8, 32]" in warnings[0]
    assert trim(intel, {**info, "sub_group_sizes": [8, 16, 32]}) == (intel, [])


def test_fit_never_cuts_on_unknown_facts():
    for prof in builtin_profiles().values():
        assert trim(prof, {}) == (prof, [])
    # a fragment of an extension list proves presence, not absence
    a750 = RECORDS["qcom-adreno750-e031.45.02.06"]
    assert trim(builtin_profiles()["adreno-7xx"], a750)[0].reduction == "subgroup"
    opencl3 = {"device_extensions": [], "extensions_complete": True,
               "max_sub_groups_per_work_group": 32}
    assert trim(builtin_profiles()["mali-valhall"], opencl3)[0].reduction == "subgroup"


# --- user profiles and CLATTN_PROFILE ---------------------------------------------------

def test_user_profile_dir_fallbacks(monkeypatch, tmp_path):
    assert user_profile_dir() == tmp_path / "user-profiles"
    monkeypatch.delenv("CLATTN_CONFIG_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert user_profile_dir() == tmp_path / "xdg" / "clattn" / "profiles"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_profile_dir() == tmp_path / "home" / ".config" / "clattn" / "profiles"


def test_user_profiles_are_searched_first():
    a750 = RECORDS["qcom-adreno750-e031.45.02.06"]
    _write(user_profile_dir() / "mine.json", [
        {"name": "my-750", "base": "adreno-7xx", "source": "measured on my phone",
         "match": {"device": ["QUALCOMM Adreno(TM) 750"]}, "params": {"thread_limit": 128}},
        {"name": "my-nv", "match": {"vendor": {"device_vendor": "NVIDIA"}}, "params": {}},
    ])
    m = match(a750)
    assert (m.profile.name, m.level, m.profile.thread_limit) == ("my-750", "user", 128)
    assert m.profile.reduction == "subgroup" and m.profile.source == "measured on my phone"
    assert "mine.json" in m.rule and "device_name 'QUALCOMM Adreno(TM) 750'" in m.rule
    assert match(RECORDS["nvidia-rtx3090-550.67"]).profile.name == "my-nv"
    assert match(RECORDS["nvidia-rtx3090-550.67"]).profile.thread_limit == 256   # over generic
    assert match(a750, user=False).profile.name == "adreno-7xx"
    assert match(RECORDS["apple-m1-opencl-1.2"]).profile.name == "apple"      # untouched


def test_user_profile_prefill_wishes_layer_and_null_means_derived():
    _write(user_profile_dir() / "mine.json", [
        {"name": "gpu-wish", "base": "nvidia", "match": {"device": ["My GPU"]},
         "params": {"prefill_qb": 4, "prefill_tc": 8}},
        {"name": "gpu-auto", "base": "generic-cpu", "params": {"prefill_kb": None}}])
    got = user_profiles()
    wish, auto = got["gpu-wish"], got["gpu-auto"]
    assert (wish.prefill_qb, wish.prefill_tc, wish.prefill_kb, wish.prefill_rm) == (4, 8, None, 4)
    assert auto.prefill_kb is None and auto.strategy == "rows"  # keys per block: tile_rows
    assert match({"device_name": "My GPU", "device_type": "GPU"}).profile == wish


def test_user_profile_named_like_builtin_layers_over_it():
    _write(user_profile_dir() / "adreno-7xx.json", {"name": "adreno-7xx", "params": {"vec": 8}})
    m = match(RECORDS["qcom-adreno735-header-only"])
    assert m.level == "user" and m.profile.vec == 8 and m.profile.reduction == "subgroup"
    assert get_profile("adreno-7xx").vec == 8 and get_profile("adreno-7xx", user=False).vec == 4
    assert builtin_profiles()["adreno-8xx"].vec == 4     # built-ins never see user entries
    assert "*adreno-7xx" in describe()


def test_clattn_profile_forces_by_name_and_path(monkeypatch, tmp_path):
    pocl = RECORDS["pocl-1.8-cpu-cortex-a55"]
    monkeypatch.setenv("CLATTN_PROFILE", "nvidia")
    m = match(pocl)
    assert (m.profile.name, m.level) == ("nvidia", "override") and "CLATTN_PROFILE" in m.rule
    assert match(pocl, user=False).profile.name == "pocl-cpu"
    _write(user_profile_dir() / "x.json", {"name": "tuned", "base": "mali", "params": {"vec": 2}})
    monkeypatch.setenv("CLATTN_PROFILE", "tuned")
    assert match(pocl).profile.vec == 2
    path = _write(tmp_path / "elsewhere" / "forced.json",
                  {"name": "forced", "params": {"thread_limit": 32}})
    monkeypatch.setenv("CLATTN_PROFILE", str(path))
    m = match(pocl)
    assert (m.profile.name, m.profile.thread_limit, m.level) == ("forced", 32, "override")
    monkeypatch.setenv("CLATTN_PROFILE", "no-such-profile")
    with pytest.raises(ValueError, match="no-such-profile.*known"):
        match(pocl)


@pytest.mark.parametrize("content, needles", [
    ("{not json", ["bad.json", "malformed JSON"]),
    ({"name": "p", "params": {"threads": 64}},
     ["bad.json", "'threads'", "allowed keys", "thread_limit"]),
    ({"name": "p", "prams": {}}, ["bad.json", "'prams'", "allowed keys", "params"]),
    ({"name": "p", "match": {"vendr": {}}}, ["bad.json", "'vendr'", "allowed keys"]),
    ({"name": "p", "match": {"vendor": {"vendor": "x"}}},
     ["bad.json", "'vendor'", "device_vendor"]),
    ({"name": "p", "match": {"architecture": {"family": "mali", "model": "G52"}}},
     ["bad.json", "architecture"]),
    ({"name": "p", "params": {"native_fp16": "yes"}}, ["bad.json", "native_fp16", "bool"]),
    ({"name": "p", "params": {"fuse_append": "false"}}, ["bad.json", "fuse_append"]),
    ({"name": "p", "params": {"fold_merge": 1}}, ["bad.json", "'fold_merge'", "bool"]),
    ({"name": "p", "params": {"prefill_qb": "8"}}, ["bad.json", "'prefill_qb'", "int or null"]),
    ({"name": "p", "params": {"prefill_kb": 0}},
     ["bad.json", "profile 'p'", "prefill_kb=0", "positive integer or null"]),
    ({"name": "p", "params": {"strategy": "fast"}},
     ["bad.json", "profile 'p'", "strategy='fast'", "rows"]),
    ({"name": "p", "base": "nope"}, ["bad.json", "unknown base 'nope'"]),
    ([{"name": "a", "base": "b"}, {"name": "b", "base": "a"}], ["bad.json", "cycle"]),
    ({"params": {}}, ["bad.json", "'name'"]),
])
def test_malformed_user_profiles_raise_naming_file_and_key(content, needles):
    _write(user_profile_dir() / "bad.json", content)
    with pytest.raises(ValueError) as err:
        user_profiles()
    for needle in needles:
        assert needle in str(err.value)


def test_match_refuses_a_malformed_user_file():
    _write(user_profile_dir() / "bad.json", "[{]")
    with pytest.raises(ValueError, match="bad.json"):
        match(RECORDS["qcom-adreno735-header-only"])
    assert match(RECORDS["qcom-adreno735-header-only"], user=False).profile.name == "adreno-7xx"


def test_save_user_profile_is_atomic_and_validated(tmp_path):
    entry = {"name": "bench-750", "base": "adreno-7xx", "source": "clattn profile run",
             "match": {"device": ["QUALCOMM Adreno(TM) 750"]}, "params": {"tile_rows": 2}}
    path = save_user_profile(entry)
    assert path == user_profile_dir() / "bench-750.json"
    assert json.loads(path.read_text()) == entry
    assert [p.name for p in path.parent.iterdir()] == ["bench-750.json"]    # no temp left
    assert match(RECORDS["qcom-adreno750-e031.45.02.06"]).profile.tile_rows == 2
    with pytest.raises(ValueError, match="tile_row"):
        save_user_profile({**entry, "name": "broken", "params": {"tile_row": 2}})
    assert not (path.parent / "broken.json").exists()
    other = save_user_profile({**entry, "name": "elsewhere"}, tmp_path / "o" / "e.json")
    assert other.is_file() and json.loads(other.read_text())["name"] == "elsewhere"


# --- reports ------------------------------------------------------------------------------

def test_reports_name_every_profile_and_explain_the_device():
    text = format_profiles_report([RECORDS["arm-mali-g52-c8adbf9"],
                                   RECORDS["nvidia-rtx3090-550.67"]])
    for name in builtin_profiles():
        assert name in text
    assert "profile: mali-bifrost" in text and "architecture: Mali Bifrost" in text
    assert "profile: nvidia" in text
    assert "No OpenCL devices found." in format_profiles_report([])
    one = describe(RECORDS["qcom-adreno650-e031.37.12.01"])
    assert "architecture: Adreno 6xx (device_version 'OpenCL 2.0 Adreno(TM) 650')" in one


# --- live devices -------------------------------------------------------------------------

def _live_devices():
    cl = pytest.importorskip("pyopencl")
    try:
        return [d for p in cl.get_platforms() for d in p.get_devices()]
    except Exception:  # noqa: BLE001 - no ICD / no platform
        return []


def test_device_info_on_every_present_device():
    devices = _live_devices()
    if not devices:
        pytest.skip("no OpenCL device present")
    for dev in devices:
        info = device_info(dev)
        assert tuple(info) == FIELDS
        assert info["device_name"] == dev.name
        assert info["device_type"] in ("GPU", "CPU", "ACCELERATOR", "CUSTOM")
        assert isinstance(info["device_extensions"], list)
        assert info["local_mem_type"] in ("local", "global", "none")
        m = match(info, user=False)
        fitted, _ = trim(m.profile, info)
        assert fitted.thread_limit <= info["max_work_group_size"]
        platform = info["platform_name"]
        if platform == "Portable Computing Language" and info["device_type"] == "CPU":
            assert m.profile.name == "pocl-cpu", m.rule
        elif platform == "Intel(R) OpenCL" and info["device_type"] == "CPU":
            assert m.profile.name == "intel-cpu", m.rule
            assert info["sub_group_sizes"] and 16 in info["sub_group_sizes"]
        elif platform == "Oclgrind":
            assert (m.profile.name, m.level) == ("generic", "default"), m.rule
        assert match(dev, user=False) == m                    # a Device is accepted too


def test_device_info_survives_missing_queries():
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError(f"driver lacks {name}")

    info = device_info(Broken())
    assert tuple(info) == FIELDS and all(v is None for v in info.values())
    assert match(info, user=False).profile.name == "generic"


def test_a_retired_key_is_dropped_with_a_note(tmp_path, monkeypatch):
    """A user profile still naming ``use_local_kv`` (no longer a setting: the kernels decide
    where K/V rows go) loads, with one warning naming the key and the file; so does a dict
    override."""
    import json as _json

    import clattn
    from clattn.profiles import user_profiles

    (tmp_path / "old.json").write_text(_json.dumps(
        {"name": "old", "base": "adreno-7xx", "params": {"use_local_kv": False, "vec": 2}}))
    monkeypatch.setenv("CLATTN_CONFIG_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"old\.json.*'use_local_kv' is no longer"):
        profs = user_profiles()
    assert profs["old"].vec == 2 and not hasattr(profs["old"], "use_local_kv")
    with pytest.warns(RuntimeWarning, match=r"override.*'use_local_kv' is no longer"):
        prof = clattn.Profile.from_dict({"use_local_kv": True, "vec": 2}, where="override")
    assert prof.vec == 2
