"""Device + profile resolution shared by the decode and merge APIs."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Mapping

from .fit import Limits
from .profiles.record import Profile
from .runtime import cl as _cl

_WARNED_NO_DEVICE = False


@dataclass
class DeviceSetup:
    """A device's runtime, what it reports, the profile it gets and why."""

    runtime: Any
    info: dict
    profile: Profile
    rule: str
    limits: Limits


def warn_cpu_fallback(reason: str) -> None:
    """Say once per process that clattn runs on its CPU fallback."""
    global _WARNED_NO_DEVICE
    if not _WARNED_NO_DEVICE:
        _WARNED_NO_DEVICE = True
        warnings.warn(f"clattn: {reason}; using the CPU fallback (numpy)", RuntimeWarning, stacklevel=3)


def resolve_profile(info: dict, profile: Any = None) -> tuple[Profile, str]:
    """The profile for a device: the registry's choice, or the caller's override.

    ``profile``: None (registry), a profile name, a :class:`Profile`, or a dict of
    fields layered over the registry's choice.
    """
    from . import profiles as reg

    if isinstance(profile, Profile):
        return profile, f"given by the caller ({profile.name})"
    if isinstance(profile, str):
        return reg.get_profile(profile), f"named by the caller ({profile})"
    m = reg.match(info)
    if isinstance(profile, Mapping):
        return Profile.from_dict(profile, base=m.profile, where="profile argument"), \
            f"{m.rule}, with the caller's overrides {sorted(profile)}"
    if profile is not None:
        raise TypeError(f"profile={profile!r}: pass None, a name, a Profile or a dict of fields")
    return m.profile, m.rule


def device_setup(runtime: Any, profile: Any = None) -> DeviceSetup:
    """Resolve and fit the profile for ``runtime``'s device (warns once if reduced)."""
    from . import profiles as reg

    info = reg.device_info(runtime.device)
    prof, rule = resolve_profile(info, profile)
    fitted, notes = reg.fit(prof, info)
    if notes:
        warnings.warn(f"clattn: profile {prof.name!r} reduced to fit {runtime.device.name!r}: "
                      + "; ".join(notes), RuntimeWarning, stacklevel=3)
    limits = Limits.from_info(info)
    try:  # subnormal support decides the cheapest exact f16 conversion
        denorms = bool(runtime.device.single_fp_config & _cl().device_fp_config.DENORM)
    except Exception:  # noqa: BLE001 - a driver without the query
        denorms = False
    return DeviceSetup(runtime, info, fitted, rule, replace(limits, denorms=denorms))
