"""The C expressions clattn.kernel_exprs builds for the templates, and the rule that the
templates keep their Python small (the builders live in clattn.kernel_exprs)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from mako import parsetree
from mako.lexer import Lexer

from clattn import kernel_exprs as kx
from clattn.codegen import KERNELS_DIR

#: lines a Python block of a template may hold
MAX_BLOCK_LINES = 10


def _c_int(expr: str, e: int) -> float:
    """Value of a C expression of one int ``e`` holding at most one top-level ?: ."""
    py = expr.replace("1.0f", "1.0").replace(" / ", " // ").replace(">>", "//2**")
    if " ? " in py:
        cond, rest = py.split(" ? ", 1)
        a, b = rest.split(" : ", 1)
        py = "(%s) if (%s) else (%s)" % (a, cond, b)
    return eval(py, {"e": e, "i": e})


@pytest.mark.parametrize("rot,interleaved", [(64, False), (64, True), (32, False), (8, True)])
def test_rope_pairs_rule(rot, interleaved):
    """Each dim's partner is an involution; the two share a frequency; x gets the minus."""
    rp = kx.RopePairs(rot, interleaved)
    for e in range(rot):
        p = _c_int(rp.partner("e"), e)
        assert 0 <= p < rot and p != e and _c_int(rp.partner("e"), p) == e
        assert _c_int(rp.freq("e"), e) == _c_int(rp.freq("e"), p) < rot // 2
        assert _c_int(rp.sign("e"), e) == -_c_int(rp.sign("e"), p)
    for i in range(rot // 2):
        x, y = (_c_int(d, i) for d in rp.dims("i"))
        assert _c_int(rp.partner("e"), x) == y and _c_int(rp.sign("e"), x) == -1.0
        assert _c_int(rp.freq("e"), x) == i


def test_rope_pairs_expressions():
    half, gptj = kx.RopePairs(64, False), kx.RopePairs(64, True)
    assert half.dims("i") == ("i", "i + 32") and gptj.dims("i") == ("2 * i", "2 * i + 1")
    assert half.partner("d") == "d < 32 ? d + 32 : d - 32" and gptj.partner("d") == "d ^ 1"
    assert half.freq("(e)") == "(e) % 32" and gptj.freq("(e)") == "(e) / 2"
    assert gptj.element_decls("e") == ["const int fi = e >> 1, pe = e ^ 1;",
                                       "const float sgn = (e & 1) ? 1.0f : -1.0f;"]
    assert half.element_decls("e")[0] == "const int fi = e < 32 ? e : e - 32;"
    assert (half.vectors(8), gptj.vectors(8)) == (4, 8)
    assert half.vector_lane_freq("cc", "e", 4) == "cc * 4 + e"
    assert gptj.vector_lane_freq("cc", "e", 4) == "(cc * 4 + e) / 2"
    assert half.rotate_vector("k", 1, 8, "float8") == [
        "const float8 x = k1, y = k5;", "k1 = (x * cs - y * sn) * rope_att;",
        "k5 = (y * cs + x * sn) * rope_att;"]
    assert gptj.rotate_vector("k", 0, 4, "float4") == [
        "k0 = (k0 * cs + k0.s1032 * (sn * (float4)(-1.0f, 1.0f, -1.0f, 1.0f))) * rope_att;"]


def test_reductions():
    assert kx.hsum("v", 4) == "(((v).s0 + (v).s1) + ((v).s2 + (v).s3))"
    assert kx.hred("x", "+", 2) == "((x).lo + (x).hi)"
    assert kx.hred("x", "max", 2) == "((x).lo > (x).hi ? (x).lo : (x).hi)"
    assert kx.hred_or("u", 4) == "((((u).lo | (u).hi)).lo | (((u).lo | (u).hi)).hi)"
    assert kx.score("t", None) == "(t)"
    assert kx.score("t", 30.0) == \
        "(3.000000000e+01f * tanh((t) * 3.333333333e-02f) * CLATTN_LOG2E)"


def test_block_sums():
    assert kx.block_sums("tv", "bs", 0, 1, 1) == ([], "tv[0]")
    assert kx.block_sums("tv", "bs", 4, 1, 4) == ([], "(float4)(tv[4], tv[5], tv[6], tv[7])")
    # wider partials than rows: folded by halves first
    assert kx.block_sums("tv", "bs", 0, 4, 1) == ([], "((((tv[0]).lo + (tv[0]).hi)).lo + "
                                                      "(((tv[0]).lo + (tv[0]).hi)).hi)")
    lines, expr = kx.block_sums("tv", "bs", 0, 2, 2)
    assert lines == ["const float2 bs_0_0 = tv[0];", "const float2 bs_0_1 = tv[1];",
                     "const float2 bs_0_1_0 = (float2)(bs_0_0.s0 + bs_0_0.s1, "
                     "bs_0_1.s0 + bs_0_1.s1);"]
    assert expr == "bs_0_1_0"
    lines, expr = kx.block_sums("tv", "bs", 0, 8, 16)   # two groups of 8, each x86-hadd
    assert expr == "(float16)(bs_0_x, bs_8_x)" and lines[-1].startswith("const float8 bs_8_x")


def _eval_vectors(lines: list, expr: str, env: dict) -> np.ndarray:
    """The value of ``expr`` after the ``const floatN x = ...;`` lines, over the float
    vectors in ``env`` (numpy arrays): OpenCL C's component swizzles, vector literals,
    array indexing and ``+``, read as Python (independent of how the builders pair)."""
    def py(text: str) -> str:
        text = re.sub(r"\((\w+(?:\[\d+\])?)\)\.s([0-9a-f])\b|\b(\w+(?:\[\d+\])?)\.s([0-9a-f])\b",
                      lambda m: "%s[%d]" % (m.group(1) or m.group(3),
                                            int(m.group(2) or m.group(4), 16)), text)
        return re.sub(r"\(float\d+\)\(", "V(", text)
    scope = dict(env, V=lambda *xs: np.concatenate([np.atleast_1d(x) for x in xs]))
    for line in lines:
        name, rhs = re.fullmatch(r"const float\d+ (\w+) = (.*);", line).groups()
        scope[name] = np.asarray(eval(py(rhs), scope))
    return np.asarray(eval(py(expr), scope))


@pytest.mark.parametrize("vec, w_out", [(16, 16), (8, 8), (16, 8), (8, 16), (4, 4), (2, 2)])
def test_block_sums_values(vec, w_out):
    """Lane j of the result is the sum of row j's partials, whatever the pairing."""
    rng = np.random.default_rng(vec * w_out)
    tv = rng.standard_normal((w_out, vec))
    lines, expr = kx.block_sums("tv", "bs", 0, vec, w_out)
    got = _eval_vectors(lines, expr, {"tv": tv})
    np.testing.assert_allclose(got, tv.sum(axis=1), rtol=1e-12)
    if vec == w_out == 16:   # whole-vector adds of shuffles, no per-lane scalar sums
        assert not any("+" in lit for ln in lines
                       for lit in re.findall(r"\(float16\)\(([^()]*)\)", ln))


def test_halves_of_16_lanes_are_components():
    """16-lane halves are component lists (Oclgrind's uninitialised-value check misreads
    .lo/.hi of a float16 a loop computed); narrower vectors keep .lo/.hi."""
    lo, hi = kx.halves("x", 16)
    assert lo == "(float8)(%s)" % ", ".join("(x).s%x" % i for i in range(8))
    assert hi.endswith("(x).sf)")
    assert "(float8)((x).s0" in kx.hred("x", "+", 16) and "(x).lo" not in kx.hred("x", "+", 16)
    assert kx.halves("x", 8) == ("(x).lo", "(x).hi")
    assert "(int8)((u).s0" in kx.hred_or("u", 16) and "(u).lo" not in kx.hred_or("u", 16)


def test_lanes_page_formats():
    def lane(fmt, lane, vec=4, raw=True, **kw):
        return kx.lanes(0, vec, "kp", lane, fmt, "half", True, raw, None, **kw)
    # raw: the kernel's raw_loads types (no more alignment than an element's)
    assert lane("float", 8) == "*(const __global ldf_t*)(kp + (8) * 4)"
    assert lane("float", 8, raw=False) == "*(const __global float4*)(kp + (8) * 4)"
    assert lane("half", 8) == "clattn_h2f(*(const __global ldh_t*)(kp + (8) * 2))"
    assert lane("half", 8, raw=False) == "vload_half4(0, (const __global half*)(kp) + 8)"
    assert lane("q8_0", 36) == ("(convert_float4(*(const __global ldq8_t*)(kp + (36))) * "
                                "clattn_h2f_1(kp_s[(36) / 32]))")
    # q4_0: value j of a block in byte j's low nibble, value j + 16 in its high nibble
    assert "(*(const __global uchar4*)(kp + 24)) & (uchar4)15)" in lane(
        "q4_0", 40, raw=False, scale="1.0f")
    assert "(kp + 0)) >> (uchar4)4)" in lane("q4_0", 16, raw=False, scale="1.0f")
    # CPU loads: the nibble as the low mantissa bits of 2^23, minus 2^23 + 8
    assert lane("q4_0", 40, scale="s") == (
        "((as_float4((convert_uint4(*(const __global ldq4_t*)(kp + 24)) & 15u) | 0x4b000000u)"
        " - 8388616.0f) * s)")
    assert "(kp + 0)) >> 4) | 0x4b000000u)" in lane("q4_0", 16, scale="1.0f")
    assert lane("q4_0", "x", vec=1) == (
        "((convert_float((((*(const __global ldq4_t*)(kp + ((x) >> 5) * 16 + ((x) & 15))) >> "
        "(uchar)((x) & 16 ? 4 : 0)) & (uchar)15)) - 8.0f) * clattn_h2f_1(kp_s[(x) / 32]))")
    assert kx.lanes(1, 2, "vp", 4, "half", "half", False, True,
                    lambda v, p: "LOAD%d(%s)" % (v, p)) == "LOAD2(vp + 4)"


def test_storage_loads_and_stores():
    assert kx.storage_load(1, "p", "float", False) == "(p)[0]"
    assert kx.storage_load(4, "p", "half", True) == "convert_float4(vload4(0, p))"
    assert kx.storage_load(8, "p", "half", False) == "vload_half8(0, p)"
    assert kx.storage_store(1, "x", "p", "float") == "(p)[0] = (x);"
    assert kx.storage_store(4, "x", "p", "half") == "vstore_half4_rte(x, 0, p);"


def test_raw_loads_and_private_vectors():
    assert kx.raw_load("p", 4, "float", False) == "*(const __global ld_t*)(p)"
    assert kx.raw_load("p", 4, "half", True) == "convert_float4(*(const __global ldn_t*)(p))"
    assert kx.raw_load("p", 4, "half", False, by_dtype=True) == \
        "clattn_h2f(*(const __global ldh_t*)(p))"
    assert kx.raw_store("x", "p", 4, "half", True) == \
        "*(__global ldn_t*)(p) = convert_half4_rte(x);"
    assert kx.raw_store("x", "p", 1, "half", False) == "*(__global ldh_t*)(p) = clattn_f2h(x);"
    assert kx.private_store("v", "pt", "float4") == "*(float4*)(pt) = v;"
    assert kx.private_load("pt", "float4") == "*(float4*)(pt)"
    assert kx.causal_mask("r", "v", 1) == "(r <= lim[v])"
    assert kx.causal_mask("r", "v", 4) == "((int4)(r) <= lim[v])"


@pytest.mark.parametrize("rows,kb,nv,vec,want", [
    (12, 32, 16, 8, (16, 2, 2, 4, 4, 2)),
    (3, 6, 3, 1, (3, 3, 1, 6, 1, 1)),
    (8, 5, 8, 4, (8, 2, 2, 1, 4, 2)),
])
def test_prefill_rows_tiles(rows, kb, nv, vec, want):
    t = kx.prefill_rows_tiles(rows, kb, nv, vec)
    assert tuple(t) == want and t.m % vec == 0 and kb % t.nk == 0


def _code_blocks(node):
    for child in node.get_children():
        if isinstance(child, parsetree.Code):
            yield child
        yield from _code_blocks(child)


@pytest.mark.parametrize("path", sorted(KERNELS_DIR.glob("*.mako")), ids=lambda p: p.name)
def test_templates_keep_their_python_small(path):
    """Every <% %> block of a template holds at most MAX_BLOCK_LINES lines: C-building
    Python belongs in clattn.kernel_exprs, where tests reach it."""
    tree = Lexer(path.read_text(), filename=str(path)).parse()
    blocks = list(_code_blocks(tree))
    long = [(b.lineno, len(b.text.strip("\n").splitlines())) for b in blocks
            if len(b.text.strip("\n").splitlines()) > MAX_BLOCK_LINES]
    assert not long, f"{path.name}: Python blocks (line, lines) over {MAX_BLOCK_LINES}: {long}"


def test_templates_leave_the_rope_pairing_to_ropepairs():
    """No template chooses between the pairings itself (clattn.kernel_exprs.RopePairs)."""
    for path in KERNELS_DIR.glob("*.mako"):
        assert not re.search(r"\binterleaved\b", path.read_text(), re.I), path.name
