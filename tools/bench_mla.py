#!/usr/bin/env python
"""Multi-head latent attention decode: the latent form beside the decompressed form.

For each MLA model of ``clattn.models.MLA_SHAPES`` (DeepSeek-V2-Lite, MiniCPM3-4B), each
OpenCL device and each context: one sequence's decode through ``BatchDecode`` in both cache
forms (``MLAShape.spec``), device-resident arrays, the same pages every call, the forms
alternated call by call (medians of kernel event time: decode and merge). Printed per row:
KV bytes per token per layer of each form, the sequence's KV bytes, both times and the
latent form's time and bytes over the decompressed form's.

* decompressed: ``num_heads`` KV heads of keys ``qk_nope + qk_rope`` wide and values
  ``v_head_dim`` wide (what transformers' attention interface sees);
* latent: one KV head shared by every query head, rows of ``kv_lora_rank + qk_rope`` values
  whose leading ``kv_lora_rank`` are the value (``value_in_key``); queries and outputs
  ``kv_lora_rank + qk_rope`` and ``kv_lora_rank`` wide. The absorption's matmuls (the query
  through the key up-projection, the output through the value up-projection) are the
  model's, not attention's, and are not timed.

Before timing, each form's output on the row's inputs is checked against the float64
oracle of the same pages (``clattn.quant.unpack_pool``); a mismatch ends the script with
status 1. Both forms see N(0, 1) rows and queries of their own widths.

    python tools/bench_mla.py --devices pocl,intel --contexts 4096,16384
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
import pyopencl.array as cla
from common import cpu_description, csv, driver_description, log  # first: clattn on the path

from clattn import BatchDecode, runtime
from clattn.models import MLA_SHAPES, MLAShape, mla_shape
from clattn.quant import pack_pool, unpack_pool
from clattn.spec import AttentionSpec
from clattn.tune.timing import table

FORMS = ("decompressed", "latent")
PAGE = 16


def oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """float64 attention of one sequence: q [H_qo, D], k [T, H_kv, D], v [T, H_kv, D_v]."""
    hqo, hkv = q.shape[0], k.shape[1]
    g = hqo // hkv
    out = np.empty((hqo, v.shape[-1]))
    for h in range(hqo):
        s = k[:, h // g].astype(np.float64) @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = p @ v[:, h // g].astype(np.float64) / p.sum()
    return out


class FormRow:
    """One form's decoder, pages, tables and query on a device, checked once."""

    def __init__(self, dev: Any, m: MLAShape, form: str, ctx: int, kv_format: str | None,
                 rng: np.random.Generator) -> None:
        self.spec: AttentionSpec = m.spec(form, page_size=PAGE, kv_format=kv_format)
        s = self.spec
        pages = ctx // PAGE
        k = rng.standard_normal((pages, s.num_kv_heads, PAGE, s.head_dim)).astype(np.float32)
        v = None if s.value_in_key else rng.standard_normal(
            (pages, s.num_kv_heads, PAGE, s.head_dim_v)).astype(np.float32)
        self.pool = pack_pool(k, v, s.layout)
        self.q = rng.standard_normal((1, s.num_qo_heads, s.head_dim)).astype(s.np_dtype)
        self.dec = BatchDecode(s, device=dev)
        queue = self.dec.setup.runtime.queue
        self.queue = queue
        indptr = np.array([0, pages], np.int32)
        self.indices = rng.permutation(pages).astype(np.int32)
        last = np.array([PAGE], np.int32)
        self.args = [cla.to_device(queue, a) for a in (self.q, self.pool, indptr, self.indices,
                                                       last)]
        self.plan = self.dec.plan(indptr, last)
        self.scale = m.sm_scale

    def check(self) -> str | None:
        """None when the output is within the f16 storage bound of the float64 oracle."""
        res = self.dec.run(*self.args, plan=self.plan, sm_scale=self.scale)
        self.queue.finish()
        got = res.out.get()[0].astype(np.float64)
        kk, vv = unpack_pool(self.pool, self.spec.layout, self.indices)
        s = self.spec
        kk = kk.transpose(0, 2, 1, 3).reshape(-1, s.num_kv_heads, s.head_dim)
        vv = vv.transpose(0, 2, 1, 3).reshape(-1, s.num_kv_heads, s.head_dim_v)
        ref = oracle(self.q[0], kk, vv, self.scale)
        # f16 output rounding (2**-11 relative) over f32 accumulation: a few output ulps
        bound = 4 * 2.0 ** -11 * max(1.0, float(np.abs(ref).max()))
        err = float(np.abs(got - ref).max())
        return None if err <= bound else f"max error {err:.3g} > {bound:.3g}"

    def time_ms(self) -> float:
        res = self.dec.run(*self.args, plan=self.plan, sm_scale=self.scale)
        self.queue.finish()
        return sum(e.profile.end - e.profile.start for e in res.events) * 1e-6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=csv, default=["pocl", "intel"])
    ap.add_argument("--models", type=csv, default=[m.name for m in MLA_SHAPES])
    ap.add_argument("--contexts", type=lambda s: csv(s, int), default=[4096, 16384])
    ap.add_argument("--formats", type=csv, default=["float16"],
                    help="page formats of both forms (float16, q8_0, q4_0)")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per row")
    args = ap.parse_args(argv)
    devices = {name: runtime.select_device(name) for name in args.devices}
    rows, failed = [], False
    for name in args.models:
        m = mla_shape(name)
        for fmt in args.formats:
            for ctx in args.contexts:
                for dname, dev in devices.items():
                    forms = {f: FormRow(dev, m, f, ctx, fmt, np.random.default_rng(0))
                             for f in FORMS}
                    bad = {f: r.check() for f, r in forms.items()}
                    if any(bad.values()):
                        log(f"{name} {fmt} ctx={ctx} {dname}: MISMATCH {bad}")
                        failed = True
                        continue
                    ms: dict[str, list[float]] = {f: [] for f in FORMS}
                    t0, turn = time.perf_counter(), 0
                    while time.perf_counter() - t0 < args.seconds or turn < 6:
                        for f in (FORMS if turn % 2 == 0 else FORMS[::-1]):
                            ms[f].append(forms[f].time_ms())
                        turn += 1
                    med = {f: statistics.median(v) for f, v in ms.items()}
                    bpt = {f: forms[f].spec.bytes_per_token for f in FORMS}
                    rows.append([name, fmt, str(ctx), dname,
                                 f"{bpt['decompressed']:.0f}", f"{bpt['latent']:.0f}",
                                 f"{bpt['latent'] / bpt['decompressed']:.3f}",
                                 f"{ctx * bpt['latent'] / 2**20:.1f}",
                                 f"{med['decompressed']:.3f}", f"{med['latent']:.3f}",
                                 f"{med['latent'] / med['decompressed']:.2f}", str(turn)])
                    log(f"{name} {fmt} ctx={ctx} {dname}: decompressed "
                        f"{med['decompressed']:.3f} ms, latent {med['latent']:.3f} ms")
    print(f"- CPU: {cpu_description()}")
    for line in driver_description(devices.values()):
        print(f"- OpenCL: {line}")
    print()
    print("\n".join(table(["model", "pages", "ctx", "device", "decompressed B/token/layer",
                           "latent B/token/layer", "bytes latent/decompressed",
                           "latent KV MiB/layer", "decompressed ms", "latent ms",
                           "time latent/decompressed", "calls per form"],
                          rows, right=set(range(2, 12)), markdown=True)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
