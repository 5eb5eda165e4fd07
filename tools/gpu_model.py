#!/usr/bin/env python
"""A cost model of the tiled decode kernel from counted work.

For every built-in GPU profile (strategy "tiled") and every real model shape, the decode
kernel the profile gets on a representative recorded device of its family
(tests/data/devices.json) is rendered and run under Oclgrind with
``OCLGRIND_INST_COUNTS=1``, in a subprocess, on one sequence of ``n`` and ``2n`` rows;
the difference of the two counts, divided by ``n``, is the work per KV row (one token's K
and V of one KV head), free of the fixed per-work-group cost (q, the final merge, the
stores). Published figures of real GPUs (tools/gpu_devices.json, every figure with its
source) turn the counts into a time per token per layer and the resource that bounds it.

What is counted, and how (tools/gpu_model.md has the whole method):

* Oclgrind has no sub-groups: a geometry that reduces through sub-groups on its device is
  counted in its local-memory form (same vec and work-group shape, ``reduction="local"``).
  The sub-group form does at most this much.
* Oclgrind cannot convert half vectors (``convert_float4(half4)``): a geometry with native
  f16 is counted with ``vload_half`` (the same bytes, the conversions in the load).
* Oclgrind has 32 KiB of local memory: a geometry that needs more is counted with fewer
  row slices (bdz halved, then tile halved); barriers per row are scaled back to the
  device's rows per step (exact for the per-step barriers), and the note says so.
* The count runs one KV head (``num_kv_heads=1``, ``num_qo_heads = group size``): a
  work-group serves one KV head, so per-row figures are those of every head.

Use
  python tools/gpu_model.py                      # the tables (counts cached per kernel)
  python tools/gpu_model.py --profiles adreno-7xx,mali-valhall --shapes Llama-3-8B
  python tools/gpu_model.py --formats float16    # f16 pages only (default: also q8_0, q4_0)
  python tools/gpu_model.py --json out.json      # everything, machine-readable

``report()`` returns the same text for ``tools/bench.py --suite gpu-model``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from common import MODELS, ROOT, csv  # first: it puts clattn on the path

DEVICES_JSON = ROOT / "tests" / "data" / "devices.json"  # recorded OpenCL devices
GPU_FIGURES_JSON = Path(__file__).resolve().parent / "gpu_devices.json"  # published figures

#: real model shapes by name (f16 pages)
SHAPES = MODELS
DTYPE = "float16"
ITEM = 2  # bytes of an f16
#: page formats counted (K and V in the same one): f16 and the quantized block formats
FORMATS = ("float16", "q8_0", "q4_0")
#: issue 40's targets for quantized pages where decode waits on memory: time over f16's
QUANT_TARGETS = {"q8_0": 0.65, "q4_0": 0.45}
PAGE_SIZE = 16
BASE_ROWS = 256  # the smaller run has about this many rows (a whole number of steps)
CONTEXTS = (4096, 32768)  # rows per sequence for the modelled times
OCLGRIND_LOCAL = 32768  # bytes of local memory Oclgrind's device offers
COUNT_VERSION = 1  # bump when what a count holds changes (invalidates the cache)
GLOBAL_LIMIT = 1.05  # the most global bytes loaded per KV byte, tables and q included


# ------------------------------------------------------------------ the Oclgrind report
_HEAD = re.compile(r"^Instructions executed for kernel '([^']+)':\s*$")
_LINE = re.compile(r"^\s*(\d+) - (.+?)(?: \((\d+) bytes\))?\s*$")
_SPACES = {0: "private", 1: "global", 2: "constant", 3: "local", 4: "generic"}
_ELEM = {"Dh": 2, "f": 4, "d": 8, "c": 1, "a": 1, "h": 1, "s": 2, "t": 2, "i": 4, "j": 4,
         "l": 8, "m": 8}
#: IR that costs no instruction on a GPU (SSA bookkeeping, markers)
FREE_OPS = frozenset({"phi", "freeze", "bitcast", "alloca", "ret", "unreachable",
                      "call llvm.lifetime.start.p0i8()", "call llvm.lifetime.end.p0i8()"})
#: floating-point arithmetic opcodes and math builtins (by their demangled name)
ARITH_OPS = frozenset({"fadd", "fsub", "fmul", "fdiv", "frem", "fneg"})
MATH_BUILTINS = frozenset({"exp", "exp2", "log", "log2", "tanh", "sin", "cos", "sincos",
                           "sqrt", "rsqrt", "fmax", "fmin", "fma", "mad", "pow", "native_exp2",
                           "native_log2", "native_exp", "native_recip", "native_divide"})


def _demangle(sym: str) -> tuple[str, str]:
    """(name, argument code) of an Itanium-mangled OpenCL builtin, or (sym, '')."""
    m = re.match(r"_Z(\d+)(.*)$", sym)
    if not m:
        return sym, ""
    n = int(m.group(1))
    return m.group(2)[:n], m.group(2)[n:]


def _pointer(args: str) -> tuple[str, int]:
    """(address space, element bytes) of the last pointer argument of a mangled signature."""
    m = re.search(r"P(?:U3AS(\d))?K?(Dh|[a-z])$", args)
    if not m:
        return "private", 4
    return _SPACES.get(int(m.group(1) or 0), "private"), _ELEM.get(m.group(2), 4)


def _lanes(name: str) -> int:
    """Vector lanes of a builtin or intrinsic from its name (vload_half4 -> 4, .v4f32 -> 4)."""
    m = re.search(r"\.v(\d+)f(?:16|32|64)\b", name) or \
        re.search(r"(?:vload|vstore)a?(?:_half)?(\d+)", name)
    return int(m.group(1)) if m and m.group(1) else 1


@dataclass
class KernelReport:
    """One kernel run's counts: operation -> executions (summed over work-items), and the
    bytes Oclgrind gives for loads and stores."""

    kernel: str
    ops: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)


def parse_report(text: str) -> list[KernelReport]:
    """Every ``Instructions executed for kernel`` block of an Oclgrind log, in order.

    Lines that are not part of a block (the program's own output) are ignored.
    """
    out: list[KernelReport] = []
    cur: KernelReport | None = None
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head:
            cur = KernelReport(head.group(1))
            out.append(cur)
            continue
        m = _LINE.match(line) if cur is not None else None
        if m is None:
            if cur is not None and line.strip():
                cur = None  # the block ended
            continue
        n, op, nb = int(m.group(1)), m.group(2).strip(), m.group(3)
        cur.ops[op] = cur.ops.get(op, 0) + n
        if nb is not None:
            cur.bytes[op] = cur.bytes.get(op, 0) + int(nb)
    return out


@dataclass
class Counts:
    """Work of one kernel run by resource (bytes, executions summed over work-items).

    ``vload``: calls of vload/vload_half per address space; ``f16_conv``: f16 values
    converted (vload_half/vstore_half lanes, fpext/fptrunc); ``arith``: floating-point
    instructions (a vector instruction counts once unless its name gives its lanes);
    ``other``: every other instruction that costs an issue slot (integer, compare,
    control, address, calls of helper functions); ``barriers``: barrier calls.
    """

    global_load: float = 0.0
    global_load_kv: float = 0.0  # of which through vload/vload_half (K, V rows and q)
    global_store: float = 0.0
    local_load: float = 0.0
    local_store: float = 0.0
    private_load: float = 0.0
    private_store: float = 0.0
    barriers: float = 0.0
    vload_global: float = 0.0
    vload_local: float = 0.0
    vload_private: float = 0.0
    f16_conv: float = 0.0
    arith: float = 0.0
    other: float = 0.0

    @classmethod
    def from_report(cls, rep: KernelReport) -> "Counts":
        c = cls()
        for op, n in rep.ops.items():
            nb = rep.bytes.get(op, 0)
            if op in FREE_OPS:
                continue
            mem = re.match(r"(load|store) (global|constant|local|private|generic)$", op)
            if mem:
                kind, space = mem.groups()
                space = "global" if space == "constant" else space
                if space == "generic":
                    space = "global"  # no generic pointers in these kernels; be pessimistic
                setattr(c, f"{space}_{kind}", getattr(c, f"{space}_{kind}") + nb)
                continue
            if op in ARITH_OPS:
                c.arith += n
                continue
            if op in ("fpext", "fptrunc"):
                c.f16_conv += n
                c.other += n
                continue
            call = re.match(r"call (\S+?)(?:\(\))?$", op)
            if not call:
                c.other += n
                continue
            sym = call.group(1)
            if sym.startswith("llvm."):
                base = sym.split(".")[1]
                if base in ("fmuladd", "fma", "maxnum", "minnum", "exp2", "log2", "sqrt",
                            "fabs", "floor", "rint", "copysign"):
                    c.arith += n * _lanes(sym)
                else:
                    c.other += n
                continue
            name, args = _demangle(sym)
            if name.startswith(("vload", "vstore")):
                lanes = _lanes(name)
                space, elem = _pointer(args)
                half = "_half" in name
                size = n * lanes * (2 if half else elem)
                if half:
                    c.f16_conv += n * lanes
                load = name.startswith("vload")
                space = "global" if space == "constant" else space
                key = f"{space}_{'load' if load else 'store'}"
                if hasattr(c, key):
                    setattr(c, key, getattr(c, key) + size)
                if load:
                    if space == "global":
                        c.global_load_kv += size
                    vk = f"vload_{space}"
                    if hasattr(c, vk):
                        setattr(c, vk, getattr(c, vk) + n)
                continue
            if name in ("barrier", "work_group_barrier"):
                c.barriers += n
                continue
            if name.startswith("convert_") and "Dh" in args:
                c.f16_conv += n * _lanes(name)
                c.other += n
                continue
            if name in MATH_BUILTINS:
                c.arith += n
                continue
            c.other += n  # get_local_id, clamp, min, isnan, helper functions, ...
        return c

    def minus(self, other: "Counts") -> "Counts":
        return Counts(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                         for f in fields(self)})

    def scaled(self, k: float) -> "Counts":
        return Counts(**{f.name: getattr(self, f.name) * k for f in fields(self)})


# ------------------------------------------------------------------ profiles, records, geometry
def gpu_profiles() -> list[str]:
    """The built-in profiles the model counts, in file order: those whose strategy is
    "tiled" (the GPU kernels) and that have a recorded GPU to model (:func:`representative`),
    plus the ``generic`` root. A tiled profile for a CPU driver (llvmpipe) has no GPU."""
    from clattn.profiles import builtin_profiles
    return [n for n, p in builtin_profiles().items()
            if p.strategy == "tiled" and (n == "generic" or representative(n) is not None)]


def _records() -> list[dict]:
    return json.loads(DEVICES_JSON.read_text())["records"]


@lru_cache(maxsize=1)
def _record_profiles() -> dict[str, str]:
    """Record id -> the built-in profile the registry gives it."""
    from clattn import profiles as reg
    return {r["id"]: reg.match(r, user=False).profile.name for r in _records()}


def representative(profile: str) -> dict | None:
    """The recorded device whose facts the profile is fitted to: of the records the
    registry gives this profile, the one reporting the most fields (ties: file order);
    failing any, of those given a profile named ``<profile>-...`` (Mali Midgard has no
    record: a Valhall/Bifrost one stands in); None for ``generic`` (no device)."""
    recs = _records()
    got = _record_profiles()
    for pick in (lambda n: n == profile, lambda n: n.startswith(profile + "-")):
        cands = [r for r in recs if pick(got[r["id"]])]
        if cands:
            return max(cands, key=lambda r: (sum(v is not None for v in r.values()),
                                             -recs.index(r)))
    return None


def spec_for(shape: str, kv_heads: int | None = None, fmt: str = DTYPE):
    """The attention spec of ``shape`` (f16 q and out) with K and V pages in ``fmt``."""
    from clattn.spec import AttentionSpec
    m = SHAPES[shape]
    g = m.num_qo_heads // m.num_kv_heads
    k = m.num_kv_heads if kv_heads is None else kv_heads
    return AttentionSpec(g * k, k, m.head_dim, page_size=PAGE_SIZE, dtype=DTYPE,
                         softcap=m.softcap, k_format=fmt, v_format=fmt)


@dataclass(frozen=True)
class Variant:
    """One profile x shape x page format: the geometry on its device and the geometry
    counted."""

    profile: str
    shape: str
    record: str | None
    device_geometry: Any
    counted_geometry: Any
    notes: tuple = ()
    fmt: str = DTYPE

    @property
    def rows_per_step(self) -> int:
        g = self.device_geometry
        return g.bdy * g.bdz * g.tile

    @property
    def counted_rows_per_step(self) -> int:
        g = self.counted_geometry
        return g.bdy * g.bdz * g.tile


@lru_cache(maxsize=None)
def variant(profile: str, shape: str, fmt: str = DTYPE) -> Variant:
    """Fit ``profile`` to its representative record for ``shape`` with pages in ``fmt``
    and derive what Oclgrind can run (local-memory reduction, vload_half, at most 32 KiB
    of local memory)."""
    from clattn import profiles as reg
    from clattn.device_fit import fit_device
    from clattn.fit import slice_heads, tiled_local_bytes
    rec = representative(profile)
    info = rec or {}
    spec = spec_for(shape, fmt=fmt)
    fit = fit_device(reg.get_profile(profile, user=False), info, spec)
    dev = fit.geometry
    notes = list(fit.notes)
    g = dev
    if g.reduction == "subgroup":
        g = replace(g, reduction="local", subgroup_size=None, subgroup_attr="", pragmas=())
        notes.append(f"counted with local-memory reduction (Oclgrind has no sub-groups; "
                     f"the device reduces through sub-groups of {dev.subgroup_size})")
    if g.native_fp16:
        g = replace(g, native_fp16=False)
        notes.append("counted with vload_half (Oclgrind cannot convert half vectors; "
                     "the device loads the same bytes natively)")

    def need(x):
        return tiled_local_bytes(spec.head_dim_v, x.bdx, x.bdz, x.tile,
                                  slice_heads(spec.group_size, x.gdz), x.reduction)
    fitted = g
    while need(fitted) > OCLGRIND_LOCAL and (fitted.bdz > 1 or fitted.tile > 1):
        fitted = replace(fitted, bdz=fitted.bdz // 2) if fitted.bdz > 1 else \
            replace(fitted, tile=fitted.tile // 2)
    if fitted is not g:
        notes.append(f"counted with bdz {fitted.bdz}, tile {fitted.tile} (device: bdz {g.bdz}, "
                     f"tile {g.tile}): Oclgrind has {OCLGRIND_LOCAL} bytes of local memory, "
                     f"the device geometry needs {need(g)}; barriers per row rescaled")
    if need(fitted) > OCLGRIND_LOCAL:
        raise ValueError(f"{profile} x {shape}: {need(fitted)} bytes of local memory even "
                         f"with one row slice; Oclgrind has {OCLGRIND_LOCAL}")
    fitted = replace(fitted, local_mem_bytes=need(fitted), notes=())
    return Variant(profile, shape, rec["id"] if rec else None, dev, fitted, tuple(notes), fmt)


# ------------------------------------------------------------------ counting (subprocess)
def _source(v: Variant) -> str:
    from clattn.codegen import render_decode
    return render_decode(spec_for(v.shape, 1, v.fmt), v.counted_geometry)


def _lengths(v: Variant, base_rows: int = BASE_ROWS) -> tuple[int, int]:
    r = v.counted_rows_per_step
    n1 = r * math.ceil(base_rows / r)
    return n1, 2 * n1


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "clattn" / "gpu_model"


def _key(v: Variant, base_rows: int = BASE_ROWS) -> str:
    g = v.counted_geometry
    text = json.dumps([COUNT_VERSION, _source(v), g.local_size(), _lengths(v, base_rows)],
                      sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def _child_payload(v: Variant, base_rows: int = BASE_ROWS) -> dict:
    g = asdict(v.counted_geometry)
    g.pop("notes", None)
    return {"shape": v.shape, "profile": v.profile, "geometry": g, "fmt": v.fmt,
            "lengths": _lengths(v, base_rows)}


def _run_child(payload: dict) -> None:
    """In the subprocess: run the decode on Oclgrind for each length (one report each),
    check it against the CPU backend, print a marker."""
    import numpy as np
    warnings.simplefilter("ignore")
    import clattn
    from clattn.fit import DecodeGeometry
    from clattn.quant import QUANTIZED, pack_pool
    fmt = payload.get("fmt", DTYPE)
    spec = spec_for(payload["shape"], 1, fmt)
    g = payload["geometry"]
    geom = DecodeGeometry(**{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()})
    dec = clattn.BatchDecode(spec, "oclgrind", backend="opencl", profile=payload["profile"])
    dec.opencl.decode_geometry = geom  # the representative device's, not Oclgrind's own
    cpu = clattn.BatchDecode(spec, backend="cpu")
    rng = np.random.default_rng(0)
    for n in payload["lengths"]:
        npg = -(-n // PAGE_SIZE)
        q = rng.standard_normal((1, spec.num_qo_heads, spec.head_dim)).astype(np.float16)
        kv = rng.standard_normal((npg, 2, 1, PAGE_SIZE, spec.head_dim))
        pages = pack_pool(kv[:, 0], kv[:, 1], spec.layout) if fmt in QUANTIZED \
            else kv.astype(np.float16)
        order = rng.permutation(npg).astype(np.int32)  # pages out of order, as in a real pool
        indptr = np.array([0, npg], np.int32)
        last = np.array([n - (npg - 1) * PAGE_SIZE], np.int32)
        sys.stderr.flush()
        res = dec.run(q, pages, indptr, order, last, split=False)
        ref = cpu.run(q, pages, indptr, order, last)
        err = float(np.abs(res.out.astype(np.float32) - ref.out.astype(np.float32)).max())
        if not err < 2e-2:
            print(f"GPU-MODEL-MISMATCH n={n} max error {err}", flush=True)
            sys.exit(3)
    print("GPU-MODEL-OK", flush=True)


@lru_cache(maxsize=None)
def _row_bytes(shape: str, fmt: str) -> float:
    """Stored bytes of one KV row (one token's K and V of one KV head) of ``shape`` in
    ``fmt`` (every table reads it per row and resource: one spec per shape and format)."""
    return spec_for(shape, 1, fmt).bytes_per_token


@dataclass
class PerRow:
    """Counted work per KV row (one token's K and V of one KV head) in page format
    ``fmt``."""

    profile: str
    shape: str
    record: str | None
    head_dim: int
    group: int
    geometry: str
    threads: int
    lengths: tuple
    counts: Counts  # per row, summed over every work-item (and work-group) of the head
    wg_barriers: float  # barriers per row, per work-group (every work-item calls each)
    notes: tuple = ()
    fmt: str = DTYPE

    @property
    def kv_bytes(self) -> float:
        """Stored bytes of a KV row in its format (a quantized block's scale included)."""
        return _row_bytes(self.shape, self.fmt)

    def per_kv_byte(self, name: str) -> float:
        return getattr(self.counts, name) / self.kv_bytes


def reports_for(v: Variant, *, cache: bool = True, timeout: float = 900.0,
                base_rows: int = BASE_ROWS) -> list[KernelReport]:
    """The two Oclgrind reports (n and 2n rows) of a variant's kernel, from the cache
    (keyed by kernel source, launch shape and lengths) or a fresh run."""
    path = _cache_dir() / f"{_key(v, base_rows)}.json"
    if cache and path.exists():
        try:
            return [KernelReport(**r) for r in json.loads(path.read_text())["reports"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    env = dict(os.environ, OCLGRIND_INST_COUNTS="1")
    for k in ("OCLGRIND_DATA_RACES", "OCLGRIND_UNINITIALIZED", "OCLGRIND_UNIFORM_WRITES"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"],
                          input=json.dumps(_child_payload(v, base_rows)), capture_output=True,
                          text=True, env=env, timeout=timeout)
    reports = [r for r in parse_report(proc.stderr + "\n" + proc.stdout)
               if r.kernel == "clattn_decode"]
    if proc.returncode != 0 or "GPU-MODEL-OK" not in proc.stdout or len(reports) != 2:
        raise RuntimeError(f"{v.profile} x {v.shape}: the Oclgrind run failed "
                           f"(rc {proc.returncode}, {len(reports)} reports):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"profile": v.profile, "shape": v.shape,
                                       "reports": [asdict(r) for r in reports]}))
            os.replace(tmp, path)
        except OSError:
            pass
    return reports


def count(v: Variant, *, cache: bool = True, base_rows: int = BASE_ROWS) -> PerRow:
    """Per-row counts of one variant (``base_rows``: rows of the smaller run, rounded up
    to whole steps; the larger run has twice as many)."""
    return per_row(v, reports_for(v, cache=cache, base_rows=base_rows), base_rows)


def per_row(v: Variant, reports: list[KernelReport], base_rows: int = BASE_ROWS) -> PerRow:
    """Per-row figures from the two runs' reports (n and 2n rows)."""
    n1, n2 = _lengths(v, base_rows)
    a, b = Counts.from_report(reports[0]), Counts.from_report(reports[1])
    d = b.minus(a).scaled(1.0 / (n2 - n1))
    g, cg = v.device_geometry, v.counted_geometry
    threads = cg.bdx * cg.bdy * cg.bdz
    # every work-item of a work-group calls each barrier; per step the count does not
    # depend on the rows per step, so rescale to the device's rows per step
    wgb = d.barriers / threads * v.counted_rows_per_step / v.rows_per_step
    spec = spec_for(v.shape)
    geo = (f"vec{g.vec} {g.bdx}x{g.bdy}x{g.bdz}" + (f" gdz{g.gdz}" if g.gdz > 1 else "")
           + (f" tile{g.tile}" if g.tile > 1 else "") + (" local-KV" if g.use_local else "")
           + (f" sg{g.subgroup_size}" if g.reduction == "subgroup" else ""))
    return PerRow(v.profile, v.shape, v.record, spec.head_dim, spec.group_size, geo, threads,
                  (n1, n2), d, wgb, v.notes, v.fmt)


def variants(profiles: Iterable[str] | None = None, shapes: Iterable[str] | None = None,
             formats: Iterable[str] = (DTYPE,)) -> list[Variant]:
    profiles = list(profiles or gpu_profiles())
    shapes = list(shapes or SHAPES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [variant(p, s, f) for f in formats for p in profiles for s in shapes]


def count_all(profiles: Iterable[str] | None = None, shapes: Iterable[str] | None = None,
              *, jobs: int = 2, cache: bool = True, base_rows: int = BASE_ROWS,
              formats: Iterable[str] = (DTYPE,)) -> list[PerRow]:
    """Per-row counts of every format x profile x shape; identical kernels are run once."""
    vs = variants(profiles, shapes, formats)
    first: dict[str, Variant] = {}
    for v in vs:
        first.setdefault(_key(v, base_rows), v)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        got = dict(zip(first, pool.map(
            lambda v: reports_for(v, cache=cache, base_rows=base_rows), first.values())))
    return [per_row(v, got[_key(v, base_rows)], base_rows) for v in vs]


# ------------------------------------------------------------------ the model
def load_devices(path: Path = GPU_FIGURES_JSON) -> list[dict]:
    """Published figures of real GPUs (each value with its source, see the JSON)."""
    data = json.loads(Path(path).read_text())
    return data["devices"]


def value(entry: Mapping[str, Any], name: str) -> float:
    """A figure of a device entry (``{"value": x, "source": ...}`` or a bare number)."""
    v = entry[name]
    return float(v["value"] if isinstance(v, Mapping) else v)


def device_profile(dev: Mapping[str, Any]) -> str:
    """The built-in profile the registry gives the device (from its OpenCL identity)."""
    from clattn import profiles as reg
    return reg.match(dev["opencl"], user=False).profile.name


@dataclass
class Estimate:
    device: str
    profile: str
    shape: str
    context: int
    work_groups: int
    busy_units: float  # fraction of the work-group slots (cores) with a work-group
    times_us: dict  # resource -> microseconds per token per layer
    bound: str
    floor_us: float  # KV bytes once over the DRAM bandwidth, all units busy
    local_form: bool = False  # the device reduces through sub-groups: local/alu/barrier
    # were counted in the local-memory form, an upper bound
    fmt: str = DTYPE  # the page format counted

    @property
    def time_us(self) -> float:
        return self.times_us[self.bound]


RESOURCES = ("global", "local", "alu", "barrier")


def estimate(row: PerRow, dev: Mapping[str, Any], context: int, *,
             work_groups: int | None = None) -> Estimate:
    """Time per token per layer (one sequence of ``context`` rows, every KV head) on
    ``dev``: each resource's time at full rate, scaled by the busy fraction of the compute
    units; the largest names the bound (a roofline: the others overlap with it).

    * global: counted global bytes loaded (K/V, page table, q) over the DRAM bandwidth;
      loads repeated within a work-group (the page table per work-item, K/V per head
      without local staging) may hit a cache, so the DRAM time lies between
      ``floor_us`` (each KV byte once) and this;
    * local: local-memory bytes loaded and stored over the local-memory bandwidth;
    * alu: floating-point + other counted instructions, one issue slot per work-item
      instruction, over (f32 FLOP/s / 2) slots per second;
    * barrier: work-group barriers x the device's barrier cost in cycles, per compute
      core (educated guess in the JSON).

    The busy fraction is work-groups / ``wg_slots`` (one work-group per core), capped at 1.
    """
    hkv = SHAPES[row.shape].num_kv_heads
    rows = context * hkv
    c = row.counts
    slots_wg = value(dev, "wg_slots")
    clock = value(dev, "clock_mhz") * 1e6
    if work_groups is None:
        work_groups = planned_work_groups(row, dev, context)
    busy = min(1.0, work_groups / slots_wg)
    bw = value(dev, "dram_gbs") * 1e9
    lbw = value(dev, "local_gbs") * 1e9
    slots = value(dev, "fp32_gflops") * 1e9 / 2
    bar = value(dev, "barrier_cycles")
    t = {
        "global": rows * c.global_load / bw,
        "local": rows * (c.local_load + c.local_store) / lbw,
        "alu": rows * (c.arith + c.other) / slots,
        "barrier": rows * row.wg_barriers * bar / (clock * slots_wg),
    }
    t = {k: v / busy * 1e6 for k, v in t.items()}
    bound = max(t, key=t.get)
    floor = rows * row.kv_bytes / bw * 1e6
    sg = variant(row.profile, row.shape, row.fmt).device_geometry.reduction == "subgroup"
    return Estimate(dev["name"], row.profile, row.shape, context, work_groups, busy, t, bound,
                    floor, sg, row.fmt)


def planned_work_groups(row: PerRow, dev: Mapping[str, Any], context: int) -> int:
    """Work-groups of the decode launch for one sequence (the planner's split-KV choice
    for the device's compute units and the profile's occupancy settings)."""
    import numpy as np

    from clattn.plan import make_plan
    from clattn.profiles import get_profile
    hkv = SHAPES[row.shape].num_kv_heads
    v = variant(row.profile, row.shape, row.fmt)
    wg = hkv * v.device_geometry.gdz
    plan = make_plan(np.array([context]), wg, int(value(dev, "compute_units")),
                     get_profile(row.profile, user=False), PAGE_SIZE)
    return wg * (plan.num_parts if plan.split else 1)


# ------------------------------------------------------------------ split-KV
#: microseconds one more kernel launch costs on a GPU driver (the merge pass of a split):
#: an educated guess (dispatch overheads of 5-20 us are what mobile OpenCL drivers show in
#: public measurements; no figure per device is published)
LAUNCH_US = 10.0
#: partition counts the model tries for one sequence
SPLIT_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: the planner follows the model when its plan is within this factor of the model's best
FOLLOW_TOLERANCE = 1.10


@dataclass(frozen=True)
class SplitChoice:
    """Split-KV for one sequence of ``context`` rows on a device, as the model sees it:
    the unsplit launch, the planner's partitions and the model's best, each in modelled
    microseconds per token per layer (decode + the merge pass when split)."""

    device: str
    profile: str
    shape: str
    context: int
    unsplit_us: float
    planned_parts: int
    planned_us: float
    best_parts: int
    best_us: float

    @property
    def gain(self) -> float:
        """What the planner's split gains over the unsplit launch (1.0: none)."""
        return self.unsplit_us / self.planned_us

    @property
    def best_gain(self) -> float:
        """What the model's best partition count gains."""
        return self.unsplit_us / self.best_us

    @property
    def follows(self) -> bool:
        """The planner's choice is within :data:`FOLLOW_TOLERANCE` of the model's best."""
        return self.planned_us <= self.best_us * FOLLOW_TOLERANCE


def merge_us(row: PerRow, dev: Mapping[str, Any], parts: int) -> float:
    """The split merge pass: ``parts`` f32 states per query head read (v and lse), the f16
    output written, at the DRAM bandwidth, plus one launch (:data:`LAUNCH_US`)."""
    hq, d = SHAPES[row.shape].num_qo_heads, SHAPES[row.shape].head_dim
    nbytes = parts * hq * (d + 1) * 4 + hq * (d * ITEM + 4)
    return nbytes / (value(dev, "dram_gbs") * 1e9) * 1e6 + LAUNCH_US


def split_choice(row: PerRow, dev: Mapping[str, Any], context: int) -> SplitChoice:
    """The model's verdict on split-KV for one sequence."""
    hkv = SHAPES[row.shape].num_kv_heads
    wg = hkv * variant(row.profile, row.shape, row.fmt).device_geometry.gdz

    def cost(parts: int) -> float:
        t = estimate(row, dev, context, work_groups=wg * parts).time_us
        return t + (merge_us(row, dev, parts) if parts > 1 else 0.0)

    planned = planned_work_groups(row, dev, context) // wg
    # the counts are per row, free of each work-group's fixed cost (q, the slice merge, the
    # state writes), which decides short partitions: partitions shorter than the profile's
    # min_partition_rows are left out, as the planner leaves them out
    from clattn.profiles import get_profile
    least = max(PAGE_SIZE, get_profile(row.profile, user=False).min_partition_rows)
    fits = [p for p in SPLIT_CANDIDATES if p == 1 or context // p >= least]
    best = min(fits, key=lambda p: (cost(p), p))
    return SplitChoice(dev["name"], row.profile, row.shape, context, cost(1), planned,
                       cost(planned), best, cost(best))


def device_rows(rows: list[PerRow], devices: list[dict], contexts: Iterable[int] = CONTEXTS,
                fmt: str = DTYPE) -> Iterator[tuple[dict, PerRow, int]]:
    """``(device, counted row, context)`` for every device whose profile was counted on a
    shape with pages in ``fmt``, shapes in :data:`SHAPES` order."""
    by = {(r.profile, r.shape): r for r in rows if r.fmt == fmt}
    for dev in devices:
        prof = device_profile(dev)
        for shape in SHAPES:
            r = by.get((prof, shape))
            if r is not None:
                for L in contexts:
                    yield dev, r, L


@dataclass
class FormatChoice:
    """A quantized page format against f16 pages on one device, shape and length: the
    modelled times (global at the counted bytes: every lane's load, an upper bound where
    lanes load the same block scale or q4_0 byte) and the same with global at the floor
    (each stored byte once: same-address loads of one instruction coalesced)."""

    device: str
    profile: str
    shape: str
    fmt: str
    context: int
    f16_us: float
    us: float
    bound: str
    floor_bound_us: float  # global at the floor, the other resources as counted
    f16_floor_bound_us: float

    @property
    def ratio(self) -> float:
        return self.us / self.f16_us

    @property
    def floor_ratio(self) -> float:
        return self.floor_bound_us / self.f16_floor_bound_us

    @property
    def target(self) -> float:
        return QUANT_TARGETS[self.fmt]


def _at_floor(e: Estimate) -> float:
    """``e``'s time with global at the KV floor (the other resources as counted)."""
    return max([e.floor_us] + [t for k, t in e.times_us.items() if k != "global"])


def format_choices(rows: list[PerRow], devices: list[dict],
                   context: int = CONTEXTS[-1]) -> list[FormatChoice]:
    """Every quantized row counted beside its f16 row, on every device of its profile."""
    base = {(r.profile, r.shape): r for r in rows if r.fmt == DTYPE}
    out = []
    for fmt in (f for f in FORMATS if f != DTYPE):
        for dev, r, L in device_rows(rows, devices, (context,), fmt):
            r16 = base.get((r.profile, r.shape))
            if r16 is None:
                continue
            e, e16 = estimate(r, dev, L), estimate(r16, dev, L)
            out.append(FormatChoice(dev["name"], r.profile, r.shape, fmt, L, e16.time_us,
                                    e.time_us, e.bound, _at_floor(e), _at_floor(e16)))
    return out


def format_table(rows: list[PerRow], devices: list[dict], context: int = CONTEXTS[-1]) -> str:
    """Markdown table: quantized pages' modelled time over f16's, against issue 40's
    targets (:data:`QUANT_TARGETS`)."""
    lines = ["| device | profile | shape | format | L | f16 us | us | bound | x f16 | "
             "x f16, global at the floor | target | met |", "|" + "---|" * 12]
    for c in format_choices(rows, devices, context):
        met = "yes" if c.ratio <= c.target else \
            "at the floor" if c.floor_ratio <= c.target else "no"
        lines.append(f"| {c.device} | {c.profile} | {c.shape} | {c.fmt} | {c.context} | "
                     f"{_f(c.f16_us, 1)} | {_f(c.us, 1)} | {c.bound} | {c.ratio:.2f} | "
                     f"{c.floor_ratio:.2f} | {c.target:.2f} | {met} |")
    return "\n".join(lines)


def split_table(rows: list[PerRow], devices: list[dict],
                contexts: Iterable[int] = CONTEXTS) -> str:
    """Markdown table: split-KV's modelled gain per device, shape and length, the
    planner's partitions against the model's best."""
    lines = ["| device | profile | shape | L | unsplit us | planner: parts | us | gain | "
             "model's best: parts | us | gain | planner follows |", "|" + "---|" * 12]
    for dev, r, L in device_rows(rows, devices, contexts):
        c = split_choice(r, dev, L)
        lines.append(f"| {c.device} | {r.profile} | {r.shape} | {L} | {_f(c.unsplit_us, 1)} | "
                     f"{c.planned_parts} | {_f(c.planned_us, 1)} | {c.gain:.2f}x | "
                     f"{c.best_parts} | {_f(c.best_us, 1)} | {c.best_gain:.2f}x | "
                     f"{'yes' if c.follows else 'no'} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ against the baseline
#: the counts of the baseline kernels (templates of commit dd74fba), per
#: "profile/shape": (global B/KV B, local-memory loads B/KV B, local stores B/KV B,
#: work-group barriers per row, other instructions per row); printed anew by
#: ``python tools/gpu_model.py --print-baseline``
BASELINE: dict[str, tuple] = {
    "generic/Llama-3.2-1B": (1.5, 24, 3, 0.375, 10511.8),
    "generic/Llama-3-8B": (1.5, 40, 3, 0.75, 33312),
    "generic/Qwen2.5-0.5B": (1.5, 42, 3.75, 0.4286, 17424),
    "generic/Gemma-2-2B": (1.5, 36, 2.5, 0.75, 60480),
    "generic/Phi-3-mini": (1.5, 8, 2.25, 0.3, 5591.63),
    "adreno/Llama-3.2-1B": (1.5, 24, 3, 0.375, 10511.8),
    "adreno/Llama-3-8B": (1.5, 40, 3, 0.75, 33312),
    "adreno/Qwen2.5-0.5B": (1.5, 42, 3.75, 0.4286, 17424),
    "adreno/Gemma-2-2B": (1.5, 36, 2.5, 0.75, 60480),
    "adreno/Phi-3-mini": (1.5, 8, 2.25, 0.3, 5591.63),
    "adreno-6xx/Llama-3.2-1B": (3, 264, 6, 0.75, 114112),
    "adreno-6xx/Llama-3-8B": (2, 136, 4, 0.75, 115264),
    "adreno-6xx/Qwen2.5-0.5B": (6, 528, 12, 1.5, 228224),
    "adreno-6xx/Gemma-2-2B": (1.5, 36, 2.5, 0.75, 60480),
    "adreno-6xx/Phi-3-mini": (1.5, 8, 2.25, 0.3, 5591.63),
    "adreno-7xx/Llama-3.2-1B": (3, 264, 6, 0.75, 114112),
    "adreno-7xx/Llama-3-8B": (2, 136, 4, 0.75, 115264),
    "adreno-7xx/Qwen2.5-0.5B": (6, 528, 12, 1.5, 228224),
    "adreno-7xx/Gemma-2-2B": (1.5, 36, 2.5, 0.75, 60480),
    "adreno-7xx/Phi-3-mini": (1.5, 8, 2.25, 0.3, 5591.63),
    "adreno-8xx/Llama-3.2-1B": (1.5, 24, 3, 0.375, 10511.8),
    "adreno-8xx/Llama-3-8B": (1.5, 40, 3, 0.75, 33312),
    "adreno-8xx/Qwen2.5-0.5B": (1.5, 42, 3.75, 0.4286, 17424),
    "adreno-8xx/Gemma-2-2B": (1.5, 36, 2.5, 0.75, 60480),
    "adreno-8xx/Phi-3-mini": (1.5, 8, 2.25, 0.3, 5591.63),
    "mali/Llama-3.2-1B": (6, 16, 1, 0.125, 12944),
    "mali/Llama-3-8B": (6, 32, 1, 0.25, 38176),
    "mali/Qwen2.5-0.5B": (10.5, 28, 1.75, 0.1429, 22399.8),
    "mali/Gemma-2-2B": (3, 32, 0.5, 0.5, 63424),
    "mali/Phi-3-mini": (1.5, 6, 0.25, 0.2, 5519.63),
    "mali-bifrost/Llama-3.2-1B": (6, 16, 1, 0.125, 12944),
    "mali-bifrost/Llama-3-8B": (6, 32, 1, 0.25, 38176),
    "mali-bifrost/Qwen2.5-0.5B": (10.5, 28, 1.75, 0.1429, 22399.8),
    "mali-bifrost/Gemma-2-2B": (3, 32, 0.5, 0.5, 63424),
    "mali-bifrost/Phi-3-mini": (1.5, 6, 0.25, 0.2, 5519.63),
    "mali-valhall/Llama-3.2-1B": (6, 16, 1, 0.125, 12944),
    "mali-valhall/Llama-3-8B": (6, 32, 1, 0.25, 38176),
    "mali-valhall/Qwen2.5-0.5B": (10.5, 28, 1.75, 0.1429, 22399.8),
    "mali-valhall/Gemma-2-2B": (3, 32, 0.5, 0.5, 63424),
    "mali-valhall/Phi-3-mini": (1.5, 6, 0.25, 0.2, 5519.63),
    "powervr/Llama-3.2-1B": (1.5, 24, 3, 0.375, 10511.8),
    "powervr/Llama-3-8B": (1.5, 40, 3, 0.75, 33312),
    "powervr/Qwen2.5-0.5B": (1.5, 42, 3.75, 0.4286, 17424),
    "powervr/Gemma-2-2B": (1.5, 36, 2.5, 0.75, 60480),
    "powervr/Phi-3-mini": (1.5, 8, 2.25, 0.3, 5591.63),
    "intel-gpu/Llama-3.2-1B": (1.5, 24, 3, 0.1875, 10512),
    "intel-gpu/Llama-3-8B": (1.25, 16, 2.5, 0.1875, 10767.8),
    "intel-gpu/Qwen2.5-0.5B": (1.5, 42, 3.75, 0.2143, 17423.8),
    "intel-gpu/Gemma-2-2B": (1.125, 6, 2.125, 0.1875, 6287.75),
    "intel-gpu/Phi-3-mini": (1.5, 8, 2.25, 0.15, 6503.63),
    "nvidia/Llama-3.2-1B": (1.5, 24, 3, 0.09375, 10512),
    "nvidia/Llama-3-8B": (1.5, 40, 3, 0.1875, 33312),
    "nvidia/Qwen2.5-0.5B": (1.5, 42, 3.75, 0.1071, 17423.8),
    "nvidia/Gemma-2-2B": (1.5, 36, 2.5, 0.375, 60479),
    "nvidia/Phi-3-mini": (1.5, 8, 2.25, 0.07143, 6503.63),
    "amd/Llama-3.2-1B": (1.5, 24, 3, 0.1875, 10512),
    "amd/Llama-3-8B": (1.5, 40, 3, 0.375, 33312),
    "amd/Qwen2.5-0.5B": (1.5, 42, 3.75, 0.2143, 17423.8),
    "amd/Gemma-2-2B": (1.5, 36, 2.5, 0.75, 60480),
    "amd/Phi-3-mini": (1.5, 8, 2.25, 0.15, 6503.63),
    "apple/Llama-3.2-1B": (1.5, 24, 3, 0.1875, 10512),
    "apple/Llama-3-8B": (1.5, 40, 3, 0.375, 33312),
    "apple/Qwen2.5-0.5B": (1.5, 42, 3.75, 0.2143, 17423.8),
    "apple/Gemma-2-2B": (1.5, 36, 2.5, 0.75, 60480),
    "apple/Phi-3-mini": (1.5, 8, 2.25, 0.15, 6503.63),
}
BASELINE_FIELDS = ("global B/KV B", "local ld B/KV B", "local st B/KV B", "WG barriers/row",
                   "other instr/row")
IMPROVE = 4.0  # adreno*/mali*: local loads per KV byte and barriers per row 4x below BASELINE


def _figures(r: PerRow) -> tuple:
    return (r.per_kv_byte("global_load"), r.per_kv_byte("local_load"),
            r.per_kv_byte("local_store"), r.wg_barriers, r.counts.other)


def verdict(r: PerRow) -> dict:
    """The figures of one row against :data:`BASELINE` and the limits: the global-load
    limit (every profile) and the 4x cuts in local loads and barriers (adreno*, mali*)."""
    now = _figures(r)
    before = BASELINE.get(f"{r.profile}/{r.shape}")
    ratio = (lambda b, n: math.inf if n <= 0 else b / n)
    out = {"global": now[0], "global_ok": now[0] <= GLOBAL_LIMIT, "before": before, "now": now,
           "needs_cut": r.profile.startswith(("adreno", "mali"))}
    if before is not None:
        out["local_cut"] = ratio(before[1], now[1])
        out["barrier_cut"] = ratio(before[3], now[3])
    cut_ok = (not out["needs_cut"]) or (before is not None and out["local_cut"] >= IMPROVE
                                        and out["barrier_cut"] >= IMPROVE)
    out["ok"] = out["global_ok"] and cut_ok
    return out


def compare_table(rows: list[PerRow]) -> str:
    """Markdown table: today's counts next to :data:`BASELINE`, with the verdict."""
    lines = ["| profile | shape | global B/KV B before -> now | local ld B/KV B before -> now "
             "(cut) | WG barriers/row before -> now (cut) | other instr/row before -> now | "
             "done? |", "|" + "---|" * 7]
    for r in rows:
        v = verdict(r)
        b, n = v["before"], v["now"]
        if b is None:
            lines.append(f"| {r.profile} | {r.shape} | (no baseline) -> {_f(n[0], 3)} | "
                         f"-> {_f(n[1])} | -> {_f(n[3], 3)} | -> {_f(n[4])} | "
                         f"{'yes' if v['ok'] else 'no'} |")
            continue
        why = []
        if not v["global_ok"]:
            why.append(f"global > {GLOBAL_LIMIT}")
        if v["needs_cut"] and v["local_cut"] < IMPROVE:
            why.append("local cut < 4x")
        if v["needs_cut"] and v["barrier_cut"] < IMPROVE:
            why.append("barrier cut < 4x")
        lines.append(
            f"| {r.profile} | {r.shape} | {_f(b[0], 3)} -> {_f(n[0], 3)} | {_f(b[1])} -> "
            f"{_f(n[1])} ({_f(v['local_cut'], 1)}x) | {_f(b[3], 3)} -> {_f(n[3], 3)} "
            f"({_f(v['barrier_cut'], 1)}x) | {_f(b[4])} -> {_f(n[4])} | "
            f"{'yes' if v['ok'] else 'no: ' + ', '.join(why)} |")
    return "\n".join(lines)


def print_baseline(rows: list[PerRow]) -> str:
    """The :data:`BASELINE` literal for today's kernels."""
    return "\n".join(f'    "{r.profile}/{r.shape}": (' + ", ".join(
        f"{x:.6g}" if i == 4 else f"{x:.4g}" for i, x in enumerate(_figures(r))) + "),"
        for r in rows)


# ------------------------------------------------------------------ the report
def _f(x: float, nd: int = 2) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{nd}f}"


def counts_table(rows: list[PerRow]) -> str:
    """Markdown table: per KV row and per stored KV byte, for every profile x shape (and
    page format, the last column)."""
    head = ("| profile | shape | device record | geometry | glob B/row | glob B/KV B | "
            "of it K/V | local ld B/KV B | local st B/KV B | WG barriers/row | arith/row | "
            "other/row | f16 conv/row | pages |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        c = r.counts
        lines.append(
            f"| {r.profile} | {r.shape} | {r.record or '(none)'} | {r.geometry} | "
            f"{_f(c.global_load)} | {_f(r.per_kv_byte('global_load'), 3)} | "
            f"{_f(r.per_kv_byte('global_load_kv'), 3)} | {_f(r.per_kv_byte('local_load'))} | "
            f"{_f(r.per_kv_byte('local_store'))} | {_f(r.wg_barriers, 3)} | {_f(c.arith)} | "
            f"{_f(c.other)} | {_f(c.f16_conv)} | {r.fmt} |")
    return "\n".join(lines)


def model_table(rows: list[PerRow], devices: list[dict],
                contexts: Iterable[int] = CONTEXTS) -> str:
    """Markdown table: the modelled time per token per layer and its bound per device."""
    lines = ["| device | profile | shape | L | WGs | global us | local us | alu us | barrier us | "
             "bound | est. us | KV floor us |", "|" + "---|" * 12]
    for dev, r, L in device_rows(rows, devices, contexts):
        e = estimate(r, dev, L)
        t = e.times_us
        star = "*" if e.local_form else ""
        lines.append(f"| {dev['name']} | {r.profile} | {r.shape} | {L} | {e.work_groups} | "
                     f"{_f(t['global'], 1)} | {_f(t['local'], 1)}{star} | "
                     f"{_f(t['alu'], 1)}{star} | {_f(t['barrier'], 1)}{star} | "
                     f"{e.bound}{star} | {_f(e.time_us, 1)} | {_f(e.floor_us, 1)} |")
    return "\n".join(lines)


def report(profiles: Iterable[str] | None = None, shapes: Iterable[str] | None = None, *,
           jobs: int = 2, cache: bool = True, contexts: Iterable[int] = CONTEXTS,
           base_rows: int = BASE_ROWS, formats: Iterable[str] = FORMATS) -> str:
    """The counts and the model as text (Markdown tables), for ``tools/bench.py``.

    The first call runs Oclgrind for every distinct kernel (minutes on two cores); the
    counts are cached under ``~/.cache/clattn/gpu_model`` by kernel source and launch.
    ``formats``: the page formats counted (f16 always; the limits, the baseline and the
    split-KV tables are f16's, the quantized ones have a table of their own).
    """
    formats = tuple(dict.fromkeys((DTYPE, *formats)))
    every = count_all(profiles, shapes, jobs=jobs, cache=cache, base_rows=base_rows,
                      formats=formats)
    rows = [r for r in every if r.fmt == DTYPE]
    devices = load_devices()
    notes = []
    for r in rows:
        for n in r.notes:
            line = f"- {r.profile} x {r.shape}: {n}"
            if line not in notes:
                notes.append(line)
    over = [r for r in rows if r.per_kv_byte("global_load") > GLOBAL_LIMIT]
    out = [
        "## Counted work per KV row (Oclgrind, f16 q and out, one sequence; a KV row = one "
        "token's K and V of one KV head; per KV byte: per byte stored in the row's format)",
        "",
        counts_table(every),
        "",
        f"Global loads above {GLOBAL_LIMIT} bytes per KV byte (the limit): "
        f"{len(over)} of {len(rows)}"
        + (" (" + ", ".join(f"{r.profile}/{r.shape} {r.per_kv_byte('global_load'):.2f}"
                            for r in over[:6]) + (", ..." if len(over) > 6 else "") + ")"
           if over else ""),
        "",
        "## Before (baseline templates of commit dd74fba) and now: the limits' verdict",
        "",
        compare_table(rows),
        "",
        "## Modelled time per token per layer (B=1; tools/gpu_devices.json)",
        "",
        model_table(rows, devices, contexts),
        "",
        "Times in microseconds per token per layer (every KV head, one sequence of L rows); "
        "each resource at its full rate over the busy share of the cores; the largest is the "
        "bound. `*`: the device reduces through sub-groups, counted here in the local-memory "
        "form, so local, alu and barrier are upper bounds. KV floor: each KV byte read once "
        "at the DRAM bandwidth.",
        "",
        "## Split-KV on the model (B=1; decode + merge pass; the planner vs the model's best)",
        "",
        split_table(rows, devices, contexts),
        "",
        f"The merge pass: the partitions' f32 states read and the output written at the DRAM "
        f"bandwidth, plus {LAUNCH_US:.0f} us for its launch (an educated guess). The planner "
        f"follows the model where its plan is within {FOLLOW_TOLERANCE:.2f}x of the best "
        f"partition count the model finds among {', '.join(map(str, SPLIT_CANDIDATES))} "
        f"(partitions of at least the profile's min_partition_rows: the counts leave out "
        f"each work-group's fixed cost, which decides shorter ones).",
        "",
        *([f"## Quantized pages on the model (B=1, L={CONTEXTS[-1]}; issue 40's targets: "
           + ", ".join(f"{k} at most {v:.2f}x f16's time" for k, v in QUANT_TARGETS.items())
           + ", where decode waits on memory)",
           "",
           format_table(every, devices),
           "",
           "x f16: the modelled time over f16 pages' on the same device and shape. Global "
           "at the floor: both times with each stored byte read once from DRAM (lanes that "
           "load the same block scale or q4_0 byte in one instruction are one access on a "
           "GPU's memory system; the counted bytes count every lane's). Met: yes with the "
           "counted bytes, at the floor with the floor only.",
           ""] if len(formats) > 1 else []),
        "## Notes on the counted kernels",
        "",
        *(notes or ["- none"]),
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", help="comma-separated (default: every tiled built-in)")
    ap.add_argument("--shapes", help="comma-separated (default: " + ", ".join(SHAPES) + ")")
    ap.add_argument("--formats", help="page formats, comma-separated (default: "
                    + ", ".join(FORMATS) + ")")
    ap.add_argument("--jobs", type=int, default=2, help="Oclgrind processes at once (2)")
    ap.add_argument("--no-cache", action="store_true", help="count again")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--print-baseline", action="store_true",
                    help="print the BASELINE literal for today's kernels and stop")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _run_child(json.loads(sys.stdin.read()))
        return 0
    profiles, shapes = csv(a.profiles), csv(a.shapes)
    formats = tuple(csv(a.formats) or FORMATS)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"--formats: {', '.join(unknown)} not among {', '.join(FORMATS)}")
    if a.print_baseline:
        print(print_baseline(count_all(profiles, shapes, jobs=a.jobs, cache=not a.no_cache)))
        return 0
    print(report(profiles, shapes, jobs=a.jobs, cache=not a.no_cache, formats=formats))
    if a.json:
        rows = count_all(profiles, shapes, jobs=a.jobs, cache=True, formats=formats)
        devs = load_devices()
        est = [asdict(estimate(r, d, L)) for d in devs for r in rows
               if r.profile == device_profile(d) for L in CONTEXTS]
        Path(a.json).write_text(json.dumps({"rows": [asdict(r) for r in rows],
                                            "estimates": est}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
