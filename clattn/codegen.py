"""Launch geometry and template rendering: (spec, profile, device limits) -> OpenCL C.

One function computes the geometry that both the template parameters and the
launch grid come from, so the two cannot disagree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from mako.lookup import TemplateLookup

from .profiles.record import Profile
from .rope import parse_rope_scaling
from .spec import AttentionSpec

FLOAT = 4  # bytes of an f32 in local memory


def kernels_dir() -> Path:
    """The kernel templates: inside the installed package, or the source tree's kernels/."""
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels", here.parent / "kernels"):
        if (cand / "decode.cl.mako").is_file():
            return cand
    raise FileNotFoundError(f"clattn kernel templates not found next to {here}")


@lru_cache(maxsize=1)
def _lookup() -> TemplateLookup:
    return TemplateLookup(directories=[str(kernels_dir())], strict_undefined=True)


@dataclass(frozen=True)
class Limits:
    """The device limits the geometry must respect (None = unknown, not enforced)."""

    max_work_group_size: int = 256
    max_work_item_sizes: tuple = (256, 256, 256)
    local_mem_size: int = 32768
    has_fp16: bool = False
    subgroup_sizes: tuple = ()  # sizes a kernel may require (Intel's required sub-group size)
    denorms: bool = False  # single precision keeps subnormals (CL_FP_DENORM)

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> "Limits":
        """From a device-info dict (``clattn.profiles.device_info``'s field names)."""
        exts = info.get("device_extensions") or []
        sizes: tuple = ()
        if "cl_intel_required_subgroup_size" in exts:
            sizes = tuple(int(s) for s in (info.get("sub_group_sizes") or ()))
        return cls(
            max_work_group_size=int(info.get("max_work_group_size") or 256),
            max_work_item_sizes=tuple(int(x) for x in (info.get("max_work_item_sizes") or (256,) * 3)),
            local_mem_size=int(info.get("local_mem_size_bytes") or 16384),
            has_fp16=bool(info.get("has_fp16")),
            subgroup_sizes=sizes,
        )


@dataclass(frozen=True)
class DecodeGeometry:
    """Everything the decode template and its launch need besides the spec."""

    strategy: str
    vec: int
    tile: int
    bdx: int = 1
    bdy: int = 1
    bdz: int = 1
    gdz: int = 1
    use_local: bool = False
    reduction: str = "local"
    subgroup_size: int | None = None
    native_fp16: bool = False
    local_mem_bytes: int = 0
    denorms: bool = False
    notes: tuple = field(default=(), compare=False)

    def local_size(self) -> tuple[int, int, int]:
        return (1, 1, 1) if self.strategy == "rows" else (self.bdx, self.bdy, self.bdz)

    def global_size(self, batch: int, num_kv_heads: int, num_parts: int) -> tuple[int, int, int]:
        if self.strategy == "rows":
            return (batch, num_kv_heads, num_parts)
        return (batch * self.bdx, num_kv_heads * self.gdz * self.bdy, num_parts * self.bdz)


def _vec_for(d: int, want: int) -> int:
    v = want
    while v > 1 and d % v:
        v //= 2
    return v


def _tiled_local_bytes(d: int, bdx: int, bdy: int, bdz: int, tile: int, use_local: bool,
                       reduction: str) -> int:
    rows = bdy * bdz * tile
    total = bdz * bdy * d + bdz * bdy * 2  # o_red, md_red
    if use_local:
        total += 2 * rows * d
    if reduction != "subgroup":
        total += bdz * bdy * (bdy * tile) * bdx
    return total * FLOAT


def decode_geometry(spec: AttentionSpec, profile: Profile, limits: Limits) -> DecodeGeometry:
    """Fit the profile's wishes to the spec and the device's limits."""
    notes: list[str] = []
    native = bool(profile.native_fp16 and limits.has_fp16 and spec.dtype == "float16")
    if profile.strategy == "rows":
        tile = 1 << (min(max(1, profile.tile_rows), 16).bit_length() - 1)  # 1, 2, 4, 8 or 16
        return DecodeGeometry("rows", _vec_for(spec.head_dim, profile.vec), tile,
                              native_fp16=native,
                              denorms=limits.denorms)
    D, G = spec.head_dim, spec.group_size
    limit = max(1, min(profile.thread_limit, limits.max_work_group_size))
    vec = _vec_for(D, profile.vec)
    while D // vec > min(limit, limits.max_work_item_sizes[0]) and vec < 16 and D % (vec * 2) == 0:
        vec *= 2
    bdx = D // vec
    if bdx > limit:
        raise ValueError(f"head_dim={D} needs {bdx} work-items at vec={vec}, more than the "
                         f"device's work-group limit {limit}")
    bdy = max(1, min(G, limit // bdx, limits.max_work_item_sizes[1]))
    gdz = math.ceil(G / bdy)
    bdy = math.ceil(G / gdz)  # balance the head slices (G=7 over 2 slices: 4 + 3)
    bdz = max(1, min(limit // (bdx * bdy), limits.max_work_item_sizes[2]))
    tile = max(1, profile.tile_rows) if G == 1 else 1
    use_local = profile.use_local_kv
    reduction, sgs = "local", None
    if profile.reduction == "subgroup":
        if bdx in limits.subgroup_sizes:
            reduction, sgs = "subgroup", bdx
        else:
            notes.append(f"subgroup reduction needs a required sub-group size of {bdx}; the device "
                         f"offers {list(limits.subgroup_sizes) or 'none'}: using local memory")

    def need() -> int:
        return _tiled_local_bytes(D, bdx, bdy, bdz, tile, use_local, reduction)

    while need() > limits.local_mem_size and (bdz > 1 or tile > 1 or use_local):
        if tile > 1:
            tile //= 2
        elif bdz > 1:
            bdz //= 2
        else:
            use_local = False
            notes.append("K/V tiles do not fit local memory: reading them from global memory")
    if need() > limits.local_mem_size:
        raise ValueError(f"decode kernel for head_dim={D}, group={G} needs {need()} bytes of "
                         f"local memory; the device has {limits.local_mem_size}")
    return DecodeGeometry("tiled", vec, tile, bdx=bdx, bdy=bdy, bdz=bdz, gdz=gdz,
                          use_local=use_local, reduction=reduction, subgroup_size=sgs,
                          native_fp16=native, local_mem_bytes=need(), notes=tuple(notes))


@dataclass(frozen=True)
class MergeGeometry:
    strategy: str
    vec: int
    mh: int = 1  # heads per work-group (tiled)
    threads: int = 64  # work-items striding over the rows (rows)
    native_fp16: bool = False
    denorms: bool = False

    def sizes(self, nh: int, head_dim: int) -> tuple[tuple, tuple]:
        """(global, local) sizes for ``nh`` (state, head) pairs."""
        if self.strategy == "rows":  # work-groups of one, each striding over rows
            return (max(1, min(nh, self.threads)),), (1,)
        nv = head_dim // self.vec
        return (nv, math.ceil(max(nh, 1) / self.mh) * self.mh), (nv, self.mh)


def merge_geometry(head_dim: int, dtype: str, profile: Profile, limits: Limits) -> MergeGeometry:
    limit = max(1, min(profile.merge_threads, limits.max_work_group_size))
    native = bool(profile.native_fp16 and limits.has_fp16 and dtype == "float16")
    vec = _vec_for(head_dim, profile.vec)
    if profile.strategy == "rows":
        return MergeGeometry("rows", vec, threads=limit, native_fp16=native,
                             denorms=limits.denorms)
    while head_dim // vec > min(limit, limits.max_work_item_sizes[0]) and vec < 16 and \
            head_dim % (vec * 2) == 0:
        vec *= 2
    nv = head_dim // vec
    if nv > min(limits.max_work_group_size, limits.max_work_item_sizes[0]):
        raise ValueError(f"head_dim={head_dim} needs {nv} work-items at vec={vec} for the merge, "
                         f"more than the device's work-group limit")
    mh = max(1, min(limit // nv, limits.max_work_item_sizes[1]))
    return MergeGeometry("tiled", vec, mh=mh, native_fp16=native)


def _cl_dtype(dtype: str) -> str:
    return "half" if dtype == "float16" else "float"


def render_decode(spec: AttentionSpec, geom: DecodeGeometry) -> str:
    """OpenCL C source of the decode kernel for ``spec`` with geometry ``geom``."""
    scaling = parse_rope_scaling(spec.rope_scaling, spec.max_position_embeddings)
    return _lookup().get_template("decode.cl.mako").render(
        D=spec.head_dim, HQO=spec.num_qo_heads, HKV=spec.num_kv_heads, G=spec.group_size,
        PS=spec.page_size, ROT=spec.rotary_dim, INTERLEAVED=scaling.interleaved,
        SLIDING=spec.sliding_window, SOFTCAP=spec.softcap, DTYPE=_cl_dtype(spec.dtype),
        DENORMS=geom.denorms,
        NATIVE_HALF=geom.native_fp16, STRATEGY=geom.strategy, VEC=geom.vec, TILE=geom.tile,
        BDX=geom.bdx, BDY=geom.bdy, BDZ=geom.bdz, GDZ=geom.gdz, USE_LOCAL=geom.use_local,
        REDUCE=geom.reduction, SGS=geom.subgroup_size)


def render_merge(head_dim: int, dtype: str, vin: str, geom: MergeGeometry) -> str:
    """OpenCL C source of the merge kernels (``vin``: dtype of the states merged)."""
    return _lookup().get_template("merge.cl.mako").render(
        D=head_dim, DTYPE=_cl_dtype(dtype), VIN=_cl_dtype(vin), NATIVE_HALF=geom.native_fp16,
        DENORMS=geom.denorms,
        STRATEGY=geom.strategy, VEC=geom.vec, MH=geom.mh)
