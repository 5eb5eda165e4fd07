"""Template rendering: (spec, geometry) -> OpenCL C source."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from mako.lookup import TemplateLookup

from . import signatures
from .fit import DecodeGeometry, MergeGeometry, PrefillGeometry, slice_heads, tiled_local
from .kernel_exprs import RopePairs
from .quant import row_bytes
from .rope import parse_rope_scaling
from .spec import AttentionSpec

#: a template every kernel folder holds (tells the folder from an unrelated "kernels")
_MARKER = "decode_rows.cl.mako"


def kernels_dir() -> Path:
    """The folder of the kernel templates: inside the installed package (``clattn/kernels``,
    where a wheel puts the repository's top-level ``kernels/``: pyproject's package-dir),
    else the repository's ``kernels/`` beside the package (a source checkout, an editable
    install)."""
    package = Path(__file__).resolve().parent
    for folder in (package / "kernels", package.parent / "kernels"):
        if (folder / _MARKER).is_file():
            return folder
    raise FileNotFoundError(f"clattn's kernel templates are missing: neither "
                            f"{package / 'kernels'} nor {package.parent / 'kernels'} holds "
                            f"{_MARKER}; reinstall clattn")


KERNELS_DIR = kernels_dir()  # the templates' folder, found once at import


@lru_cache(maxsize=1)
def _lookup() -> TemplateLookup:
    return TemplateLookup(directories=[str(KERNELS_DIR)], strict_undefined=True)


def _cl_dtype(dtype: str) -> str:
    return "half" if dtype == "float16" else "float"


def _rope_pairs(spec: AttentionSpec) -> RopePairs:
    """The RoPE pairing of ``spec``'s rotary dims (template parameter ROPE)."""
    scaling = parse_rope_scaling(spec.rope_scaling, spec.max_position_embeddings)
    return RopePairs(spec.rotary_dim, scaling.interleaved)


def _attention_params(spec: AttentionSpec, geom: DecodeGeometry | PrefillGeometry) -> dict:
    """Template parameters every attention kernel (decode, prefill) takes from the spec
    and the geometry's number handling; the page storage's are :func:`_pool_params`."""
    return dict(
        D=spec.head_dim, DV=spec.head_dim_v, HQO=spec.num_qo_heads, HKV=spec.num_kv_heads,
        G=spec.group_size, PS=spec.page_size, ROT=spec.rotary_dim, ROPE=_rope_pairs(spec),
        SLIDING=spec.sliding_window, SOFTCAP=spec.softcap, DTYPE=_cl_dtype(spec.dtype),
        DENORMS=geom.denorms, STORAGE_HALF=geom.storage_half, NATIVE_HALF=geom.native_fp16,
        **_pool_params(spec))


def render_decode(spec: AttentionSpec, geom: DecodeGeometry, fused: bool = False,
                  sinks: bool = False, fold: bool = False) -> str:
    """OpenCL C source of the decode kernel for ``spec`` with geometry ``geom``.

    The template is ``decode_<strategy>.cl.mako``; its parameter list comes from the
    argument table :data:`clattn.signatures.DECODE`, or with ``fused`` (the append of a
    one-token step fused in: float pools only) :data:`clattn.signatures.DECODE_APPEND`.
    ``sinks`` compiles the learned-sink epilogue in (the build for calls passing
    ``sink_logits``; the arguments are the same either way, and a build without it
    ignores them). ``fold`` folds the split merge in: the last partition of a split
    sequence to finish merges its states into ``out``/``lse`` as ``clattn_merge_varlen``
    does (the same arithmetic, kernels/merge_state.clh.mako), counting on ``counters``;
    a split launch of this build is then the only launch.
    """
    if fused and spec.byte_pool:
        raise ValueError("render_decode: the fused append takes float pools only (a byte "
                         "pool's append checks every block first, in its own launch)")
    if fused and geom.gdz > 1:
        raise ValueError(f"render_decode: the fused append needs one work-group per KV head "
                         f"(gdz={geom.gdz}: the head's other groups would read the new row "
                         f"unordered); use separate launches")
    table = signatures.DECODE_APPEND if fused else signatures.DECODE
    return _lookup().get_template(f"decode_{geom.strategy}.cl.mako").render(
        **_attention_params(spec, geom), PRAGMAS=geom.pragmas, VEC=geom.vec, TILE=geom.tile,
        PREFETCH=geom.prefetch, VEC_ROPE=geom.vec_rope, V_CHUNKS=geom.v_chunks,
        BDX=geom.bdx, BDY=geom.bdy, BDZ=geom.bdz, GDZ=geom.gdz,
        GH=slice_heads(spec.group_size, geom.gdz), USE_LOCAL=geom.use_local,
        REDUCE=geom.reduction, SGS=geom.subgroup_size, SG_ATTR=geom.subgroup_attr,
        FUSED=fused, SINKS=sinks, FOLD=fold, SIGNATURE=table.signature(), FIXUP=table.fixup(),
        LOCAL=tiled_local(spec.head_dim_v, geom.bdx, geom.bdz, geom.tile,
                          slice_heads(spec.group_size, geom.gdz), geom.reduction)
        if geom.strategy == "tiled" else None)


def _pool_params(spec: AttentionSpec) -> dict:
    """Template parameters of the page storage (clattn.quant's layout). ``VIN_K``: the
    values are the leading ``DV`` values of the key rows (a V row is addressed as its K
    row: K's region, row stride ``V_ROWB = K_ROWB`` and scale layout)."""
    lay = spec.layout
    fmt = {"float16": "half", "float32": "float"}
    k_rowb = row_bytes(spec.k_format, spec.head_dim)
    return dict(KFMT=fmt.get(spec.k_format, spec.k_format),
                VFMT=fmt.get(spec.v_format, spec.v_format), BYTE_POOL=spec.byte_pool,
                PAGE_BYTES=lay.page_bytes, K_REGION=lay.k_region, V_REGION=lay.v_region,
                K_ROWB=k_rowb, VIN_K=spec.value_in_key,
                V_ROWB=k_rowb if spec.value_in_key else row_bytes(spec.v_format, spec.head_dim_v))


def render_merge(head_dim: int, dtype: str, vin: str, geom: MergeGeometry,
                 sinks: bool = False) -> str:
    """OpenCL C source of the merge kernels (``vin``: dtype of the states merged;
    ``sinks``: the learned-sink epilogue compiled in, as :func:`render_decode`)."""
    pair, varlen = signatures.MERGE_PAIR, signatures.MERGE_VARLEN
    return _lookup().get_template("merge.cl.mako").render(
        D=head_dim, DV=head_dim, DTYPE=_cl_dtype(dtype), VIN=_cl_dtype(vin),
        NATIVE_HALF=geom.native_fp16, DENORMS=geom.denorms, STORAGE_HALF=geom.storage_half,
        PRAGMAS=(), STRATEGY=geom.strategy, VEC=geom.vec, MH=geom.mh, SINKS=sinks,
        PAIR_SIGNATURE=pair.signature(), PAIR_FIXUP=pair.fixup(),
        VARLEN_SIGNATURE=varlen.signature(), VARLEN_FIXUP=varlen.fixup())


def render_append(spec: AttentionSpec, geom: MergeGeometry) -> str:
    """OpenCL C source of the KV-cache append and page-copy kernels (``append.cl.mako``;
    tables :data:`clattn.signatures.APPEND` and :data:`~clattn.signatures.PAGE_COPY`; a byte
    pool adds :data:`~clattn.signatures.APPEND_CHECK`)."""
    app, cp = signatures.APPEND, signatures.PAGE_COPY
    return _lookup().get_template("append.cl.mako").render(
        D=spec.head_dim, DV=spec.head_dim_v, HKV=spec.num_kv_heads, PS=spec.page_size,
        ROT=spec.rotary_dim, ROPE=_rope_pairs(spec), DTYPE=_cl_dtype(spec.dtype),
        NATIVE_HALF=geom.native_fp16, DENORMS=geom.denorms, STORAGE_HALF=geom.storage_half,
        PRAGMAS=(), STRATEGY=geom.strategy, VEC=geom.vec, MH=geom.mh,
        APPEND_SIGNATURE=app.signature(), APPEND_FIXUP=app.fixup(),
        CHECK_SIGNATURE=signatures.APPEND_CHECK.signature(),
        COPY_SIGNATURE=cp.signature(), COPY_FIXUP=cp.fixup(), NBK=spec.layout.blocks(0),
        NBV=spec.layout.blocks(1), **_pool_params(spec))


def render_prefill(spec: AttentionSpec, geom: PrefillGeometry) -> str:
    """OpenCL C source of the prefill kernel (``prefill_<strategy>.cl.mako``; argument
    table :data:`clattn.signatures.PREFILL`)."""
    table = signatures.PREFILL
    return _lookup().get_template(f"prefill_{geom.strategy}.cl.mako").render(
        **_attention_params(spec, geom), PRAGMAS=(), VEC=geom.vec, QB=geom.qb, KB=geom.kb,
        RM=geom.rm, TC=geom.tc, TR=geom.tr, FUSED=False, FOLD=False, SIGNATURE=table.signature(),
        FIXUP=table.fixup())


def render_half_probe(lanes: int, storage_half: bool = True, denorms: bool = False) -> str:
    """OpenCL C source of :mod:`clattn.compiler_probe`'s check of the f16 conversions at
    ``lanes`` values per conversion: through ``__fp16`` (``storage_half``) or the integer
    code (with ``denorms``: the variant for devices that keep f32 subnormals)."""
    return _lookup().get_template("half_probe.cl.mako").render(
        V=lanes, DTYPE="half", DENORMS=denorms, STORAGE_HALF=storage_half)
