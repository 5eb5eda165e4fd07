<%doc>
Pieces shared by the two prefill templates (prefill_rows.cl.mako, prefill_tiled.cl.mako):
the set-up of one work unit (its sequence, its queries, the attended chunk, the causal
limit) and RoPE with given cos/sin. Parameters: those of decode_common.clh.mako (PS, HKV,
D, SLIDING, FIXUP rendered from clattn.signatures.PREFILL, the pool), QB (queries per
unit), ROT, ROPE.

Semantics (docs/prefill.md): query i of the n_q queries of sequence b is chunk row
chunk - n_q + i; causal, it attends chunk rows [0, its own row], else the whole chunk;
with use_mask, only those its bit of the packed custom mask keeps (bit i * chunk + r of
the sequence's segment, which starts at byte mask_indptr[b]). Its RoPE position is
k_pos_offset[b] + its row (q_pos_mode 0) or q_pos[b] + i (q_pos_mode 1). Every index
read from a table or the mask is clamped.
</%doc>
<%namespace name="d" file="decode_common.clh.mako"/>
<%def name="setup()">
${d.setup()}
/* work unit u: sequence b and its queries [q0, q0 + nq), rows [qs, qs + nq) of q and
   out; c0 is the chunk row of query q0; query q0 + i attends chunk rows [0, QLIM(i)] and
   sits at position qpos0 + i; the unit reads rows [0, r_end) */
#define UNIT_SETUP \
    ${FIXUP} \
    const int b = clamp(units[4 * u], 0, batch - 1); \
    const int q0 = max(units[4 * u + 1], 0); \
    const int n_q = max(units[4 * u + 2], 0); \
    const int qs = clamp(units[4 * u + 3], 0, total_q); \
    const int p0 = clamp(page_indptr[b], 0, nnz); \
    const int npages = num_pages > 0 ? clamp(page_indptr[b + 1], p0, nnz) - p0 : 0; \
    const int stored = npages > 0 ? (npages - 1) * ${PS} + clamp(last_page_len[b], 1, ${PS}) : 0; \
    SEQ_WINDOW \
    const int chunk = stored - wo + sink; \
    const int nq = q0 < n_q ? min(min(n_q - q0, ${QB}), total_q - qs) : 0; \
    const int c0 = nq > 0 ? chunk - n_q + q0 : 0; \
    const int r_end = nq <= 0 ? 0 : (causal ? clamp(c0 + nq, 0, chunk) : chunk); \
    const int kpos0 = rotary_mode ? k_pos_offset[b] : 0; \
    const int qpos_b = !rotary_mode ? 0 : (q_pos_mode ? q_pos[b] : kpos0 + chunk - n_q); \
    const int qpos0 = qpos_b + q0; \
    const int rope_table = (rotary_mode && (long)qpos_b + n_q - 1 >= long_from) ? 1 : 0; \
    const __global float2* tt = rope_turns + rope_table * ${ROT // 2}; \
    const long mbit0 = use_mask ? (long)clamp(mask_indptr[b], 0, max(mask_bytes, 0)) * 8 + (long)q0 * chunk : 0;

/* the last chunk row query q0 + i of the unit attends (-1: none) */
#define QLIM(i) ((i) < nq ? (causal ? c0 + (i) : chunk - 1) : -1)

/* whether the custom mask lets query q0 + i attend chunk row `row` (no mask: it does) */
#define MASK_KEEPS(i, row) (!use_mask || clattn_mask_bit(mask, mask_bytes, mbit0 + (long)(i) * chunk + (row)))

/* whether query q0 + i attends a row at all: one of rows [0, lim], lim its QLIM, that the
   mask keeps (a query keeping none is empty: out = 0, lse = -inf) */
#define KEEPS_ANY(i, lim) ((lim) >= 0 && (!use_mask || clattn_mask_any(mask, mask_bytes, mbit0 + (long)(i) * chunk, (long)(lim) + 1)))

/* bit `bit` of the packed mask (least significant bit of a byte first); the byte is
   clamped into the mask's nbytes, an empty mask keeps nothing */
inline int clattn_mask_bit(const __global uchar* mask, const int nbytes, const long bit)
{
    if (nbytes <= 0) return 0;
    return (mask[clamp(bit >> 3, 0L, (long)nbytes - 1)] >> (int)(bit & 7)) & 1;
}

/* bits bit .. bit + 24 (at least) of the packed mask as the low bits of a word (bytes
   clamped as in clattn_mask_bit) */
inline uint clattn_mask_bits(const __global uchar* mask, const int nbytes, const long bit)
{
    if (nbytes <= 0) return 0u;
    uint w = 0u;
    for (int k = 0; k < 4; ++k)
        w |= (uint)mask[clamp((bit >> 3) + k, 0L, (long)nbytes - 1)] << (8 * k);
    return w >> (int)(bit & 7);
}

/* whether any of the n bits from bit0 is set (bytes clamped as in clattn_mask_bit) */
inline int clattn_mask_any(const __global uchar* mask, const int nbytes, const long bit0,
                           const long n)
{
    if (n <= 0 || nbytes <= 0) return 0;
    const long last = bit0 + n - 1;
    for (long by = bit0 >> 3; by <= last >> 3; ++by) {
        int m = mask[clamp(by, 0L, (long)nbytes - 1)];
        if (by == bit0 >> 3) m &= 0xff << (int)(bit0 & 7);
        if (by == last >> 3) m &= 0xff >> (7 - (int)(last & 7));
        if (m) return 1;
    }
    return 0;
}

/* rotate the private row f (RoPE pairs of the spec) by the angles of cs/sn, scaled by att */
inline void clattn_rotate_cs(float* f, const float* cs, const float* sn, const float att)
{
    for (int i = 0; i < ${ROT // 2}; ++i) {
<% x, y = ROPE.dims("i") %>\
        const int ia = ${x}, ib = ${y};
        const float x = f[ia], y = f[ib];
        f[ia] = (x * cs[i] - y * sn[i]) * att;
        f[ib] = (y * cs[i] + x * sn[i]) * att;
    }
}

/* cos/sin of every RoPE frequency of tt at position pos */
inline void clattn_rope_cs(const int pos, const __global float2* tt, float* cs, float* sn)
{
    for (int i = 0; i < ${ROT // 2}; ++i) sn[i] = sincos(clattn_rope_angle(pos, tt[i]), cs + i);
}
</%def>

## clattn_basev of float<V> (V = 1: float); 2^x is common.clh.mako's clattn_exp2_<V> (the
## decode rows kernel's; measured on Intel's CPU runtime: the library's vector exp2 made
## the rows prefill 10-40% slower; PoCL: no difference)
<%def name="basev(V)">
<% T = "float" if V == 1 else "float%d" % V %>\
/* clattn_exp_base of every lane: the running max, or 0 where it is still -inf */
inline ${T} clattn_basev(const ${T} mx)
{
    return select(mx, (${T})(0.0f), mx == (${T})(-INFINITY));
}
</%def>
