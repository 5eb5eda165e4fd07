"""What a device reports, as a plain dict, and the facts the registry reads from it.

The dict has exactly the device fields of ``shared/devices/real_devices.json``
records (:data:`FIELDS`), so a live ``pyopencl.Device`` and a transcribed clinfo
dump look the same to the matcher. ``None`` means "not reported".
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
from typing import Any, Callable, Mapping, NamedTuple

FIELDS: tuple[str, ...] = (
    "platform_name", "platform_version", "device_name", "device_vendor", "device_version",
    "opencl_c_version", "driver_version", "device_type", "max_compute_units",
    "max_clock_frequency_mhz", "max_work_group_size", "max_work_item_sizes",
    "preferred_work_group_size_multiple", "local_mem_size_bytes", "local_mem_type",
    "global_mem_size_bytes", "max_mem_alloc_size_bytes", "preferred_vector_width_half",
    "preferred_vector_width_float", "native_vector_width_half", "native_vector_width_float",
    "has_fp16", "subgroup_extensions", "other_notable_extensions", "sub_group_sizes",
    "max_sub_groups_per_work_group", "device_extensions", "extensions_complete",
)

#: extensions that give a kernel sub-group functions (the cl_qcom ones require cl_khr_subgroups)
SUBGROUP_EXTENSIONS = frozenset({
    "cl_khr_subgroups", "cl_intel_subgroups", "cl_qcom_reqd_sub_group_size",
    "cl_qcom_subgroup_shuffle",
})
_NOTABLE_PREFIXES = ("cl_qcom_", "cl_arm_", "cl_intel_", "cl_nv_", "cl_amd_", "cl_APPLE_",
                     "cl_img_", "cl_ext_")
_NOTABLE_KHR = ("cl_khr_fp64", "cl_khr_int64_base_atomics", "cl_khr_int64_extended_atomics",
                "cl_khr_il_program", "cl_khr_image2d_from_buffer", "cl_khr_integer_dot_product",
                "cl_khr_external_memory", "cl_khr_suggested_local_work_size")
_CL_DEVICE_SUB_GROUP_SIZES_INTEL = 0x4108


def _query(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when the driver lacks the query (any error)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - drivers fail in many ways; a missing fact is None
        return None


def _type_name(bits: int | None) -> str | None:
    if bits is None:
        return None
    # Oclgrind reports every bit; a device that says GPU is treated as one.
    for bit, name in ((4, "GPU"), (2, "CPU"), (8, "ACCELERATOR"), (16, "CUSTOM")):
        if bits & bit:
            return name
    return None


def _intel_sub_group_sizes(device: Any) -> list[int] | None:
    """CL_DEVICE_SUB_GROUP_SIZES_INTEL through the ICD loader (pyopencl lacks the query)."""
    import pyopencl as cl

    libs = glob.glob(os.path.join(os.path.dirname(cl.__file__), ".libs", "libOpenCL*"))
    lib = libs[0] if libs else ctypes.util.find_library("OpenCL")
    if not lib:
        return None
    get = ctypes.CDLL(lib).clGetDeviceInfo
    get.restype = ctypes.c_int32
    get.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_void_p,
                    ctypes.POINTER(ctypes.c_size_t)]
    size = ctypes.c_size_t(0)
    if get(device.int_ptr, _CL_DEVICE_SUB_GROUP_SIZES_INTEL, 0, None, ctypes.byref(size)) != 0:
        return None
    arr = (ctypes.c_size_t * (size.value // ctypes.sizeof(ctypes.c_size_t)))()
    if get(device.int_ptr, _CL_DEVICE_SUB_GROUP_SIZES_INTEL, size.value, arr, None) != 0:
        return None
    return [int(v) for v in arr] or None


def device_info(device: Any) -> dict[str, Any]:
    """The :data:`FIELDS` of a ``pyopencl.Device``; a query the driver lacks gives None.

    ``preferred_work_group_size_multiple`` is a kernel query (it needs a program
    build, which takes seconds on Adreno), so it is always None here.
    """
    d = device
    exts = _query(lambda: d.extensions.split())
    mem_type = _query(lambda: {0: "none", 1: "local", 2: "global"}.get(int(d.local_mem_type)))
    info: dict[str, Any] = {
        "platform_name": _query(lambda: d.platform.name),
        "platform_version": _query(lambda: d.platform.version),
        "device_name": _query(lambda: d.name),
        "device_vendor": _query(lambda: d.vendor),
        "device_version": _query(lambda: d.version),
        "opencl_c_version": _query(lambda: d.opencl_c_version),
        "driver_version": _query(lambda: d.driver_version),
        "device_type": _type_name(_query(lambda: int(d.type))),
        "max_compute_units": _query(lambda: int(d.max_compute_units)),
        "max_clock_frequency_mhz": _query(lambda: int(d.max_clock_frequency)),
        "max_work_group_size": _query(lambda: int(d.max_work_group_size)),
        "max_work_item_sizes": _query(lambda: [int(v) for v in d.max_work_item_sizes]),
        "preferred_work_group_size_multiple": None,
        "local_mem_size_bytes": _query(lambda: int(d.local_mem_size)),
        "local_mem_type": mem_type,
        "global_mem_size_bytes": _query(lambda: int(d.global_mem_size)),
        "max_mem_alloc_size_bytes": _query(lambda: int(d.max_mem_alloc_size)),
        "preferred_vector_width_half": _query(lambda: int(d.preferred_vector_width_half)),
        "preferred_vector_width_float": _query(lambda: int(d.preferred_vector_width_float)),
        "native_vector_width_half": _query(lambda: int(d.native_vector_width_half)),
        "native_vector_width_float": _query(lambda: int(d.native_vector_width_float)),
        "has_fp16": None if exts is None else "cl_khr_fp16" in exts,
        "subgroup_extensions": None if exts is None else
        [e for e in exts if "subgroup" in e or "sub_group" in e],
        "other_notable_extensions": None if exts is None else
        [e for e in exts if e.startswith(_NOTABLE_PREFIXES) or e in _NOTABLE_KHR],
        "sub_group_sizes": None,
        "max_sub_groups_per_work_group": _query(lambda: int(d.max_num_sub_groups)),
        "device_extensions": exts,
        "extensions_complete": None if exts is None else True,
    }
    if exts and "cl_intel_subgroups" in exts:
        info["sub_group_sizes"] = _query(lambda: _intel_sub_group_sizes(d))
    return info


# --- facts the registry reads -------------------------------------------------------------

class Arch(NamedTuple):
    """A GPU architecture parsed from the identity strings."""

    family: str   # "adreno" or "mali"
    model: str    # "740", "X1-85", "G710", "T860", ...
    field: str    # the info field it was read from
    value: str    # that field's value


_ADRENO = re.compile(r"Adreno\s*(?:\(TM\))?\s*(X\d+-\d+|\d{3,4})\b", re.I)
_FREEDRENO = re.compile(r"^FD(\d{3})$", re.I)  # Mesa rusticl on freedreno: "FD630"
_MALI = re.compile(r"\b(?:Mali|Immortalis)[- ]?(G1-[A-Za-z]+|[GT]\d+(?:AE)?)\b", re.I)


def architecture(info: Mapping[str, Any]) -> Arch | None:
    """The Adreno model number or Mali model, from device_version, OpenCL C version or name.

    Qualcomm's driver names every GPU "QUALCOMM Adreno(TM)" and puts the model in
    device_version ("OpenCL 2.0 Adreno(TM) 630"); newer drivers also put it in the name.
    """
    for field in ("device_version", "opencl_c_version", "device_name"):
        value = info.get(field)
        if isinstance(value, str) and (m := _ADRENO.search(value)):
            return Arch("adreno", m.group(1).upper(), field, value)
    name = info.get("device_name")
    if isinstance(name, str):
        if m := _FREEDRENO.match(name.strip()):
            return Arch("adreno", m.group(1), "device_name", name)
        if m := _MALI.search(name):
            return Arch("mali", m.group(1).upper(), "device_name", name)
    return None


_CPU_HINT = re.compile(r"HSTR:\s*(?:pthread|cpu)-|^(?:pthread|cpu)-", re.I)


def device_type(info: Mapping[str, Any]) -> tuple[str | None, str]:
    """(type, how it is known): the reported CL_DEVICE_TYPE, else inferred.

    Only transcribed records lack the type; PoCL's CPU devices are recognised by
    their "cpu-"/"pthread-" names, everything else unreported is taken as a GPU.
    """
    reported = info.get("device_type")
    if reported:
        return str(reported), "reported"
    for field in ("device_name", "device_version"):
        value = info.get(field)
        if isinstance(value, str) and _CPU_HINT.search(value):
            return "CPU", f"inferred from {field} {value!r}"
    if info.get("platform_name") == "Intel(R) OpenCL":  # Intel's CPU runtime
        return "CPU", "inferred from platform_name 'Intel(R) OpenCL'"
    return "GPU", "not reported; taken as GPU"


def extension_names(info: Mapping[str, Any]) -> tuple[set[str], bool]:
    """(known extension names, whether an absent name is really absent)."""
    names = set(info.get("device_extensions") or ()) | set(info.get("subgroup_extensions") or ())
    listed = any(info.get(k) is not None for k in ("device_extensions", "subgroup_extensions"))
    return names, listed and info.get("extensions_complete") is not False


def subgroup_support(info: Mapping[str, Any]) -> bool | None:
    """True/False when known: a sub-group extension, or OpenCL 2.1+/3.0 max sub-groups > 0."""
    names, complete = extension_names(info)
    if names & SUBGROUP_EXTENSIONS:
        return True
    max_sgs = info.get("max_sub_groups_per_work_group")
    if isinstance(max_sgs, int) and max_sgs > 0:
        return True
    return False if complete else None


def fp16_support(info: Mapping[str, Any]) -> bool | None:
    """Whether cl_khr_fp16 is there (None when no extension list was seen)."""
    if info.get("has_fp16") is not None:
        return bool(info["has_fp16"])
    names, complete = extension_names(info)
    if "cl_khr_fp16" in names:
        return True
    return False if complete and info.get("device_extensions") is not None else None
