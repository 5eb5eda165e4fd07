"""``clattn tune``'s correctness set covers quantized pages and prefill: the checks pass on
every device, FAIL when the kernel's answer is off by one value (they cannot pass
vacuously), the reference they compare with agrees with the float64 oracle, and the report
states the pool bytes per token of every page format."""
from __future__ import annotations

import numpy as np
import pytest
from naive import naive_decode
from test_profiler import _fake_report

import clattn
from clattn import cpu_backend
from clattn.decode import BatchDecode
from clattn.prefill import BatchPrefill
from clattn.quant import unpack_pool
from clattn.tune import checks
from clattn.tune.checks import (
    PREFILL_CASES,
    PREFILL_NEW,
    QUANT_CASES,
    VERIFY_LENGTHS,
    kv_bytes,
    make_case,
    make_prefill_case,
    prefill_checks,
    quantized_checks,
)
from clattn.tune.report import format_report
from clattn.tune.workloads import MODELS, spec_for

BAD_ROW = 2  # a sequence with rows (VERIFY_LENGTHS[2] = 45) and new tokens (PREFILL_NEW[2])


def _perturbed(cls, monkeypatch):
    """Make ``cls.run`` return its answer with one value of ``out`` off by 0.5."""
    real = cls.run

    def run(self, *a, **kw):
        out, lse, evt = real(self, *a, **kw)
        out = np.array(out, copy=True)
        row = BAD_ROW if cls is BatchDecode else int(a[2][BAD_ROW])  # q row of that sequence
        out[row, 0, 0] += np.asarray(0.5, out.dtype)
        return out, lse, evt

    monkeypatch.setattr(cls, "run", run)


def test_quantized_decode_checks_pass_and_name_both_formats(device):
    res = quantized_checks(device)
    assert len(res) == 2 * len(QUANT_CASES)
    assert all(c.passed for c in res), [c for c in res if not c.passed]
    names = " | ".join(c.name for c in res)
    for what in ("K q8_0 V q4_0", "K q4_0 V q8_0", "split"):
        assert what in names, what


def test_quantized_checks_fail_on_one_wrong_value(device, monkeypatch):
    _perturbed(BatchDecode, monkeypatch)
    res = quantized_checks(device)
    assert res and not any(c.passed for c in res)
    for c in res:
        assert c.detail == "1 value(s) outside atol=rtol=0.002", c
        assert c.max_abs_err == pytest.approx(0.5, abs=0.01)


def test_prefill_checks_pass(device):
    res = prefill_checks(device)
    assert [c.name.rsplit(" ", 1)[-1] for c in res][-1] == "non-causal"
    assert len(res) == len(PREFILL_CASES) and all(c.passed for c in res), res
    assert all(c.name.startswith("prefill f16 14/2/64 ") for c in res)


def test_prefill_checks_fail_on_one_wrong_value(device, monkeypatch):
    _perturbed(BatchPrefill, monkeypatch)
    res = prefill_checks(device)
    assert len(res) == len(PREFILL_CASES) and not any(c.passed for c in res)
    assert all("1 value(s) outside" in c.detail for c in res), res


def test_a_build_failure_is_a_failed_check(device, monkeypatch):
    def broken(self):
        raise RuntimeError("no compiler today")
    monkeypatch.setattr(BatchPrefill, "build", broken)
    res = prefill_checks(device)
    assert len(res) == 1 and not res[0].passed and "build failed" in res[0].detail


def test_the_quantized_reference_is_the_oracle_on_the_same_bytes():
    """What the checks compare with (the CPU backend on the byte pool) equals the float64
    oracle on the pool's dequantized values."""
    spec = spec_for(MODELS[QUANT_CASES[0][0]], k_format="q8_0", v_format="q4_0")
    (q, pool, indptr, indices, last), kw = make_case(spec, VERIFY_LENGTHS, seed=9)
    assert pool.dtype == np.uint8 and pool.shape == spec.pool_shape(pool.shape[0])
    k, v = unpack_pool(pool, spec.layout)
    ref_o, ref_s = naive_decode(q, np.stack([k, v], axis=1), indptr, indices, last)
    got_o, got_s = cpu_backend.batch_decode(spec, q, pool, indptr, indices, last)
    ok, err, why = checks.compare(got_o, got_s, ref_o, np.asarray(ref_s), spec.dtype)
    assert ok, why


def test_prefill_case_queries_are_the_last_rows():
    spec = spec_for(MODELS[1])
    (q, _, qo, *_), kw = make_prefill_case(spec, VERIFY_LENGTHS, PREFILL_NEW, seed=1, rope=True)
    assert list(np.diff(qo)) == PREFILL_NEW and q.shape == (sum(PREFILL_NEW), 14, 64)
    assert "q_pos" not in kw and kw["rotary_mode"] == 1
    with pytest.raises(ValueError, match="new="):
        make_prefill_case(spec, [3], [4], seed=1)


def test_kv_bytes_per_token_of_every_format():
    kb = kv_bytes()
    hkv, d = MODELS[QUANT_CASES[0][0]].num_kv_heads, MODELS[QUANT_CASES[0][0]].head_dim
    values = hkv * d * 2  # K and V
    # q8_0: 32 int8 + an f16 scale per 32 values; q4_0: 16 bytes + an f16 scale
    assert kb.per_format == {"float16": values * 2, "float32": values * 4,
                             "q8_0": values * 34 / 32, "q4_0": values * 18 / 32}
    assert kb.shape == "Llama-3-8B 32/8/128"
    assert "q4_0 1152 B (0.28x f16)" in kb.summary()
    small = kv_bytes(clattn.AttentionSpec(14, 2, 64))
    assert small.shape == "14/2/64" and small.per_format["float16"] == 512
    rep = _fake_report()
    rep.kv_bytes = kb
    assert f"KV bytes per token per layer, {kb.summary()}" in format_report(rep)
    assert rep.to_json()["kv_bytes"]["per_format"]["q8_0"] == 2176
