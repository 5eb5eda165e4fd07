"""The ``clattn`` command: devices, profiles, render (every kernel kind), tune (alias profile)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, Callable

from . import runtime
from .codegen import render_append, render_decode, render_half_probe, render_merge, render_prefill
from .device import probed_limits, resolve_profile
from .device_fit import DeviceFit, fit_device
from .fit import Limits, append_geometry, merge_geometry, prefill_geometry
from .profiles import STRATEGIES, device_info
from .profiles_report import format_profiles_report
from .quant import KV_FORMATS
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
        problem = runtime.device_problem(d)
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


def _render_decode(spec: AttentionSpec, fitted: DeviceFit, limits: Limits,
                   args: argparse.Namespace) -> tuple[Any, str]:
    return fitted.geometry, render_decode(spec, fitted.geometry)


def _render_split_merge(spec: AttentionSpec, fitted: DeviceFit, limits: Limits,
                        args: argparse.Namespace) -> tuple[Any, str]:
    geom = merge_geometry(spec.head_dim_v, spec.dtype, fitted.profile, limits)
    return geom, render_merge(spec.head_dim_v, spec.dtype, "float32", geom)


def _render_merge(spec: AttentionSpec, fitted: DeviceFit, limits: Limits,
                  args: argparse.Namespace) -> tuple[Any, str]:
    geom = merge_geometry(spec.head_dim_v, spec.dtype, fitted.profile, limits)
    return geom, render_merge(spec.head_dim_v, spec.dtype, spec.dtype, geom)


def _render_append(spec: AttentionSpec, fitted: DeviceFit, limits: Limits,
                   args: argparse.Namespace) -> tuple[Any, str]:
    geom = append_geometry(spec.head_dim, spec.dtype, fitted.profile, limits)
    return geom, render_append(spec, geom)


def _render_prefill(spec: AttentionSpec, fitted: DeviceFit, limits: Limits,
                    args: argparse.Namespace) -> tuple[Any, str]:
    geom = prefill_geometry(spec, fitted.profile, limits)
    return geom, render_prefill(spec, geom)


def _render_half_probe(spec: AttentionSpec, fitted: DeviceFit, limits: Limits,
                       args: argparse.Namespace) -> tuple[Any, str]:
    return f"lanes={args.lanes}", render_half_probe(args.lanes)


#: ``clattn render KIND``: what each kind is, and how it is fitted and rendered
RENDER_KINDS: dict[str, tuple[str, Callable[..., tuple[Any, str]]]] = {
    "decode": ("the decode kernel (decode_rows or decode_tiled, by the profile's strategy)",
               _render_decode),
    "split-merge": ("the merge of a split decode's f32 partial states", _render_split_merge),
    "merge": ("merge_state / merge_states over states of the spec's dtype", _render_merge),
    "append": ("the KV-cache append, its byte-pool check and page copy (pages in "
               "--k-format / --v-format)", _render_append),
    "prefill": ("the prefill kernel (prefill_rows or prefill_tiled, by the profile's "
                "strategy)", _render_prefill),
    "half-probe": ("the compiler probe's f16 conversion check (--lanes values a "
                   "conversion)", _render_half_probe),
}


def cmd_render(args: argparse.Namespace) -> int:
    """Print the OpenCL C generated for one kernel kind and configuration."""
    scaling = _json_arg("--rope-scaling", args.rope_scaling) if args.rope_scaling else None
    spec = AttentionSpec(args.heads, args.kv_heads, args.head_dim, page_size=args.page_size,
                         dtype=args.dtype, sliding_window=args.sliding_window,
                         rope_scaling=scaling, rotary_dim=args.rotary_dim, softcap=args.softcap,
                         k_format=args.k_format, v_format=args.v_format,
                         head_dim_v=args.head_dim_v, value_in_key=args.value_in_key)
    dev = runtime.select_device(args.device) if args.device != "none" else None
    info = device_info(dev) if dev is not None else {}
    profile = _json_arg("--profile", args.profile) \
        if args.profile and args.profile.lstrip().startswith("{") else args.profile
    prof, rule = resolve_profile(info, profile)
    if args.strategy:
        prof, rule = replace(prof, strategy=args.strategy), f"{rule}, strategy {args.strategy}"
    limits = probed_limits(runtime.Runtime.for_device(dev), info) if info else Limits()
    fitted = fit_device(prof, info, spec if args.kind == "decode" else None, limits)
    geom, src = RENDER_KINDS[args.kind][1](spec, fitted, limits, args)
    notes = list(fitted.notes) + [n for n in getattr(geom, "notes", ()) if n not in fitted.notes]
    head = [f"clattn {args.kind} kernel for {spec}",
            f"device: {dev.name if dev is not None else 'none (generic limits)'}",
            f"profile: {prof.name} ({rule})"] + [f"note: {n}" for n in notes]
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
    r = sub.add_parser("render", help="print the OpenCL C generated for a configuration",
                       epilog="kinds: " + "; ".join(f"{k}: {what}"
                                                    for k, (what, _) in RENDER_KINDS.items()))
    r.add_argument("kind", choices=list(RENDER_KINDS))
    r.add_argument("--heads", type=int, default=32)
    r.add_argument("--kv-heads", type=int, default=8)
    r.add_argument("--head-dim", type=int, default=128)
    r.add_argument("--head-dim-v", type=int, help="the values' width (default: --head-dim)")
    r.add_argument("--value-in-key", action="store_true",
                   help="values are the first --head-dim-v values of the key rows (MLA's "
                        "absorbed form: one row per token and KV head)")
    r.add_argument("--page-size", type=int, default=16)
    r.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    r.add_argument("--sliding-window", action="store_true")
    r.add_argument("--rope-scaling",
                   help="HF rope_scaling as JSON, e.g. '{\"rope_type\": \"gptj\"}'")
    r.add_argument("--rotary-dim", type=int)
    r.add_argument("--softcap", type=float)
    r.add_argument("--k-format", choices=list(KV_FORMATS), help="K pages (default: --dtype)")
    r.add_argument("--v-format", choices=list(KV_FORMATS), help="V pages (default: --dtype)")
    r.add_argument("--strategy", choices=list(STRATEGIES),
                   help="rows or tiled kernels, over the profile's choice")
    r.add_argument("--lanes", type=int, default=16, help="half-probe: values a conversion")
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
