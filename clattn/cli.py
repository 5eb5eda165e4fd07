"""The ``clattn`` command: devices, profiles, render, tune (alias profile)."""
from __future__ import annotations

import argparse
import json
import sys

from . import runtime
from .codegen import render_decode, render_merge
from .device import probed_limits, resolve_profile
from .device_fit import fit_device
from .fit import Limits, merge_geometry
from .profiles import device_info
from .profiles_report import format_profiles_report
from .spec import AttentionSpec
from .tune import command as tune_command
from .tune.report import device_report


def cmd_devices(args: argparse.Namespace) -> int:
    """List every OpenCL device with the properties that matter."""
    devs = runtime.all_devices()
    if args.json:
        print(json.dumps([device_info(d) for d in devs], indent=2, default=str))
        return 0
    if not devs:
        print("No OpenCL device found: clattn uses its CPU fallback (numpy).\n"
              "Install a driver, e.g. pip install 'clattn[pocl]' (or [intel], [oclgrind]).")
        return 0
    chosen = runtime.select_device()
    for i, d in enumerate(devs):
        mark = "  <- default" if chosen is not None and d.int_ptr == chosen.int_ptr else ""
        problem = None if runtime.is_simulator(d) else runtime.device_problem(d)
        if problem:
            mark = f"  (unusable: its compiler fails: {problem})"
        print(f"[{i}] {d.platform.name} / {d.name}{mark}")
        print(device_report(d))
        print()
    print("Choose with PYOPENCL_CTX='P:D' or device='pocl' | 'intel' | 'oclgrind' | a name.")
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    """The profile registry and what each device gets."""
    infos = [device_info(d) for d in runtime.all_devices()]
    print(format_profiles_report(infos))
    return 0


def _json_arg(option: str, text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option}: malformed JSON ({exc})") from None


def cmd_render(args: argparse.Namespace) -> int:
    """Print the OpenCL C generated for a configuration."""
    scaling = _json_arg("--rope-scaling", args.rope_scaling) if args.rope_scaling else None
    spec = AttentionSpec(args.heads, args.kv_heads, args.head_dim, page_size=args.page_size,
                         dtype=args.dtype, sliding_window=args.sliding_window,
                         rope_scaling=scaling, rotary_dim=args.rotary_dim, softcap=args.softcap)
    dev = runtime.select_device(args.device) if args.device != "none" else None
    info = device_info(dev) if dev is not None else {}
    profile = _json_arg("--profile", args.profile) \
        if args.profile and args.profile.lstrip().startswith("{") else args.profile
    prof, rule = resolve_profile(info, profile)
    limits = probed_limits(runtime.Runtime.for_device(dev), info) if info else Limits()
    fit = fit_device(prof, info, spec if args.kernel == "decode" else None, limits)
    head = [f"clattn {args.kernel} kernel for {spec}",
            f"device: {dev.name if dev is not None else 'none (generic limits)'}",
            f"profile: {prof.name} ({rule})"] + [f"note: {n}" for n in fit.notes]
    if args.kernel == "decode":
        geom = fit.geometry
        src = render_decode(spec, geom)
    else:
        geom = merge_geometry(spec.head_dim, spec.dtype, fit.profile, limits)
        src = render_merge(spec.head_dim, spec.dtype, spec.dtype, geom)
    head.append(f"geometry: {geom}")
    print("\n".join("// " + h for h in head))
    print(src)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``clattn`` argument parser with every subcommand."""
    p = argparse.ArgumentParser(prog="clattn", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("devices", help="list every OpenCL platform and device")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=cmd_devices)
    pr = sub.add_parser("profiles", help="the profile registry and what each device gets")
    pr.set_defaults(func=cmd_profiles)
    r = sub.add_parser("render", help="print the OpenCL C generated for a configuration")
    r.add_argument("kernel", choices=["decode", "merge"])
    r.add_argument("--heads", type=int, default=32)
    r.add_argument("--kv-heads", type=int, default=8)
    r.add_argument("--head-dim", type=int, default=128)
    r.add_argument("--page-size", type=int, default=16)
    r.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    r.add_argument("--sliding-window", action="store_true")
    r.add_argument("--rope-scaling", help="HF rope_scaling as JSON, e.g. '{\"rope_type\": \"gptj\"}'")
    r.add_argument("--rotary-dim", type=int)
    r.add_argument("--softcap", type=float)
    r.add_argument("--device", default=None, help="device name, 'P:D', or 'none'")
    r.add_argument("--profile", default=None,
                   help="profile name, or a JSON object of fields layered over the device's "
                        "profile (default: the registry's choice)")
    r.set_defaults(func=cmd_render)
    t = sub.add_parser("tune", aliases=["profile"],
                       help="measure a device (ceilings, correctness) and tune its profile")
    tune_command.add_arguments(t)
    t.set_defaults(func=tune_command.run)
    return p


def main(argv: list[str] | None = None) -> int:
    """The console entry point; the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (runtime.NoDeviceError, ValueError, TypeError) as exc:
        print(f"clattn: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
