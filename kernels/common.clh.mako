## Shared pieces of the clattn kernels: typed loads/stores and the RoPE angle.
## Parameters: DTYPE ("half"|"float"), NATIVE_HALF (bool), PRAGMAS (extensions to enable)
## prelude(poly=True): the state math takes 2^x and log2 from the inline polynomials below
## instead of the library (CPU kernels: PoCL's exp2 and log2 are out-of-line calls that took
## half the time of its f16 merges, measured with perf); lanes: vector widths V for which
## the state math is also defined on float<V>, lane by lane (names suffixed _V)
<%! from clattn import kernel_exprs as kx %>\
<%def name="prelude(poly=False, lanes=())">
% if NATIVE_HALF:
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
% endif
% for ext in PRAGMAS:
#pragma OPENCL EXTENSION ${ext} : enable
% endfor
#define CLATTN_LOG2E 1.4426950408889634f
#define CLATTN_TWO_PI 6.283185307179586f
% if poly:
%   for V in (1,) + tuple(lanes):
${exp2_poly(V)}
${log2_poly(V)}
%   endfor
% endif

typedef ${"half" if DTYPE == "half" else "float"} st_t;  /* storage type of q, pages, out */

/* The attention-state math, written once (docs/contract.md, "Merging" and "Non-finite
   values"). A state is (m, l, acc): running max of base-2 scores, sum of 2^(s - m), and
   the weighted sum of values; its lse is m + log2(l). Empty: l == 0 -> lse = -inf.
   Broken (a NaN or +inf reached it): l is NaN -> lse = NaN, never -inf. */
% for V in (1,) + tuple(lanes):
${state_math(V, poly)}
% endfor

/* the base subtracted from the scores before exp2 under a running max mx: mx, or 0 while
   mx is still -inf, so that rows scoring -inf weigh exp2(-inf) = 0 instead of
   exp2(-inf - -inf) = NaN wherever a part of the chunk has seen nothing else yet (NaN and
   +inf are kept: a broken state stays broken) */
inline float clattn_exp_base(const float mx)
{
    return mx == -INFINITY ? 0.0f : mx;
}

/* lse and 1 / l of a part of the chunk that saw `rows` rows: one whose rows all scored
   -inf (l == 0 after rows) is broken, NaN; with no rows it is empty (docs/contract.md,
   "Non-finite values") */
inline float clattn_part_lse(const float m, const float l, const int rows)
{
    return (rows && l == 0.0f) ? NAN : clattn_state_lse(m, l);
}

inline float clattn_part_inv(const float l, const int rows)
{
    return (rows && l == 0.0f) ? NAN : clattn_state_inv(l);
}

/* a part's final state (m, l) with a learned attention sink folded in: the sink is one
   more score t (base 2, no value) of the softmax, so the state becomes the merge of (m, l)
   with (t, 1, v = 0): m' = max(m, t), l' = l 2^(m - m') + 2^(t - m'); returns (m', l').
   The part's acc is scaled by 2^(m - m') (clattn_state_weight(m, m')). t = -inf is no
   sink: (m, l) unchanged and the factor 1 (0 for an empty part, whose acc is 0); t = +inf
   breaks the state (NaN), as a NaN does (docs/contract.md, "Learned attention sinks").
   By value, not through pointers: a CPU compiler then keeps m and l in registers */
inline float2 clattn_with_sink(const float m, const float l, float t)
{
    t = t == INFINITY ? NAN : t;
    const float m2 = clattn_max_nan(m, t);
    return (float2)(m2, l * clattn_state_weight(m, m2) + clattn_state_weight(t, m2));
}

/* the base-2 sink of query head h, -inf (none) unless `on` */
#define CLATTN_SINK(on, h) ((on) ? sink_logits[h] * CLATTN_LOG2E : -INFINITY)

/* angle (radians, reduced to about [-pi, pi]) of position pos for a frequency given in
   turns per position as an (hi, lo) f32 pair, exact over the whole int range: pos is
   split into two 16-bit halves so each product with hi is exact as an fma pair; whole
   turns are dropped from every part before they are added */
inline float clattn_rope_angle(int pos, float2 t)
{
#pragma OPENCL FP_CONTRACT OFF
    const float a = (float)(pos & (int)0xffff0000);   /* exact: 16 significant bits */
    const float b = (float)(pos & 0xffff);
    const float pa = a * t.x, ea = fma(a, t.x, -pa);
    const float pb = b * t.x, eb = fma(b, t.x, -pb);
    const float pl = (float)pos * t.y;
    float frac = (pa - rint(pa)) + (pb - rint(pb)) + (pl - rint(pl)) + (ea + eb);
    frac -= rint(frac);
    return frac * CLATTN_TWO_PI;
}
</%def>

## The state math on float (V = 1) or float<V> lane by lane (names suffixed _V)
<%def name="state_math(V, poly)">
<%
T = "float" if V == 1 else "float%d" % V
S = "" if V == 1 else "_%d" % V
EXP2, LOG2 = ("clattn_exp2_%d" % V, "clattn_log2_%d" % V) if poly else ("exp2", "log2")
def sel(a, b, c):   # c ? b : a (PoCL's scalar select() is an out-of-line call)
    return "((%s) ? (%s) : (%s))" % (c, b, a) if V == 1 else "select(%s, %s, %s)" % (a, b, c)
%>\
/* lse of a state with running max m and sum l */
inline ${T} clattn_state_lse${S}(const ${T} m, const ${T} l)
{
    return ${sel(sel("(%s)(NAN)" % T, "(%s)(-INFINITY)" % T, "l == 0.0f"), "m + %s(l)" % LOG2, "l > 0.0f")};
}

/* 1 / l for the output, 0 for an empty state (its acc is 0); NaN stays NaN */
inline ${T} clattn_state_inv${S}(const ${T} l)
{
    return ${sel("1.0f / l", "(%s)(0.0f)" % T, "l == 0.0f")};
}

/* max that keeps NaN (fmax and max() drop it, which would hide a broken state) */
inline ${T} clattn_max_nan${S}(const ${T} a, const ${T} b)
{
    return ${sel("a", "b", "b > a || isnan(b)")};
}

/* weight 2^(s - mx) of a state with lse s in a merge whose largest lse is mx; an empty
   state (s = -inf) weighs exactly 0, and its v must then not be read into the sum */
inline ${T} clattn_state_weight${S}(const ${T} s, const ${T} mx)
{
    return ${sel("%s(s - mx)" % EXP2, "(%s)(0.0f)" % T, "s == -INFINITY")};
}
</%def>

## 2^x of float<V> (V = 1: float) for x <= 0 (NaN kept), named clattn_exp2_<V>
<%def name="exp2_poly(V)">
<% T = "float" if V == 1 else "float%d" % V; I = "int" if V == 1 else "int%d" % V %>\
/* 2^x for x <= 0 (-inf gives 0) without library calls: round-to-nearest by the
   1.5 * 2^23 trick, 2^f on [-1/2, 1/2] by its degree-6 Taylor polynomial (error
   below 2e-7 relative), 2^n as one exponent-field scaling; x below -126.5 gives 0 (every
   caller weighs against a 2^0 = 1 of the same sum, so a weight below 2^-126 is lost in
   its rounding anyway) */
inline ${T} clattn_exp2_${V}(${T} x)
{
    x = x < -127.0f ? (${T})(-127.0f) : x;
    const ${T} t = x + 12582912.0f;
    const ${I} n = as_${I}(t) - 0x4B400000;
    const ${T} f = x - (t - 12582912.0f);
    ${T} p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    return p * as_${T}((n + 127) << 23);
}
</%def>

## log2 of float<V> (V = 1: float) lanes l > 0 (normal or +inf; the state sums it serves
## are >= 1), named clattn_log2_<V>
<%def name="log2_poly(V)">
<% T = "float" if V == 1 else "float%d" % V; I = "int" if V == 1 else "int%d" % V %>\
/* log2(l) without library calls: l = 2^e * m with m in [sqrt(1/2), sqrt(2)), and
   log2(m) = 2 atanh(f) / ln 2 with f = (m - 1) / (m + 1), |f| <= 0.172, by its series to
   f^9 (truncation below 1e-9) */
inline ${T} clattn_log2_${V}(const ${T} l)
{
    const ${I} bits = as_${I}(l);
    const ${T} m1 = as_${T}((bits & 0x007fffff) | 0x3f800000);
    const ${I} big = m1 > 1.41421356f;
    const ${T} m = ${"big ? m1 * 0.5f : m1" if V == 1 else "select(m1, m1 * 0.5f, big)"};
    const ${T} e = convert_${T}(((bits >> 23) & 0xff) - 127 ${"+" if V == 1 else "-"} big);   /* true: 1, or -1 in a vector */
    const ${T} f = (m - 1.0f) / (m + 1.0f);
    const ${T} f2 = f * f;
    ${T} p = 0.11111111f;
    p = p * f2 + 0.14285714f;
    p = p * f2 + 0.2f;
    p = p * f2 + 0.33333333f;
    p = p * f2 + 1.0f;
    return ${"l == INFINITY ? l : e + f * p * 2.88539008f" if V == 1 else "select(e + f * p * 2.88539008f, l, l == INFINITY)"};
}
</%def>

## load VEC elements of storage at p (element pointer) as float<VEC>
<%def name="loadv(vec, ptr)">${kx.storage_load(vec, ptr, DTYPE, NATIVE_HALF)}</%def>

## store float<VEC> val at storage element pointer ptr
<%def name="storev(vec, val, ptr)">${kx.storage_store(vec, val, ptr, DTYPE)}</%def>

## float<VEC> type name
<%def name="fv(vec)">float${"" if vec == 1 else vec}</%def>

## Raw vector loads for CPU-style kernels: ld_t is an element-aligned vector type (an
## unaligned load with no library call), clattn_h2f/clattn_f2h convert f16 exactly.
## Parameters used: DTYPE, DENORMS, STORAGE_HALF (convert through clang's __fp16).
<%def name="raw_loads(V)">
<%
FV = "float" if V == 1 else "float%d" % V
UV = "ushort" if V == 1 else "ushort%d" % V
UI = "uint" if V == 1 else "uint%d" % V
%>\
typedef ${FV} __attribute__((aligned(4))) ldf_t;
typedef ${UV} __attribute__((aligned(2))) ldh_t;
/* quantized codes (byte pools: rows are only 16-byte aligned, less than a wide vector) */
typedef ${"char" if V == 1 else "char%d" % V} __attribute__((aligned(1))) ldq8_t;
typedef ${"uchar" if V == 1 else "uchar%d" % V} __attribute__((aligned(1))) ldq4_t;
typedef ${"ldf_t" if DTYPE == "float" else "ldh_t"} ld_t;
% if STORAGE_HALF:
/* f16 <-> f32 through clang's storage-only __fp16 type: one hardware conversion per
   vector (x86 F16C, Arm), exact both ways (round to nearest even); used where the
   driver passed clattn.compiler_probe's check */
/* (scalars go through two-lane vectors: OpenCL C allows no scalar __fp16 value) */
typedef __fp16 clattn_hv_t __attribute__((ext_vector_type(${max(V, 2)})));
inline ${FV} clattn_h2f(const ${UV} u)
{
%   if V == 1:
    return __builtin_convertvector(__builtin_astype((ushort2)(u, 0), clattn_hv_t), float2).x;
%   else:
    return __builtin_convertvector(__builtin_astype(u, clattn_hv_t), ${FV});
%   endif
}

inline ${UV} clattn_f2h(const ${FV} f)
{
%   if V == 1:
    return __builtin_astype(__builtin_convertvector((float2)(f, 0.0f), clattn_hv_t), ushort2).x;
%   else:
    return __builtin_astype(__builtin_convertvector(f, clattn_hv_t), ${UV});
%   endif
}
% else:
/* exact f16 -> f32 (normals, subnormals, inf, nan) without library calls */
inline ${FV} clattn_h2f(const ${UV} u)
{
    const ${UI} h = convert_${UI}(u);
    const ${UI} em = (h & 0x7fffu) << 13;
    const ${UI} sgn = (h & 0x8000u) << 16;
% if DENORMS:
    /* exponent rebias by one multiply: exact for normals and (float-subnormal) halves */
    ${UI} bits = as_${UI}(as_${FV}(em) * 0x1p112f);
% else:
    const ${UI} e = em >> 23;
    const ${UI} sub = as_${UI}(convert_${FV}(em >> 13) * 0x1p-24f);
    ${UI} bits = e == 0u ? sub : em + (112u << 23);
% endif
    bits = em >= (0x7c00u << 13) ? (em | 0x7f800000u) : bits;   /* inf, nan */
    return as_${FV}(bits | sgn);
}

/* f32 -> f16, round to nearest even (overflow to inf, nan kept), without library calls */
inline ${UV} clattn_f2h(const ${FV} f)
{
    const ${UI} x = as_${UI}(f);
    const ${UI} sgn = (x >> 16) & 0x8000u;
    const ${UI} a = x & 0x7fffffffu;
    /* normal halves: rebias, round the 13 dropped bits to nearest even */
    const ${UI} nrm = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    /* subnormal halves: adding 0.5 lets the FPU round at the 2^-24 unit */
    const ${UI} sub = as_${UI}(as_${FV}(a) + 0.5f) - 0x3f000000u;
    ${UI} h = a < 0x38800000u ? sub : nrm;
    h = a >= 0x477ff000u ? (${UI})0x7c00u : h;                        /* overflow -> inf */
    h = a > 0x7f800000u ? (${UI})0x7e00u : h;                         /* nan */
    return convert_${UV}(h | sgn);
}
% endif
</%def>

## fold the learned sink t into the final state (m, l) (variables, updated) and declare
## alpha, the factor of the state's acc (clattn_with_sink); `on` False: a build without
## learned sinks, alpha 1 (what t = -inf gives, bit for bit) and no sink code at all
<%def name="add_sink(m, l, t, on=True)">\
% if on:
const float2 sink_ml = clattn_with_sink(${m}, ${l}, ${t});
        const float alpha = clattn_state_weight(${m}, sink_ml.x);
        ${m} = sink_ml.x;
        ${l} = sink_ml.y;\
% else:
const float alpha = 1.0f;\
% endif
</%def>
