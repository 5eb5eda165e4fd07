"""Every kernel's parameter list comes from its argument table, and the launch agrees.

The compiled kernels are asked for their argument names and types
(``-cl-kernel-arg-info``) and compared with the tables in ``clattn.signatures`` that
:class:`clattn.launch.Launcher` launches by; every built-in profile's rendering is
parsed and compared with the same tables.
"""
import re

import numpy as np
import pytest

import clattn
from clattn import signatures
from clattn.codegen import render_append, render_decode, render_merge, render_prefill
from clattn.fit import Limits, append_geometry, decode_geometry, merge_geometry, prefill_geometry
from clattn.launch import ArgTable, Buffer, Scalar
from clattn.profiles import builtin_profiles

SPEC = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float16", sliding_window=True,
                            softcap=30.0)
LIMITS = Limits(subgroups="intel", subgroup_sizes=(8, 16, 32, 64))


def _expected(table: ArgTable, st: str, vin: str = "float") -> list[tuple[str, str]]:
    """(name, type) per OpenCL argument, as the compiler reports them."""
    out = []
    for a in table.args:
        if isinstance(a, Buffer):
            out.append((a.name, a.ctype.replace("st_t", st).replace("in_t", vin) + "*"))
            if a.offset:
                out.append((a.offset_name, a.offset))
        else:
            out.append((a.name, a.ctype))
    return out


def _parsed(source: str, kernel: str) -> list[tuple[str, str]]:
    """(name, type) of each parameter of ``kernel`` in OpenCL C ``source``."""
    m = re.search(r"\b%s\s*\(([^)]*)\)" % kernel, source)
    assert m, f"{kernel} not found in the source"
    params = []
    for p in m.group(1).split(","):
        words = p.replace("*", " * ").split()
        words = [w for w in words if w not in ("const", "__global")]
        name, ctype = words[-1], "".join(words[:-1])
        params.append((name, ctype))
    return params


@pytest.mark.parametrize("name", sorted(builtin_profiles()))
def test_every_profile_renders_its_table(name):
    prof = builtin_profiles()[name]
    geom = decode_geometry(SPEC, prof, LIMITS)
    src = render_decode(SPEC, geom)
    assert _parsed(src, "clattn_decode") == _expected(signatures.DECODE, "st_t"), geom.strategy
    fused = render_decode(SPEC, geom, fused=True)  # the append fused in (one-token steps)
    assert _parsed(fused, "clattn_decode") == _expected(signatures.DECODE_APPEND, "st_t")
    msrc = render_merge(64, "float16", "float16", merge_geometry(64, "float16", prof, LIMITS))
    for table in (signatures.MERGE_PAIR, signatures.MERGE_VARLEN):
        assert _parsed(msrc, table.kernel) == _expected(table, "st_t", "in_t")
    asrc = render_append(SPEC, append_geometry(64, "float16", prof, LIMITS))
    for table in (signatures.APPEND, signatures.PAGE_COPY):
        assert _parsed(asrc, table.kernel) == _expected(table, "st_t"), table.kernel
    psrc = render_prefill(SPEC, prefill_geometry(SPEC, prof, LIMITS))
    assert _parsed(psrc, "clattn_prefill") == _expected(signatures.PREFILL, "st_t")


def test_table_offsets_and_dtypes():
    dt = signatures.DECODE.scalar_dtypes()
    assert len(dt) == len(_expected(signatures.DECODE, "x"))
    names = [n for n, _ in _expected(signatures.DECODE, "x")]
    assert dt[names.index("pages_off")] == np.uint64
    assert dt[names.index("sm_scale")] == np.float32
    assert dt[names.index("q")] is None
    with pytest.raises(ValueError, match="used twice"):
        ArgTable("k", [Buffer("a", "int"), Scalar("a_off", "int")])
    with pytest.raises(TypeError, match=r"missing \['nnz'\]"):
        named = {a.name: None for a in signatures.DECODE.args if a.name != "nnz"}
        signatures.DECODE.values(named, dummy=object())


@pytest.mark.parametrize("strategy", ["rows", "tiled"])
def test_compiled_arguments_match_the_tables(device, strategy):
    """The driver's view of each built kernel equals its table, name by name."""
    cl = clattn.runtime.cl()
    prof = "pocl-cpu" if strategy == "rows" else "generic"
    dec = clattn.BatchDecode(SPEC, device, profile=prof)
    merge_src = render_merge(64, "float16", "float32", dec.merge_geometry)
    for src, tables in ((dec.source(), [signatures.DECODE]),
                        (merge_src, [signatures.MERGE_PAIR, signatures.MERGE_VARLEN])):
        prg = cl.Program(dec.setup.runtime.context, src).build(options=["-cl-kernel-arg-info"])
        for table in tables:
            k = cl.Kernel(prg, table.kernel)
            want = _expected(table, "st_t", "in_t")  # drivers report the typedef names
            assert k.num_args == len(want), table.kernel
            try:
                got = [(k.get_arg_info(i, cl.kernel_arg_info.NAME),
                        k.get_arg_info(i, cl.kernel_arg_info.TYPE_NAME).replace(" ", ""))
                       for i in range(k.num_args)]
            except cl.RuntimeError:  # Intel's CPU runtime keeps no argument info
                got = _parsed(src, table.kernel)
            assert got == want, table.kernel


def test_bound_kernel_sets_only_what_changed_and_never_records_a_refused_view(device):
    """BoundKernel.set skips what the kernel holds already; a view it refuses (not a whole
    number of elements into its buffer) is refused again the next time, never taken for
    set: the merge then still reads the array it last accepted."""
    cl = clattn.runtime.cl()
    rt = clattn.runtime.Runtime.for_device(device)
    geom = merge_geometry(64, "float32", builtin_profiles()["generic"],
                          Limits.from_info(clattn.profiles.device_info(device)))
    knl = rt.launcher(("test-bound", 64), signatures.MERGE_PAIR,
                      lambda: render_merge(64, "float32", "float32", geom))
    q = rt.queue
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((4, 64)).astype(np.float32) for _ in range(3)]
    v, vo, other = (cl.array.to_device(q, h) for h in host)
    s, so = (cl.array.to_device(q, np.zeros(4, np.float32)) for _ in range(2))
    bound = knl.bind(v=v, s=s, vo=vo, so=so, NH=4)
    skewed = cl.array.Array(q, (4, 63), np.float32, data=other.base_data, offset=2)
    for _ in range(2):
        with pytest.raises(ValueError, match="whole number of 4-byte elements"):
            bound.set(vo=skewed)
    bound.set(vo=vo, NH=4)  # unchanged: nothing set again
    gsz, lsz = geom.sizes(4, 64)
    bound.launch(q, gsz, lsz).wait()
    # equal lse 0 on both sides: the merge is the mean of v and vo
    np.testing.assert_allclose(v.get(), (host[0] + host[1]) / 2, rtol=1e-6)


def test_fused_decode_refuses_byte_pools_and_head_slices():
    q8 = clattn.AttentionSpec(8, 2, 64, page_size=16, k_format="q8_0", v_format="q8_0")
    prof = builtin_profiles()["generic-cpu"]
    with pytest.raises(ValueError, match="float pools only"):
        render_decode(q8, decode_geometry(q8, prof, LIMITS), fused=True)
    wide = clattn.AttentionSpec(32, 2, 64, page_size=16)  # 16 query heads per KV head
    geom = decode_geometry(wide, clattn.Profile(name="t", strategy="tiled"), LIMITS)
    assert geom.gdz > 1
    with pytest.raises(ValueError, match="gdz=2"):
        render_decode(wide, geom, fused=True)
