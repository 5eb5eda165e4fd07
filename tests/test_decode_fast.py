"""BatchDecode.run's short path (device arrays, a plan, out=/lse=): the same results as the
checked path, and every refusal of the checked path still made for the arrays of each call,
after the path has kept state from earlier calls."""
import warnings

import numpy as np
import pytest
from cases import compare, decode_args, make_case
from naive import naive_decode

import clattn
from clattn import runtime
from clattn.decode_fast import OneCallPath


def _decoder(spec, device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return clattn.BatchDecode(spec, device)


def _dev(queue, a):
    return runtime.cl().array.to_device(queue, np.ascontiguousarray(a))


def _outputs(queue, case, dtype):
    cla = runtime.cl().array
    return (cla.zeros(queue, case["q"].shape, dtype),
            cla.zeros(queue, case["q"].shape[:2], np.float32))


@pytest.mark.parametrize("kind", ["plain", "window-rope-packed", "split"])
def test_short_path_equals_checked_path_and_oracle(device, kind):
    window = kind == "window-rope-packed"
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float16", sliding_window=window)
    lengths = [1, 70, 0, 33] if kind != "split" else [300, 5, 129]
    case = make_case(spec, lengths, seed=3, window=20 if window else None,
                     sinks=3 if window else None, rope=window)
    args, kw = decode_args(case)
    dec = _decoder(spec, device)
    queue = dec.setup.runtime.queue
    plan = dec.plan(args[2], args[4], window_offset=kw.get("window_offset"),
                    sink_size=kw.get("sink_size"), split=16 if kind == "split" else None)
    assert plan.split == (kind == "split")
    ref = naive_decode(*args, **kw, **({"rotary_mode": 1} if window else {}))
    tables = dict(page_indptr=_dev(queue, args[2]), page_indices=_dev(queue, args[3]))
    call_kw = dict(rotary_mode=1, q_pos=_dev(queue, kw["q_pos"]),
                   k_pos_offset=_dev(queue, kw["k_pos_offset"])) if window else {}
    if window:  # the packed [3, B] table, as a view into a larger buffer
        packed = np.stack([args[4], kw["window_offset"], kw["sink_size"]]).astype(np.int32)
        big = _dev(queue, np.concatenate([np.full(5, -7, np.int32), packed.ravel()]))
        call_kw["length_info"] = big[5:].reshape(packed.shape)
    else:
        tables["last_page_len"] = _dev(queue, args[4])
    dq, dpages = _dev(queue, args[0]), _dev(queue, args[1])
    results = []
    for _ in range(3):  # the first call keeps state, the next ones reuse it
        out, lse = _outputs(queue, case, spec.np_dtype)
        res = dec.run(dq, dpages, **tables, **call_kw, plan=plan, out=out, lse=lse)
        assert res.out is out and res.lse is lse and res.event is res.events[-1]
        assert len(res.events) == (2 if plan.split and not dec.profile.fold_merge else 1)
        results.append((out.get(), lse.get()))
    checked_out, checked_lse = _outputs(queue, case, spec.np_dtype)
    dec.run(dq, dpages, **tables, **call_kw, plan=plan, out=checked_out, lse=checked_lse,
            queue=queue)  # a queue given: the checked path
    for o, s in results:
        compare(o, s, *ref, spec.dtype)
        assert np.array_equal(o, checked_out.get()) and np.array_equal(s, checked_lse.get())


@pytest.mark.parametrize("split", [False, 16])
def test_short_path_with_learned_sinks(device, split, monkeypatch):
    """Device sink logits on the short path: the oracle's sinks, the checked path's bits,
    and a later call without sinks sink-free again (the kept kernel's flag re-set)."""
    spec = clattn.AttentionSpec(8, 2, 64, page_size=16, dtype="float32")
    case = make_case(spec, [300, 0, 33], seed=4)
    args, _ = decode_args(case)
    dec = _decoder(spec, device)
    queue = dec.setup.runtime.queue
    plan = dec.plan(args[2], args[4], split=split)
    sinks = np.random.default_rng(1).normal(0, 2, spec.num_qo_heads).astype(np.float32)
    dev_args = [_dev(queue, a) for a in args]
    short = []
    real = OneCallPath.run

    def spy(self, *a, **k):
        short.append(real(self, *a, **k))
        return short[-1]

    monkeypatch.setattr(OneCallPath, "run", spy)
    for with_sinks in (True, False, True):
        kw = dict(sink_logits=_dev(queue, sinks)) if with_sinks else {}
        out, lse = _outputs(queue, case, spec.np_dtype)
        dec.run(*dev_args, plan=plan, out=out, lse=lse, **kw)
        assert short.pop() is not None  # taken by the short path
        checked_out, checked_lse = _outputs(queue, case, spec.np_dtype)
        dec.run(*dev_args, plan=plan, out=checked_out, lse=checked_lse, queue=queue, **kw)
        ref = naive_decode(*args, sink_logits=sinks if with_sinks else None)
        compare(out.get(), lse.get(), *ref, spec.dtype)
        assert np.array_equal(out.get(), checked_out.get())
        assert np.array_equal(lse.get(), checked_lse.get())


def test_new_tables_under_a_kept_plan(device):
    """Other device tables of the same shapes under the same (unsplit) plan: the call reads
    the tables it is given, not the first call's."""
    spec = clattn.AttentionSpec(4, 1, 64, page_size=16, dtype="float32")
    case = make_case(spec, [40, 17], seed=5, extra_pages=4)
    args, _ = decode_args(case)
    dec = _decoder(spec, device)
    queue = dec.setup.runtime.queue
    plan = dec.plan(args[2], args[4], split=False)
    dq, dpages = _dev(queue, args[0]), _dev(queue, args[1])
    shorter = np.array([3, 16], np.int32)
    rev = args[3][::-1].copy()
    for indices, last in ((args[3], args[4]), (rev, shorter), (args[3], shorter)):
        out, lse = _outputs(queue, case, spec.np_dtype)
        dec.run(dq, dpages, _dev(queue, args[2]), _dev(queue, indices), _dev(queue, last),
                plan=plan, out=out, lse=lse)
        compare(out.get(), lse.get(), *naive_decode(args[0], args[1], args[2], indices, last),
                spec.dtype)


def test_refusals_after_the_path_kept_state(device):
    spec = clattn.AttentionSpec(4, 1, 64, page_size=16, dtype="float16")
    case = make_case(spec, [40, 17], seed=6)
    args, _ = decode_args(case)
    dec = _decoder(spec, device)
    queue = dec.setup.runtime.queue
    plan = dec.plan(args[2], args[4])
    d = [_dev(queue, a) for a in args]
    out, lse = _outputs(queue, case, spec.np_dtype)
    dec.run(*d, plan=plan, out=out, lse=lse)
    before = out.get(), lse.get()
    cla = runtime.cl().array
    bad = [
        (TypeError, "page_indices: dtype int64",
         dict(page_indices=_dev(queue, args[3].astype(np.int64)))),
        (ValueError, r"page_indptr: expected shape \(3\), got \(2,\)",
         dict(page_indptr=_dev(queue, args[2][:2]))),
        (TypeError, "q: dtype float32", dict(q=_dev(queue, args[0].astype(np.float32)))),
        (ValueError, "plan: made for 2 sequences", dict(
            q=d[0][:1], page_indptr=d[2][:2], last_page_len=d[4][:1],
            out=cla.empty(queue, (1,) + out.shape[1:], out.dtype), lse=lse[:1])),
        (ValueError, "lse: expected shape", dict(lse=cla.empty(queue, (2, 3), np.float32))),
        (ValueError, "sm_scale=inf", dict(sm_scale=float("inf"))),
        (ValueError, "rotary_mode=2", dict(rotary_mode=2)),
        (ValueError, "q_pos: required", dict(rotary_mode=1)),
        (ValueError, "window_offset/sink_size: given", dict(window_offset=d[4])),
        (ValueError, "C-contiguous", dict(q=cla.to_device(
            queue, np.zeros((64, 4, 2), np.float16)).transpose((2, 1, 0)))),
    ]
    for exc, match, change in bad:
        call = dict(q=d[0], pages=d[1], page_indptr=d[2], page_indices=d[3],
                    last_page_len=d[4], out=out, lse=lse, plan=plan)
        call.update(change)
        with pytest.raises(exc, match=match):
            dec.run(**call)
        queue.finish()
        assert np.array_equal(out.get(), before[0]) and np.array_equal(lse.get(), before[1])
