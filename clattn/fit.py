"""Fitting a profile to a spec and a device: (spec, profile, device limits) -> geometry.

The geometry is everything a kernel template and its launch need besides the spec;
both the template parameters and the launch grid come from it, so they cannot disagree.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .profiles.device_info import extension_names, subgroup_support
from .profiles.record import Profile
from .rope import parse_rope_scaling
from .spec import AttentionSpec

FLOAT = 4  # bytes of an f32 in local memory


#: how a kernel can ask for a sub-group size: the extension, its attribute, its pragma
SUBGROUP_REQUESTS = {
    "intel": ("cl_intel_required_subgroup_size", "intel_reqd_sub_group_size({n})", None),
    "qcom": ("cl_qcom_reqd_sub_group_size", 'qcom_reqd_sub_group_size("{mode}")',
             "cl_qcom_reqd_sub_group_size"),
}
#: Adreno's two wave modes and their sub-group sizes (Adreno 6xx and later)
QCOM_WAVES = {64: "half", 128: "full"}


#: platforms whose compiler cannot build the rows kernels with wider float vectors unless
#: it compiles for a CPU with AVX-512 (:func:`pocl_target_cpu` names it): PoCL reports a
#: native float width of 16 on every AVX-512 host, but its LLVM compiles for the CPU it
#: knows the host as; where that CPU lacks avx512f (PyPI's PoCL, LLVM 14, knows a Zen 4 as
#: znver3), LLVM aborts the process on 16-float vectors ("Do not know how to split this
#: operator's operand") or miscompiles them (measured on a Zen 4)
ROWS_VEC_CAPS = {"Portable Computing Language": 8}
#: LLVM CPU names whose instruction set includes AVX-512F: a PoCL compiling for one of
#: them keeps 16-float vectors (measured right and faster: 1.7-1.9x in the rows prefill on
#: a Zen 5 under Debian's PoCL, skylake-avx512; PyPI's PoCL on a Sapphire Rapids Xeon,
#: which its LLVM 14 knows as rocketlake)
AVX512_CPUS = frozenset({
    "knl", "knm", "skylake-avx512", "skx", "cascadelake", "cooperlake", "cannonlake",
    "icelake-client", "icelake-server", "tigerlake", "rocketlake", "sapphirerapids",
    "emeraldrapids", "graniterapids", "graniterapids-d", "diamondrapids", "znver4", "znver5",
    "x86-64-v4",
})
_HSTR = re.compile(r"HSTR:\s*(\S+)")
#: the environment part of a target triple that can follow ``linux``
_TRIPLE_ENVS = frozenset({"gnu", "musl", "android", "gnueabihf", "gnueabi", "eabi", "eabihf"})

#: local memory assumed where a device record does not report it: the least OpenCL requires
#: of a device that is not of type CL_DEVICE_TYPE_CUSTOM
UNREPORTED_LOCAL_MEM = 32768


def pocl_target_cpu(info: Mapping[str, Any]) -> str | None:
    """The LLVM CPU a PoCL device compiles for, or None where the record does not say.

    PoCL's device version ends in ``HSTR: pthread-<triple>-<cpu>``
    (``pthread-x86_64-unknown-linux-gnu-rocketlake``: the CPU follows the triple's
    ``linux`` and its environment); Debian's builds also name the CPU in the device name
    (``pthread-skylake-avx512``), which is read when the version does not.
    """
    m = _HSTR.search(str(info.get("device_version") or ""))
    if m:
        parts = m.group(1).lower().split("-")
        if "linux" not in parts:
            return None
        rest = parts[parts.index("linux") + 1:]
        if rest and rest[0] in _TRIPLE_ENVS:
            rest = rest[1:]
        return "-".join(rest) or None
    name = str(info.get("device_name") or "").lower()
    for cpu in sorted(AVX512_CPUS, key=len, reverse=True):
        if name.startswith(f"pthread-{cpu}"):
            return cpu
    return None


#: the rows prefill settings a tiled profile falls back to on a device without the tiled
#: prefill (a loop budget: llvmpipe), and every tiled profile builds the same one kernel
#: there: long key blocks run few loop iterations per key (many keys per work unit within
#: the budget), and vectors of 2 floats: llvmpipe's compiler takes minutes over this
#: kernel at 4 or 8 and seconds at 2, for the same run time and about half the keys per
#: unit of 8 (tools/RESULTS.md, "The test run")
LLVMPIPE_PREFILL_ROWS = {"prefill_vec": 2, "prefill_kb": 16}


def _is_llvmpipe(info: Mapping[str, Any]) -> bool:
    """Whether ``info`` is Mesa's llvmpipe (rusticl or Clover on the host CPU)."""
    return "llvmpipe" in str(info.get("device_name") or "").lower()


def _rows_max_vec(info: Mapping[str, Any]) -> int:
    """The widest float vector the rows kernels may use on the device of ``info``."""
    cap = ROWS_VEC_CAPS.get(str(info.get("platform_name")))
    if cap is None or pocl_target_cpu(info) in AVX512_CPUS:
        return 16
    return cap


@dataclass(frozen=True)
class Limits:
    """The device facts the geometry must respect.

    ``subgroups``: ``"intel"`` or ``"qcom"`` (sub-group functions and a way to require
    the size, ``subgroup_sizes`` listing the sizes that can be required), ``"free"``
    (sub-group functions, the size chosen by the compiler), ``"none"``, or ``"unknown"``
    (the device record lists no extensions).
    """

    max_work_group_size: int = 256
    max_work_item_sizes: tuple = (256, 256, 256)
    local_mem_size: int = UNREPORTED_LOCAL_MEM
    has_fp16: bool = False
    subgroups: str = "none"
    subgroup_sizes: tuple = ()
    khr_subgroups: bool = False  # cl_khr_subgroups: its pragma enables the functions
    denorms: bool = False  # single precision keeps subnormals (CL_FP_DENORM)
    #: the compiler converts clang's ``__fp16`` storage type exactly (clattn.compiler_probe)
    storage_half: bool = False
    #: the compiler builds and runs ``__builtin_prefetch`` (clattn.compiler_probe)
    prefetch: bool = False
    #: widest float vector the rows kernels may use (see ROWS_VEC_CAPS)
    rows_max_vec: int = 16
    #: CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT (1: not reported)
    native_float: int = 1
    #: the fit may give the prefill the tiled kernel: not on a device with a loop budget
    #: (Mesa's llvmpipe, whose first launch of it left query rows unwritten), where only
    #: the rows kernel's iterations are bounded (clattn.loop_budget)
    tiled_prefill: bool = True
    #: loop iterations a work-item may run in all, every loop together, before the
    #: device ends its loops unannounced (clattn.loop_budget; 0: no budget)
    loop_budget: int = 0

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> "Limits":
        """From a device-info dict (``clattn.profiles.device_info``'s field names)."""
        names, complete = extension_names(info)
        support = subgroup_support(info)
        sizes: tuple = ()
        if support is None:
            kind = "unknown"
        elif not support:
            kind = "none"
        elif SUBGROUP_REQUESTS["intel"][0] in names:
            kind = "intel"
            sizes = tuple(int(s) for s in (info.get("sub_group_sizes") or ()))
        elif SUBGROUP_REQUESTS["qcom"][0] in names:
            kind, sizes = "qcom", tuple(QCOM_WAVES)
        else:
            kind = "free"
        return cls(
            max_work_group_size=int(info.get("max_work_group_size") or 256),
            max_work_item_sizes=tuple(int(x) for x in
                                      (info.get("max_work_item_sizes") or (256,) * 3)),
            # not reported (an incomplete record): OpenCL's minimum for a device that is
            # not of type CUSTOM, 32 KiB (CL_DEVICE_LOCAL_MEM_SIZE)
            local_mem_size=int(info.get("local_mem_size_bytes") or UNREPORTED_LOCAL_MEM),
            rows_max_vec=_rows_max_vec(info),
            native_float=int(info.get("native_vector_width_float") or 1),
            has_fp16=bool(info.get("has_fp16")),
            subgroups=kind, subgroup_sizes=sizes, khr_subgroups="cl_khr_subgroups" in names,
            tiled_prefill=not _is_llvmpipe(info),
        )


@dataclass(frozen=True)
class DecodeGeometry:
    """Everything the decode template and its launch need besides the spec.

    ``vec`` floats per load; ``tile`` rows per block (rows) or per row slice per step
    (tiled). rows only: ``vec_rope`` (keys rotated a vector at a time), ``v_chunks``
    (head_dim chunks of V accumulated per pass) and ``prefetch`` (blocks ahead whose K and
    V rows are prefetched; 0: none). Both: ``gdz`` head slices per KV head (each
    work-item serves the ``ceil(G / gdz)`` query heads of its head slice). tiled only:
    the work-group shape ``bdx x bdy x bdz`` (head_dim lanes x 1 x row slices),
    ``use_local`` (K/V staged in local memory: never, the tiled kernel keeps them in
    registers), ``reduction`` and the required ``subgroup_size`` with the
    ``subgroup_attr`` and ``pragmas`` that request it.
    ``notes``: every wish of the profile that was cut, with its reason.
    """

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
    subgroup_attr: str = ""
    pragmas: tuple = ()
    native_fp16: bool = False
    local_mem_bytes: int = 0
    denorms: bool = False
    storage_half: bool = False  # f16 converted through clang's __fp16 (rows kernels)
    vec_rope: bool = False
    v_chunks: int = 1
    prefetch: int = 0
    notes: tuple = field(default=(), compare=False)

    def local_size(self) -> tuple[int, int, int]:
        return (1, 1, 1) if self.strategy == "rows" else (self.bdx, self.bdy, self.bdz)

    def global_size(self, batch: int, num_kv_heads: int, num_parts: int) -> tuple[int, int, int]:
        if self.strategy == "rows":
            return (batch, num_kv_heads * self.gdz, num_parts)
        return (batch * self.bdx, num_kv_heads * self.gdz * self.bdy, num_parts * self.bdz)

    @property
    def threads(self) -> int:
        """Work-items per work-group."""
        return self.bdx * self.bdy * self.bdz


def _vec_for(d: int, want: int, cap: int = 16) -> int:
    v = 1 << (max(1, min(want, cap)).bit_length() - 1)  # a power of two: OpenCL's widths
    while v > 1 and d % v:
        v //= 2
    return v


def _widths(spec: AttentionSpec) -> tuple[int, str]:
    """The width every vector of a kernel must divide (head_dim, and head_dim_v where it
    differs) and its text for the notes."""
    if not spec.split_widths:
        return spec.head_dim, f"head_dim {spec.head_dim}"
    return math.gcd(spec.head_dim, spec.head_dim_v), \
        f"head_dim {spec.head_dim} and head_dim_v {spec.head_dim_v}"


#: the rows decode's vector width is cut to the device's native float width, but never
#: below this: 8 keeps its measured default on AVX2 (two NEON registers elsewhere), 16 is
#: taken where the compiler targets AVX-512 (measured on a Sapphire Rapids Xeon, 16k
#: tokens, f16 pages: 0.86-0.93x the time of 8 on both PoCL builds and Intel's runtime)
ROWS_MIN_NATIVE_VEC = 8


def _rows_decode_vec(spec: AttentionSpec, profile: Profile, limits: Limits,
                     notes: list) -> int:
    """The rows decode's vector width: the profile's ``vec``, at most the device's native
    float width where that is ROWS_MIN_NATIVE_VEC or more, then :func:`_rows_vec`'s cuts
    (the compiler's widest vector, a power of two dividing the rows). A width the device
    and the shape derive is documented for ``vec``, not noted: a cut is noted only below
    what the profile asked up to ROWS_MIN_NATIVE_VEC (so that the CPU profiles' 16 warns of
    nothing where AVX2, PyPI's PoCL on a Zen 4 or a head_dim of 40 takes 8)."""
    want = min(profile.vec, max(limits.native_float, ROWS_MIN_NATIVE_VEC))
    cuts: list = []
    vec = _rows_vec(spec, want, limits, cuts)
    if vec < min(profile.vec, ROWS_MIN_NATIVE_VEC):
        notes.extend(cuts)
    return vec


def _rows_vec(spec: AttentionSpec, want: int, limits: Limits, notes: list,
              name: str = "vec") -> int:
    """The rows kernels' vector width: the profile's (field ``name``), cut to divide
    the rows of ``spec`` (:func:`_widths`) and to what the device's compiler builds
    (``limits.rows_max_vec``); each cut noted."""
    d, text = _widths(spec)
    vec = _vec_for(d, want, limits.rows_max_vec)
    if want > limits.rows_max_vec:
        notes.append(f"{name} {want} -> {vec}: this platform's compiler builds the rows "
                     f"kernels with at most {limits.rows_max_vec} floats per vector")
    elif vec != want:
        notes.append(f"{name} {want} -> {vec}: {text}")
    return vec


#: tiled decode: query heads a work-item serves at most (q, running state and accumulator
#: of each in registers); a larger group is split over ``gdz`` work-groups per KV head
TILED_MAX_HEADS = 8

#: tiled decode: (row, head) scores a work-item keeps at most per step (``tile x heads``)
TILED_MAX_SCORES = 32

#: rows decode: a block of more than ROWS_SMALL_BLOCK rows (scored as vectors of at most
#: ``vec`` lanes, each block paying one softmax step and one page walk per head) is kept
#: only while its K and V rows take at most ROWS_BLOCK_BYTES. Measured on PoCL and Intel's
#: runtime (Zen 4, 16k tokens, 16 rows against 8): 1.02-1.15x where 16 rows take 4-8 KiB
#: (Qwen2.5-0.5B, Llama-3.2-1B, Llama-3-8B f16, Phi-3 f16), 0.85-0.95x at 12-16 KiB
#: (Llama-3-8B and Phi-3 f32, Gemma-2 f16: 0.82-0.90x)
ROWS_SMALL_BLOCK = 8
ROWS_BLOCK_BYTES = 8192
#: rows decode: a work-item that does at least this many multiply-adds per byte of its KV
#: rows keeps blocks of 16 rows whatever their bytes (each block's softmax step, paid per
#: head, spread over more rows outweighs the block's cache footprint). The rows
#: ROWS_BLOCK_BYTES was measured on do 0.25-1 per byte; the latent MLA rows do 15
#: (DeepSeek-V2-Lite: 16 heads x (576 + 512) per 1152 bytes) and 19 (MiniCPM3 in 2 head
#: slices: 20 x (288 + 256) per 576), and measured 1.07-1.16x faster with 16 rows than 8
#: (2-core Sapphire Rapids, PyPI's PoCL and Intel's runtime, 4k and 16k rows)
ROWS_DENSE_MACS_PER_BYTE = 8

#: rows decode: the prefetch runs this many multiply-adds (G x head_dim per row) ahead of
#: the block being computed, in whole blocks, at least one and at most PREFETCH_MAX_BLOCKS:
#: one block of Llama-3-8B's shape (group 4, head_dim 128, 8 rows) is enough, Llama-3.2-1B's
#: (head_dim 64) needs two (measured on PoCL, 16k tokens: 2.0x faster than one block in f16
#: and f32), Phi-3's (group 1) gains 8-14% from two and nothing more from four
PREFETCH_MACS = 4096
PREFETCH_MAX_BLOCKS = 2


def slice_heads(G: int, gdz: int) -> int:
    """Query heads of a head slice (``ceil(G / gdz)``), a work-item's of either decode
    kernel."""
    return -(-G // gdz)


@dataclass(frozen=True)
class TiledLocal:
    """The tiled decode kernel's local memory, read by its fit and its template.

    One float array, ``scratch``: in the row loop (local-memory reduction only) the
    partial dot products ``[bdz][tile x heads][bdx]`` from 0 and their sums
    ``[bdz][tile x heads]`` from ``partials``; after the loop, reused, the row slices'
    states ``[bdz][heads][d]`` from 0 and their ``(m, d)`` pairs from ``states``. Beside
    it, ``pages`` ints: the pages of the step's rows (local-memory reduction only).
    """

    partials: int  # floats of the partial dot products (the sums start there)
    loop: int  # floats of the row loop: partials and their sums
    states: int  # floats of the slices' states (their (m, d) pairs start there)
    merge: int  # floats of the merge: states and pairs
    pages: int  # ints of the step's pages

    @property
    def scratch(self) -> int:
        """Floats of the shared array (the loop's and the merge's, reused)."""
        return max(self.loop, self.merge)

    @property
    def bytes(self) -> int:
        """Local memory of the kernel, in bytes."""
        return FLOAT * (self.scratch + self.pages)


def tiled_local(d: int, bdx: int, bdz: int, tile: int, heads: int,
                reduction: str) -> TiledLocal:
    """The :class:`TiledLocal` layout of the tiled decode kernel at this geometry:
    ``bdz x tile`` rows per step, ``heads`` query heads per work-item, the dot products
    reduced through local memory unless ``reduction`` is ``"subgroup"``; ``d`` is the
    states' width (the value head size, ``head_dim_v``)."""
    rows = bdz * tile
    local_red = reduction != "subgroup"
    partials = rows * heads * bdx if local_red else 0
    return TiledLocal(partials=partials,
                      loop=partials + rows * heads if local_red else 0,
                      states=bdz * heads * d, merge=bdz * heads * (d + 2),
                      pages=rows if local_red else 0)


def tiled_local_bytes(d: int, bdx: int, bdz: int, tile: int, heads: int,
                      reduction: str) -> int:
    """Local memory of the tiled decode kernel in bytes (:func:`tiled_local`)."""
    return tiled_local(d, bdx, bdz, tile, heads, reduction).bytes


def rows_vector_registers(vec: int) -> int:
    """Vector registers the rows decode's value pass may fill at ``vec`` floats per vector.

    16-float vectors are AVX-512's, which has 32 registers; every narrower CPU vector
    is taken as 16 registers (AVX2's count, fewer than NEON's 32). Measured: 16 registers
    at 8k tokens, one core: group 2 4% faster with 4 chunks than with 2, group 1 2-5%
    with 6; 8 at group 2 spills, 20% slower. 32 registers at 16k tokens, 2 cores (Sapphire
    Rapids, PyPI's PoCL and Intel's runtime): group 7 head_dim 64 (Qwen2.5-0.5B) 1.08x
    faster with 4 chunks than with 1, group 4 head_dim 64 1.04-1.07x with 4 than with 2;
    head_dim 128 and 256 the same.
    """
    return 32 if vec >= 16 else 16


def rows_head_slices(group_size: int, vec: int) -> int:
    """Head slices per KV head of the rows decode at ``vec`` floats per vector: the fewest
    whose heads' partial dot products and a key chunk fit the vector registers
    (:func:`rows_vector_registers`). Each slice reads its KV rows again, so a group is
    cut only where its scores would spill (of the models clattn knows, the latent forms
    of multi-head latent attention, one KV head for all query heads). Measured on 2 cores
    (Sapphire Rapids, PyPI's PoCL and Intel's runtime, 4096 rows, f16): MiniCPM3's latent
    form (40 heads) 1.47-1.57x faster in 2 slices, 1.51-1.59x in 4; DeepSeek-V2-Lite's
    (16 heads) 0.95-1.10x in 2, so it stays whole under 32 registers."""
    return -(-group_size // (rows_vector_registers(vec) - 1))


def _prefetch_blocks(spec: AttentionSpec, tile: int, heads: int) -> int:
    """Blocks ahead the rows decode prefetches (see PREFETCH_MACS) for a work-item of
    ``heads`` query heads."""
    per_block = heads * spec.head_dim * tile
    return max(1, min(PREFETCH_MAX_BLOCKS, round(PREFETCH_MACS / per_block)))


def _rows_tile(spec: AttentionSpec, want: int, heads: int, notes: list) -> int:
    """Rows per block of the rows decode for a work-item of ``heads`` query heads: the
    profile's, a power of two up to 16 (a cut noted), and more than ROWS_SMALL_BLOCK only
    while their K and V rows fit in ROWS_BLOCK_BYTES or the work-item does at least
    ROWS_DENSE_MACS_PER_BYTE multiply-adds per byte of them (sizes the shape derives, as
    documented for ``tile_rows``: not noted, so that the default profile warns of
    nothing)."""
    tile = 1 << (min(max(1, want), 16).bit_length() - 1)
    if tile != want:
        notes.append(f"tile_rows {want} -> {tile}: the rows kernel takes a power of two up "
                     f"to 16")
    per_row = spec.bytes_per_token / spec.num_kv_heads
    dense = heads * (spec.head_dim + spec.head_dim_v) >= ROWS_DENSE_MACS_PER_BYTE * per_row
    while tile > ROWS_SMALL_BLOCK and tile * per_row > ROWS_BLOCK_BYTES and not dense:
        tile //= 2
    return tile


def _rows_geometry(spec: AttentionSpec, profile: Profile, limits: Limits,
                   native: bool) -> DecodeGeometry:
    notes: list = []
    vec_notes: list = []
    vec = _rows_decode_vec(spec, profile, limits, vec_notes)
    gdz = rows_head_slices(spec.group_size, vec)
    heads = slice_heads(spec.group_size, gdz)   # a slice's query heads
    tile = _rows_tile(spec, profile.tile_rows, heads, notes)
    notes += vec_notes
    interleaved = parse_rope_scaling(spec.rope_scaling, spec.max_position_embeddings).interleaved
    half = spec.rotary_dim // 2
    vec_rope = (not interleaved and half % vec == 0) or \
        (interleaved and vec % 2 == 0 and spec.rotary_dim % vec == 0)
    nv = spec.head_dim_v // vec   # chunks of a V row
    # as many chunks per pass (up to 8, dividing nv) as keep their accumulators (one per
    # head of the slice), a value and a weight in the vector registers
    regs = rows_vector_registers(vec)
    v_chunks = max((c for c in range(1, 9) if nv % c == 0 and c * heads + 3 <= regs),
                   default=1)
    return DecodeGeometry("rows", vec, tile, gdz=gdz, native_fp16=native,
                          denorms=limits.denorms, storage_half=limits.storage_half,
                          prefetch=_prefetch_blocks(spec, tile, heads) if limits.prefetch else 0,
                          vec_rope=vec_rope, v_chunks=v_chunks, notes=tuple(notes))


def _subgroup_choice(profile: Profile, limits: Limits, D: int, vec: int,
                     limit: int) -> tuple[int, int | None, str, tuple, str | None]:
    """(vec, sub-group size, attribute, pragmas, reason it was cut or None).

    The reduction sums one row's BDX = D / vec lanes with ``sub_group_reduce_add``, so a
    sub-group must be exactly those lanes: its size must be required, and equal BDX.
    """
    if limits.subgroups in ("none", "unknown"):
        why = "the device reports no sub-group functions" if limits.subgroups == "none" \
            else "the device's extensions are unknown"
        return vec, None, "", (), why
    if limits.subgroups == "free":
        return vec, None, "", (), ("the device cannot require a sub-group size (no "
                                   "cl_intel_required_subgroup_size / cl_qcom_reqd_sub_group_size)")
    want = [profile.subgroup_size] if profile.subgroup_size else \
        [D // v for v in (vec, 1, 2, 4, 8, 16) if D % v == 0]
    for n in want:
        if n in limits.subgroup_sizes and D % n == 0 and D // n in (1, 2, 4, 8, 16) and \
                n <= limit:
            ext, attr, pragma = SUBGROUP_REQUESTS[limits.subgroups]
            pragmas = tuple(p for p in (pragma, "cl_khr_subgroups" if limits.khr_subgroups
                                        else None) if p)
            text = attr.format(n=n, mode=QCOM_WAVES.get(n, ""))
            return D // n, n, f"__attribute__(({text}))", pragmas, None
    return vec, None, "", (), (f"no sub-group size in {want} can be required for head_dim {D} "
                               f"(device sizes {list(limits.subgroup_sizes) or 'unknown'}, "
                               f"work-group limit {limit})")


def decode_geometry(spec: AttentionSpec, profile: Profile, limits: Limits) -> DecodeGeometry:
    """Fit the profile's wishes to the spec and the device's limits.

    Every wish that is not honoured (vector width, sub-group reduction, local staging,
    thread count) is listed in ``notes`` with its reason; an impossible fit raises.
    """
    notes: list[str] = []
    native = bool(profile.native_fp16 and limits.has_fp16 and spec.dtype == "float16")
    if profile.strategy == "rows":
        return _rows_geometry(spec, profile, limits, native)
    D, G = spec.head_dim, spec.group_size
    both = _widths(spec)[0]   # vec divides the q/K row and the V row
    limit = max(1, min(profile.thread_limit, limits.max_work_group_size))
    if limit < profile.thread_limit:
        notes.append(f"thread_limit {profile.thread_limit} -> {limit}: the device (or the "
                     f"compiled kernel) allows {limits.max_work_group_size} work-items")
    vec = _vec_for(both, profile.vec)
    while D // vec > min(limit, limits.max_work_item_sizes[0]) and vec < 16 and \
            both % (vec * 2) == 0:
        vec *= 2
    reduction, sgs, attr, pragmas = "local", None, "", ()
    if profile.reduction == "subgroup":
        sub = _subgroup_choice(profile, limits, D, vec, limit)
        why = sub[4] if sub[4] or spec.head_dim_v % sub[0] == 0 else \
            f"a sub-group's lanes take {sub[0]} values each, which head_dim_v " \
            f"{spec.head_dim_v} is not a multiple of"
        if why:
            notes.append(f"reduction subgroup -> local: {why}")
        else:
            vec, sgs, attr, pragmas = sub[:4]
            reduction = "subgroup"
    if vec != profile.vec:
        notes.append(f"vec {profile.vec} -> {vec}: head_dim {D} over "
                     + (f"one sub-group of {sgs}" if sgs else f"at most {limit} work-items"))
    bdx = D // vec
    if bdx > limit:
        raise ValueError(f"head_dim={D} needs {bdx} work-items at vec={vec}, more than the "
                         f"device's work-group limit {limit}")
    # every work-item serves all the heads of its head slice: each K/V row is loaded once
    # per work-group (gdz > 1 only for groups too large to keep in registers)
    gdz = math.ceil(G / TILED_MAX_HEADS)
    heads = slice_heads(G, gdz)
    bdz = max(1, min(limit // bdx, limits.max_work_item_sizes[2]))
    cap = max(1, TILED_MAX_SCORES // heads)
    tile = max(1, profile.tile_rows)
    why = []
    if tile > cap:
        tile = cap
        why.append(f"a work-item keeps at most {TILED_MAX_SCORES} scores per step "
                   f"({heads} heads)")

    def need() -> int:
        return tiled_local_bytes(spec.head_dim_v, bdx, bdz, tile, heads, reduction)

    # fewer rows per step (more barriers per row) until local memory fits; the merge of
    # the row slices needs fewer slices, given as many more rows each
    while need() > limits.local_mem_size and (bdz > 1 or tile > 1):
        merge_bytes = tiled_local_bytes(spec.head_dim_v, bdx, bdz, 1, heads, "subgroup")
        if merge_bytes > limits.local_mem_size and bdz > 1:
            bdz //= 2
            tile = min(tile * 2, cap)
            reason = (f"half the row slices, twice the rows each: their merge must fit "
                      f"{limits.local_mem_size} bytes of local memory")
        else:
            if tile > 1:
                tile //= 2
            else:
                bdz //= 2
            reason = (f"the step's partial sums must fit {limits.local_mem_size} bytes of "
                      "local memory")
        if reason not in why:
            why.append(reason)
    if need() > limits.local_mem_size:
        raise ValueError(f"decode kernel for head_dim={D}, group={G} needs {need()} bytes of "
                         f"local memory; the device has {limits.local_mem_size}")
    if tile != max(1, profile.tile_rows):
        notes.append(f"tile_rows {profile.tile_rows} -> {tile}: " + "; ".join(why))
    return DecodeGeometry("tiled", vec, tile, bdx=bdx, bdy=1, bdz=bdz, gdz=gdz,
                          use_local=False, reduction=reduction, subgroup_size=sgs,
                          subgroup_attr=attr, pragmas=pragmas, native_fp16=native,
                          local_mem_bytes=need(), notes=tuple(notes))


@dataclass(frozen=True)
class MergeGeometry:
    strategy: str
    vec: int
    mh: int = 1  # heads per work-group (tiled)
    threads: int = 64  # work-items striding over the rows (rows)
    native_fp16: bool = False
    denorms: bool = False
    storage_half: bool = False  # f16 converted through clang's __fp16 (rows kernels)

    def sizes(self, nh: int, head_dim: int) -> tuple[tuple, tuple]:
        """(global, local) sizes for ``nh`` (state, head) pairs."""
        if self.strategy == "rows":  # work-groups of one, each striding over rows
            return (max(1, min(nh, self.threads)),), (1,)
        nv = head_dim // self.vec
        return (nv, math.ceil(max(nh, 1) / self.mh) * self.mh), (nv, self.mh)


def merge_geometry(head_dim: int, dtype: str, profile: Profile, limits: Limits) -> MergeGeometry:
    limit = max(1, min(profile.merge_threads, limits.max_work_group_size))
    native = bool(profile.native_fp16 and limits.has_fp16 and dtype == "float16")
    if profile.strategy == "rows":
        vec = _vec_for(head_dim, profile.vec, limits.rows_max_vec)
        # a device with a loop budget (clattn.loop_budget): a work-item per (row, head)
        # pair, whose loops walk only that pair's states
        threads = limit if not limits.loop_budget else 2**30
        return MergeGeometry("rows", vec, threads=threads, native_fp16=native,
                             denorms=limits.denorms, storage_half=limits.storage_half)
    vec = _vec_for(head_dim, profile.vec)
    while head_dim // vec > min(limit, limits.max_work_item_sizes[0]) and vec < 16 and \
            head_dim % (vec * 2) == 0:
        vec *= 2
    nv = head_dim // vec
    if nv > min(limits.max_work_group_size, limits.max_work_item_sizes[0]):
        raise ValueError(f"head_dim={head_dim} needs {nv} work-items at vec={vec} for the merge, "
                         f"more than the device's work-group limit")
    mh = max(1, min(limit // nv, limits.max_work_item_sizes[1]))
    return MergeGeometry("tiled", vec, mh=mh, native_fp16=native)


def append_geometry(head_dim: int, dtype: str, profile: Profile, limits: Limits) -> MergeGeometry:
    """Geometry of the KV-cache append and page-copy kernels (:mod:`clattn.cache`).

    They move rows of ``head_dim`` values as the merge does (rows: work-items striding
    over rows, ``vec`` elements at a time; tiled: ``D / vec`` lanes x ``mh`` rows per
    work-group), so the merge's fit serves them.
    """
    return merge_geometry(head_dim, dtype, profile, limits)


@dataclass(frozen=True)
class PrefillGeometry:
    """Everything the prefill templates (:mod:`clattn.prefill`) and their launch need.

    ``qb`` queries per work unit (a tile of one sequence's queries: ``rows``, one
    work-item; ``tiled``, one work-group) over ``kb`` keys per block; rows: a plan whose
    queries follow long caches takes units of ``qb_long`` (when not 0) instead, a second
    build of the kernel (:func:`clattn.prefill.queries_per_unit`). rows: ``vec`` floats
    per load along head_dim. tiled: ``tr`` row groups of ``rm`` (query, head) rows, each
    group ``tc`` threads wide (keys in the score phase, head_dim in the value phase);
    ``kb = tc * rk``. ``notes``: every wish of the profile that was cut, with its reason.
    """

    strategy: str
    vec: int
    qb: int
    kb: int
    qb_long: int = 0  # rows: queries per unit of a plan over long caches (0: qb only)
    rm: int = 1
    tc: int = 1
    tr: int = 1
    native_fp16: bool = False
    denorms: bool = False
    storage_half: bool = False  # f16 converted through clang's __fp16 (rows kernels)
    local_mem_bytes: int = 0
    notes: tuple = field(default=(), compare=False)

    def local_size(self) -> tuple[int, int]:
        return (1, 1) if self.strategy == "rows" else (self.tc, self.tr)

    def global_size(self, n_units: int, num_kv_heads: int) -> tuple[int, int]:
        if self.strategy == "rows":
            return (n_units, num_kv_heads)
        return (n_units * self.tc, num_kv_heads * self.tr)

    @property
    def threads(self) -> int:
        return self.tc * self.tr


#: rows prefill: floats of q (and as many of accumulators) a work-item keeps: 32 rows of
#: head_dim 128 (measured on a 2-core AMD EPYC, PoCL and Intel, Llama-3-8B shapes: 1.3-1.4x
#: the speed of 16 rows, 16 rows of 64 no better); the derived queries per work-item
PREFILL_ROW_FLOATS = 4096
#: rows prefill: at most this many (query, head) rows per work-item (Qwen2.5's 7 heads of
#: 64 per KV head: 9 queries, 64 rows, 1.1-1.4x the speed of 32 rows on Intel's runtime);
#: a ``prefill_qb`` wish is cut to it
PREFILL_ROWS = 64
#: rows prefill: the derived queries per work-item fill at least this many row vectors, the
#: rows of the kernel's score tile (kernel_exprs.prefill_rows_tiles): with one, each key
#: element loaded serves one multiply-add. At 16-float vectors (Sapphire Rapids, PoCL and
#: Intel) Gemma-2's 2 heads of 256 in 16 queries and Phi-3's 1 head of 96 in 32 ran
#: 1.10-1.13x faster than in 8 and 16 over 4096 cached rows, 1.00-1.02x on an empty cache
PREFILL_MIN_ROW_VECTORS = 2
#: rows prefill: a plan whose new queries follow at least this many cached rows each, on
#: average, takes units of twice the derived queries (each unit streams the whole cache:
#: larger units read it fewer times; the same units lose over short caches, where a
#: smaller unit's causal diagonal and its L1-sized state win). Sapphire Rapids, f16, B=1,
#: 128 new over 4096 cached: Gemma-2 32 queries 1.05x the speed of 16, Llama-3-8B 16
#: 1.07-1.08x of 8, PoCL and Intel; 128 over 1024: 1.00-1.04x; 512 over none: 0.87-0.89x
PREFILL_LONG_CACHE = 2048
#: rows prefill: keys per block are a power of two up to this
PREFILL_MAX_KB = 16
#: tiled prefill without wishes: threads per row group, rows per thread, keys per thread
PREFILL_TC, PREFILL_RM, PREFILL_RK = 16, 4, 2


def _prefill_local_bytes(d: int, rows: int, kb: int, tc: int, dv: int | None = None) -> int:
    """q tile, K tile (rows padded by one float), V tile (``dv`` wide, default ``d``),
    probabilities, two reductions."""
    dv = d if dv is None else dv
    return FLOAT * (rows * d + kb * (d + 1) + kb * dv + rows * (kb + 1) + 2 * rows * tc)


class _Cuts:
    """The prefill wishes of a profile and why each one was cut (notes in field order)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.why: dict[str, list[str]] = {}

    def cut(self, name: str, why: str) -> None:
        """Record a reason ``name``'s wish was not kept (once per reason)."""
        reasons = self.why.setdefault(name, [])
        if why not in reasons:
            reasons.append(why)

    def notes(self, got: Mapping[str, int]) -> list[str]:
        """``"prefill_qb 32 -> 9: why"`` for each wish (not None) that ``got`` differs from."""
        out = []
        for name, value in got.items():
            want = getattr(self.profile, name)
            if want is not None and want != value:
                out.append(f"{name} {want} -> {value}: "
                           + "; ".join(self.why.get(name, ["the kernel's limits"])))
        return out


def _halvings(n: int) -> list[int]:
    """``n, n // 2, ..., 1``."""
    out = [max(1, n)]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def _prefill_rows(spec: AttentionSpec, profile: Profile, limits: Limits,
                  native: bool) -> PrefillGeometry:
    G = spec.group_size
    notes: list = []
    if profile.prefill_vec is None:
        vec = max(_rows_decode_vec(spec, profile, limits, notes),
                  _vec_for(_widths(spec)[0], limits.native_float, limits.rows_max_vec))
    else:
        vec = _rows_vec(spec, profile.prefill_vec, limits, notes, "prefill_vec")
    kb_field = "prefill_kb" if profile.prefill_kb is not None else "tile_rows"
    want_kb = getattr(profile, kb_field)
    kb = 1 << (min(max(1, want_kb), PREFILL_MAX_KB).bit_length() - 1)
    if kb != want_kb:
        notes.append(f"{kb_field} {want_kb} -> {kb}: the rows kernel takes a power of two up "
                     f"to {PREFILL_MAX_KB}")
    cap = max(1, PREFILL_ROWS // G)
    qb_long = 0
    if profile.prefill_qb is None:
        by_floats = min(16, PREFILL_ROW_FLOATS // ((spec.head_dim + spec.head_dim_v) // 2 * G))
        qb = max(1, min(max(by_floats, -(-PREFILL_MIN_ROW_VECTORS * vec // G)), cap))
        qb_long = 2 * qb if 2 * qb <= cap else 0
    else:
        qb = min(profile.prefill_qb, cap)
        if qb != profile.prefill_qb:
            notes.append(f"prefill_qb {profile.prefill_qb} -> {qb}: the rows kernel keeps at "
                         f"most {PREFILL_ROWS} (query, head) rows per work-item ({G} heads "
                         f"per query)")
    return PrefillGeometry("rows", vec, qb, kb, qb_long=qb_long, native_fp16=native,
                           denorms=limits.denorms,
                           storage_half=limits.storage_half,
                           notes=tuple(notes))


def prefill_geometry(spec: AttentionSpec, profile: Profile, limits: Limits) -> PrefillGeometry:
    """Fit the profile to the prefill kernels of ``spec`` on a device with ``limits``.

    rows: ``prefill_vec`` floats per vector, cut as decode's ``vec`` (None: the wider of
    ``vec`` and the device's native float vector width); keys per block ``prefill_kb``
    (None: ``tile_rows``), a power of two up to :data:`PREFILL_MAX_KB`; queries per
    work-item ``prefill_qb``, at most :data:`PREFILL_ROWS` (query, head) rows (None: so
    that q and the accumulators hold about :data:`PREFILL_ROW_FLOATS` floats, at most 16
    queries, but at least :data:`PREFILL_MIN_ROW_VECTORS` vectors of rows).

    tiled: ``prefill_tc`` threads per row group (None: :data:`PREFILL_TC`), halved until
    it divides head_dim and fits the work-group; ``prefill_rm`` rows per thread (None:
    :data:`PREFILL_RM`), raised only when one query's heads need more rows than the row
    groups hold; ``prefill_kb`` keys per tile, a multiple of the threads of a row group
    (None: :data:`PREFILL_RK` per thread); ``prefill_qb`` queries per work-group, at most
    what the row groups hold (None: that many). Then the key tile, the query tile (down to
    16 rows), the threads per row group (down to 4) and the query tile again are halved
    until local memory fits.

    Every wish that is cut is listed in ``notes`` with its reason, as are the wishes the
    prefill kernels do not take (sub-group reduction, K/V outside local memory); an
    impossible fit raises.
    """
    D, G = spec.head_dim, spec.group_size
    native = bool(profile.native_fp16 and limits.has_fp16 and spec.dtype == "float16")
    if profile.strategy == "rows":
        return _prefill_rows(spec, profile, limits, native)
    if not limits.tiled_prefill:
        rows = _prefill_rows(spec, profile.with_(**LLVMPIPE_PREFILL_ROWS), limits, native)
        return replace(rows, notes=tuple(rows.notes) + (
            "strategy tiled -> rows (prefill): the device ends a work-item's loops after a "
            "fixed count (Mesa's llvmpipe), and only the rows kernel's are bounded "
            "(clattn.loop_budget); it takes "
            + ", ".join(f"{k} {v}" for k, v in LLVMPIPE_PREFILL_ROWS.items()),))
    notes: list[str] = []
    Dv, dv_name = spec.head_dim_v, "head_dim_v" if spec.split_widths else "head_dim"
    if profile.reduction == "subgroup":
        notes.append("reduction subgroup -> local: the prefill kernel reduces through local "
                     "memory")
    cuts = _Cuts(profile)
    limit = max(1, min(profile.thread_limit, limits.max_work_group_size))
    cap_x = min(limit, limits.max_work_item_sizes[0])
    want_tc = profile.prefill_tc or PREFILL_TC
    # the value phase gives each thread of a row group the columns tc + TC * c of a V row
    tc = next(t for t in _halvings(want_tc) if Dv % t == 0 and t <= cap_x)
    if want_tc > cap_x:
        cuts.cut("prefill_tc", f"at most {cap_x} work-items across the work-group")
    if Dv % want_tc:
        cuts.cut("prefill_tc", f"{dv_name} {Dv} is not a multiple of {want_tc} (halved until "
                               f"it is)")
    rm = profile.prefill_rm or PREFILL_RM
    want_kb = profile.prefill_kb or tc * PREFILL_RK
    rk = max(1, want_kb // tc)
    if tc * rk != want_kb:
        cuts.cut("prefill_kb", f"a multiple of the {tc} threads of a row group")
    tr_max = max(1, min(limit // tc, limits.max_work_item_sizes[1]))
    qb = max(1, tr_max * rm // G)
    if profile.prefill_qb is not None:
        if profile.prefill_qb > qb:
            cuts.cut("prefill_qb", f"{tr_max} row groups of {rm} rows hold {qb} queries of "
                                   f"{G} heads (work-group limit {limit})")
        qb = min(profile.prefill_qb, qb)
    local = f"the tiles must fit {limits.local_mem_size} bytes of local memory"
    while True:
        rows = qb * G
        rm_eff = rm if -(-rows // rm) <= tr_max else -(-rows // tr_max)
        tr = -(-rows // rm_eff)
        need = _prefill_local_bytes(D, tr * rm_eff, tc * rk, tc, Dv)
        if need <= limits.local_mem_size:
            break
        if rk > 1:
            rk //= 2
            cuts.cut("prefill_kb", local)
        elif qb > 1 and qb * G > 16:
            qb //= 2
            cuts.cut("prefill_qb", local)
        elif tc > 4:
            tc //= 2
            tr_max = max(1, min(limit // tc, limits.max_work_item_sizes[1]))
            cuts.cut("prefill_tc", local)
            cuts.cut("prefill_kb", local)
        elif qb > 1:
            qb //= 2
            cuts.cut("prefill_qb", local)
        else:
            raise ValueError(f"prefill kernel for head_dim={D}, group={G} needs {need} bytes of "
                             f"local memory; the device has {limits.local_mem_size}")
    if rm_eff != rm:
        cuts.cut("prefill_rm", f"one query's {G} heads over at most {tr_max} row groups")
    notes += cuts.notes({"prefill_qb": qb, "prefill_kb": tc * rk, "prefill_tc": tc,
                         "prefill_rm": rm_eff})
    return PrefillGeometry("tiled", 1, qb, tc * rk, rm=rm_eff, tc=tc, tr=tr, native_fp16=native,
                           denorms=limits.denorms, storage_half=limits.storage_half,
                           local_mem_bytes=need, notes=tuple(notes))
