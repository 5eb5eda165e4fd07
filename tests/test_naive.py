"""Self-checks of the naive oracle (tests/naive.py) against hand-computed values."""
import math

import numpy as np
import pytest
from hf_oracle import read_config
from model_configs import load_models, model
from naive import (
    chunk_offsets,
    naive_decode,
    naive_inv_freq,
    naive_merge,
    naive_merge_k,
    naive_rotate,
)


def test_default_and_gptj_and_linear():
    inv, af = naive_inv_freq(4, 10000.0, None)
    np.testing.assert_allclose(inv, [1.0, 0.01], rtol=1e-15)
    assert af == 1.0
    inv, af = naive_inv_freq(4, 10000.0, {"rope_type": "gptj"})
    np.testing.assert_allclose(inv, [1.0, 0.01], rtol=1e-15)
    inv, af = naive_inv_freq(4, 10000.0, {"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(inv, [0.25, 0.0025], rtol=1e-15)
    assert af == 1.0
    inv, _ = naive_inv_freq(4, 10000.0, {"type": "default"})
    np.testing.assert_allclose(inv, [1.0, 0.01], rtol=1e-15)


def test_llama3_bands():
    # dim 6, theta 100: inv = [1, 100^-1/3, 100^-2/3] = [1, 0.215443469, 0.0464158883]
    # wavelengths 2*pi/inv = [6.2832, 29.1640, 135.3671]; old ctx 100, low 1 -> 100, high 4 -> 25
    # i=0: high frequency (6.28 < 25) kept; i=2: low frequency (135 > 100) -> /8;
    # i=1: medium: smooth = (100/29.16396 - 1)/3 = 0.80962977, inv*(0.19037/8 + 0.80963) = 0.1795562
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 100}
    inv, af = naive_inv_freq(6, 100.0, rs)
    np.testing.assert_allclose(inv, [1.0, 0.1795561988, 0.0464158883 / 8], rtol=1e-9)
    assert af == 1.0
    inv4, _ = naive_inv_freq(6, 100.0, dict(rs, rope_type="llama4"))
    np.testing.assert_array_equal(inv, inv4)
    # low == high (Llama-4 style) must not divide by zero
    inv, _ = naive_inv_freq(64, 500000.0, dict(rs, low_freq_factor=1.0, high_freq_factor=1.0,
                                               original_max_position_embeddings=8192))
    assert np.isfinite(inv).all()


def test_longrope_phi35():
    m = model("Phi-3.5-mini")
    # HF keeps original_max_position_embeddings at the config's top level
    rs = dict(m["rope_scaling"],
              original_max_position_embeddings=m["original_max_position_embeddings"])
    assert rs["type"] == "longrope" and rs["original_max_position_embeddings"] == 4096
    assert "factor" not in rs
    assert read_config(m).rope_params["attention_factor"] == pytest.approx(1.1902380714238083)
    # factor = 131072 / 4096 = 32; attention_factor = sqrt(1 + ln 32 / ln 4096) = sqrt(17/12)
    for use_long, key in ((False, "short_factor"), (True, "long_factor")):
        inv, af = naive_inv_freq(96, 10000.0, rs, m["max_position_embeddings"], use_long)
        assert af == pytest.approx(1.1902380714238083, rel=1e-14)
        assert inv.shape == (48,)
        assert inv[0] == pytest.approx(1.0 / rs[key][0], rel=1e-14)
        assert inv[1] == pytest.approx(1.0 / (rs[key][1] * 10000.0 ** (2 / 96)), rel=1e-14)
    inv, af = naive_inv_freq(96, 10000.0, dict(rs, attention_factor=1.5), 131072)
    assert af == 1.5
    inv, af = naive_inv_freq(4, 10000.0, {"rope_type": "longrope", "short_factor": [1, 2],
                                          "long_factor": [3, 4], "factor": 1.0,
                                          "original_max_position_embeddings": 10})
    assert af == 1.0
    np.testing.assert_allclose(inv, [1.0, 0.005], rtol=1e-15)


def test_yarn_gpt_oss():
    m = model("gpt-oss-20b")
    rs = m["rope_scaling"]
    assert rs["truncate"] is False
    inv, af = naive_inv_freq(64, 150000.0, rs, m["max_position_embeddings"])
    assert af == pytest.approx(1.3465735902799727, rel=1e-14)  # 0.1 ln 32 + 1
    plain = np.array([150000.0 ** (-2 * i / 64) for i in range(32)])
    # correction range (not truncated): low = 8.0927791, high = 17.3980245
    np.testing.assert_allclose(inv[:9], plain[:9], rtol=1e-14)
    np.testing.assert_allclose(inv[18:], plain[18:] / 32, rtol=1e-14)
    ramp = (12 - 8.092779115512402) / (17.39802450158856 - 8.092779115512402)
    assert inv[12] == pytest.approx(plain[12] * (ramp / 32 + 1 - ramp), rel=1e-12)
    # truncated (default): low 8, high 18 -> ramp at 12 = 0.4
    rs_t = {k: v for k, v in rs.items() if k != "truncate"}
    inv, _ = naive_inv_freq(64, 150000.0, rs_t, m["max_position_embeddings"])
    assert inv[12] == pytest.approx(plain[12] * (0.4 / 32 + 0.6), rel=1e-12)
    np.testing.assert_allclose(inv[18:], plain[18:] / 32, rtol=1e-14)


def test_yarn_attention_factor_variants():
    base = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}
    _, af = naive_inv_freq(64, 10000.0, dict(base, mscale=0.707, mscale_all_dim=0.707))
    assert af == pytest.approx(1.0, rel=1e-15)
    _, af = naive_inv_freq(64, 10000.0, dict(base, mscale=1.0, mscale_all_dim=0.5))
    assert af == pytest.approx((0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1), rel=1e-14)
    _, af = naive_inv_freq(64, 10000.0, dict(base, attention_factor=0.9))
    assert af == 0.9
    # original_max_position_embeddings falls back to the top-level value
    a, _ = naive_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0}, 4096)
    b, _ = naive_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 4096})
    np.testing.assert_array_equal(a, b)


def test_dynamic_refused():
    with pytest.raises(ValueError):
        naive_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_rotate_pairing():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    th = 0.3
    c, s = math.cos(th), math.sin(th)
    # rotate-half over rotary_dim 4 with inv_freq [1, 0]: dims (0,2) rotate by 0.3, (1,3) by 0
    y = naive_rotate(x, th, [1.0, 0.0], 1.0, 4, False)
    np.testing.assert_allclose(y, [1 * c - 3 * s, 2, 3 * c + 1 * s, 4, 5], rtol=1e-15)
    # interleaved: dims (0,1) rotate by 0.3, (2,3) by 0; dim 4 passes through
    y = naive_rotate(x, th, [1.0, 0.0], 1.0, 4, True)
    np.testing.assert_allclose(y, [1 * c - 2 * s, 2 * c + 1 * s, 3, 4, 5], rtol=1e-15)
    y = naive_rotate(x, th, [1.0, 0.0], 2.0, 4, True)
    np.testing.assert_allclose(y, [2 * (c - 2 * s), 2 * (2 * c + s), 6, 8, 5], rtol=1e-15)


def test_chunk_offsets():
    assert chunk_offsets(5) == [0, 1, 2, 3, 4]
    assert chunk_offsets(10, 6, 2) == [0, 1, 6, 7, 8, 9]
    assert chunk_offsets(10, 10, 3) == [0, 1, 2]
    assert chunk_offsets(10, 0, 0) == list(range(10))
    assert chunk_offsets(0, 0, 0) == []


def _tiny_pages():
    # 2 pages of size 2, H_kv 1, D 2; sequence 0 owns pages [1, 0] with 3 rows, sequence 1 none
    pages = np.zeros((2, 2, 1, 2, 2))
    pages[1, 0, 0, 0] = [1, 0]; pages[1, 1, 0, 0] = [10, 0]
    pages[1, 0, 0, 1] = [0, 1]; pages[1, 1, 0, 1] = [0, 10]
    pages[0, 0, 0, 0] = [1, 1]; pages[0, 1, 0, 0] = [5, 5]
    pages[0, 0, 0, 1] = [9, 9]; pages[0, 1, 0, 1] = [99, 99]   # beyond last_page_len
    return pages


def test_decode_by_hand():
    pages = _tiny_pages()
    q = np.array([[[2.0, 0.0]], [[1.0, 1.0]]])
    out, lse = naive_decode(q, pages, [0, 2, 2], [1, 0], [1, 2], sm_scale=1.0)
    s = np.array([2.0, 0.0, 2.0])
    w = np.exp(s) / np.exp(s).sum()
    np.testing.assert_allclose(out[0, 0], w[0] * np.array([10, 0]) + w[1] * np.array([0, 10])
                               + w[2] * np.array([5, 5]), rtol=1e-14)
    assert lse[0, 0] == pytest.approx(math.log2(np.exp(s).sum()), rel=1e-14)
    assert lse[1, 0] == -math.inf and (out[1] == 0).all()
    # window: offset 2, 1 sink -> rows at offsets 0, 2
    out, lse = naive_decode(q, pages, [0, 2, 2], [1, 0], [1, 2], window_offset=[2, 0],
                            sink_size=[1, 0], sm_scale=1.0)
    s = np.array([2.0, 2.0])
    assert lse[0, 0] == pytest.approx(math.log2(np.exp(s).sum()), rel=1e-14)
    np.testing.assert_allclose(out[0, 0], [7.5, 2.5], rtol=1e-14)
    # softcap 1: scores tanh(2), 0, tanh(2)
    out, lse = naive_decode(q, pages, [0, 2, 2], [1, 0], [1, 2], sm_scale=1.0, softcap=1.0)
    s = np.tanh(np.array([2.0, 0.0, 2.0]))
    assert lse[0, 0] == pytest.approx(math.log2(np.exp(s).sum()), rel=1e-14)


def test_rope_relative_invariance():
    """With attention_factor 1, shifting q_pos and k_pos_offset together changes nothing."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 8))
    pages = rng.standard_normal((2, 2, 1, 4, 8))
    kw = dict(rotary_mode=1, rope_theta=100.0)
    for rs in (None, {"rope_type": "gptj"}, {"rope_type": "linear", "factor": 2.0}):
        a = naive_decode(q, pages, [0, 2], [1, 0], [3], q_pos=[9], k_pos_offset=[2],
                         rope_scaling=rs, **kw)
        b = naive_decode(q, pages, [0, 2], [1, 0], [3], q_pos=[109], k_pos_offset=[102],
                         rope_scaling=rs, **kw)
        np.testing.assert_allclose(a[0], b[0], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(a[1], b[1], rtol=1e-9)
    # linear factor 2 is rope_scale 0.5
    a = naive_decode(q, pages, [0, 2], [1, 0], [3], q_pos=[9], k_pos_offset=[2],
                     rope_scaling={"rope_type": "linear", "factor": 2.0}, **kw)
    b = naive_decode(q, pages, [0, 2], [1, 0], [3], q_pos=[9], k_pos_offset=[2],
                     rope_scale=0.5, **kw)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-12)


def test_merge_by_hand():
    v = np.array([[[1.0, 2.0]], [[3.0, 4.0]], [[0.0, 0.0]]])
    s = np.array([[1.0], [-np.inf], [-np.inf]])
    vo = np.array([[[3.0, 4.0]], [[5.0, 6.0]], [[7.0, 7.0]]])
    so = np.array([[1.0], [2.0], [-np.inf]])
    mv, ms = naive_merge(v, s, vo, so)
    np.testing.assert_allclose(mv[0, 0], [2.0, 3.0])
    assert ms[0, 0] == pytest.approx(2.0)
    np.testing.assert_allclose(mv[1, 0], [5.0, 6.0])
    assert ms[1, 0] == 2.0
    assert (mv[2] == 0).all() and ms[2, 0] == -np.inf
    kv, ks = naive_merge_k(np.stack([v, vo], axis=1), np.stack([s, so], axis=1))
    np.testing.assert_allclose(kv, mv)
    np.testing.assert_array_equal(ks, ms)


def test_model_fixture():
    ms = load_models()
    assert len(ms) >= 20 and all(m["head_dim"] for m in ms)
    assert model("Llama-3.2-1B")["rope_scaling"]["rope_type"] == "llama3"
    assert model("GPT-J-6B")["rope_scaling"] is None and read_config(model("GPT-J-6B")).interleaved
    assert model("GPT-J-6B")["rotary_dim"] == 64
    assert len(model("Phi-3.5-mini")["rope_scaling"]["short_factor"]) == 48
    assert model("Gemma-2-2B")["attn_logit_softcapping"] == 50.0
