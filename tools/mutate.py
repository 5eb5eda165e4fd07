#!/usr/bin/env python3
"""Mutation check: does the test suite catch deliberate bugs?

Each mutant below is a small, plausible bug: a file (a glob, so that a template may move
between files), exact anchor text that must occur there exactly once (or ``count`` times),
its replacement, and the default-run tests that must catch it. The script copies the
repository to a temporary directory once, checks that Python there imports the copy's
``clattn`` (not the installed one), runs each mutant's tests unmodified (the baseline must
pass), then applies one mutant at a time, runs ``python -m pytest -q -x <tests>`` in the
copy, and restores the file.

Results per mutant:
  caught     a test failed (the first failing test is shown)
  SURVIVED   every selected test passed with the bug in place
  STALE      an anchor is missing or ambiguous: the code moved; re-anchor the mutant
  INVALID    the mutant does not build (an OpenCL build or template error): it tests nothing
  ERROR      pytest could not run or selected no test
The exit status is 0 only when every mutant was caught.

    .venv/bin/python tools/mutate.py                 # all mutants
    .venv/bin/python tools/mutate.py --list          # names, files, anchors found or not
    .venv/bin/python tools/mutate.py f16-store-rtz gqa-heads-swapped-rows
    .venv/bin/python tools/mutate.py --json out.json # the table as data too

Anchors are written against the current text; when a file is rewritten, ``--list``
shows which mutants went stale (``kernel`` mutants target the OpenCL templates).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DECODE = "kernels/decode*.mako"          # the decode templates (rows, tiled, shared)
COMMON = "kernels/common.clh.mako"
MERGE = "kernels/merge.cl.mako"
MERGE_STATE = "kernels/merge_state.clh.mako"    # the K-way merge (merge.cl and the fold's)
EXPRS = "clattn/kernel_exprs.py"                # the C expressions the templates splice in
IGNORE = (".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "*.egg-info",
          "build", "dist", ".mypy_cache", ".ruff_cache")
#: text in pytest's output meaning "the mutated code does not build", not "a test caught it"
BUILD_FAILURE = re.compile(r"BUILD_PROGRAM_FAILURE|clBuildProgram failed|mako\.exceptions|"
                           r"CompileException|SyntaxException|SyntaxError|IndentationError")

KT = "tests/test_kernels.py"
#: the CPU drivers and the CPU backend only (no Oclgrind): mutants whose tests run there
FAST = {"CLATTN_TEST_DEVICES": "pocl,intel,cpu"}
#: PoCL alone: mutants that crash Intel's runtime (a crash is no test's verdict)
POCL = {"CLATTN_TEST_DEVICES": "pocl"}
ROWS = "(pocl- or intel-) and not tiled and not cpu"     # -k: the rows kernel on both drivers
TILED = "tiled"


@dataclass
class Mutant:
    name: str
    path: str                      # a file or a glob, relative to the repository root
    edits: list                    # [(anchor, replacement)]
    tests: list                    # pytest arguments
    why: str = ""
    kind: str = "python"           # "kernel" for OpenCL templates
    count: int = 1                 # occurrences each anchor must have (0: at least one);
    #                                all are replaced
    env: dict = field(default_factory=dict)


def k(*words: str) -> str:
    return " and ".join(f"({w})" for w in words)


MUTANTS = [
    # ---- f16 rounding, RoPE from HF configs, split partitions, q rounding ---------------
    Mutant("f16-store-rtz", EXPRS, [
        ('return "vstore_half_rte(%s, 0, %s);" % (val, ptr)',
         'return "vstore_half_rtz(%s, 0, %s);" % (val, ptr)'),
        ('return "vstore_half%d_rte(%s, 0, %s);" % (vec, val, ptr)',
         'return "vstore_half%d_rtz(%s, 0, %s);" % (vec, val, ptr)')],
        [KT, "-k", k("model_shapes", "float16", "not cpu")],
        "the decode's f16 store rounds toward zero (rows and tiled kernels)", "kernel"),
    Mutant("f2h-truncates", COMMON, [
        ("const ${UI} nrm = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;",
         "const ${UI} nrm = (a - (112u << 23)) >> 13;")],
        ["tests/test_compiler_probe.py", "-k", "integer and pocl"],
        "the CPU kernels' integer f32->f16 conversion (drivers without cl_khr_fp16 or "
        "__fp16) truncates",
        "kernel"),
    Mutant("merge-native-f16-rtz", EXPRS, [
        ('convert_%s_rte(%s);" % (ptr, vtype("half", vec), val)',
         'convert_%s_rtz(%s);" % (ptr, vtype("half", vec), val)')],
        [KT, "tests/test_kernel_numerics.py", "-k", k("split or merge", "intel")],
        "the merge kernel's native f16 store (cl_khr_fp16 drivers) rounds toward zero",
        "kernel"),
    Mutant("from-hf-config-drops-gptj-pairing", "clattn/spec.py", [
        ('if config.get("model_type") == "gptj" and not scaling:',
         'if config.get("model_type") == "gpt-j" and not scaling:')],
        ["tests/test_hf_config.py"],
        "AttentionSpec.from_hf_config forgets GPT-J's interleaved RoPE"),
    Mutant("from-hf-config-ignores-rotary-dim", "clattn/spec.py", [
        ('rd = config.get("rotary_dim")', 'rd = None')],
        ["tests/test_hf_config.py"],
        "AttentionSpec.from_hf_config rotates all of GPT-J's 256 dims instead of 64"),
    Mutant("last-split-partition-clipped", DECODE, [
        ("const int r_hi = (nparts_b > 1 && part < nparts_b - 1) ? "
         "(int)min((long)r_lo + part_rows, (long)chunk) : chunk;",
         "const int r_hi = nparts_b > 1 ? (int)min((long)r_lo + part_rows, (long)chunk) : chunk;")],
        ["tests/test_kernel_numerics.py", "-k", "stale_plan"],
        "the last partition stops at part_rows (rows of a grown table are dropped)", "kernel"),
    Mutant("q-f16-before-scoring-rows", DECODE, [
        ('q${g}_${i} = ${("f[%d]" % i) if V == 1 else "vload%d(0, f + %d)" % (V, i * V)} * qscale;',
         'q${g}_${i} = as_${FV}((as_${UI}('
         '${("f[%d]" % i) if V == 1 else "vload%d(0, f + %d)" % (V, i * V)} * qscale) '
         '+ (${UI})0x1000u) & (${UI})0xffffe000u);')],
        [KT, "-k", k("model_shapes", ROWS)],
        "the rows kernel keeps the scaled q at f16 precision", "kernel"),
    Mutant("q-f16-before-scoring-tiled", DECODE, [
        ('qv[g] *= sm_scale${" * CLATTN_LOG2E" if SOFTCAP is None else ""};',
         'qv[g] *= sm_scale${" * CLATTN_LOG2E" if SOFTCAP is None else ""};\n'
         '        qv[g] = as_float${"" if VEC == 1 else VEC}('
         '(as_uint${"" if VEC == 1 else VEC}(qv[g]) + 0x1000u) & 0xffffe000u);')],
        [KT, "-k", k("model_shapes", TILED)],
        "the tiled kernel keeps the scaled q at f16 precision", "kernel"),
    # ---- sinks, lse, pages, GQA, softcap, exp2/log2 and the online softmax -------------
    Mutant("sinks-dropped", DECODE, [
        ("const int sink = clamp(sink_size[b], 0, wo);",
         "const int sink = 0 * clamp(sink_size[b], 0, wo);")],
        [KT, "-k", k("window", "not cpu")],
        "sink rows are never attended", "kernel"),
    Mutant("lse-natural-log", COMMON, [
        ('"m + %s(l)" % LOG2', '"m + %s(l) * 0.6931472f" % LOG2')],
        [KT, "-k", k("model_shapes", "not cpu")],
        "lse = m + ln(l) instead of log2", "kernel"),
    Mutant("last-page-len-off-by-one", DECODE, [
        ("clamp(last_page_len[b], 1, ${PS})", "clamp(last_page_len[b] - 1, 1, ${PS})")],
        [KT, "-k", k("model_shapes", "not cpu")],
        "the last page holds one row less", "kernel"),
    Mutant("gqa-heads-swapped-rows", DECODE, [
        ("const __global st_t* qp = q + ((ulong)b * ${HQO} + ${head(g)}) * ${D};",
         "const __global st_t* qp = q + ((ulong)b * ${HQO} + ${g} * ${HKV} + kvh) * ${D};")],
        [KT, "-k", k("model_shapes", ROWS)],
        "query head g of KV head kvh read as head g * H_kv + kvh (rows)", "kernel"),
    Mutant("gqa-heads-swapped-tiled", DECODE, [
        ("const int h = kvh * ${G} + min(g0 + g, ${G - 1});",
         "const int h = min(g0 + g, ${G - 1}) * ${HKV} + kvh;")],
        [KT, "-k", k("model_shapes", TILED)],
        "query head mapping swapped (tiled)", "kernel"),
    Mutant("softcap-skipped", EXPRS, [
        ('return "(%.9ef * tanh((%s) * %.9ef) * CLATTN_LOG2E)" % (softcap, x, 1.0 / softcap)',
         'return "((%s) * CLATTN_LOG2E)" % x')],
        [KT, "-k", k("gemma2_softcap", "not cpu")],
        "the kernels ignore the soft-cap", "kernel"),
    Mutant("softcap-skipped-cpu", "clattn/cpu_backend.py", [
        ("return s if softcap is None else softcap * np.tanh(s / softcap)", "return s")],
        [KT, "-k", k("gemma2_softcap", "cpu")],
        "the CPU backend ignores the soft-cap"),
    Mutant("merge-exp-for-exp2", COMMON, [
        ('sel("%s(s - mx)" % EXP2', 'sel("%s((s - mx) * 1.4426950f)" % EXP2')],
        [KT, "-k", k("merge_state_on_device or merge_states_on_device")],
        "merge weights e^(s - m) for base-2 states (kernels)", "kernel"),
    Mutant("merge-exp-for-exp2-cpu", "clattn/cpu_backend.py", [
        ("np.exp2(s - m_safe)", "np.exp(s - m_safe)")],
        ["tests/test_merge.py", "-k", "commutative or associative"],
        "merge weights e^(s - m) (CPU backend): commutative and associative all the same"),
    Mutant("exp2-polynomial-cut", COMMON, [
        ("${T} p = 1.5403530e-4f;\n    p = p * f + 1.3333558e-3f;",
         "${T} p = 0.0f;\n    p = p * f + 0.0f;")],
        [KT, "-k", k("model_shapes", ROWS)],
        "the rows kernel's exp2 polynomial loses its two highest terms", "kernel"),
    Mutant("exp2-range-unclamped", COMMON, [
        ("x = x < -127.0f ? (${T})(-127.0f) : x;", "x = x < -200.0f ? (${T})(-200.0f) : x;")],
        ["tests/test_kernel_numerics.py", "-k", "accurate"],
        "the CPU kernels' exp2 scales by 2^n below the exponent field's range (2^-127 "
        "and less wrap to huge or negative numbers)", "kernel"),
    Mutant("log2-polynomial-cut", COMMON, [
        ("p = p * f2 + 0.33333333f;", "p = p * f2 + 0.0f;")],
        ["tests/test_kernel_numerics.py", "-k", "accurate"],
        "the CPU kernels' log2 polynomial loses its f^3 term", "kernel"),
    Mutant("rescale-skipped", DECODE, [
        ("if (mx > m${g}) {", "if (0) {")],
        [KT, "-k", k("model_shapes", ROWS)],
        "the rows kernel never rescales its state when a block raises the max", "kernel"),
    Mutant("max-test-skipped", DECODE, [
        ('if (${kx.hred_or("up", W)}) {', "if (0) {")],
        [KT, "-k", k("model_shapes", ROWS)],
        "the rows kernel never looks for a new max (its exponent base stays 0)", "kernel"),
    Mutant("block-second-half-unmasked", DECODE, [
        ("sv${h} = n < ${(h + 1) * W} ?", "sv${h} = n < ${W} ?")],
        # a block of two score vectors: 8-float ones, as the simulator's width gives
        ["tests/test_oclgrind.py", "-k", "variant_clean_under_oclgrind and rows-f32-split"],
        "the rows kernel scores the rows past the end of a partial 16-row block", "kernel"),
    Mutant("block-row-past-the-end-scored", DECODE, [
        ("(${IT})(${\", \".join(str(h * W + j) for j in range(W))}) >= n)",
         "(${IT})(${\", \".join(str(h * W + j) for j in range(W))}) > n)")],
        [KT, "-k", k("model_shapes", ROWS)],
        "the rows kernel scores the row just past the end of a partial block", "kernel"),
    Mutant("rows-slices-share-one-counter", DECODE, [
        ("counters + (ulong)b * ${HKV * GDZ} + get_global_id(1);",
         "counters + (ulong)b * ${HKV} + kvh;")],
        ["tests/test_head_slices.py", "-k", "fold and g17"],
        "the head slices of a KV head fold on one counter: a slice's states never merge",
        "kernel"),
    Mutant("rows-slice-heads-from-the-first", DECODE, [
        ("const int g0 = (get_global_id(1) % ${GDZ}) * ${GH};", "const int g0 = 0;")],
        ["tests/test_head_slices.py", "-k", "merge-launch and g17"],
        "every head slice computes the first slice's heads", "kernel"),
    # ---- one per kernel feature ---------------------------------------------------------
    Mutant("window-row-dropped", DECODE, [
        ("const int wo = clamp(window_offset[b], 0, stored);",
         "const int wo = clamp(window_offset[b] + 1, 0, stored);")],
        [KT, "-k", k("long_context_32k_window", "float32", "not cpu")],
        "the window starts one row late", "kernel"),
    Mutant("window-row-address", DECODE, [
        ("return row < sink ? row : row - sink + wo;",
         "return row <= sink ? row : row - sink + wo;")],
        [KT, "-k", k("sliding_window_limits", "not cpu")],
        "the first window row is read from the sinks' side", "kernel", count=0),
    Mutant("rope-angle-lo-dropped", COMMON, [
        ("const float pl = (float)pos * t.y;", "const float pl = 0.0f;")],
        [KT, "-k", k("rope_types_large_positions", "not cpu")],
        "the RoPE angle drops the low part of the frequency (f32 angles at 1e5)", "kernel"),
    Mutant("rope-att-dropped-rows", DECODE, [
        ("${f}[${x}] = (a * cs - bb * sn) * rope_att;", "${f}[${x}] = (a * cs - bb * sn);")],
        [KT, "-k", k("rope_types_large_positions", "yarn or longrope", ROWS)],
        "the attention factor (yarn, longrope) is not applied to half of q's pairs (rows)",
        "kernel"),
    Mutant("rope-att-dropped-tiled", DECODE, [
        ("xf[e] = (xf[e] * cs + sgn * partner * sn) * rope_att;",
         "xf[e] = (xf[e] * cs + sgn * partner * sn);")],
        [KT, "-k", k("rope_types_large_positions", "yarn or longrope", TILED)],
        "the attention factor is not applied (tiled)", "kernel"),
    Mutant("partial-rotary-pairs", DECODE, [
        ('<% x, y = ROPE.dims("i") %>',
         '<% x, y = ROPE.dims("i") if ROPE.interleaved else ("i", "i + %d" % (D // 2)) %>')],
        [KT, "-k", k("rope_types_large_positions", "partial", ROWS)],
        "partial rotary dims pair i with i + head_dim/2 instead of i + rotary_dim/2",
        "kernel"),
    Mutant("longrope-switch-late", DECODE, [
        ("q_pos[b] >= long_from", "q_pos[b] > long_from")],
        [KT, "-k", k("rope_types_large_positions", "longrope", "not cpu")],
        "the long factors start one position late", "kernel"),
    Mutant("longrope-switch-early-cpu", "clattn/cpu_backend.py", [
        ("int(q_pos[b]) + 1 > long_from", "int(q_pos[b]) + 1 >= long_from")],
        ["tests/test_fallback.py", "-k", "longrope"],
        "the CPU backend switches to the long factors one position early"),
    Mutant("page-index-unclamped", DECODE, [
        ("return pg < 0 ? 0 : (pg >= num_pages ? num_pages - 1 : pg);",
         "return pg;")],
        ["tests/test_oclgrind.py", "-k", "variant_clean_under_oclgrind and adversarial-rows"],
        "garbage page indices are used as they are (Oclgrind sees the reads)", "kernel",
        count=0),
    Mutant("merge-weights-swapped-rows", MERGE, [
        ('${rload("vp + %d" % (i * VEC), DTYPE)} * wx[j]) +',
         '${rload("vp + %d" % (i * VEC), DTYPE)} * wy[j]) +')],
        [KT, "-k", "merge_state_on_device"],
        "the pairwise merge weighs v by the other state's weight (rows merge)", "kernel"),
    Mutant("merge-weights-swapped-tiled", MERGE, [
        ('${c.loadv(VEC, "vp")} * wa) +', '${c.loadv(VEC, "vp")} * wb) +')],
        ["tests/test_profiles_on_devices.py", "-k", "merges_on_device"],
        "the pairwise merge weighs v by the other state's weight (tiled merge)", "kernel"),
    Mutant("tiled-slice-merge-unweighted", DECODE, [
        ("const float w = clattn_state_weight(md[zi * 2], mt);   /* empty slice: 0 */",
         "const float w = md[zi * 2 + 1] > 0.0f ? 1.0f : 0.0f;")],
        [KT, "-k", k("model_shapes", TILED)],
        "the tiled kernel merges its row slices without their weights", "kernel"),
    Mutant("tiled-local-reduction-short", DECODE, [
        ("for (int x = 0; x < ${BDX}; ++x) t += pt[x];",
         "for (int x = 0; x < ${BDX} - 1; ++x) t += pt[x];")],
        [KT, "-k", k("model_shapes", "pocl", "tiled")],
        "the local-memory dot-product reduction drops a lane (tiled)", "kernel"),
    Mutant("tiled-subgroup-reduce-max", DECODE, [
        ("s[j][g] = sub_group_reduce_add(", "s[j][g] = sub_group_reduce_max(")],
        [KT, "-k", k("model_shapes", "intel-tiled")],
        "the sub-group reduction takes the max instead of the sum (tiled, Intel)", "kernel"),
    Mutant("tiled-shared-page-shifted", DECODE, [
        ("pg[j] = pg_step[tz * ${TILE} + j];",
         "pg[j] = pg_step[(tz * ${TILE} + j + 1) % ${ROWS}];")],
        [KT, "-k", k("model_shapes", "pocl", "tiled")],
        "each row takes the page-table entry read for the next row (tiled, local form)",
        "kernel"),
    Mutant("plan-floor-partitions", "clattn/plan.py", [
        ("parts = np.maximum(1, -(-chunk // rows))", "parts = np.maximum(1, chunk // rows)")],
        ["tests/test_plan.py"],
        "the planner rounds partition counts down (the kernel's last partition hides it)"),
    # ---- quantized pages, non-finite states, prepared steps ---------------------------
    Mutant("q4-nibbles-swapped", EXPRS, [
        ('nib = "(%s & 15u)" % b if lane % 32 < 16 else "(%s >> 4)" % b',
         'nib = "(%s & 15u)" % b if lane % 32 >= 16 else "(%s >> 4)" % b')],
        ["tests/test_quant.py", "-k", "decode and q4_0"],
        "q4 lanes read from the wrong nibble", "kernel"),
    Mutant("q8-scale-ignored", EXPRS, [
        ('return "(convert_%s(*(const __global %s*)(%s + (%s))) * %s)" '
         '% (fv, c, name, lane, scale)',
         'return "(convert_%s(*(const __global %s*)(%s + (%s))))" % (fv, c, name, lane)')],
        ["tests/test_quant.py", "-k", "decode and q8_0"],
        "q8 values used without their block scale", "kernel"),
    Mutant("q8-rounding-half-even", "clattn/quant.py", [
        ("q = np.copysign(np.floor(np.abs(p.astype(np.float64)) + 0.5), p)",
         "q = np.rint(p.astype(np.float64))")],
        ["tests/test_quant.py", "-k", "half_away"],
        "the q8_0 quantizer rounds x * id half to even instead of away from zero (ggml)"),
    Mutant("q4-sum-not-rounded-to-f32", "clattn/quant.py", [
        ("np.trunc(p + np.float32(8.5))", "np.trunc(p.astype(np.float64) + 8.5)")],
        ["tests/test_ggml_blocks.py", "-k", "bit_for_bit and q4_0"],
        "the q4_0 quantizer truncates x * id + 8.5 exactly, not its f32 sum (ggml)"),
    Mutant("append-q8-half-even", "kernels/append_bytes.clh.mako", [
        ("return q4 ? min(15, (int)(p + 8.5f)) : (int)round(p);",
         "return q4 ? min(15, (int)(p + 8.5f)) : (int)rint(p);")],
        ["tests/test_cache_quant.py", "-k", "bit_for_bit and pocl"],
        "the append kernel rounds q8_0's x * id half to even instead of away from zero",
        "kernel"),
    Mutant("append-q4-sum-fused", "kernels/append_bytes.clh.mako", [
        ("return q4 ? min(15, (int)(p + 8.5f)) : (int)round(p);",
         "return q4 ? min(15, (int)fma(x, id, 8.5f)) : (int)round(p);")],
        ["tests/test_cache_quant.py", "-k", "bit_for_bit and pocl"],
        "the append kernel fuses q4_0's x * id + 8.5 into one rounding", "kernel"),
    Mutant("append-tiny-scale-codes-kept", "kernels/append_bytes.clh.mako", [
        ("return fabs(d) >= 0x1p-125f ? copysign(clattn_div(1.0f, fabs(d)), d) : 0.0f;",
         "return d != 0.0f ? copysign(clattn_div(1.0f, fabs(d)), d) : 0.0f;")],
        ["tests/test_cache_quant.py", "-k", "bit_for_bit and pocl"],
        "the append kernel computes codes from a scale below TINY_SCALE", "kernel"),
    Mutant("append-check-ignored", "kernels/append_bytes.clh.mako", [
        ("    if (flags[0] == epoch)\n        return;", "")],
        ["tests/test_cache_quant.py", "-k", "device_arrays"],
        "the append writes a block the check pass refused"),
    Mutant("q-values-scale-dropped", DECODE, [
        ("vsc[j] = j < n ? clattn_h2f_1(vrow_s[j][${bb}]) : 0.0f;",
         "vsc[j] = j < n ? 1.0f : 0.0f;")],
        ["tests/test_quant.py", "-k", "decode"],
        "the rows kernel's quantized values lose their block scale"),
    Mutant("broken-state-labelled-empty", COMMON, [
        ('sel(sel("(%s)(NAN)" % T, "(%s)(-INFINITY)" % T, "l == 0.0f")',
         'sel(sel("(%s)(-INFINITY)" % T, "(%s)(-INFINITY)" % T, "l == 0.0f")')],
        ["tests/test_nonfinite.py"],
        "a NaN state gets lse = -inf (reads as empty)", "kernel"),
    Mutant("empty-side-v-read", MERGE_STATE, [
        ("if (sk == -INFINITY) continue;   /* empty: weight 0, v not read */",
         "/* v of empty states read */")],
        ["tests/test_nonfinite.py", "-k", "merges"],
        "the merge multiplies an empty state's v by 0 (NaN poisons it)", "kernel", count=2),
    Mutant("rope-angle-high-half-dropped", COMMON, [
        ("float frac = (pa - rint(pa)) + (pb - rint(pb))",
         "float frac = (pb - rint(pb))")],
        ["tests/test_reliability.py", "-k", "rope_positions"],
        "RoPE angles lose the high 16 bits of the position", "kernel"),
    Mutant("step-reuses-stale-q", "clattn/launch.py", [
        ("if refs.get(name, _UNSET) is v:",
         "if v is not None and refs.get(name) is not None:")],
        ["tests/test_decode_step.py", "-k", "equals_run"],
        "a prepared step keeps the first layer's q and pages", "python"),
    Mutant("split-workspace-unordered", "clattn/opencl_backend.py", [
        ("if last is not None and not (queue_orders and last[1] is queue):",
         "if False:")],
        ["tests/test_kernels.py", "-k", "two_split_runs_in_flight"],
        "split launches sharing the workspace are not ordered on its last user", "python"),
    Mutant("cache-chunks-on-decode", "clattn/cache.py", [
        ("if self.prefill and tables.T > len(tables.lengths):", "if False:")],
        ["tests/test_cache_prefill.py", "-k", "prompts_decode_and_mixed and float32"],
        "the cache runs prompt chunks on the decode kernel (no prefill path)", "python"),
    Mutant("prefill-units-interleaved", "clattn/prefill.py", [
        ("return np.lexsort((-work, seq, -longest[seq]))",
         "return np.argsort(-work, kind='stable')")],
        ["tests/test_prefill.py", "-k", "plan_order_keeps_a_sequence_together"],
        "the prefill units of a batch's sequences interleave (their keys leave the cache)",
        "python"),
    Mutant("prefill-long-units-by-attended-rows", "clattn/prefill.py", [
        ("cached = np.maximum(np.asarray(chunk, np.int64) - n_q, 0)",
         "cached = np.asarray(chunk, np.int64)")],
        ["tests/test_prefill.py", "-k", "queries_per_unit_take_long_units"],
        "the plan takes long units by the rows its queries attend (new ones too), so long "
        "prompts over short caches get them", "python"),
    Mutant("cache-prefill-long-units-ignored", "clattn/cache_device.py", [
        ("qb = queries_per_unit(self.opencl.prefill_geometry, runs.n, runs.chunk)",
         "qb = self.opencl.prefill_geometry.qb")],
        ["tests/test_cache_prefill.py", "-k", "longer_units"],
        "the cache's prefill steps keep qb-query units over long caches", env=FAST),
    Mutant("prefill-run-past-window-slide", "clattn/cache_tables.py", [
        ("key &= t.window_offset == t.sink_size", "key &= t.window_offset >= 0")],
        ["tests/test_cache_prefill.py", "-k", "slide_inside_a_chunk and None"],
        "a prefill run takes the tokens whose window has begun to slide", "python"),
    Mutant("prefill-run-across-longrope-switch", "clattn/cache_tables.py", [
        ("key += 2 * (t.q_pos >= long_from)", "key += 0")],
        ["tests/test_cache_prefill.py", "-k", "longrope"],
        "a prefill run straddles longrope's switch (its first tokens get the long factors)",
        "python"),
    Mutant("minus-inf-part-nan", COMMON, [
        ("return mx == -INFINITY ? 0.0f : mx;", "return mx;")],
        ["tests/test_fuzz.py", "-k", "minus_inf and not cpu"],
        "a part of the chunk whose rows all score -inf turns the state NaN", "kernel"),
    Mutant("split-dead-partitions-read-as-empty", MERGE_STATE, [
        ("const int dead = ${skip} && mx == -INFINITY && clattn_split_dead(${vin}, ${lo}, "
         "${hi}, ${H}, ${h});",
         "const int dead = 0;")],
        ["tests/test_nonfinite.py", "-k", "all_scores_minus_inf"],
        "split-KV: a sequence whose rows all score -inf reads as empty", "kernel", count=2),
    Mutant("append-q4-zero-scale-sign-of-first", "kernels/append_bytes.clh.mako", [
        ("    float m = 0.0f, am = 0.0f;", "    float m = x[0], am = fabs(x[0]);")],
        ["tests/test_cache_quant.py", "-k", "bit_for_bit and pocl"],
        "a q4_0 block of zeros led by -0 gets scale +0 (ggml's is -0 whatever the zeros)",
        "kernel"),
    Mutant("rows-past-int32-accepted", "clattn/validate.py", [
        ("    if nnz * spec.page_size > INT32_MAX:", "    if False:")],
        ["tests/test_validation.py", "-k", "32_bit"],
        "a page table naming more than 2**31 - 1 rows reaches the kernels", "python"),
    Mutant("pool-huge-pages-not-advised", "clattn/host_memory.py", [
        ("        advise_huge_pages(host.ctypes.data, arr.nbytes)\n", "        pass\n")],
        ["tests/test_host_memory.py"],
        "a CPU device's page pool is allocated without asking for huge pages", "python"),
    Mutant("pool-misaligned", "clattn/host_memory.py", [
        ("    lo = -(-address // HUGE_PAGE) * HUGE_PAGE", "    lo = address")],
        ["tests/test_host_memory.py"],
        "huge pages are advised from an address that does not start one", "python"),
    Mutant("pool-advised-past-its-end", "clattn/host_memory.py", [
        ("    hi = (address + nbytes) // HUGE_PAGE * HUGE_PAGE",
         "    hi = -(-(address + nbytes) // HUGE_PAGE) * HUGE_PAGE")],
        ["tests/test_host_memory.py"],
        "the advice reaches past the pool, into memory it does not own", "python"),
    # ---- other machines and OpenCL stacks ---------------------------------------------
    Mutant("probe-in-process-everywhere", "clattn/compiler_probe.py", [
        ("    return device.platform.name.strip().lower().startswith(IN_PROCESS_PLATFORMS)",
         "    return True")],
        ["tests/test_compiler_probe.py", "-k", "allow_list"],
        "compiler probes run in the caller's process on every platform (rusticl's compiler "
        "ends the process on __builtin_prefetch)", "python"),
    Mutant("probe-crash-means-yes", "clattn/compiler_probe.py", [
        ('    if done.returncode == 0 and lines and lines[-1] in ("yes", "no"):',
         '    if done.returncode or lines and lines[-1] in ("yes", "no"):'),
        ('        return lines[-1] == "yes", ""', '        return True, ""')],
        ["tests/test_compiler_probe.py", "-k", "kills"],
        "a child probe that died is read as a working feature", "python"),
    Mutant("unusable-device-used", "clattn/device.py", [
        ("    runtime.check_usable(dev)\n    return device_setup", "    return device_setup")],
        ["tests/test_portability.py", "-k", "refused_by_name"],
        "a device whose compiler cannot build a kernel is used (every kernel then fails to "
        "build)", "python"),
    Mutant("unusable-device-chosen-by-default", "clattn/runtime.py", [
        ("    real = [d for d in devices if not is_simulator(d) and device_problem(d) is None]",
         "    real = [d for d in devices if not is_simulator(d)]")],
        ["tests/test_portability.py", "-k", "refused_by_name"],
        "the default device choice takes a device whose compiler fails", "python"),
    Mutant("tuner-drops-before-shrinking", "clattn/tune/search.py", [
        ("        if room and total_bytes(need, cold, 1) > room:", "        if False:")],
        ["tests/test_profiler.py", "-k", "shrink"],
        "the tuner's pools are not shrunk to the memory there is (shapes dropped instead)",
        "python"),
    Mutant("prefill-tuner-times-unverified", "clattn/tune/prefill_search.py", [
        ("                why = self._verify(pre, name)\n", "                why = None\n")],
        ["tests/test_tune_prefill.py", "-k", k("verifies_every_candidate", "pocl")],
        "the tuner's prefill stage times a candidate without checking it against the CPU "
        "backend (a wrong kernel can win)", "python"),
    Mutant("tuner-keeps-a-slower-winner", "clattn/tune/search.py", [
        ("    if best is not default and scores[best.id] >= scores[default.id]:",
         "    if False:")],
        ["tests/test_profiler.py", "-k", "does_not_hold_up"],
        "a search winner slower than the default when timed again is kept (both stages)",
        "python"),
    Mutant("prefill-rows-one-row-vector", "clattn/fit.py", [
        ("max(by_floats, -(-PREFILL_MIN_ROW_VECTORS * vec // G))", "max(by_floats, 1)")],
        ["tests/test_tune_prefill_fit.py", "-k", "fill_two_row_vectors"],
        "the rows prefill derives units of one row vector (one multiply-add per key element)",
        "python"),
    Mutant("llvmpipe-tiled-prefill", "clattn/fit.py", [
        ('            tiled_prefill="llvmpipe" not in '
         'str(info.get("device_name") or "").lower(),\n',
         "")],
        ["tests/test_portability.py", "-k", "llvmpipe_fault"],
        "Mesa's llvmpipe is given the tiled prefill kernel it gets wrong", "python"),
    # ---- format limits, rules one input reaches, growing state, integration sequences --
    Mutant("append-decode-position-late", "clattn/cache_tables.py", [
        ("s.pos_offset + chunk - 1, s.pos_offset, slot, s.pos_offset + s.length,",
         "s.pos_offset + chunk - 1, s.pos_offset, slot, s.pos_offset + s.length + 1,")],
        ["tests/test_cache.py", "-k", k("rope_append_positions", "cpu or intel")],
        'rope="append": a decode step after a chunk rotates its key one position late'),
    Mutant("position-overflow-first-token-only", "clattn/cache_tables.py", [
        ("if s.pos_offset + s.length + n - 1 > _POS_LIMIT:",
         "if s.pos_offset + s.length > _POS_LIMIT:")],
        ["tests/test_cache.py", "-k", k("past_int32", "cpu or intel")],
        "begin checks the step's first new position only: the last ones wrap past int32"),
    Mutant("prefill-longrope-by-first-query", "kernels/prefill_common.clh.mako", [
        ("(rotary_mode && (long)qpos_b + n_q - 1 >= long_from)",
         "(rotary_mode && (long)qpos_b >= long_from)")],
        ["tests/test_prefill.py", "-k", k("longrope_switch", "intel")],
        "the prefill kernels choose longrope's factors by a sequence's first query", "kernel"),
    Mutant("prefill-longrope-by-first-query-cpu", "clattn/cpu_backend.py", [
        ("inv = inv2[1] if qpos + n - 1 >= long_from else inv2[0]",
         "inv = inv2[1] if qpos >= long_from else inv2[0]")],
        ["tests/test_prefill.py", "-k", k("longrope_switch", "cpu")],
        "the CPU prefill chooses longrope's factors by a sequence's first query"),
    Mutant("prefill-queries-before-window-accepted", "clattn/validate.py", [
        ("        over |= (n_q > t.stored - wo) & (wo != sink) & (n_q > 0)\n", "")],
        ["tests/test_prefill.py", "-k", k("inside_the_window", "cpu or intel")],
        "causal prefill queries before a window's start run (meaningless results)"),
    Mutant("prefill-query-position-overflow-unchecked", "clattn/validate.py", [
        ("            if (last > INT32_MAX).any():", "            if False:")],
        ["tests/test_prefill.py", "-k", k("int32_limit", "cpu or intel")],
        "prefill: queries placed by q_pos past int32 run (their positions wrap)"),
    Mutant("append-check-f16-limit-65504", "kernels/append_bytes.clh.mako", [
        ("fabs(clattn_scale32(m, q4)) >= 65520.0f", "fabs(clattn_scale32(m, q4)) > 65504.0f")],
        ["tests/test_cache_quant.py", "-k", k("top_of_float16", "intel")],
        "the device check refuses blocks whose scale f16 stores as 65504", "kernel"),
    Mutant("append-check-accepts-65520", "kernels/append_bytes.clh.mako", [
        ("fabs(clattn_scale32(m, q4)) >= 65520.0f", "fabs(clattn_scale32(m, q4)) > 65520.0f")],
        ["tests/test_cache_quant.py", "-k", k("top_of_float16", "intel")],
        "the device check lets a scale of 65520 through: f16 stores it as inf", "kernel"),
    Mutant("workspace-never-grows", "clattn/opencl_backend.py", [
        ("if self._ws is None or self._ws[0] < n_ws:", "if self._ws is None:")],
        ["tests/test_oclgrind.py", "tests/test_cache_oclgrind.py", "-k",
         "rows-growing-split-workspace or cache-rows-growing-split"],
        "the backend keeps the split workspace of its first plan (BatchDecode's and the "
        "cache's later plans write past it)"),
    Mutant("later-padding-accepted-with-windows", "clattn/integrations/transformers.py", [
        ("late = (held[:, None] > 0) | (np.cumsum(new, axis=1) > 0)",
         "late = np.cumsum(new, axis=1) > 0")],
        ["tests/test_transformers.py", "-k", k("later_forward_refused", "intel")],
        "a sliding-window model accepts padding in a later forward (the window counts it)"),
    Mutant("windowed-crop-pages-given-back", "clattn/integrations/transformers.py", [
        ("g.recorded = g.recorded + L if layer.record_past else 0", "g.recorded = 0")],
        ["tests/test_transformers.py", "-k", k("assisted_decoding", "intel")],
        "assisted decoding: a sliding-window layer gives back pages a crop needs"),
    Mutant("longrope-cache-drop-not-handled", "clattn/integrations/transformers.py", [
        ("            _keep_cache_on_restart(type(self))\n", "")],
        ["tests/test_longrope_switch.py", "-k", k("cpu", "Phi-3.5-mini", "10")],
        "a longrope model's generate drops the ClattnCache at the switch: eager from there"),
    Mutant("longrope-past-keys-kept-short", "clattn/integrations/transformers.py", [
        ("            given.reset()  # the recompute appends every position from 0",
         ("            inputs.update({n: inputs[n][:, given.get_seq_length():]\n"
          "                           for n in (\"input_ids\", \"position_ids\")})"))],
        ["tests/test_longrope_switch.py", "-k", k("cpu", "Phi-3.5-mini", "10")],
        "at the longrope switch the cache is kept instead of recomputed: the past keys "
        "keep their short-factor rotation"),
    Mutant("sink-in-every-partition", "kernels/decode_rows.cl.mako", [
        ('"CLATTN_SINK(direct && use_sinks, h)"', '"CLATTN_SINK(use_sinks, h)"')],
        ["tests/test_sinks.py", "-k", "unsplit_and_split"],
        "a split sequence's partitions each add the learned sink (the merge adds it again)",
        "kernel"),
    Mutant("launch-sinks-on-the-build-without", "clattn/decode_launch.py", [
        ('self.kernels(operands["sink_logits"] is not None,', "self.kernels(False,")],
        ["tests/test_sinks.py", "-k", "paged_cache_sinks or switch_builds"],
        "a bound decode launch (the cache's, BatchDecode.run's short path) runs learned "
        "sinks on the build without the sink epilogue (the sinks are dropped)"),
    Mutant("held-append-reads-caller-kv-late", "clattn/cache_device.py", [
        ('dk, ek = self._device_input("k", k, held=self.fuse)',
         'dk, ek = self._device_input("k", k, held=False)')],
        ["tests/test_cache_fused.py", "-k", "held"],
        "a held (fused) append reads the caller's device k/v at the attend, not at append",
        "python"),
    Mutant("fold-counter-not-reset", "kernels/decode_rows.cl.mako", [
        ("            atomic_xchg(ctr, 0);\n", "")],
        ["tests/test_fold_merge.py", "-k", k("equals_separate", "float32", ROWS)],
        "the folded merge leaves its counter set: the next launch's last partition never "
        "sees count - 1 (no merge)", "kernel"),
    Mutant("fold-last-partition-off-by-one", "kernels/decode_rows.cl.mako", [
        ("(int)get_global_size(2), n_ws) - 1)", "(int)get_global_size(2), n_ws) - 2)")],
        ["tests/test_fold_merge.py", "-k", k("equals_separate", "float32", ROWS)],
        "the partition before the last merges (before the last one's state is stored), "
        "and the counter is left at 1", "kernel"),
    Mutant("fold-tiled-counter-not-reset", "kernels/decode_tiled.cl.mako", [
        ("            if (last) atomic_xchg(ctr, 0);\n", "")],
        ["tests/test_fold_merge.py", "-k", k("equals_separate", "float32", TILED)],
        "the tiled folded merge leaves its counter set", "kernel"),
    Mutant("custom-mask-ignored-on-device", "clattn/prefill.py", [
        ("use_mask=int(custom_mask is not None),", "use_mask=0,")],
        ["tests/test_custom_mask.py", "-k", "random_masks"],
        "the prefill kernels are told there is no mask", "python"),
    # ---- issue 36: bugs the suite let through, or caught only by a machine's luck ----------
    Mutant("append-longrope-after-long-from", "kernels/append_row.clh.mako", [
        ("rope_turns + (pos >= long_from ? ${ROT // 2} : 0);",
         "rope_turns + (pos > long_from ? ${ROT // 2} : 0);")],
        ["tests/test_cache_prefill.py", "-k", "at_long_from"],
        "the device append rotates the key at exactly long_from with the short factors",
        "kernel", env=FAST),
    Mutant("probe-child-status-ignored", "clattn/compiler_probe.py", [
        ('if done.returncode == 0 and lines and lines[-1] in ("yes", "no"):',
         'if lines and lines[-1] in ("yes", "no"):')],
        ["tests/test_compiler_probe.py", "-k", "kills"],
        "a probe child that prints yes and then dies counts as yes", env=FAST),
    Mutant("health-check-any-right-value", "clattn/runtime.py", [
        ("if not (got == 7).all():", "if not (got == 7).any():")],
        ["tests/test_portability.py", "-k", "computes_wrong"],
        "a device whose health kernel writes some wrong values is accepted", env=FAST),
    Mutant("step-sinks-on-the-unfolded-build", "clattn/decode_launch.py", [
        ("self.opencl.decode_kernels(sinks=sinks, fold=fold)",
         "self.opencl.decode_kernels(sinks=sinks, fold=fold and not sinks)")],
        ["tests/test_fold_merge.py", "-k", "step_with_sinks"],
        "a prepared split step with sinks launches the unfolded decode and no merge",
        env=FAST),
    Mutant("fold-counters-never-grow", "clattn/opencl_backend.py", [
        ("if self._counters is None or self._counters[0] < n:", "if self._counters is None:")],
        ["tests/test_fold_merge.py", "-k", "grow_with"],
        "the folded merge's counters keep the first batch's size (later launches count "
        "past them; Intel's runtime crashes on it, PoCL gives wrong values)", env=POCL),
    Mutant("prefill-whole-block-on-the-diagonal", "kernels/prefill_rows.cl.mako", [
        ("const int whole = mfull && r0 + ${KB - 1} <= QLIM(0);",
         "const int whole = mfull && r0 <= QLIM(0);")],
        ["tests/test_prefill.py", "-k", k("model_shapes", ROWS)],
        "the rows prefill skips the causal masks in a block the diagonal crosses (queries "
        "attend later keys)", "kernel", env=FAST),
    Mutant("prefill-diagonal-tiles-by-the-last-row", "kernels/prefill_rows.cl.mako", [
        ("jt = min(jt, max(((int*)lim)[r + ${a}] - r0 + 1, 0));",
         "jt = min(jt, max(((int*)lim)[r + ${MV - 1}] - r0 + 1, 0));")],
        ["tests/test_prefill.py", "-k", "masked_nonfinite and not tiled and not cpu"],
        "the rows prefill's diagonal value tiles run to the keys of the tile's last row "
        "(earlier rows add later keys' values)", "kernel", env=FAST),
    Mutant("prefill-mask-unit-offset", "kernels/prefill_common.clh.mako", [
        ("* 8 + (long)q0 * chunk : 0;", "* 8 : 0;")],
        ["tests/test_custom_mask.py", "-k", "several_prefill_units"],
        "a sequence's later prefill units read the mask bits of its first queries",
        "kernel", env=FAST),
    Mutant("fuse-when-any-sequence-has-one-token", "clattn/cache_device.py", [
        ("all(n == 1 for n in t.lengths)", "any(n == 1 for n in t.lengths)")],
        ["tests/test_cache_fused.py", "-k", "every_sequence_brings"],
        "a step fuses its append when any sequence (not every one) brings one token",
        env=FAST),
    Mutant("sink-logit-overflow-accepted", "clattn/validate.py", [
        ("        if huge.any():\n", "        if False:\n")],
        ["tests/test_sinks.py", "-k", "bad_sinks"],
        "a finite sink logit whose base-2 form overflows f32 is launched (NaN heads)",
        env=FAST),
    Mutant("wait-for-context-unchecked", "clattn/staging.py", [
        ("if rt is not None and _context_of(e) != rt.context:", "if False:")],
        ["tests/test_kernels.py", "-k", "another_context"],
        "an event of another context reaches the driver (PoCL: INVALID_CONTEXT at enqueue; "
        "Intel's runtime aborts the process)", env=POCL),
    Mutant("simulator-as-the-last-resort", "clattn/runtime.py", [
        ("    usable = gpus or pocl or real\n",
         "    usable = gpus or pocl or real or [d for d in devices if is_simulator(d)]\n")],
        ["tests/test_portability.py", "-k", "only_the_simulator"],
        "with every real device unusable the default is the Oclgrind simulator",
        env={"CLATTN_TEST_DEVICES": "pocl,oclgrind"}),
    Mutant("tree-mask-rounds-parents", "clattn/mask.py", [
        ("if not is_int(p) or not -1 <= p < i:", "if not -1 <= int(p) < i:")],
        ["tests/test_custom_mask.py", "-k", "tree_mask_refuses"],
        "tree_mask takes a parent of 0.5 as 0", env=FAST),
    Mutant("masked-begin-checks-masks-first", "clattn/cache.py", [
        ("                seq_ids, lengths, _ = self.table.check_step(seq_ids, lengths)\n", "")],
        ["tests/test_custom_mask.py", "-k", "take_seq_ids"],
        "begin(..., masks=) reads seq_ids twice and checks masks before lengths (raw "
        "IndexError, a generator refused)", env=FAST),
    # ---- multi-head latent attention in the latent form (clattn.integrations.hf_mla) ----
    Mutant("mla-latent-scale-of-row-width", "clattn/integrations/transformers.py", [
        ("        query, key, value = absorb.inputs(query, *cached)\n",
         "        query, key, value = absorb.inputs(query, *cached)\n"
         "        scaling = query.shape[-1] ** -0.5\n")],
        ["tests/test_mla_latent.py", "-k", "bound and cpu"],
        "the latent form attends with 1/sqrt of the row's width, not the model's scale"),
    Mutant("mla-latent-values-from-the-row-end", "clattn/integrations/hf_mla.py", [
        ("        rows = torch.cat((latent, k_pe.to(latent.dtype)), dim=-1)",
         "        rows = torch.cat((k_pe.to(latent.dtype), latent), dim=-1)")],
        ["tests/test_mla_latent.py", "-k", "bound and cpu"],
        "the latent form's rows are stored [k_pe | c]: the values (a row's leading "
        "kv_lora_rank) take in the rope key, and the absorbed query meets the wrong parts"),
]


# ---------------------------------------------------------------------------- machinery
def _files(base: Path, pattern: str) -> list[Path]:
    if any(ch in pattern for ch in "*?["):
        return sorted(p for p in base.glob(pattern) if p.is_file())
    p = base / pattern
    return [p] if p.is_file() else []


def locate(base: Path, m: Mutant) -> tuple[dict, str | None]:
    """{file: mutated text} for mutant ``m`` under ``base``, or ({}, why it is stale)."""
    files = _files(base, m.path)
    if not files:
        return {}, f"no file matches {m.path!r}"
    texts = {f: f.read_text(encoding="utf-8") for f in files}
    out: dict = {}
    for anchor, repl in m.edits:
        hits = {f: t.count(anchor) for f, t in {**texts, **out}.items() if anchor in t}
        total = sum(hits.values())
        if total == 0 or (m.count and total != m.count):   # count 0: at least one
            where = ", ".join(f"{f.relative_to(base)} x{n}" for f, n in hits.items()) or "nowhere"
            return {}, (f"anchor found {total} times (want {m.count}) in {m.path}: "
                        f"{anchor[:70]!r} ({where})")
        for f in hits:
            out[f] = out.get(f, texts[f]).replace(anchor, repl)
    return out, None


def _env(copy: Path, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CLATTN_REQUIRE_DEVICES", "CLATTN_TEST_DEVICES", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=os.pathsep.join([str(copy), str(copy / "tests")]),
               PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def run_pytest(copy: Path, tests: list, env: dict, timeout: int) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "-W", "ignore", *tests]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, out + "\n[timed out]", time.monotonic() - t0


def first_failure(output: str) -> str:
    """The first failing test and what failed it (an assertion, or another exception)."""
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    e = re.search(r"^E\s+(\w+(?:Error|Exception|Failed))\b", output, re.M)
    kind = e.group(1) if e else ""
    return (m.group(1) if m else "") + (f" ({kind})" if kind and kind != "AssertionError" else "")


def classify(rc: int, output: str) -> tuple[str, str]:
    if rc == 0:
        return "SURVIVED", "every selected test passed"
    if rc == 1:
        if BUILD_FAILURE.search(output):
            return "INVALID", "the mutated code does not build: " + first_failure(output)
        return "caught", first_failure(output)
    if rc == 5:
        return "ERROR", "no test selected"
    if rc == -1:
        return "ERROR", "timed out"
    return "ERROR", f"pytest exit status {rc}: " + output.strip().splitlines()[-1:][0][:200] \
        if output.strip() else f"pytest exit status {rc}"


def make_copy(tmp: Path) -> Path:
    copy = tmp / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(*IGNORE), symlinks=True)
    return copy


def check_import(copy: Path) -> None:
    code = "import clattn, sys; print(clattn.__file__)"
    res = subprocess.run([sys.executable, "-c", code], cwd=copy, env=_env(copy, {}),
                         capture_output=True, text=True)
    path = res.stdout.strip()
    if res.returncode or not Path(path).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"mutate: the copy's clattn is not the one imported "
                         f"({path or res.stderr})")


def table(rows: list) -> str:
    head = ("mutant", "kind", "result", "seconds", "detail")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(4)]
    lines = [" | ".join(str(h).ljust(w) for h, w in zip(head, widths + [0])).rstrip()]
    lines.append("-|-".join("-" * w for w in widths + [6]))
    for r in rows:
        lines.append(" | ".join(str(c).ljust(w) for c, w in zip(r, widths + [0])).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutants to run (glob patterns; default all)")
    ap.add_argument("--list", action="store_true",
                    help="list mutants and whether their anchors hold")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmodified runs")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    chosen = [m for m in MUTANTS if not args.names or
              any(fnmatch.fnmatch(m.name, pat) for pat in args.names)]
    if not chosen:
        print(f"mutate: no mutant matches {args.names}", file=sys.stderr)
        return 2
    if args.list:
        bad = 0
        for m in chosen:
            _, why = locate(ROOT, m)
            bad += why is not None
            print(f"{m.name:36} {m.kind:7} {'STALE: ' + why if why else 'ok'}")
        return 1 if bad else 0

    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="clattn-mutate-") as tmp:
        copy = make_copy(Path(tmp))
        check_import(copy)
        print(f"mutate: {len(chosen)} mutants; copy at {copy}", flush=True)
        baseline_ok: dict = {}
        for m in chosen:
            mutated, why = locate(copy, m)
            if why:
                rows.append((m.name, m.kind, "STALE", 0, why))
                print(f"  {m.name}: STALE ({why})", flush=True)
                continue
            key = json.dumps([m.tests, m.env])
            if not args.no_baseline and key not in baseline_ok:
                rc, out, secs = run_pytest(copy, m.tests, _env(copy, m.env), args.timeout)
                baseline_ok[key] = (rc == 0, first_failure(out) or out.strip()[-300:])
                print(f"  baseline {' '.join(m.tests)}: rc={rc} ({secs:.0f}s)", flush=True)
            if not args.no_baseline and not baseline_ok[key][0]:
                rows.append((m.name, m.kind, "ERROR", 0,
                             f"baseline fails without the mutant: {baseline_ok[key][1]}"))
                continue
            originals = {f: f.read_text(encoding="utf-8") for f in mutated}
            try:
                for f, text in mutated.items():
                    f.write_text(text, encoding="utf-8")
                rc, out, secs = run_pytest(copy, m.tests, _env(copy, m.env), args.timeout)
            finally:
                for f, text in originals.items():
                    f.write_text(text, encoding="utf-8")
            result, detail = classify(rc, out)
            files = ", ".join(str(f.relative_to(copy)) for f in mutated)
            rows.append((m.name, m.kind, result, round(secs), detail))
            results.append(dict(name=m.name, kind=m.kind, files=files, result=result,
                                seconds=round(secs, 1), detail=detail, why=m.why,
                                tests=m.tests))
            print(f"  {m.name}: {result} ({secs:.0f}s) {detail}", flush=True)
            if result == "SURVIVED":
                print("    --- output tail ---\n" + "\n".join(out.splitlines()[-5:]), flush=True)
    print()
    print(table(rows))
    bad = [r for r in rows if r[2] != "caught"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} mutants caught"
          + (f"; not caught: {', '.join(r[0] + ' (' + r[2] + ')' for r in bad)}" if bad else ""))
    if args.json:
        stale = [dict(name=r[0], kind=r[1], result=r[2], detail=r[4]) for r in rows
                 if r[2] in ("STALE", "ERROR") and r[0] not in {x["name"] for x in results}]
        Path(args.json).write_text(json.dumps(results + stale, indent=2), encoding="utf-8")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
