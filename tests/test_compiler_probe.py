"""clattn.compiler_probe: the checks that turn on the ``__fp16`` conversions and the
prefetch of the CPU kernels, and the kernels with both off (the standard code every
other driver runs)."""
import numpy as np
import pytest
from cases import compare, decode_args, make_case, oracle, spec_scenario

import clattn
from clattn import codegen, compiler_probe
from clattn.runtime import Runtime


def test_probe_floats_cover_every_rounding_case():
    x = compiler_probe.probe_floats()
    assert x.size % max(compiler_probe.PROBE_LANES) == 0
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.unique(halves[np.isfinite(halves)].astype(np.float64))
    assert np.isin(finite.astype(np.float32), x).all(), "every finite half"
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)   # exact in f32
    assert np.isin(mids, x).all(), "every tie between neighbouring halves"
    assert np.isin(np.nextafter(mids, np.float32(np.inf)), x).all(), "just past each tie"
    assert np.isnan(x).any() and np.isin([65520.0, np.inf, -np.inf, 2.0 ** -25], x).all()


@pytest.mark.parametrize("lanes", compiler_probe.PROBE_LANES)
def test_integer_f16_conversion_is_exact(device, lanes):
    """The integer conversion the kernels use without ``cl_khr_fp16`` and ``__fp16``: every
    half and every rounding case, bit for bit; also its ``denorms`` variant on a device
    that keeps f32 subnormals (the only devices it is chosen for)."""
    import pyopencl as cl

    from clattn.fit import Limits
    from clattn.profiles import device_info

    if lanes > Limits.from_info(device_info(device)).rows_max_vec:
        return   # never built there (and PoCL's LLVM cannot build it on AVX-512 hosts)
    keeps = bool(device.single_fp_config & cl.device_fp_config.DENORM)
    for denorms in (False, True) if keeps else (False,):
        src = codegen.render_half_probe(lanes, storage_half=False, denorms=denorms)
        assert compiler_probe.check_half(Runtime.for_device(device), lanes, src), \
            f"denorms={denorms}"


def test_check_rejects_a_wrong_conversion(device):
    """The check can fail: a conversion that truncates instead of rounding is refused."""
    src = codegen.render_half_probe(8, storage_half=False)
    wrong = src.replace("+ 0xfffu + ((a >> 13) & 1u)", "")
    assert wrong != src
    assert not compiler_probe.check_half(Runtime.for_device(device), 8, wrong)


def test_probe_answers_and_fit(device):
    """What the probe says reaches the geometry: ``__fp16`` only without cl_khr_fp16, the
    prefetch distance only where ``__builtin_prefetch`` works."""
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float16")
    dec = clattn.BatchDecode(spec, device, backend="opencl")
    rt = dec.setup.runtime
    lim = dec.setup.limits
    assert lim.storage_half == (not lim.has_fp16 and
                                compiler_probe.storage_half_works(rt, lim.rows_max_vec))
    assert lim.prefetch == compiler_probe.prefetch_works(rt)
    if dec.geometry.strategy == "rows":
        assert dec.geometry.storage_half == lim.storage_half
        assert (dec.geometry.prefetch > 0) == lim.prefetch
        src = dec.source()
        assert ("__builtin_prefetch" in src) == lim.prefetch
        assert ("__fp16" in src) == lim.storage_half


SHAPES = [
    spec_scenario("gqa4-d128", 8, 2, 128, page_size=16, dtype="float16"),
    spec_scenario("gqa7-d64-win", 7, 1, 64, page_size=8, dtype="float16", sliding_window=True),
]


@pytest.mark.parametrize("sc", SHAPES, ids=str)
def test_decode_with_the_probed_features_off(device, sc, monkeypatch):
    """The standard code paths (integer f16 conversion, no prefetch) stay right on the
    devices that would otherwise use ``__fp16`` and the prefetch."""
    monkeypatch.setattr(clattn.device, "storage_half_works", lambda rt, lanes=16: False)
    monkeypatch.setattr(clattn.device, "prefetch_works", lambda rt: False)
    dec = clattn.BatchDecode(sc.spec, device, backend="opencl")
    assert not dec.setup.limits.storage_half and not dec.setup.limits.prefetch
    assert dec.geometry.prefetch == 0 and not dec.geometry.storage_half
    win = dict(window=[5, 0, 40], sinks=[2, 0, 4]) if sc.spec.sliding_window else {}
    for rope in (False, True):
        case = make_case(sc.spec, [37, 1, 70], seed=3, rope=rope, **win)
        args, call = decode_args(case)
        mode = {"rotary_mode": 1} if rope else {}
        res = dec.run(*args, **call, **sc.call, **mode)
        compare(res.out, res.lse, *oracle(sc, case, **mode), sc.spec.dtype,
                what=f"{sc} rope={rope}: ")


def _fresh_answers(monkeypatch):
    monkeypatch.setattr(compiler_probe, "_RESULTS", {})


@pytest.mark.parametrize("what", ["prefetch", "storage_half"])
def test_a_probe_in_a_child_process_answers_as_in_process(device, what, monkeypatch):
    """On a platform outside the allow-list the probe runs in a child Python process that
    finds the same device by its names and versions; its answer is the in-process one."""
    rt = Runtime.for_device(device)
    probe = {"prefetch": compiler_probe.prefetch_works,
             "storage_half": lambda r: compiler_probe.storage_half_works(r, 8)}[what]
    _fresh_answers(monkeypatch)
    monkeypatch.setattr(compiler_probe, "runs_in_process", lambda dev: True)
    here = probe(rt)
    _fresh_answers(monkeypatch)
    monkeypatch.setattr(compiler_probe, "runs_in_process", lambda dev: False)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a child that answers is no warning
        assert probe(rt) == here


@pytest.mark.parametrize("said", ["", "print('yes', flush=True); "],
                         ids=["no-answer", "yes-then-dies"])
def test_a_compiler_that_kills_its_process_means_no_and_one_warning(device, monkeypatch, said):
    """A child that dies (as rusticl's SPIR-V writer ends the process on
    ``__builtin_prefetch``), with no answer or after printing "yes" (the exit status
    counts, not the words): the feature is off, the caller's process goes on, and one
    warning names the device and the exit status."""
    import sys
    rt = Runtime.for_device(device)
    _fresh_answers(monkeypatch)
    monkeypatch.setattr(compiler_probe, "runs_in_process", lambda dev: False)
    monkeypatch.setattr(compiler_probe, "child_command", lambda *a: [
        sys.executable, "-c", f"import os, sys; {said}sys.stderr.write('Unexpected llvm "
        "intrinsic\\n'); sys.stderr.flush(); os._exit(8)"])
    with pytest.warns(RuntimeWarning, match=r"prefetch probe failed .*status 8.*intrinsic"):
        assert compiler_probe.prefetch_works(rt) is False
    assert compiler_probe.prefetch_works(rt) is False  # answered once per process


def test_the_allow_list_names_the_cpu_drivers():
    """PoCL and Intel's CPU runtime run the probes in process; any other platform in a
    child (rusticl, Clover, GPU drivers)."""
    from types import SimpleNamespace as NS

    def dev(platform):
        return NS(platform=NS(name=platform))

    assert compiler_probe.runs_in_process(dev("Portable Computing Language"))
    assert compiler_probe.runs_in_process(dev("Intel(R) OpenCL"))
    for other in ("rusticl", "Clover", "NVIDIA CUDA", "QUALCOMM Snapdragon(TM)", "ARM Platform"):
        assert not compiler_probe.runs_in_process(dev(other)), other
