## KV-cache writes into a byte pool (K or V stored as q8_0, q4_0, or a float type other
## than DTYPE): included by append.cl.mako, whose header lists the parameters. The
## quantizer is clattn.quant's (ggml's reference quantizer), bit for bit: the f32 scale
## d = amax / 127 (q8_0) or m / -8 (q4_0, m the first value of largest magnitude, +0 when
## all are zero), stored as f16(d); id = 1 / d (0 when |d| < 2^-125); each code
## round_half_away(x * id) (q8_0) or min(15, trunc(x * id + 8.5)) (q4_0), every
## operation one correctly rounded f32 operation. A key row is D values wide in NBK blocks,
## a value row DV in NBV (clattn.quant.PageLayout.blocks: a float row's last block may be
## shorter than 32; a quantized row is whole blocks). VIN_K: the values are in the key
## rows: NBV is 0, no value row is written or copied (v is not read).
<%namespace name="c" file="common.clh.mako"/>
<%
QUANT = ("q8_0", "q4_0")
NT = NBK + NBV   # work items of a (token, head)
NKINDS = 1 if VIN_K else 2   # regions of a (page, head): K, and V unless in the key rows
def scale_bytes(fmt, width):
    return width // 32 * 2 if fmt in QUANT else 0
ITEMS = "n_tokens * %d" % (HKV * NT)
%>\
typedef uchar kv_t;     /* element of the pool: bytes */

/* the cnt (<= 32) values of block b of a row as they are stored: a key rotated at
   position pos when rotate is 1 (the float path's formula and angles) */
inline void clattn_block(const __global st_t* row, const int b, const int cnt,
                         const int rotate, const int pos, const __global float2* tt,
                         const float rope_att, float* x)
{
    for (int i = 0; i < cnt; ++i) {
        const int e = b * 32 + i;
        float val = ${c.loadv(1, "row + e")};
        if (rotate && e < ${ROT}) {
% for line in ROPE.element_decls("e"):
            ${line}
% endfor
            const float ang = clattn_rope_angle(pos, tt[fi]);
            const float cs = cos(ang), sn = sin(ang);
            val = (val * cs + sgn * ${c.loadv(1, "row + pe")} * sn) * rope_att;
        }
        x[i] = val;
    }
}

/* a / b correctly rounded (a >= 0, b > 0 finite, the quotient 0 or a normal f32): the
   division (OpenCL allows 2.5 units of error) moves to a neighbour while that
   neighbour's remainder, exact as an fma result, is smaller */
inline float clattn_div(const float a, const float b)
{
#pragma OPENCL FP_CONTRACT OFF
    float q = a / b;
    for (int i = 0; i < 3; ++i) {
        const float lo = nextafter(q, 0.0f), hi = nextafter(q, INFINITY);
        const float r = fabs(fma(-q, b, a));
        if (fabs(fma(-lo, b, a)) < r)
            q = lo;
        else if (fabs(fma(-hi, b, a)) < r)
            q = hi;
        else
            break;
    }
    return q;
}

/* the block's f32 scale d before its f16 rounding, from its first value m of largest
   magnitude (+0 when all are zero); a tiny amax is divided scaled by 2^80 so that no
   remainder is subnormal (the scaling back is exact wherever the scale is not tiny) */
inline float clattn_scale32(const float m, const int q4)
{
    if (q4)
        return m * -0.125f;   /* m / -8: the same correctly rounded result */
    const float a = fabs(m);
    return a < 0x1p-80f ? clattn_div(a * 0x1p80f, 127.0f) * 0x1p-80f : clattn_div(a, 127.0f);
}

/* id = 1 / d, correctly rounded; 0 for a tiny scale (its codes are the zero codes) */
inline float clattn_inv_scale(const float d)
{
    return fabs(d) >= 0x1p-125f ? copysign(clattn_div(1.0f, fabs(d)), d) : 0.0f;
}

/* the code of x: the product x * id rounded once, then half away from zero (q8_0), or
   8.5 added (rounded once) and the sum truncated, at most 15 (q4_0) */
inline int clattn_code(const float x, const float id, const int q4)
{
#pragma OPENCL FP_CONTRACT OFF
    const float p = x * id;
    return q4 ? min(15, (int)(p + 8.5f)) : (int)round(p);
}

/* first value of largest magnitude, and whether every value is finite */
inline float clattn_block_max(const float* x, int* finite)
{
    float m = 0.0f, am = 0.0f;   /* +0 when all are zero */
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

## store block b of values x (private float[32], cnt of them) of format fmt and row width
## `width` into the region at byte offset reg (row r)
<%def name="store_block(fmt, rowb, width)">
% if fmt in QUANT:
<% q4 = int(fmt == "q4_0") %>\
                int finite;
                const float m = clattn_block_max(x, &finite);
                __global uchar* sc = pages + reg + ${PS * rowb} + ((ulong)r * ${width // 32} + b) * 2;
                const float d32 = clattn_scale32(m, ${q4});
                vstore_half_rte(d32, 0, (__global half*)sc);
                const float id = clattn_inv_scale(d32);
                __global uchar* dst = pages + reg + (ulong)r * ${rowb} + b * ${16 if q4 else 32};
%   if q4:
                for (int j = 0; j < 16; ++j)   /* values j and j + 16 share byte j */
                    dst[j] = (uchar)(clattn_code(x[j], id, 1) | (clattn_code(x[j + 16], id, 1) << 4));
%   else:
                for (int j = 0; j < 32; ++j)
                    dst[j] = as_uchar((char)clattn_code(x[j], id, 0));
%   endif
% else:
<% et = "half" if fmt == "half" else "float" %>\
                __global ${et}* dst = (__global ${et}*)(pages + reg + (ulong)r * ${rowb}) + b * 32;
                for (int j = 0; j < cnt; ++j) {
%   if fmt == "half":
                    vstore_half_rte(x[j], j, dst);
%   else:
                    dst[j] = x[j];
%   endif
                }
% endif
</%def>

## the kind of item `it` (0: a key block, 1: a value block)
<%def name="item_kind()">
            const int rem = it % ${NT}, kind = rem >= ${NBK};
</%def>
## one (token, head, kind, block) item after item_kind: t, h, b, cnt (its values), the
## source row and its values
<%def name="item_setup()">
            const int b = kind ? rem - ${NBK} : rem, th = it / ${NT};
            const int t = th / ${HKV}, h = th % ${HKV};
            const int cnt = min(32, (kind ? ${DV} : ${D}) - b * 32);
            const __global st_t* row = kind ? v + ((ulong)t * ${HKV} + h) * ${DV}
                                            : k + ((ulong)t * ${HKV} + h) * ${D};
            const int pos = rotary_mode && kind == 0 ? k_pos[t] : 0;
            float x[32];
            clattn_block(row, b, cnt, rotary_mode && kind == 0, pos,
                         rope_turns + (pos >= long_from ? ${ROT // 2} : 0), rope_att, x);
</%def>

__kernel void clattn_append_check(${CHECK_SIGNATURE})
{
    ${APPEND_FIXUP}
    for (int it = get_global_id(0); it < ${ITEMS}; it += get_global_size(0)) {
${item_kind()}
% for kind, fmt in ((0, KFMT), (1, VFMT)):
%   if fmt not in QUANT:
        if (kind == ${kind})
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
${item_kind()}
${item_setup()}
        const long flat = (long)slots[t];
        if (flat < 0 || flat >= cap)
            continue;   /* outside the pool: nothing written */
        const ulong page = (ulong)flat / ${PS};
        const int r = (int)(flat % ${PS});
        if (kind == 0) {
            const ulong reg = page * ${PAGE_BYTES} + (ulong)h * ${K_REGION};
${store_block(KFMT, K_ROWB, D)}
        }
% if not VIN_K:
        else {
            const ulong reg = page * ${PAGE_BYTES} + ${HKV * K_REGION} + (ulong)h * ${V_REGION};
${store_block(VFMT, V_ROWB, DV)}
        }
% endif
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
    for (int it = get_global_id(0); it < n_copies * ${NKINDS * HKV * PS}; it += get_global_size(0)) {
        const int cidx = it / ${NKINDS * HKV * PS};
        const int rem = it % ${NKINDS * HKV * PS};
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
${copy_region(K_ROWB, scale_bytes(KFMT, D))}
        }
% if not VIN_K:
        else {
${copy_region(V_ROWB, scale_bytes(VFMT, DV))}
        }
% endif
    }
}
