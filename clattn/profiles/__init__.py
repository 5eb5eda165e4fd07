"""Device profiles: which kernel parameters each GPU family gets, and why.

``match(device_info(dev))`` picks a profile (user overlay and ``$CLATTN_PROFILE``
first); :func:`clattn.device_fit.fit_device` fits it to the device.
"""
from .device_info import FIELDS, architecture, device_info
from .record import REDUCTIONS, STRATEGIES, Profile
from .registry import (
    Match,
    as_info,
    builtin_profiles,
    get_profile,
    match,
    profiles_table,
    save_user_profile,
    user_profile_dir,
    user_profiles,
)

__all__ = [
    "FIELDS", "Match", "Profile", "REDUCTIONS", "STRATEGIES", "architecture", "as_info",
    "builtin_profiles", "device_info", "get_profile", "match", "profiles_table",
    "save_user_profile", "user_profile_dir", "user_profiles",
]
