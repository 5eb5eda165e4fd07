"""DeepSeek-V2-Lite's latent form in the decode stage of ``clattn tune``: full runs time
and verify it (quick runs do not), its pool holds key rows only and is counted so (GB/s
from :attr:`clattn.AttentionSpec.bytes_per_token`), its kernel agrees with the CPU
backend at the model's softmax scale, and the report names it.

One tiny context keeps the PoCL run short: a 48-row sequence, one build."""
from __future__ import annotations

import numpy as np
from test_profiler import POCL, _fake_report, needs_pocl

from clattn import cpu_backend, runtime
from clattn.models import mla_shape
from clattn.profiles import device_info, match
from clattn.tune import search
from clattn.tune.ceilings import Sizing
from clattn.tune.checks import check_decode, compare, decoder, make_case
from clattn.tune.report import format_report
from clattn.tune.search import Candidate, Settings, ShapeResult, Tuner, TuningResult
from clattn.tune.workloads import (
    MLA_MODELS,
    MLA_POINTS,
    PAGE_SIZE,
    PagePool,
    Workload,
    shapes_for,
    spec_for,
)

LATENT = "DeepSeek-V2-Lite (latent)"
#: the tiny MLA point of the runs here: one sequence of 48 rows (3 pages)
TINY = ((1, 48),)


def test_full_settings_add_the_latent_shape_and_quick_ones_do_not():
    full, quick = Settings.make(False, search.NO_BUDGET), Settings.make(True, None)
    assert full.mla_points == MLA_POINTS and not quick.mla_points
    shapes = shapes_for(full.points, mla_points=full.mla_points)
    mla = [s for s in shapes if s.model == LATENT]
    assert [(s.batch, s.context) for s in mla] == list(MLA_POINTS)
    assert shapes == sorted(shapes, key=lambda x: (x.bytes_moved, x.key))
    assert all(s.model != LATENT for s in shapes_for(quick.points, mla_points=quick.mla_points))


def test_latent_shape_is_the_models_spec_and_counts_key_rows_only():
    m = mla_shape("DeepSeek-V2-Lite")
    (s,) = shapes_for((), mla_points=((1, 8192),))
    assert s.spec == m.spec("latent") and s.sm_scale == m.sm_scale
    assert s.key == f"{LATENT} B=1 ctx=8192"
    # one 576-wide f16 row per token (values are its leading 512), q 576 wide, out 512
    assert s.bytes_moved == 8192 * 576 * 2 + 16 * (576 + 512) * 2
    assert s.page_bytes == s.spec.layout.page_bytes == PAGE_SIZE * 576 * 2


@needs_pocl
def test_latent_workload_is_a_key_only_pool_that_verifies_on_pocl():
    """The pool is K rows only, filled with finite f16; the timed call (the workload's
    arguments and keywords) and the tuner's verification case agree with the CPU backend
    at the model's softmax scale."""
    rt = runtime.Runtime.for_device(POCL)
    (model,) = MLA_MODELS
    spec = spec_for(model)
    (shape,) = shapes_for((), mla_points=TINY)
    pool = PagePool(rt, spec, shape.num_pages + 1, seed=3)
    w = Workload(rt, pool, shape.batch, shape.context, seed=4, sm_scale=shape.sm_scale)
    try:
        assert pool.pages.shape == (shape.num_pages + 1, shape.page_bytes)
        host = pool.host_pages(pool.num_pages)
        rows = host.view(np.float16)
        assert np.isfinite(rows).all() and np.abs(rows).max() <= 1.0
        base = match(device_info(POCL), user=False).profile
        dec = decoder(spec, POCL, base)
        res = dec.run(*w.args(hot=True), **w.kw, out=w.out, lse=w.lse)
        for evt in getattr(res, "events", (res.event,)):
            evt.wait()
        ref_out, ref_lse = cpu_backend.batch_decode(spec, *w.host_args(), **w.kw)[:2]
        ok, err, why = compare(w.out.get(), w.lse.get(), ref_out, ref_lse, spec.dtype)
        assert ok, (err, why)
        assert w.out.shape == (1, 16, 512)
        assert ref_out.shape == (1, 16, 512)
        args, kw = make_case(spec, [0, 1, 45], seed=5)
        assert args[1].shape[1] == spec.layout.page_bytes and spec.layout.kinds == (0,)
        assert check_decode(LATENT, dec, args, {**kw, "sm_scale": model.sm_scale}).passed
    finally:
        w.release()
        pool.release()


@needs_pocl
def test_full_tuner_times_and_verifies_the_latent_shape(monkeypatch):
    """A full tuner (no time budget) at a tiny context: the default is verified on the
    latent model and timed on its shape, which is scored with the others."""
    monkeypatch.setattr(search, "sizing", lambda dev: Sizing(8 << 20))
    settings = Settings(quick=False, budget_s=search.NO_BUDGET, points=TINY, mla_points=TINY,
                        max_kernels=1, max_plans=0, passes=1, target_s=0.005, reps=3)
    rt = runtime.Runtime.for_device(POCL)
    info = device_info(POCL)
    tuner = Tuner(rt, info, match(info, user=False).profile, settings,
                  search.Progress(60, enabled=False))
    tuner.t0 -= 1e6  # as if a slow machine had spent a million seconds: no verdict changes
    assert LATENT in tuner.specs and LATENT in {s.model for s in tuner.shapes}
    res = tuner.run()
    default = res.candidates[0]
    assert default.status == "ok", default.reason
    assert f"{LATENT} B=1 ctx=48" in default.times and default.score == len(res.shapes)
    assert any(r.shape.model == LATENT for r in res.per_shape)


def test_report_names_the_latent_shape():
    rep = _fake_report()
    (shape,) = shapes_for((), mla_points=MLA_POINTS)
    prof = rep.tuning.chosen.profile
    cand = Candidate(0, prof, "default", status="ok", times={shape.key: 1e-3}, score=1.0)
    rep.tuning = TuningResult(Settings.make(False, None), [shape], {}, [cand], 1.0,
                              chosen=cand, default=cand,
                              per_shape=[ShapeResult(shape, 2e-3, 1e-3, "no split", 4)])
    text = format_report(rep)
    assert f"{LATENT} B=1 ctx=8192" in text
    gbps = rep.tuning.per_shape[0].tuned_gbps
    assert abs(gbps - shape.bytes_moved / 1e-3 * 1e-9) < 1e-9
