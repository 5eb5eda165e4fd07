"""The one fit: a profile's wishes x a spec x a device's facts -> what runs, and every cut.

:func:`fit_device` trims the wishes to what the device reports (work-group sizes,
sub-groups, half precision, local memory) and, given a spec, fits the decode kernel's
geometry to the trimmed profile. Every wish it cuts is one note, with its reason, in one
list: ``clattn profiles``, ``clattn tune``, :class:`~clattn.BatchDecode` (one warning per
note) and ``tools/gpu_model.py`` show that list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .fit import DecodeGeometry, Limits, decode_geometry
from .profiles.device_info import fp16_support, subgroup_support
from .profiles.record import Profile
from .spec import AttentionSpec

#: the decode shape the commands report the fit for, where no spec is given (Llama-3-8B's
#: attention: 32 query heads, 8 KV heads, head_dim 128, float16 pages of 16 tokens)
REPORT_SPEC = AttentionSpec(32, 8, 128, page_size=16, dtype="float16")
#: how the reports name :data:`REPORT_SPEC`
REPORT_SHAPE = (f"decode, {REPORT_SPEC.num_qo_heads} query / {REPORT_SPEC.num_kv_heads} KV "
                f"heads, head_dim {REPORT_SPEC.head_dim}, {REPORT_SPEC.dtype}")


@dataclass(frozen=True)
class DeviceFit:
    """Wishes fitted to a device.

    ``profile``: the wishes trimmed to the device's reported facts (what every kernel's
    geometry starts from); ``notes``: every wish that was cut, with its reason (the
    profile's cuts, then the decode kernel's); ``geometry``: the decode kernel's, when
    the fit was given a spec.
    """

    profile: Profile
    notes: tuple[str, ...]
    geometry: DecodeGeometry | None = None


def fit_device(wishes: Profile, info: Mapping[str, Any], spec: AttentionSpec | None = None,
               limits: Limits | None = None) -> DeviceFit:
    """Fit ``wishes`` to the device ``info`` describes and, given ``spec``, its decode kernel.

    Parameters
    ----------
    wishes : Profile
        The matched (or given) profile.
    info : Mapping
        The device's :func:`~clattn.profiles.device_info` record; unknown facts (None)
        cut nothing.
    spec : AttentionSpec, optional
        Fit the decode kernel for it too (its cuts join the notes).
    limits : Limits, optional
        The facts the kernel's geometry respects; default ``Limits.from_info(info)``
        (a device at hand adds what its compiler is found to do,
        :func:`clattn.device.probed_limits`).

    Returns
    -------
    DeviceFit

    Raises
    ------
    ValueError
        When the decode kernel cannot fit the device (head_dim past the work-group limit,
        local memory too small), saying why.
    """
    profile, notes = _trim(wishes, info)
    geometry = None
    if spec is not None:
        geometry = decode_geometry(spec, profile, Limits.from_info(info) if limits is None
                                   else limits)
        notes += [n for n in geometry.notes if n not in notes]
    return DeviceFit(profile, tuple(notes), geometry)


def report_fit(wishes: Profile, info: Mapping[str, Any]) -> DeviceFit:
    """:func:`fit_device` for :data:`REPORT_SPEC`, an impossible decode fit as a note."""
    try:
        return fit_device(wishes, info, REPORT_SPEC)
    except ValueError as exc:
        profile, notes = _trim(wishes, info)
        return DeviceFit(profile, (*notes, f"no decode kernel fits: {exc}"))


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _trim(profile: Profile, info: Mapping[str, Any]) -> tuple[Profile, list[str]]:
    """The profile within the device's reported facts; one note per cut. Thread counts
    drop to the largest power of two within max_work_group_size and
    max_work_item_sizes[0]."""
    changes: dict[str, Any] = {}
    notes: list[str] = []
    limits = {"max_work_group_size": info.get("max_work_group_size")}
    sizes = info.get("max_work_item_sizes")
    if isinstance(sizes, (list, tuple)) and sizes:
        limits["max_work_item_sizes[0]"] = sizes[0]
    known = {k: v for k, v in limits.items() if isinstance(v, int) and v > 0}
    if known:
        cap = min(known.values())
        why = ", ".join(f"{k} {v}" for k, v in known.items() if v == cap)
        for key in ("thread_limit", "merge_threads"):
            if getattr(profile, key) > cap:
                changes[key] = _pow2_floor(cap)
                notes.append(f"{key} {getattr(profile, key)} -> {changes[key]} (device {why})")
    if profile.reduction == "subgroup":
        sg = subgroup_support(info)
        sg_sizes = info.get("sub_group_sizes")
        why = None
        if sg is False:
            why = ("no sub-group support (no cl_khr_subgroups / cl_intel_subgroups, "
                   "no OpenCL 3.0 sub-groups)")
        elif profile.subgroup_size and isinstance(sg_sizes, list) and sg_sizes and \
                profile.subgroup_size not in sg_sizes:
            why = f"sub-group size {profile.subgroup_size} not in the device's {sg_sizes}"
        if why:
            changes.update(reduction="local", subgroup_size=None)
            notes.append(f"reduction subgroup -> local: {why}")
    if profile.native_fp16 and fp16_support(info) is False:
        # a preference ("use half loads where the device has them"), not a limit: no note
        changes["native_fp16"] = False
    fitted = profile.with_(**changes) if changes else profile
    return fitted, notes
