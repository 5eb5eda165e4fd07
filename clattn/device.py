"""Device + profile resolution shared by the decode and merge APIs."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

from . import runtime
from .compiler_probe import prefetch_works, storage_half_works
from .device_fit import fit_device
from .fit import Limits
from .loop_budget import loop_budget
from .profiles.record import Profile
from .runtime import cl as _cl

#: where a BatchDecode / BatchPrefill may run
BACKENDS = ("auto", "opencl", "cpu")

_WARNED_NO_DEVICE = False


@dataclass
class DeviceSetup:
    """A device's runtime, what it reports, the profile it gets and why.

    ``wishes``: the profile as matched or given; ``profile``: the wishes trimmed to the
    device's facts (:func:`clattn.device_fit.fit_device`), ``notes`` saying what was cut.
    """

    runtime: Any
    info: dict
    profile: Profile
    rule: str
    limits: Limits
    wishes: Profile
    notes: tuple = ()


def warn_cpu_fallback(reason: str) -> None:
    """Say once per process that clattn runs on its CPU fallback."""
    global _WARNED_NO_DEVICE
    if not _WARNED_NO_DEVICE:
        _WARNED_NO_DEVICE = True
        warnings.warn(f"clattn: {reason}; using the CPU fallback (numpy)", RuntimeWarning,
                      stacklevel=3)


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
    """Resolve the profile for ``runtime``'s device and trim it to the device's facts;
    the trim's notes are kept for the object that fits its kernel to show
    (:func:`warn_notes`)."""
    from . import profiles as reg

    info = reg.device_info(runtime.device)
    prof, rule = resolve_profile(info, profile)
    fit = fit_device(prof, info)
    return DeviceSetup(runtime, info, fit.profile, rule, probed_limits(runtime, info),
                       wishes=prof, notes=fit.notes)


def warn_notes(notes: Iterable[str], what: str = "", stacklevel: int = 3) -> None:
    """One RuntimeWarning per note of a fit, ``clattn: <what><note>`` (``stacklevel``
    counted from the caller)."""
    for note in notes:
        warnings.warn(f"clattn: {what}{note}", RuntimeWarning, stacklevel=stacklevel + 1)


def probed_limits(runtime: Any, info: Mapping[str, Any]) -> Limits:
    """The device facts the fit respects: what ``info`` reports, the subnormal support,
    what :mod:`clattn.compiler_probe` finds the compiler does and the loop budget
    :mod:`clattn.loop_budget` finds."""
    limits = Limits.from_info(info)
    try:  # subnormal support decides the cheapest exact f16 conversion
        denorms = bool(runtime.device.single_fp_config & _cl().device_fp_config.DENORM)
    except Exception:  # noqa: BLE001 - a driver without the query
        denorms = False
    # without cl_khr_fp16, the CPU-style kernels convert f16 through clang's __fp16 where
    # the compiler gets every case right (one hardware conversion per vector)
    storage = not limits.has_fp16 and storage_half_works(runtime, limits.rows_max_vec)
    budget = loop_budget(runtime)
    return replace(limits, denorms=denorms, storage_half=storage,
                   prefetch=prefetch_works(runtime), loop_budget=budget,
                   tiled_prefill=limits.tiled_prefill and not budget)


def open_backend(device: Any, backend: str, profile: Any) -> DeviceSetup | None:
    """The device set-up an attention object runs on, or None for the CPU backend.

    ``backend``: ``"auto"`` (OpenCL when a device exists, else the CPU backend with one
    warning), ``"opencl"`` (a device or :class:`~clattn.runtime.NoDeviceError`) or
    ``"cpu"``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: allowed {BACKENDS}")
    if backend == "cpu":
        return None
    dev = runtime.select_device(device)
    if dev is None:
        if backend == "opencl":
            raise runtime.NoDeviceError(f"backend='opencl' but {runtime.no_device_reason()}")
        warn_cpu_fallback(runtime.no_device_reason())
        return None
    runtime.check_usable(dev)
    return device_setup(runtime.Runtime.for_argument(device, dev), profile)


def build_fitted(setup: DeviceSetup, geometry: Any, build: Callable[[Any], Any],
                 refit: Callable[[Limits], Any], what: str) -> tuple[Any, Any]:
    """Build a kernel for ``geometry``; while the compiled kernel allows fewer work-items
    per group than it asks (CL_KERNEL_WORK_GROUP_SIZE: registers, private memory), fit
    again with that as the device's limit and rebuild, with one warning.

    Returns ``(launcher, geometry)``; ``setup.limits`` keeps the kernel's limit.
    """
    device = setup.runtime.device
    while True:
        launcher = build(geometry)
        allowed = launcher.work_group_size(device)
        want = geometry.threads
        if allowed is None or allowed >= want:
            return launcher, geometry
        limits = replace(setup.limits, max_work_group_size=allowed)
        smaller = refit(limits)
        if smaller.threads >= want:
            raise RuntimeError(f"{what} kernel needs {want} work-items per group; "
                               f"{device.name!r} allows {allowed} for it")
        warnings.warn(f"clattn: the {what} kernel allows {allowed} work-items per group on "
                      f"{device.name!r}, the geometry asked for {want}: "
                      f"{'; '.join(smaller.notes) or 'fitted again'}", RuntimeWarning,
                      stacklevel=4)
        setup.limits, geometry = limits, smaller
