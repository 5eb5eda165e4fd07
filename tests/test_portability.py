"""Every kernel family on every usable OpenCL stack present, f16 included.

conftest's ``any_device`` adds the further CPU stacks the rest of the suite leaves out
(Debian's PoCL 3.1 beside PyPI's, Mesa's rusticl on llvmpipe with
``RUSTICL_ENABLE=llvmpipe``) to the devices the suite runs on. Each family is checked on
a small shape against the float64 oracle (decode, split-KV and its merge, prefill) or
numpy's quantizer bit for bit (append into quantized pages), with the device's own
profile and with the GPU profile (the tiled kernels that Adreno and Mali run through
rusticl). Shapes are few and small: on llvmpipe each new kernel costs seconds to tens of
seconds of JIT.

A device whose compiler cannot build a kernel is refused by name, never used: the
refusal is checked on the devices that have the fault and, by simulating it, everywhere.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from cases import compare, decode_args, make_case, merge_cases, oracle, spec_scenario
from conftest import GPU_PROFILE, UNUSABLE
from naive import naive_decode, naive_merge
from prefill_cases import naive_prefill, prefill_case
from prefill_cases import run as run_prefill

import clattn
from clattn import quant, runtime

F16, F32 = "float16", "float32"
#: (profile, dtype): the device's own profile in f16, the GPU profile in both
VARIANTS = [(None, F16), (GPU_PROFILE, F16), (GPU_PROFILE, F32)]
IDS = ["own-f16", "gpu-f16", "gpu-f32"]


def _scenario(dtype):
    return spec_scenario(f"gqa4-d64-win-{dtype}", 8, 2, 64, page_size=16, dtype=dtype,
                         sliding_window=True)


def _quiet(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # profile fitting notes, probe notes
        return make()


@pytest.mark.parametrize("profile,dtype", VARIANTS, ids=IDS)
def test_decode_split_and_merge(any_device, get_decoder, profile, dtype):
    """Decode with a window, sinks and RoPE in the kernel, unsplit and split into
    partitions of 32 rows (the merge kernel joins them)."""
    sc = _scenario(dtype)
    dec = _quiet(lambda: get_decoder(sc.spec, any_device, profile))
    case = make_case(sc.spec, [37, 1, 130], seed=11, rope=True, window=[5, 0, 40],
                     sinks=[2, 0, 4])
    args, call = decode_args(case)
    want = oracle(sc, case, rotary_mode=1)
    for split in (False, 32):
        plan = dec.plan(args[2], args[4], window_offset=call.get("window_offset"),
                        sink_size=call.get("sink_size"), split=split)
        res = dec.run(*args, **call, rotary_mode=1, plan=plan)
        compare(res.out, res.lse, *want, dtype, what=f"{any_device.name} split={split}: ")


def test_merge_states(any_device):
    """The pairwise merge kernel on f16 states, empty (-inf) sides included."""
    rng = np.random.default_rng(4)
    (v, s, vo, so), _ = merge_cases(rng, 6, 4, 64, F16)
    got_v, got_s = _quiet(lambda: clattn.merge_state(v, s, vo, so, device=any_device))
    want_v, want_s = naive_merge(v, s, vo, so)
    compare(got_v, got_s, want_v, want_s, F16, what=f"{any_device.name} merge: ")


@pytest.mark.parametrize("profile", [None, GPU_PROFILE], ids=["own", "gpu"])
def test_prefill_over_a_cached_prefix(any_device, profile):
    """Causal f16 prefill of ragged chunks over cached rows, window and RoPE in the kernel."""
    sc = _scenario(F16)
    pre = _quiet(lambda: clattn.BatchPrefill(sc.spec, any_device, backend="opencl",
                                             profile=profile))
    if profile and "llvmpipe" in any_device.name.lower():
        assert pre.geometry.strategy == "rows", "the fit keeps llvmpipe off the tiled prefill"
        assert (pre.geometry.vec, pre.geometry.kb) == (2, 16), \
            "a GPU profile falls back to the rows settings llvmpipe builds in seconds"
    case = prefill_case(sc.spec, [20, 0, 33], [5, 9, 1], seed=6, rope=True,
                        window=[3, 0, 10], sinks=[2, 0, 1])
    res = run_prefill(pre, case, rotary_mode=1)
    compare(res.out, res.lse, *naive_prefill(sc, case, rotary_mode=1), F16,
            what=f"{any_device.name} prefill: ")


@pytest.mark.parametrize("profile", [None, GPU_PROFILE], ids=["own", "gpu"])
def test_cache_append_quantized_pages(any_device, profile):
    """The cache's append kernel quantizes f16 keys to q4_0 and values to q8_0 with
    numpy's bytes; a decode step over those pages agrees with the CPU backend's."""
    spec = clattn.AttentionSpec(4, 2, 64, page_size=16, dtype=F16, k_format="q4_0",
                                v_format="q8_0")
    rng = np.random.default_rng(8)
    T = 21
    k = rng.standard_normal((T, 2, 64)).astype(F16)
    v = rng.standard_normal((T, 2, 64)).astype(F16)
    q = rng.standard_normal((1, 4, 64)).astype(F16)
    pools = {}
    for where in ("cpu", "device"):
        if where == "cpu":
            cache = clattn.PagedKVCache(spec, 1, backend="cpu", num_pages=4)
        else:
            cache = _quiet(lambda: clattn.PagedKVCache(spec, 1, device=any_device, num_pages=4,
                                                       profile=profile, backend="opencl"))
        cache.add("s")
        cache.begin(["s"], [T - 1])
        cache.append(0, k[:-1], v[:-1])
        cache.end()
        cache.begin(["s"], [1])
        cache.append(0, k[-1:], v[-1:])
        res = cache.attend(0, q)
        pages = np.array(cache.table.seqs["s"].pages[:cache.table.seqs["s"].npages])
        cache.end()
        pool = cache.pools[0]
        pools[where] = pool if isinstance(pool, np.ndarray) else pool.get()
    for kind in (0, 1):
        got_d, got_s = quant.region_views(pools["device"], spec.layout, kind)
        want_d, want_s = quant.region_views(pools["cpu"], spec.layout, kind)
        assert np.array_equal(got_d[pages], want_d[pages]), f"kind {kind}: codes differ"
        assert np.array_equal(got_s[pages].view(np.uint16), want_s[pages].view(np.uint16)), \
            f"kind {kind}: scales differ"
    # the last step's decode against the float64 oracle over the dequantized pages
    kd, vd = quant.unpack_pool(pools["device"], spec.layout)
    dense = np.stack([kd, vd], axis=1)
    last = T - (len(pages) - 1) * 16
    want = naive_decode(q, dense, np.array([0, len(pages)]), pages.astype(np.int32),
                        np.array([last]))
    compare(res.out, res.lse, *want, F16, what=f"{any_device.name} quantized decode: ")


def test_prefill_fit_passes_over_the_llvmpipe_fault():
    """Mesa's llvmpipe (its loop budget: tests/test_loop_budget.py) gets the rows prefill
    kernel even under a GPU profile, with a note; every other device keeps the tiled one."""
    from clattn.fit import Limits, prefill_geometry
    from clattn.profiles import get_profile

    spec = _scenario(F16).spec
    prof = get_profile(GPU_PROFILE)
    info = {"device_name": "llvmpipe (LLVM 15.0.6, 256 bits)", "platform_name": "rusticl",
            "max_work_group_size": 1024, "local_mem_size_bytes": 32768}
    geom = prefill_geometry(spec, prof, Limits.from_info(info))
    assert geom.strategy == "rows" and any("llvmpipe" in n for n in geom.notes)
    info["device_name"] = "Adreno (TM) 740"
    assert prefill_geometry(spec, prof, Limits.from_info(info)).strategy == "tiled"


# ---------------------------------------------------------------------------- unusable devices
def test_a_device_whose_compiler_fails_is_refused_by_name(any_device, monkeypatch):
    """A device whose compiler cannot build a kernel (simulated on a real one): the default
    choice passes over it, naming it explicitly raises DeviceUnusableError naming it and
    the compiler's words, and nothing falls back silently."""
    why = "error: unknown target CPU 'generic'"
    real = runtime.device_problem
    monkeypatch.setattr(runtime, "device_problem",
                        lambda d: why if d.int_ptr == any_device.int_ptr else real(d))
    assert runtime.select_device() is None or runtime.select_device().int_ptr != any_device.int_ptr
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype=F32)
    with pytest.raises(clattn.DeviceUnusableError, match="unknown target CPU") as err:
        clattn.BatchDecode(spec, any_device)
    assert any_device.name.strip() in str(err.value)
    with pytest.raises(clattn.DeviceUnusableError):
        clattn.merge_state(*merge_cases(np.random.default_rng(0), 3, 2, 64, F32)[0],
                           device=any_device)


@pytest.mark.parametrize("wrong", ["gid == 0 ? 7 : 3", "gid == 3 ? 5 : 7"],
                         ids=["most-wrong", "one-wrong"])
def test_a_device_that_computes_wrong_is_unusable(device, monkeypatch, wrong):
    """The health check's one-line kernel must write every value right: a device whose
    kernel writes any wrong value (one of four, or all but one) is unusable, by name."""
    monkeypatch.setattr(runtime, "_PROBLEMS", {})
    monkeypatch.setattr(runtime, "_HEALTH_SOURCE",
                        "__kernel void clattn_health(__global int* x) { int gid = "
                        f"get_global_id(0); x[gid] = {wrong}; }}")
    assert runtime.device_problem(device) == "a one-line kernel ran but wrote wrong values"
    monkeypatch.setattr(runtime, "_PROBLEMS", {})
    monkeypatch.undo()
    assert runtime.device_problem(device) is None


def test_only_the_simulator_usable_falls_back_to_the_cpu_backend(oclgrind_device,
                                                                monkeypatch):
    """Every real device unusable (simulated) and Oclgrind installed: the default choice is
    no device, not the 1000x slower simulator; an attention object says so in one message
    naming why and where the simulator is, and runs the CPU backend (README); Oclgrind is
    still chosen when named."""
    from clattn import device as device_mod
    monkeypatch.delenv("PYOPENCL_CTX", raising=False)
    monkeypatch.setattr(runtime, "device_problem",
                        lambda d: None if runtime.is_simulator(d) else "error: simulated")
    monkeypatch.setattr(device_mod, "_WARNED_NO_DEVICE", False)
    assert runtime.select_device() is None
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype=F32)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        dec = clattn.BatchDecode(spec)
        again = clattn.BatchPrefill(spec)
    msgs = [str(w.message) for w in got]
    assert len(msgs) == 1 and "no usable OpenCL device" in msgs[0] and \
        "error: simulated" in msgs[0] and "device='oclgrind'" in msgs[0], msgs
    assert dec.backend == "cpu" and again.setup is None
    with pytest.raises(clattn.NoDeviceError, match="no usable OpenCL device"):
        clattn.BatchDecode(spec, backend="opencl")
    assert runtime.select_device("oclgrind").int_ptr == oclgrind_device.int_ptr


def test_devices_present_that_cannot_build_are_refused():
    """Each device present whose compiler fails (PyPI's PoCL 3.0 on a CPU its LLVM 14 does
    not know, such as AMD's Zen 5) is refused with the driver's reason, the default choice
    is a usable device, and "pocl" names a usable PoCL where one is present. (Nothing to
    check where every device builds: the simulated fault above covers the logic.)"""
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype=F32)
    for key, (dev, why) in UNUSABLE.items():
        assert runtime.device_problem(dev) == why, key
        with pytest.raises(clattn.DeviceUnusableError, match="cannot build a kernel"):
            clattn.BatchDecode(spec, dev)
        chosen = runtime.select_device()
        assert chosen is None or runtime.device_problem(chosen) is None
        pocls = [d for d in runtime.all_devices()
                 if "portable computing language" in d.platform.name.lower()]
        if key.startswith("pocl") and any(runtime.device_problem(d) is None for d in pocls):
            assert runtime.device_problem(runtime.select_device("pocl")) is None
