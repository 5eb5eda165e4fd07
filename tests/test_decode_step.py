"""A prepared step (BatchDecode.prepare) runs every layer like BatchDecode.run does."""
import threading
import warnings

import numpy as np
import pytest
from cases import compare, decode_args, make_case
from naive import naive_decode

import clattn
from clattn import runtime


def _layers(spec, case, n, seed):
    rng = np.random.default_rng(seed)
    dt = spec.np_dtype
    qs = [rng.standard_normal(case["q"].shape).astype(dt) for _ in range(n)]
    pools = [rng.standard_normal(case["pages"].shape).astype(dt) for _ in range(n)]
    return qs, pools


@pytest.mark.parametrize("split", [False, 16])
@pytest.mark.parametrize("profile", [None, "adreno-7xx"])
def test_step_equals_run_per_layer(device, split, profile):
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float16", sliding_window=True)
    case = make_case(spec, [1, 70, 0, 33], seed=4, window=20, sinks=3, rope=True)
    args, kw = decode_args(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dec = clattn.BatchDecode(spec, device, profile=profile)
    kw["rotary_mode"] = 1
    plan = dec.plan(args[2], args[4], window_offset=kw["window_offset"],
                    sink_size=kw["sink_size"], split=split)
    step = dec.prepare(*args[2:], num_pages=case["pages"].shape[0], plan=plan, **kw)
    qs, pools = _layers(spec, case, 3, seed=9)
    cl = runtime.cl()
    queue = dec.setup.runtime.queue
    outs = [cl.array.empty(queue, case["q"].shape, spec.np_dtype) for _ in qs]
    lses = [cl.array.empty(queue, case["q"].shape[:2], np.float32) for _ in qs]
    dq = [cl.array.to_device(queue, q) for q in qs]
    dp = [cl.array.to_device(queue, p) for p in pools]
    for i in range(3):  # device path (outputs given) and host path
        step.run(dq[i], dp[i], out=outs[i], lse=lses[i])
    for i in range(3):
        host = step.run(qs[i], pools[i])
        ref = naive_decode(qs[i], pools[i], *args[2:], **kw)
        compare(outs[i].get(), lses[i].get(), *ref, spec.dtype)
        compare(host.out, host.lse, *ref, spec.dtype)
        again = dec.run(qs[i], pools[i], *args[2:], plan=plan, **kw)
        assert np.array_equal(again.out, host.out) and np.array_equal(again.lse, host.lse)


def test_step_checks_operands(device):
    spec = clattn.AttentionSpec(4, 1, 64, page_size=16, dtype="float32")
    case = make_case(spec, [5, 9], seed=1)
    args, kw = decode_args(case)
    dec = clattn.BatchDecode(spec, device)
    P = case["pages"].shape[0]
    step = dec.prepare(*args[2:], num_pages=P, **kw)
    with pytest.raises(ValueError, match="pages: a pool of"):
        step.run(args[0], np.zeros((P + 1,) + case["pages"].shape[1:], np.float32))
    with pytest.raises(ValueError, match="prepared for 2"):
        step.run(args[0][:1], args[1])
    with pytest.raises(TypeError, match="q: dtype"):
        step.run(args[0].astype(np.float16), args[1])
    bad = args[3].copy()
    bad[0] = P  # out of the pool: refused when preparing
    with pytest.raises(ValueError, match="page_indices"):
        dec.prepare(args[2], bad, *args[4:], num_pages=P, **kw)
    for bad_p in (-1, True, 2**31, 10**12):   # 2**31 and up failed in pyopencl's binding
        with pytest.raises(ValueError, match=r"num_pages=.*an int in 0\.\.2\*\*31 - 1"):
            dec.prepare(*args[2:], num_pages=bad_p, **kw)


def test_step_from_threads(device):
    """One step shared by several threads: every result equals the single-threaded one."""
    import sys
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    case = make_case(spec, [40, 3, 17], seed=2)
    args, kw = decode_args(case)
    dec = clattn.BatchDecode(spec, device)
    step = dec.prepare(*args[2:], num_pages=case["pages"].shape[0], **kw)
    qs, pools = _layers(spec, case, 8, seed=3)
    want = [step.run(q, p) for q, p in zip(qs, pools)]
    got = [None] * 8
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        def work(i):
            for _ in range(5):
                got[i] = step.run(qs[i], pools[i])
        ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    for w, g in zip(want, got):
        assert np.array_equal(w.out, g.out) and np.array_equal(w.lse, g.lse)


def test_a_failed_launch_keeps_the_tables_upload_events(device):
    """A step whose launch is refused (an out view at a byte offset no element starts at,
    caught when the arguments are bound) still waits for its tables' uploads next time."""
    cl = runtime.cl()
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    case = make_case(spec, [5, 9], seed=1)
    args, kw = decode_args(case)
    dec = clattn.BatchDecode(spec, device)
    queue = dec.setup.runtime.queue
    tables = [cl.array.to_device(queue, t) for t in args[2:5]]
    for t in tables:   # the tables' producers, still pending as far as the step knows
        t.add_event(cl.enqueue_marker(queue))
    step = dec.prepare(*tables, num_pages=case["pages"].shape[0], **kw)
    pending = list(step._table_events)
    assert pending
    q, pages = (cl.array.to_device(queue, a) for a in args[:2])
    buf = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, 4 * 2 * 8 * 64 + 64)
    bad_out = cl.array.Array(queue, (2, 8, 64), np.float32, data=buf, offset=2)
    lse = cl.array.zeros(queue, (2, 8), np.float32)
    with pytest.raises(Exception):
        step.run(q, pages, out=bad_out, lse=lse)
    assert step._table_events == pending
    out = cl.array.zeros(queue, (2, 8, 64), np.float32)
    r = step.run(q, pages, out=out, lse=lse)
    assert not step._table_events
    ref_out, ref_lse = naive_decode(args[0], args[1], *args[2:5])
    compare(r.out.get(), r.lse.get(), ref_out, ref_lse, np.float32)


def test_split_runs_share_the_decoders_workspace(device):
    """A step prepared for a small split plan, then runs whose plans need more states:
    the decoder's one workspace grows, the step keeps running right on the buffers it
    was prepared with, and split launches of the step and of run() interleave exactly."""
    spec = clattn.AttentionSpec(4, 2, 32, page_size=8, dtype="float32")
    small = make_case(spec, [40, 3], seed=5)
    large = make_case(spec, [300, 170, 9], seed=6)
    dec = clattn.BatchDecode(spec, device)
    args_s, kw_s = decode_args(small)
    args_l, kw_l = decode_args(large)
    plan_s = dec.plan(args_s[2], args_s[4], split=8)
    plan_l = dec.plan(args_l[2], args_l[4], split=8)
    assert plan_s.split and plan_l.split and plan_l.n_ws > plan_s.n_ws
    step = dec.prepare(*args_s[2:], num_pages=small["pages"].shape[0], plan=plan_s, **kw_s)
    first = dec.opencl.workspace(plan_s.n_ws)
    ref_s = naive_decode(*args_s, **kw_s)
    ref_l = naive_decode(*args_l, **kw_l)
    for _ in range(3):
        res = step.run(small["q"], small["pages"])
        compare(res.out, res.lse, *ref_s, spec.dtype)
        res = dec.run(*args_l, plan=plan_l, **kw_l)
        compare(res.out, res.lse, *ref_l, spec.dtype)
    grown = dec.opencl.workspace(plan_l.n_ws)
    assert grown[0] is not first[0] and dec.opencl.workspace(1)[0] is grown[0]
