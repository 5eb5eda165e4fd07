"""Device profiles: which kernel parameters each GPU family gets, and why.

``match(device_info(dev))`` picks a profile (user overlay and ``$CLATTN_PROFILE``
first); ``fit(profile, info)`` trims it to the device's reported limits.
"""
from .device_info import FIELDS, architecture, device_info
from .record import REDUCTIONS, STRATEGIES, Profile
from .registry import (
    Match,
    builtin_profiles,
    describe,
    fit,
    format_profiles_report,
    get_profile,
    match,
    save_user_profile,
    user_profile_dir,
    user_profiles,
)

__all__ = [
    "FIELDS", "Match", "Profile", "REDUCTIONS", "STRATEGIES", "architecture",
    "builtin_profiles", "describe", "device_info", "fit", "format_profiles_report",
    "get_profile", "match", "save_user_profile", "user_profile_dir", "user_profiles",
]
