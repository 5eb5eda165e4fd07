"""Key scores from q8_0 pages by integer dot products: a prototype timed beside float ones.

Decode dequantizes a q8_0 key to floats and multiplies it by the float query
(docs/contract.md section 12): on a CPU whose decode is bound by its own work (no
AVX-512: every row of RESULTS' machine F), each 8 codes cost two conversions (sign
extension, int to float) beside the group's multiply-adds, where an f16 key costs one,
and q8_0 pages decode no faster than f16 ones though they hold half the bytes. ggml's
quantized path quantizes the query too, per block of 32 values, and sums code products
in integers. This script measures what that would buy before any kernel or the contract
changes: four stand-alone kernels score every row of one KV head's keys for the group's
query heads (the K half of a decode; no softmax, no values), each work-item a contiguous
slice of rows, explicit vectors loaded as decode's kernels load them (a vector pointer, not
``vloadn``, which PoCL calls out of line):

* ``f16``: f16 keys converted to floats, float multiply-adds (the f16 pages' work);
* ``q8_0``: q8_0 keys converted to floats, float multiply-adds per block, the block's
  scale applied once per block and head (the q8_0 pages' work today);
* ``q8_0 x q8, short`` and ``q8_0 x q8, int``: q8_0 keys times the query quantized to 8
  bits per block (f32 scale ``max|q| / 127``, codes rounded half to even: ggml rounds half
  away from zero and keeps an f16 scale, a difference that moves no time), products formed
  in 16-bit lanes and paired into 32-bit sums, or formed in 32-bit lanes, summed per block
  in 32-bit integers, then converted and scaled once per block and head.

Each kernel's scores are checked against float64 scores of what it reads (for the integer
forms: of the quantized query; how far the query's rounding moves the scores from the
float q8_0 kernel's is printed beside).
The kernels run in turns, the order reversed every other turn, on the same rows (hot:
the machine's arithmetic, not its memory, is what this asks about).

    python tools/proto_int_dot.py --device "pthread-AMD EPYC" --model Llama-3-8B

A developer script, not a test.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
import warnings

import numpy as np
import pyopencl as cl
from common import MODELS, cpu_description, driver_description  # first: clattn on the path

from clattn import runtime
from clattn.quant import dequantize, quantize

BLOCK = 32


#: f16 to f32 in one hardware conversion where the device has one, as decode's kernels:
#: cl_khr_fp16's half type, else clang's __fp16 storage type (PoCL)
H2F = {True: """#pragma OPENCL EXTENSION cl_khr_fp16 : enable
inline float h2f1(const ushort u) { return convert_float(as_half(u)); }
inline float8 h2f8(const ushort8 u) { return convert_float8(as_half8(u)); }""",
       False: """typedef __fp16 h2_t __attribute__((ext_vector_type(2)));
typedef __fp16 h8_t __attribute__((ext_vector_type(8)));
inline float h2f1(const ushort u)
{ return __builtin_convertvector(__builtin_astype((ushort2)(u, 0), h2_t), float2).x; }
inline float8 h2f8(const ushort8 u)
{ return __builtin_convertvector(__builtin_astype(u, h8_t), float8); }"""}


#: the integer forms of ``q8_0 x q8``: the products' type, the widening of 16 codes to it,
#: and the sum of a product vector's lanes into 8 lanes
INT_FORMS = {
    "q8_0 x q8, short": ("short16", "convert_short16",
                         "convert_int8(p.even) + convert_int8(p.odd)"),
    "q8_0 x q8, int": ("int16", "convert_int16", "p.lo + p.hi"),
}


def _lines(fmt: str, *ranges: range) -> str:
    """``fmt`` formatted with every combination of the ranges' values, a line each."""
    return "\n".join(fmt.format(*v) for v in itertools.product(*ranges))


def _float_body(G: int, D: int, scaled: bool) -> str:
    """One row's float scores: f16 keys (``scaled`` False) or q8_0 ones, whose block sums
    are scaled once per block and head."""
    if not scaled:
        return "\n".join(
            f"            {{ const float8 k = h2f8(LD(ushort8, kr + {c * 8}));\n"
            + _lines("              acc{0} += q{0}_%d * k;" % c, range(G)) + " }"
            for c in range(D // 8))
    return _blocks(G, D, "float8", "float8", "convert_float8(LD(char8, kr + %d))",
                   "b{0} += q{0}_%d * k;", "acc{0} += b{0} * d;")


def _int_body(G: int, D: int, form: str) -> str:
    """One row's scores from integer block sums (``INT_FORMS[form]``)."""
    typ, widen, pairs = INT_FORMS[form]
    return _blocks(G, D, "int8", typ, f"{widen}(LD(char16, kr + %d))",
                   f"{{{{ const {typ} p = k * qi{{0}}_%d; b{{0}} += {pairs}; }}}}",
                   "acc{0} += convert_float8(b{0}) * (d * qd{0}_%d);")


def _blocks(G: int, D: int, sum_t: str, k_t: str, load: str, step: str, scale: str) -> str:
    """One row's scores block by block: each head's block sum ``b<head>`` (``sum_t``) over
    chunks ``k`` (``k_t``, as many codes as its lanes; ``load`` % the chunk's byte offset),
    updated by ``step`` (% the chunk's index; ``{0}`` the head), then ``scale`` (% the
    block's index) adds it to the head's scores with the block's key scale ``d``."""
    width = int(k_t.lstrip("abcdefghijklmnopqrstuvwxyz"))
    per, out = BLOCK // width, []
    for b in range(D // BLOCK):
        out.append(f"            {{ const float d = h2f1(sc[{b}]);")
        out.append(_lines(f"              {sum_t} b{{0}} = ({sum_t})(0);", range(G)))
        for c in range(per):
            out.append(f"              {{ const {k_t} k = {load % (b * BLOCK + c * width)};")
            out.append(_lines("                " + step % (b * per + c), range(G)) + " }")
        out.append(_lines("              " + scale.replace("%d", str(b)), range(G)) + " }")
    return "\n".join(out)


def kernel_source(G: int, D: int, native_half: bool) -> str:
    """The kernels for a group of ``G`` query heads of ``D`` dimensions (``native_half``:
    the device has cl_khr_fp16): ``score_f16``, ``score_q8`` and one ``score_i<n>`` per
    :data:`INT_FORMS` entry."""
    if D % BLOCK:
        raise ValueError(f"head_dim {D}: q8_0 blocks need a multiple of {BLOCK}")
    NB = D // BLOCK
    sums = _lines("        S[(size_t)r * %d + {0}] = hsum8(acc{0});" % G, range(G))
    zero = _lines("        float8 acc{0} = (float8)(0.0f);", range(G))
    q_f = _lines("    const float8 q{0}_{1} = LD(float8, Q + {0} * %d + {1} * 8);" % D,
                 range(G), range(D // 8))
    q_d = _lines("    const float qd{0}_{1} = QD[{0} * %d + {1}];" % NB, range(G), range(NB))
    src = ["""
inline float hsum8(const float8 v)
{ const float4 a = v.lo + v.hi; const float2 b = a.lo + a.hi; return b.x + b.y; }
""" + H2F[native_half] + """
#define LD(type, p) (*(const __global type*)(p))
#define SLICE const int w = get_global_id(0); const int per = rows / get_global_size(0); \\
    const int r0 = w * per;
"""]
    for name, key_t, scaled in (("score_f16", "ushort", None), ("score_q8", "char", True)):
        scales = "__global const ushort* KS, " if scaled else ""
        sc = f"const __global ushort* sc = KS + (size_t)r * {NB};" if scaled else ""
        src.append(f"""
__kernel void {name}(__global const {key_t}* K, {scales}__global const float* Q,
                     __global float* S, const int rows) {{
    SLICE
{q_f}
    for (int r = r0; r < r0 + per; ++r) {{
        const __global {key_t}* kr = K + (size_t)r * {D};
        {sc}
{zero}
{_float_body(G, D, bool(scaled))}
{sums}
    }}
}}
""")
    for n, form in enumerate(INT_FORMS):
        typ, widen, _ = INT_FORMS[form]
        q_i = _lines(f"    const {typ} qi{{0}}_{{1}} = {widen}(LD(char16, QI + {{0}} * {D} + "
                     f"{{1}} * 16));", range(G), range(D // 16))
        src.append(f"""
__kernel void score_i{n}(__global const char* K, __global const ushort* KS,
                         __global const char* QI, __global const float* QD,
                         __global float* S, const int rows) {{
    SLICE
{q_i}
{q_d}
    for (int r = r0; r < r0 + per; ++r) {{
        const __global char* kr = K + (size_t)r * {D};
        const __global ushort* sc = KS + (size_t)r * {NB};
{zero}
{_int_body(G, D, form)}
{sums}
    }}
}}
""")
    return "".join(src)


def quantize_query(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``q [G, D]`` as int8 codes and float32 scales per block of 32 (``max|q| / 127``,
    codes rounded half to even)."""
    G, D = q.shape
    b = q.reshape(G, D // BLOCK, BLOCK).astype(np.float32)
    d = np.abs(b).max(axis=2) / np.float32(127)
    codes = np.rint(b / np.where(d > 0, d, 1)[..., None]).astype(np.int8)
    return codes.reshape(G, D), d.astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", default="Llama-3-8B", help=f"one of {', '.join(MODELS)}")
    ap.add_argument("--rows", type=int, default=32768, help="key rows (hot: a few MiB)")
    ap.add_argument("--items", type=int, default=0,
                    help="work-items (default: 8 per compute unit)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    m = MODELS[args.model]
    G, D = m.num_qo_heads // m.num_kv_heads, m.head_dim
    dev = runtime.select_device(args.device)
    ctx = cl.Context([dev])
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    items = args.items or 8 * dev.max_compute_units
    rows = args.rows // items * items
    rng = np.random.default_rng(args.seed)
    k = rng.standard_normal((rows, D)).astype(np.float32)
    q = rng.standard_normal((G, D)).astype(np.float32)
    k16 = k.astype(np.float16)
    kq, ks = quantize(k, "q8_0")
    qi, qd = quantize_query(q)
    source = kernel_source(G, D, "cl_khr_fp16" in dev.extensions)
    prg = cl.Program(ctx, source).build(options=["-cl-fast-relaxed-math"])
    mf = cl.mem_flags

    def buf(a: np.ndarray) -> cl.Buffer:
        return cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))

    names = ["f16", "q8_0", *INT_FORMS]
    S = {n: cl.Buffer(ctx, mf.WRITE_ONLY, rows * G * 4) for n in names}
    i32 = np.int32(rows)
    kb, sb = buf(kq), buf(ks.view(np.uint16))
    runs = {"f16": (prg.score_f16, [buf(k16.view(np.uint16)), buf(q), S["f16"], i32]),
            "q8_0": (prg.score_q8, [kb, sb, buf(q), S["q8_0"], i32])}
    for n, form in enumerate(INT_FORMS):
        runs[form] = (getattr(prg, f"score_i{n}"), [kb, sb, buf(qi), buf(qd), S[form], i32])
    kd = dequantize(kq, ks, "q8_0").astype(np.float64)
    exact = {"f16": k16.astype(np.float64) @ q.T.astype(np.float64),
             "q8_0": kd @ q.T.astype(np.float64)}
    qdq = (qi.astype(np.float64).reshape(G, D // BLOCK, BLOCK) * qd[..., None]).reshape(G, D)
    for form in INT_FORMS:
        exact[form] = kd @ qdq.T
    errors = {}
    for name, (knl, kargs) in runs.items():
        knl(queue, (items,), (1,), *kargs).wait()
        got = np.empty((rows, G), np.float32)
        cl.enqueue_copy(queue, got, S[name])
        scale = np.abs(exact[name]).max()
        errors[name] = np.abs(got - exact[name]).max() / scale
        if errors[name] > 1e-5:
            raise SystemExit(f"{name}: scores off by {errors[name]:.2e} of the largest")
    beside = np.abs(kd @ qdq.T - exact["q8_0"]).max() / np.abs(exact["q8_0"]).max()
    ms: dict[str, list[float]] = {n: [] for n in runs}
    t0, turn = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds or turn < 6:
        for name in names if turn % 2 == 0 else names[::-1]:
            knl, kargs = runs[name]
            evt = knl(queue, (items,), (1,), *kargs)
            evt.wait()
            ms[name].append((evt.profile.end - evt.profile.start) * 1e-6)
        turn += 1
    base = statistics.median(ms["f16"])
    print(f"## `python tools/proto_int_dot.py --device {args.device} --model {args.model}`\n")
    print(f"- CPU: {cpu_description()}")
    print(f"- device: {driver_description([dev])[0]}")
    print(f"- {args.model}: {G} query heads of {D} per KV head; {rows} key rows, "
          f"{items} work-items; {turn} turns\n")
    print("| kernel | median ms | key bytes | time / f16's | scores' error (of the largest) |")
    print("|---|---:|---:|---:|---|")
    nbytes = {n: kq.nbytes + ks.nbytes for n in names} | {"f16": k16.nbytes}
    for name in names:
        t = statistics.median(ms[name])
        note = f"{errors[name]:.1e}"
        if name in INT_FORMS:
            note += f"; {beside:.1e} from q8_0's (the query's rounding)"
        print(f"| {name} | {t:.3f} | {nbytes[name]} | {t / base:.2f} | {note} |")


if __name__ == "__main__":
    main()
