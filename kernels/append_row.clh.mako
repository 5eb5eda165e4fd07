<%doc>
The append's write of one (token, KV head) row pair of a float pool (K or V stored as
DTYPE): shared by the append kernel (append.cl.mako) and the decode kernels' fused
append (decode_rows / decode_tiled with FUSED), so both write the same bits.
Parameters: D, HKV, PS, ROT, ROPE, DTYPE, NATIVE_HALF (as in append.cl.mako). The
names it reads: k, v, pages, slots, k_pos, rope_turns, long_from, rope_att, cap (slots
in the pool).
</%doc>
<%namespace name="c" file="common.clh.mako"/>
## the raw element type and the slot address (once per program)
<%def name="helpers()">
typedef ${"ushort" if DTYPE == "half" else "uint"} raw_t;   /* the bits of one stored element: copies move bits, never values */

/* element offset of row `slot` of (page, kind, head) */
inline ulong clattn_slot_at(const ulong page, const int kind, const int h, const ulong slot)
{
    return (((page * 2 + kind) * ${HKV} + h) * ${PS} + slot) * ${D};
}
</%def>

## copy VEC raw elements from src to dst (element pointers)
<%def name="mv(dst, src, vec)">\
% if vec == 1:
(${dst})[0] = (${src})[0];\
% else:
vstore${vec}(vload${vec}(0, ${src}), 0, ${dst});\
% endif
</%def>

## set-up of the row pair of token `t`, head `h` (C expressions); `skip` leaves it
## when the slot is outside the pool (nothing written)
<%def name="row_setup(t, h, skip)">
            const int t = ${t}, h = ${h};
            const long flat = (long)slots[t];
            if (flat < 0 || flat >= cap) ${skip};   /* outside the pool: nothing written */
            const ulong kd = clattn_slot_at((ulong)flat / ${PS}, 0, h, (ulong)flat % ${PS});
            const ulong vd = kd + (ulong)${HKV * PS * D};
            const __global raw_t* ks = (const __global raw_t*)k + ((ulong)t * ${HKV} + h) * ${D};
            const __global raw_t* vs = (const __global raw_t*)v + ((ulong)t * ${HKV} + h) * ${D};
            __global raw_t* kr = (__global raw_t*)pages;
            __global raw_t* vr = kr;
</%def>

## write lanes [e0, e0 + vec) of the row pair (after row_setup); `rope` is the flag of
## RoPE at append
<%def name="lanes(e0, vec, rope)">
            {
                const int e0 = ${e0};
                ${mv('vr + vd + e0', 'vs + e0', vec)}
                if (!${rope} || e0 >= ${ROT}) {
                    ${mv('kr + kd + e0', 'ks + e0', vec)}
                } else {
                    /* RoPE at append: the key at position k_pos[t] (the decode kernel's
                       formula and angles); cos and sin apart, no private pointer */
                    const int pos = k_pos[t];
                    const __global float2* tt = rope_turns + (pos >= long_from ? ${ROT // 2} : 0);
                    const __global st_t* kx = k + ((ulong)t * ${HKV} + h) * ${D};
                    for (int e = e0; e < e0 + ${vec}; ++e) {
% for line in ROPE.element_decls("e"):
                        ${line}
% endfor
                        float x = ${c.loadv(1, "kx + e")};
                        if (e < ${ROT}) {
                            const float ang = clattn_rope_angle(pos, tt[fi]);
                            const float cs = cos(ang), sn = sin(ang);
                            x = (x * cs + sgn * ${c.loadv(1, "kx + pe")} * sn) * rope_att;
                        }
                        ${c.storev(1, "x", "pages + kd + e")}
                    }
                }
            }
</%def>
