## KV-cache writes into a byte pool (K or V stored as q8_0, q4_0, or a float type other
## than DTYPE): included by append.cl.mako, whose header lists the parameters. The
## quantizer is clattn.quant's, bit for bit: the scale is f16(f32(amax / 127)) (q8_0) or
## f16(m / -8) (q4_0, m the first value of largest magnitude), each code the exact
## quotient x / d rounded half to even, then clamped.
<%namespace name="c" file="common.clh.mako"/>
<%
NB = D // 32
QUANT = ("q8_0", "q4_0")
def scale_bytes(fmt):
    return NB * 2 if fmt in QUANT else 0
ITEMS = "n_tokens * %d" % (HKV * 2 * NB)
%>\
typedef uchar kv_t;     /* element of the pool: bytes */

/* the 32 values of block b of a row as they are stored: a key rotated at position pos
   when rotate is 1 (the float path's formula and angles) */
inline void clattn_block(const __global st_t* row, const int b, const int rotate,
                         const int pos, const __global float2* tt, const float rope_att,
                         float* x)
{
    for (int i = 0; i < 32; ++i) {
        const int e = b * 32 + i;
        float val = ${c.loadv(1, "row + e")};
        if (rotate && e < ${ROT}) {
% if INTERLEAVED:
            const int fi = e >> 1, pe = e ^ 1;
            const float sgn = (e & 1) ? 1.0f : -1.0f;
% else:
            const int fi = e < ${ROT // 2} ? e : e - ${ROT // 2};
            const int pe = e < ${ROT // 2} ? e + ${ROT // 2} : e - ${ROT // 2};
            const float sgn = e < ${ROT // 2} ? -1.0f : 1.0f;
% endif
            const float ang = clattn_rope_angle(pos, tt[fi]);
            const float cs = cos(ang), sn = sin(ang);
            val = (val * cs + sgn * ${c.loadv(1, "row + pe")} * sn) * rope_att;
        }
        x[i] = val;
    }
}

/* a / 127 correctly rounded (a >= 0): the division's candidates one unit either side
   are compared by their remainders, exact as fma results */
inline float clattn_div127(const float a)
{
#pragma OPENCL FP_CONTRACT OFF
    const float q = a / 127.0f;
    const float lo = nextafter(q, 0.0f), hi = nextafter(q, INFINITY);
    const float rq = fabs(fma(-q, 127.0f, a));
    const float rl = fabs(fma(-lo, 127.0f, a)), rh = fabs(fma(-hi, 127.0f, a));
    return rl < rq ? lo : (rh < rq ? hi : q);
}

/* the block's scale as f32 before its f16 rounding, from its first value m of largest
   magnitude */
inline float clattn_scale32(const float m, const int q4)
{
    return q4 ? m / -8.0f : clattn_div127(fabs(m));
}

/* rint(x / d), half to even, on the exact quotient (d != 0 an f16 value): the division
   gives a candidate, exact comparisons of 2x with (2q +- 1) |d| (products of at most
   21 bits) correct it */
inline int clattn_rint_div(const float x, const float d)
{
#pragma OPENCL FP_CONTRACT OFF
    const float s = d < 0.0f ? -x : x, a = fabs(d);
    float q = clamp(rint(s / a), -300.0f, 300.0f);
    const float t = 2.0f * s;
    const float hi = (2.0f * q + 1.0f) * a, lo = (2.0f * q - 1.0f) * a;
    const int odd = ((int)q) & 1;
    if (t > hi || (t == hi && odd))
        q += 1.0f;
    else if (t < lo || (t == lo && odd))
        q -= 1.0f;
    return (int)q;
}

/* first value of largest magnitude, and whether every value is finite */
inline float clattn_block_max(const float* x, int* finite)
{
    float m = x[0], am = fabs(x[0]);   /* x[0] itself when all are zero: -0 as numpy */
    int ok = 1;
    for (int i = 0; i < 32; ++i) {
        ok &= isfinite(x[i]);
        if (fabs(x[i]) > am) {
            am = fabs(x[i]);
            m = x[i];
        }
    }
    *finite = ok;
    return m;
}

## store block b of values x (private float[32]) of format fmt into the region at byte
## offset reg (row r)
<%def name="store_block(fmt, rowb)">
% if fmt in QUANT:
<% q4 = int(fmt == "q4_0") %>\
                int finite;
                const float m = clattn_block_max(x, &finite);
                __global uchar* sc = pages + reg + ${PS * rowb} + ((ulong)r * ${NB} + b) * 2;
                vstore_half_rte(clattn_scale32(m, ${q4}), 0, (__global half*)sc);
                const float d = vload_half(0, (const __global half*)sc);
                __global uchar* dst = pages + reg + (ulong)r * ${rowb} + b * ${16 if q4 else 32};
%   if q4:
                for (int j = 0; j < 16; ++j) {   /* values j and j + 16 share byte j */
                    const int lo = d == 0.0f ? 8 : clamp(clattn_rint_div(x[j], d) + 8, 0, 15);
                    const int hi = d == 0.0f ? 8 : clamp(clattn_rint_div(x[j + 16], d) + 8, 0, 15);
                    dst[j] = (uchar)(lo | (hi << 4));
                }
%   else:
                for (int j = 0; j < 32; ++j)
                    dst[j] = as_uchar((char)(d == 0.0f ? 0 : clamp(clattn_rint_div(x[j], d), -127, 127)));
%   endif
% else:
<% et = "half" if fmt == "half" else "float" %>\
                __global ${et}* dst = (__global ${et}*)(pages + reg + (ulong)r * ${rowb}) + b * 32;
                for (int j = 0; j < 32; ++j) {
%   if fmt == "half":
                    vstore_half_rte(x[j], j, dst);
%   else:
                    dst[j] = x[j];
%   endif
                }
% endif
</%def>

## one (token, head, kind, block) item: t, h, kind, b, the source row and its values
<%def name="item_setup()">
            const int b = it % ${NB}, kind = (it / ${NB}) & 1, th = it / ${2 * NB};
            const int t = th / ${HKV}, h = th % ${HKV};
            const __global st_t* row = (kind ? v : k) + ((ulong)t * ${HKV} + h) * ${D};
            const int pos = rotary_mode && kind == 0 ? k_pos[t] : 0;
            float x[32];
            clattn_block(row, b, rotary_mode && kind == 0, pos,
                         rope_turns + (pos >= long_from ? ${ROT // 2} : 0), rope_att, x);
</%def>

__kernel void clattn_append_check(${CHECK_SIGNATURE})
{
    ${APPEND_FIXUP}
    for (int it = get_global_id(0); it < ${ITEMS}; it += get_global_size(0)) {
% for kind, fmt in ((0, KFMT), (1, VFMT)):
%   if fmt not in QUANT:
        if ((it / ${NB} & 1) == ${kind})
            continue;   /* a float kind holds any value */
%   endif
% endfor
${item_setup()}
        int finite;
        const float m = clattn_block_max(x, &finite);
        const int q4 = ${"1" if KFMT == "q4_0" else "0"} * (kind == 0) + ${"1" if VFMT == "q4_0" else "0"} * (kind == 1);
        /* f32 values from 65520 on round to inf in f16 */
        if (!finite || fabs(clattn_scale32(m, q4)) >= 65520.0f)
            atomic_xchg(flags, epoch);
    }
}

__kernel void clattn_append(${APPEND_SIGNATURE})
{
    ${APPEND_FIXUP}
    if (flags[0] == epoch)
        return;   /* the check found a value the format cannot hold: nothing is written */
    const long cap = (long)max(num_pages, 0) * ${PS};
    for (int it = get_global_id(0); it < ${ITEMS}; it += get_global_size(0)) {
${item_setup()}
        const long flat = (long)slots[t];
        if (flat < 0 || flat >= cap)
            continue;   /* outside the pool: nothing written */
        const ulong page = (ulong)flat / ${PS};
        const int r = (int)(flat % ${PS});
        if (kind == 0) {
            const ulong reg = page * ${PAGE_BYTES} + (ulong)h * ${K_REGION};
${store_block(KFMT, K_ROWB)}
        } else {
            const ulong reg = page * ${PAGE_BYTES} + ${HKV * K_REGION} + (ulong)h * ${V_REGION};
${store_block(VFMT, V_ROWB)}
        }
    }
}

## copy the rows data and scales of row r of one region (ushort units: every size is even)
<%def name="copy_region(rowb, scb)">
                for (int j = 0; j < ${rowb // 2}; ++j)
                    dr[r * ${rowb // 2} + j] = sr[r * ${rowb // 2} + j];
% if scb:
                for (int j = 0; j < ${scb // 2}; ++j)
                    dr[${PS * rowb // 2} + r * ${scb // 2} + j] = sr[${PS * rowb // 2} + r * ${scb // 2} + j];
% endif
</%def>

__kernel void clattn_page_copy(${COPY_SIGNATURE})
{
    ${COPY_FIXUP}
    for (int it = get_global_id(0); it < n_copies * ${2 * HKV * PS}; it += get_global_size(0)) {
        const int cidx = it / ${2 * HKV * PS};
        const int rem = it % ${2 * HKV * PS};
        const int kind = rem / ${HKV * PS}, h = (rem / ${PS}) % ${HKV}, r = rem % ${PS};
        const int dst = copies[3 * cidx + 1];
        const int rows = clamp(copies[3 * cidx + 2], 0, ${PS});
        if (dst < 0 || dst >= num_pages || r >= rows)
            continue;
        const int src = clamp(copies[3 * cidx], 0, num_pages - 1);
        const ulong at = kind ? ${HKV * K_REGION} + (ulong)h * ${V_REGION} : (ulong)h * ${K_REGION};
        __global ushort* dr = (__global ushort*)(pages + (ulong)dst * ${PAGE_BYTES} + at);
        const __global ushort* sr = (const __global ushort*)(pages + (ulong)src * ${PAGE_BYTES} + at);
        if (kind == 0) {
${copy_region(K_ROWB, scale_bytes(KFMT))}
        } else {
${copy_region(V_ROWB, scale_bytes(VFMT))}
        }
    }
}
