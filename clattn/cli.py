"""The ``clattn`` command: devices, profiles, render, profile."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import runtime

_FIELDS = [
    ("platform", "platform_name"), ("device", "device_name"), ("vendor", "device_vendor"),
    ("type", "device_type"), ("version", "device_version"), ("OpenCL C", "opencl_c_version"),
    ("driver", "driver_version"), ("compute units", "max_compute_units"),
    ("max work-group size", "max_work_group_size"), ("max work-item sizes", "max_work_item_sizes"),
    ("local memory", "local_mem_size_bytes"), ("local memory type", "local_mem_type"),
    ("global memory", "global_mem_size_bytes"), ("max allocation", "max_mem_alloc_size_bytes"),
    ("fp16 (cl_khr_fp16)", "has_fp16"), ("subgroup extensions", "subgroup_extensions"),
    ("sub-group sizes", "sub_group_sizes"),
]


def _fmt(v: Any) -> str:
    if isinstance(v, list):
        return ", ".join(str(x) for x in v) if v else "none"
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 20:
        return f"{v} ({v / (1 << 20):.0f} MiB)"
    return "unknown" if v is None else str(v)


def device_report(dev: Any) -> str:
    """What a kernel author needs to know about one device."""
    from .profiles import device_info
    info = device_info(dev)
    width = max(len(k) for k, _ in _FIELDS)
    return "\n".join(f"  {k:<{width}}  {_fmt(info.get(f))}" for k, f in _FIELDS)


def cmd_devices(args: argparse.Namespace) -> int:
    from .profiles import device_info
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
        print(f"[{i}] {d.platform.name} / {d.name}{mark}")
        print(device_report(d))
        print()
    print("Choose with PYOPENCL_CTX='P:D' or device='pocl' | 'intel' | 'oclgrind' | a name.")
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    from .profiles import device_info, format_profiles_report
    infos = [device_info(d) for d in runtime.all_devices()]
    print(format_profiles_report(infos))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from .codegen import Limits, decode_geometry, merge_geometry, render_decode, render_merge
    from .profiles import device_info, fit
    from .setup import resolve_profile
    from .spec import AttentionSpec

    scaling = json.loads(args.rope_scaling) if args.rope_scaling else None
    spec = AttentionSpec(args.heads, args.kv_heads, args.head_dim, page_size=args.page_size,
                         dtype=args.dtype, sliding_window=args.sliding_window,
                         rope_scaling=scaling, rotary_dim=args.rotary_dim, softcap=args.softcap)
    dev = runtime.select_device(args.device) if args.device != "none" else None
    info = device_info(dev) if dev is not None else {}
    profile = json.loads(args.profile) if args.profile and args.profile.lstrip().startswith("{") \
        else args.profile
    prof, rule = resolve_profile(info, profile)
    prof, notes = fit(prof, info) if info else (prof, [])
    limits = Limits.from_info(info) if info else Limits()
    head = [f"clattn {args.kernel} kernel for {spec}",
            f"device: {dev.name if dev is not None else 'none (generic limits)'}",
            f"profile: {prof.name} ({rule})"] + [f"note: {n}" for n in notes]
    if args.kernel == "decode":
        geom = decode_geometry(spec, prof, limits)
        src = render_decode(spec, geom)
        head.append(f"geometry: {geom}")
    else:
        geom = merge_geometry(spec.head_dim, spec.dtype, prof, limits)
        src = render_merge(spec.head_dim, spec.dtype, spec.dtype, geom)
        head.append(f"geometry: {geom}")
    print("\n".join("// " + h for h in head))
    print(src)
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    try:
        from . import profiler
    except ImportError:  # pragma: no cover - the profiler is optional while it is built
        profiler = None
    if profiler is not None:
        pf = sub.add_parser("profile", help="profile a device: ceilings, correctness, tuning")
        profiler.add_arguments(pf)
        pf.set_defaults(func=profiler.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (runtime.NoDeviceError, ValueError, TypeError) as exc:
        print(f"clattn: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
