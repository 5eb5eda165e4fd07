"""What ``clattn profiles`` prints: the profile table, then for each device the profile it
gets, why, and the one fit's notes (:func:`clattn.device_fit.report_fit`)."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from .device_fit import REPORT_SHAPE, report_fit
from .profiles import as_info, match, profiles_table


def device_block(info: Mapping[str, Any], user: bool = True) -> str:
    """A device's profile, why it matched, the fit's notes and the fitted parameters."""
    m = match(info, user=user)
    fit = report_fit(m.profile, info)
    fitted = fit.profile
    params = ", ".join(f"{f.name}={getattr(fitted, f.name)!r}" for f in fields(fitted)
                       if f.name not in ("name", "source"))
    lines = [f"Device: {info.get('device_name')!r} on {info.get('platform_name')!r} "
             f"({info.get('device_version')!r})",
             f"  profile: {m.profile.name}  [{m.level}]",
             f"  why:     {m.rule}",
             f"  source:  {m.profile.source}",
             f"  fit for: {REPORT_SHAPE}"]
    lines += [f"  fitted:  {n}" for n in fit.notes] or ["  fitted:  no changes needed"]
    lines.append(f"  params:  {params}")
    return "\n".join(lines)


def describe(info: Any = None, *, user: bool = True) -> str:
    """The profile table and, given a device (its record or a ``pyopencl.Device``), which
    profile it gets, why, and the fit."""
    parts = [profiles_table(user)]
    if info is not None:
        parts.append(device_block(as_info(info), user))
    return "\n\n".join(parts)


def format_profiles_report(infos: list[Any], *, user: bool = True) -> str:
    """What ``clattn profiles`` prints: the table, then one block per device."""
    parts = [profiles_table(user)]
    parts += [device_block(as_info(i), user) for i in infos] or ["No OpenCL devices found."]
    return "\n\n".join(parts)
