"""Fault injection (issue 16): a device allocation that fails, a copy back that fails, a
kernel build that fails, and Ctrl-C during ``clattn profile``.

Each gives a clear error (the driver's, with a note saying what clattn was allocating;
``BuildError``; exit code 130 and a message), leaves what the caller passed as it was
(arrays, the user profile directory, ``--out``/``--plot`` files) and leaves the object
usable: the next call, with the fault gone, gives the CPU backend's result.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from cases import decode_args, make_case
from conftest import DEVICES
from prefill_cases import prefill_case
from prefill_cases import run as run_prefill

import clattn
from clattn import cli, runtime
from clattn.tune import ceilings, command, session
from clattn.tune.report import CeilingsResult

cl = runtime.cl()
SPEC = clattn.AttentionSpec(4, 2, 32, page_size=4, dtype="float16")
#: the errors a driver raises when memory runs out
ALLOC_ERRORS = [
    pytest.param(lambda: cl.MemoryError("clCreateBuffer failed: MEM_OBJECT_ALLOCATION_FAILURE "
                                        "(injected)"), id="MemoryError"),
    pytest.param(lambda: cl.RuntimeError("clCreateBuffer failed: OUT_OF_RESOURCES (injected)"),
                 id="RuntimeError"),
]


class Faults:
    """Counts calls of a patched pyopencl function; call number ``fail_at`` raises."""

    def __init__(self, monkeypatch, owner, name, fail_at=None, error=None):
        self.calls, self.fail_at, self.error = 0, fail_at, error
        real = getattr(owner, name)

        def wrapped(*a, **kw):
            self.calls += 1
            if self.calls == self.fail_at:
                raise self.error()
            return real(*a, **kw)
        monkeypatch.setattr(owner, name, wrapped)


def _snapshot(values):
    """Bytes of every numpy array among ``values`` (by position)."""
    return [v.tobytes() if isinstance(v, np.ndarray) else None for v in values]


def _assert_same(out, lse, ref):
    """The CPU backend's result, within f16 rounding (the outputs are f16)."""
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref[0], np.float32),
                               rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, ref[1], rtol=1e-5, atol=1e-4)


def _each_failure(monkeypatch, make, call, error, reset):
    """Yield (the error, obj) for a fresh ``obj = make()`` whose ``call(obj)`` had its
    k-th device allocation fail, for every k a call makes (counted on a warm second call;
    ``reset()`` undoes what those two calls wrote)."""
    call(make())  # runtime-wide allocations (made once per device) out of the way
    with monkeypatch.context() as mp:
        count = Faults(mp, cl, "Buffer")
        call(make())
    reset()
    assert count.calls > 0
    for k in range(1, count.calls + 1):
        obj = make()
        with monkeypatch.context() as mp:
            Faults(mp, cl, "Buffer", fail_at=k, error=error)
            with pytest.raises(cl.Error) as info:
                call(obj)
        assert "(injected)" in str(info.value)
        yield info.value, obj


def _noted(exc):
    """The note clattn adds to a driver error: what it was allocating."""
    notes = getattr(exc, "__notes__", [])
    assert any(n.startswith("clattn: allocating ") for n in notes), (exc, notes)


# ------------------------------------------------------------------------ allocations
@pytest.mark.parametrize("error", ALLOC_ERRORS)
def test_decode_allocation_failure(device, error, monkeypatch):
    """Every allocation of a split RoPE decode (uploads, outputs, RoPE table, plan table,
    workspace) failing in turn: the driver's error with a note, out=/lse= and the inputs
    unchanged, and the same decoder right on the next call."""
    case = make_case(SPEC, [40, 7, 0], seed=3, rope=True)
    args, kw = decode_args(case)
    kw.update(rotary_mode=1, split=8)
    ref = clattn.BatchDecode(SPEC, backend="cpu").run(*args, **kw)
    out = np.full(ref[0].shape, 7, ref[0].dtype)
    lse = np.full(ref[1].shape, 7, np.float32)
    before = _snapshot(list(args) + list(kw.values()) + [out, lse])

    def make():
        return clattn.BatchDecode(SPEC, device, backend="opencl").build()

    def call(dec):
        return dec.run(*args, out=out, lse=lse, **kw)

    def reset():
        out[...], lse[...] = 7, 7

    for exc, dec in _each_failure(monkeypatch, make, call, error, reset):
        _noted(exc)
        assert _snapshot(list(args) + list(kw.values()) + [out, lse]) == before
        res = call(dec)
        _assert_same(res.out, res.lse, ref)
        reset()


@pytest.mark.parametrize("error", ALLOC_ERRORS[:1])
def test_decode_allocation_failure_device_arrays(device, error, monkeypatch):
    """Device inputs, outputs allocated by the call: a failed allocation changes no input."""
    case = make_case(SPEC, [9, 30], seed=4)
    args, kw = decode_args(case)
    ref = clattn.BatchDecode(SPEC, backend="cpu").run(*args, split=8, **kw)
    queue = runtime.Runtime.for_device(device).queue
    dev_args = [cl.array.to_device(queue, a) for a in args]

    def make():
        return clattn.BatchDecode(SPEC, device, backend="opencl").build()

    def call(dec):
        res = dec.run(*dev_args, split=8, **kw)
        return res.out.get(), res.lse.get()

    for exc, dec in _each_failure(monkeypatch, make, call, error, lambda: None):
        _noted(exc)
        for d, a in zip(dev_args, args):
            assert np.array_equal(d.get(), a)
        _assert_same(*call(dec), ref)


@pytest.mark.parametrize("error", ALLOC_ERRORS[:1])
def test_prefill_allocation_failure(device, error, monkeypatch):
    case = prefill_case(SPEC, [3, 9], [5, 2], seed=5, rope=True)
    ref = run_prefill(clattn.BatchPrefill(SPEC, backend="cpu"), case, rotary_mode=1)
    out = np.full(ref[0].shape, 7, ref[0].dtype)
    lse = np.full(ref[1].shape, 7, np.float32)
    before = _snapshot(list(case.values()) + [out, lse])

    def make():
        return clattn.BatchPrefill(SPEC, device, backend="opencl").build()

    def call(pre):
        return run_prefill(pre, case, rotary_mode=1, out=out, lse=lse)

    def reset():
        out[...], lse[...] = 7, 7

    for exc, pre in _each_failure(monkeypatch, make, call, error, reset):
        _noted(exc)
        assert _snapshot(list(case.values()) + [out, lse]) == before
        res = call(pre)
        _assert_same(res.out, res.lse, ref)
        reset()


def _states(seed=0, N=5, K=3, H=2, D=32):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((N, K, H, D)).astype(np.float16)
    s = (rng.standard_normal((N, K, H)) * 4).astype(np.float32)
    s[0, 1] = -np.inf
    return v, s


@pytest.mark.parametrize("error", ALLOC_ERRORS)
def test_merge_allocation_failure(device, error, monkeypatch):
    """merge_state_ (numpy, in place) and merge_states (numpy out=/lse=) with each
    allocation failing: v, s, out, lse unchanged; the next call right."""
    vk, sk = _states()
    v0, s0, vo, so = vk[:, 0].copy(), sk[:, 0].copy(), vk[:, 1].copy(), sk[:, 1].copy()
    v, s = v0.copy(), s0.copy()
    want_pair = clattn.merge_state(v, s, vo, so)
    want_k = clattn.merge_states(vk, sk)
    before = _snapshot([v, s, vo, so, vk, sk])
    out, lse = np.full_like(want_k[0], 7), np.full_like(want_k[1], 7)

    def pair(_):
        clattn.merge_state_(v, s, vo, so, device=device)

    def reset():
        v[...], s[...] = v0, s0
        out[...], lse[...] = 7, 7

    for exc, _ in _each_failure(monkeypatch, lambda: None, pair, error, reset):
        _noted(exc)
        assert _snapshot([v, s, vo, so, vk, sk]) == before
    pair(None)
    _assert_same(v, s, want_pair)

    def kway(_):
        return clattn.merge_states(vk, sk, out=out, lse=lse, device=device)

    for exc, _ in _each_failure(monkeypatch, lambda: None, kway, error, reset):
        _noted(exc)
        assert (out == 7).all() and (lse == 7).all()
    _assert_same(*kway(None), want_k)


# ------------------------------------------------------------------------ copy back
def test_copy_back_failure_writes_no_output(device, monkeypatch):
    """The second result's copy back failing: the first numpy output is not written
    either (no half-delivered result), and the next call is right."""
    case = make_case(SPEC, [9, 30], seed=6)
    args, kw = decode_args(case)
    ref = clattn.BatchDecode(SPEC, backend="cpu").run(*args, **kw)
    out = np.full(ref[0].shape, 7, ref[0].dtype)
    lse = np.full(ref[1].shape, 7, np.float32)
    dec = clattn.BatchDecode(SPEC, device, backend="opencl").build()
    error = ALLOC_ERRORS[1].values[0]
    with monkeypatch.context() as mp:
        Faults(mp, cl.array.Array, "get", fail_at=2, error=error)
        with pytest.raises(cl.Error, match="injected"):
            dec.run(*args, out=out, lse=lse, **kw)
    assert (out == 7).all() and (lse == 7).all()
    res = dec.run(*args, out=out, lse=lse, **kw)
    _assert_same(res.out, res.lse, ref)
    vk, sk = _states(1)
    o, l_ = np.full((5, 2, 32), 7, np.float16), np.full((5, 2), 7, np.float32)
    with monkeypatch.context() as mp:
        Faults(mp, cl.array.Array, "get", fail_at=2, error=error)
        with pytest.raises(cl.Error, match="injected"):
            clattn.merge_states(vk, sk, out=o, lse=l_, device=device)
    assert (o == 7).all() and (l_ == 7).all()


# ------------------------------------------------------------------------ kernel builds
def _failing_builds(monkeypatch, fail_at):
    """pyopencl.Program.build failing on call ``fail_at`` as a compiler would."""
    return Faults(monkeypatch, cl.Program, "build", fail_at=fail_at,
                  error=lambda: cl.RuntimeError("clBuildProgram failed: BUILD_PROGRAM_FAILURE "
                                                "(injected)"))


@pytest.mark.parametrize("fail_at", [1, 2])
def test_build_failure_then_build_works(device, fail_at, monkeypatch, tmp_path):
    """A decode (its decode kernel, then its merge kernel), prefill and merge kernel build
    failing: BuildError naming the device, with the source saved; nothing cached from the
    failure: the same objects build and run right once the compiler works again."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the failed source goes
    ctx = cl.Context([device])  # a runtime of its own: nothing built there yet
    queue = cl.CommandQueue(ctx)
    case = make_case(SPEC, [40, 7], seed=7, rope=True)
    args, kw = decode_args(case)
    kw.update(rotary_mode=1, split=8)
    ref = clattn.BatchDecode(SPEC, backend="cpu").run(*args, **kw)
    dec = clattn.BatchDecode(SPEC, ctx, backend="opencl")
    pcase = prefill_case(SPEC, [3, 9], [5, 2], seed=8)
    pref = run_prefill(clattn.BatchPrefill(SPEC, backend="cpu"), pcase)
    pre = clattn.BatchPrefill(SPEC, ctx, backend="opencl")
    vk, sk = _states(2)
    dvk, dsk = cl.array.to_device(queue, vk), cl.array.to_device(queue, sk)
    want_k = clattn.merge_states(vk, sk)
    calls = [(lambda: dec.run(*args, **kw), ref),
             (lambda: run_prefill(pre, pcase), pref),
             (lambda: [a.get() for a in clattn.merge_states(dvk, dsk)], want_k)]
    for k, (call, want) in enumerate(calls):
        with monkeypatch.context() as mp:
            _failing_builds(mp, fail_at if k == 0 else 1)
            with pytest.raises(clattn.BuildError, match="injected") as info:
                call()
        msg = str(info.value)
        assert device.name in msg and "source saved to" in msg
        saved = msg.split("source saved to ")[1].split("\n")[0]
        assert os.path.dirname(saved) == str(tmp_path) and os.path.getsize(saved) > 0
        res = call()
        _assert_same(res[0], res[1], want)


# ------------------------------------------------------------------------ clattn profile
def _device_name():
    if not DEVICES:
        pytest.skip("no OpenCL device")
    return next(iter(DEVICES))


def _profile(tmp_path, monkeypatch, *extra):
    """``clattn profile --save --out`` into tmp_path: (exit code, the files there after)."""
    monkeypatch.setenv("CLATTN_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.delenv("CLATTN_PROFILE", raising=False)
    rc = cli.main(["profile", "--device", _device_name(), "--quick", "--no-progress", "--save",
                   "--out", str(tmp_path / "report.json"), *extra])
    return rc, sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                      if p.is_file())


def _interrupt(*_a, **_kw):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["ceilings", "correctness"])
def test_profile_interrupted_while_measuring(where, tmp_path, monkeypatch, capsys):
    """Ctrl-C in a measurement: exit code 130, said on stderr, nothing written."""
    if where == "ceilings":
        monkeypatch.setattr(ceilings, "read_bandwidth", _interrupt)
    else:
        monkeypatch.setattr(session, "measure_ceilings", lambda rt, s, *cap: CeilingsResult())
        monkeypatch.setattr(session, "correctness", _interrupt)
    rc, files = _profile(tmp_path, monkeypatch)
    assert rc == command.EXIT_INTERRUPTED == 130
    assert "interrupted; nothing was saved" in capsys.readouterr().err
    assert files == []


def _fake_run(monkeypatch):
    """The measurement replaced by a finished report (the outputs are what is tested)."""
    from test_profiler import _fake_report
    monkeypatch.setattr(session, "tune_device", lambda *a, **kw: _fake_report())


@pytest.mark.parametrize("victim", ["save", "out"])
def test_profile_interrupted_while_writing(victim, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of writing the user profile or the JSON report: exit code 130,
    said on stderr, no half-written file (a file is whole or absent), no temporary left."""
    _fake_run(monkeypatch)
    from clattn import fileio
    real = fileio.os.fsync
    seen = []

    def fsync(fd):
        seen.append(fd)
        if len(seen) == (1 if victim == "save" else 2):
            raise KeyboardInterrupt
        return real(fd)

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    rc, files = _profile(tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert rc == command.EXIT_INTERRUPTED
    assert "interrupted while writing; no file was half written" in err
    if victim == "save":
        assert files == []
    else:
        assert [f for f in files if not f.startswith("cfg/")] == []
        (saved,) = files  # the profile written before the interrupt is whole
        json.loads((tmp_path / saved).read_text())


def test_profile_interrupted_while_plotting(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the PNG is being written: no half-written --plot file either."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    _fake_run(monkeypatch)

    def savefig(self, fname, **kw):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n half a picture")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", savefig)
    rc, files = _profile(tmp_path, monkeypatch, "--plot", str(tmp_path / "plot.png"))
    assert rc == command.EXIT_INTERRUPTED
    assert "interrupted while writing" in capsys.readouterr().err
    assert "plot.png" not in files and not [f for f in files if "plot" in f]
    assert "report.json" not in files
