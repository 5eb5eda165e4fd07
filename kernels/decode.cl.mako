<%doc>
clattn paged-KV decode attention (one query token per sequence), SPEC.md semantics.

Template parameters (all from clattn.codegen, which computes them from the
AttentionSpec and the device profile):
  D, HQO, HKV, G, PS, ROT, INTERLEAVED, SLIDING, SOFTCAP, DTYPE, NATIVE_HALF,
  STRATEGY ("rows" | "tiled"), VEC, TILE,
  tiled only: BDX, BDY, BDZ, GDZ, USE_LOCAL, REDUCE, SGS
Work decomposition:
  rows : one work-item per (sequence b, KV head, partition p); global (B, HKV, NP),
         local (1, 1, 1); blocks of TILE rows, private accumulators for all G heads.
  tiled: one work-group per (b, KV head x GDZ head slices, p); local (BDX, BDY, BDZ):
         tx across head_dim (VEC each), ty across query heads of the group, tz across
         row slices; TILE rows per (ty, tz) per step; a final merge over tz.
Every index read from the page table is clamped, so no input can make the kernel
read or write out of bounds.
</%doc>
<%namespace name="c" file="common.clh.mako"/>
${c.prelude()}
<% NV = D // VEC %>\
<%
def hsum(v):
    """Horizontal sum of a float<VEC> expression, as a balanced tree."""
    terms = ["(%s)" % v] if VEC == 1 else ["(%s).s%x" % (v, i) for i in range(VEC)]
    while len(terms) > 1:
        terms = ["(%s + %s)" % (terms[i], terms[i + 1]) for i in range(0, len(terms), 2)]
    return terms[0]

def score(x):
    """Score in log2 units; q was pre-scaled by sm_scale (and log2 e without soft-cap)."""
    if SOFTCAP is None:
        return "(%s)" % x
    return "(%.9ef * tanh((%s) * %.9ef) * CLATTN_LOG2E)" % (SOFTCAP, x, 1.0 / SOFTCAP)
%>\
## rotate the private float array f[D] (a row of q or k) at position pos
<%def name="rotate_row(f, pos=None)">
        {
            const __global float2* tt = rope_turns + rope_table * ${ROT // 2};
            for (int i = 0; i < ${ROT // 2}; ++i) {
                float cs, sn;
% if pos is None:
                /* angle of row r0 + j = angle(r0) + angle(j): compose two exact rotations */
                cs = cb[i] * cj[j][i] - sb[i] * sj[j][i];
                sn = sb[i] * cj[j][i] + cb[i] * sj[j][i];
% else:
                sn = sincos(clattn_rope_angle(${pos}, tt[i]), &cs);
% endif
% if INTERLEAVED:
                const float a = ${f}[2 * i], bb = ${f}[2 * i + 1];
                ${f}[2 * i] = (a * cs - bb * sn) * rope_att;
                ${f}[2 * i + 1] = (bb * cs + a * sn) * rope_att;
% else:
                const float a = ${f}[i], bb = ${f}[i + ${ROT // 2}];
                ${f}[i] = (a * cs - bb * sn) * rope_att;
                ${f}[i + ${ROT // 2}] = (bb * cs + a * sn) * rope_att;
% endif
            }
        }
</%def>
## rotate float<VEC> x holding dims tx*VEC.. of the row at storage pointer src
<%def name="rope_vec(x, src, pos)">\
if (rotary_mode) {
            const __global float2* tt = rope_turns + rope_table * ${ROT // 2};
            float* xf = (float*)&${x};
            for (int e = 0; e < ${VEC}; ++e) {
                const int d = tx * ${VEC} + e;
                if (d < ${ROT}) {
% if INTERLEAVED:
                    const int i = d / 2;
                    const int pd = d ^ 1;
                    const float sgn = (d & 1) ? 1.0f : -1.0f;
% else:
                    const int i = d % ${ROT // 2};
                    const int pd = d < ${ROT // 2} ? d + ${ROT // 2} : d - ${ROT // 2};
                    const float sgn = d < ${ROT // 2} ? -1.0f : 1.0f;
% endif
                    float cs;
                    const float sn = sincos(clattn_rope_angle(${pos}, tt[i]), &cs);
                    const float partner = ${c.loadv(1, src + " + pd")};
                    xf[e] = (xf[e] * cs + sgn * partner * sn) * rope_att;
                }
            }
        }
</%def>

#define KERNEL_ARGS \
    const __global st_t* q, const int q_off, \
    const __global st_t* pages, const ulong pages_off, const int num_pages, \
    const __global int* page_indptr, const int indptr_off, \
    const __global int* page_indices, const int indices_off, const int nnz, \
    const __global int* last_page_len, const int last_off, \
    const __global int* window_offset, const int wo_off, \
    const __global int* sink_size, const int sink_off, \
    const __global int* q_pos, const int qpos_off, \
    const __global int* k_pos_offset, const int kpo_off, \
    __global st_t* out, const int out_off, \
    __global float* lse, const int lse_off, \
    __global float* ws_o, __global float* ws_s, const int n_ws, \
    const __global int* part_indptr, const int split, const int part_rows, \
    const int rotary_mode, const float sm_scale, \
    const __global float2* rope_turns, const int long_from, const float rope_att

/* the attended chunk of sequence b and the rows [r_lo, r_hi) of partition p */
#define SEQ_SETUP \
    q += q_off; pages += pages_off; page_indptr += indptr_off; page_indices += indices_off; \
    last_page_len += last_off; window_offset += wo_off; sink_size += sink_off; \
    q_pos += qpos_off; k_pos_offset += kpo_off; out += out_off; lse += lse_off; \
    const int p0 = clamp(page_indptr[b], 0, nnz); \
    const int p1 = clamp(page_indptr[b + 1], p0, nnz); \
    const int npages = num_pages > 0 ? p1 - p0 : 0; \
    const int stored = npages > 0 ? (npages - 1) * ${PS} + clamp(last_page_len[b], 1, ${PS}) : 0; \
    SEQ_WINDOW \
    const int chunk = stored - wo + sink; \
    const int nparts_b = split ? max(part_indptr[b + 1] - part_indptr[b], 1) : 1; \
    const int r_lo = nparts_b > 1 ? min(part * part_rows, chunk) : 0; \
    const int r_hi = (nparts_b > 1 && part < nparts_b - 1) ? min(r_lo + part_rows, chunk) : chunk; \
    const int ws_at = nparts_b > 1 ? part_indptr[b] + part : -1; \
    const int direct = nparts_b <= 1; \
    const int valid_part = part < nparts_b && (direct || (ws_at >= 0 && ws_at < n_ws)); \
    const int rope_table = (rotary_mode && q_pos[b] >= long_from) ? 1 : 0;

% if SLIDING:
#define SEQ_WINDOW \
    const int wo = clamp(window_offset[b], 0, stored); \
    const int sink = clamp(sink_size[b], 0, wo);
% else:
#define SEQ_WINDOW const int wo = 0; const int sink = 0;
% endif

/* element offset of the K row (kv = 0) or V row (kv = 1) of chunk row `row` */
inline ulong clattn_row_at(const __global int* page_indices, const int p0, const int row,
                           const int sink, const int wo, const int kvh, const int num_pages,
                           const int kv)
{
    const int off = row < sink ? row : row - sink + wo;
    const int pg = page_indices[p0 + off / ${PS}];
    const int page = pg < 0 ? 0 : (pg >= num_pages ? num_pages - 1 : pg);
    return ((((ulong)page * 2 + kv) * ${HKV} + kvh) * ${PS} + (off % ${PS})) * ${D};
}

% if STRATEGY == "rows":
<%
# Straight-line code: every loop over head_dim chunks (NV) and group heads (G) is
# unrolled here, so the accumulators are plain variables a CPU compiler keeps in
# registers; the loads are unaligned vector loads through a typedef (no vload
# library calls, which some CPU drivers do not inline).
V = VEC
FV = "float" if V == 1 else "float%d" % V
UV = "ushort" if V == 1 else "ushort%d" % V
UI = "uint" if V == 1 else "uint%d" % V
IV = "int" if V == 1 else "int%d" % V
HALF = ROT // 2
VECROT = (not INTERLEAVED and HALF % V == 0) or (INTERLEAVED and V % 2 == 0 and ROT % V == 0)
NRV = (HALF // V if not INTERLEAVED else ROT // V) if VECROT else 0
SWAP = "" if V == 1 else ".s" + "".join("%x" % (i ^ 1) for i in range(V))
SIGN = "(%s)(%s)" % (FV, ", ".join("-1.0f" if i % 2 == 0 else "1.0f" for i in range(V))) if V > 1 else "1.0f"
def ld(ptr):
    if DTYPE == "float":
        return "*(const __global ld_t*)(%s)" % ptr
    if NATIVE_HALF:  # the device converts half vectors itself (e.g. x86 F16C)
        return "convert_%s(*(const __global ldn_t*)(%s))" % (FV, ptr)
    return "clattn_h2f(*(const __global ld_t*)(%s))" % ptr
%>\
${c.raw_loads(V)}
% if NATIVE_HALF and DTYPE == "half":
typedef ${"half" if V == 1 else "half%d" % V} __attribute__((aligned(2))) ldn_t;
% endif


<%
FT = "float" if TILE == 1 else "float%d" % TILE
IT = "int" if TILE == 1 else "int%d" % TILE
def hred(v, op, n):
    """Reduce a float<n> expression to a float with a tree of .lo/.hi halves."""
    while n > 1:
        a, b = "(%s).lo" % v, "(%s).hi" % v
        # max() is undefined for infinities in OpenCL C: compare and select instead
        v = ("(%s + %s)" % (a, b)) if op == "+" else ("(%s > %s ? %s : %s)" % (a, b, a, b))
        n //= 2
    return v
%>\
% for T, TT, TI in ((1, "float", "int"), (TILE, FT, IT)) if TILE > 1 else ((1, "float", "int"),):
/* 2^x for x <= 0 (-inf gives 0) without library calls: round-to-nearest by the
   1.5 * 2^23 trick, 2^f on [-1/2, 1/2] by its degree-6 Taylor polynomial (error
   below 2e-7 relative), 2^n as two exponent-field scalings (n down to -150) */
inline ${TT} clattn_exp2_${T}(${TT} x)
{
    x = x < -150.0f ? (${TT})(-150.0f) : x;
    const ${TT} t = x + 12582912.0f;
    const ${TI} n = as_${TI}(t) - 0x4B400000;
    const ${TT} f = x - (t - 12582912.0f);
    ${TT} p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    const ${TI} n1 = n >> 1;
    return p * as_${TT}((n1 + 127) << 23) * as_${TT}((n - n1 + 127) << 23);
}
% endfor

__kernel void clattn_decode(KERNEL_ARGS)
{
    const int b = get_global_id(0);
    const int kvh = get_global_id(1);
    const int part = get_global_id(2);
    SEQ_SETUP
    if (!valid_part) return;

    /* q of the G heads of this KV head: rotated, scaled, in registers */
% for g in range(G):
%   for i in range(NV):
    ${FV} q${g}_${i};
%   endfor
% endfor
    {
        const float qscale = sm_scale${" * CLATTN_LOG2E" if SOFTCAP is None else ""};
        float f[${D}];
% for g in range(G):
        {
            const __global st_t* qp = q + ((ulong)b * ${HQO} + kvh * ${G} + ${g}) * ${D};
            for (int i = 0; i < ${D}; ++i) f[i] = ${c.loadv(1, "qp + i")};
            if (rotary_mode) {
${rotate_row("f", "q_pos[b]")}
            }
%   for i in range(NV):
            q${g}_${i} = ${("f[%d]" % i) if V == 1 else "vload%d(0, f + %d)" % (V, i * V)} * qscale;
%   endfor
        }
% endfor
    }
% for g in range(G):
    float m${g} = -INFINITY, l${g} = 0.0f;
%   for i in range(NV):
    ${FV} a${g}_${i} = 0.0f;
%   endfor
% endfor
    const int kpos0 = rotary_mode ? k_pos_offset[b] : 0;
    const __global float2* tt = rope_turns + rope_table * ${HALF};
% if VECROT:
    /* RoPE of the keys, vectorised: cos/sin of the block start (per block) composed with
       those of 0..TILE-1 positions (once) */
    ${FV} cjv[${TILE}][${NRV}], sjv[${TILE}][${NRV}], cbv[${NRV}], sbv[${NRV}];
    if (rotary_mode) {
        for (int j = 0; j < ${TILE}; ++j)
            for (int cc = 0; cc < ${NRV}; ++cc)
                for (int e = 0; e < ${V}; ++e) {
                    const int fi = ${"cc * %d + e" % V if not INTERLEAVED else "(cc * %d + e) / 2" % V};
                    float cs;
                    ((float*)&sjv[j][cc])[e] = sincos(clattn_rope_angle(j, tt[fi]), &cs);
                    ((float*)&cjv[j][cc])[e] = cs;
                }
    }
% else:
    float cj[${TILE}][${HALF}], sj[${TILE}][${HALF}], cb[${HALF}], sb[${HALF}];
    if (rotary_mode) {
        for (int j = 0; j < ${TILE}; ++j)
            for (int i = 0; i < ${HALF}; ++i) sj[j][i] = sincos(clattn_rope_angle(j, tt[i]), &cj[j][i]);
    }
% endif

    for (int r0 = r_lo; r0 < r_hi; r0 += ${TILE}) {
        const int n = min(${TILE}, r_hi - r0);
% for g in range(G):
        float s${g}[${TILE}] __attribute__((aligned(64)));
% endfor
        if (n < ${TILE}) {
            for (int j = n; j < ${TILE}; ++j) {
% for g in range(G):
                s${g}[j] = -INFINITY;
% endfor
            }
        }
        if (rotary_mode) {
% if VECROT:
            for (int cc = 0; cc < ${NRV}; ++cc)
                for (int e = 0; e < ${V}; ++e) {
                    const int fi = ${"cc * %d + e" % V if not INTERLEAVED else "(cc * %d + e) / 2" % V};
                    float cs;
                    ((float*)&sbv[cc])[e] = sincos(clattn_rope_angle(kpos0 + r0, tt[fi]), &cs);
                    ((float*)&cbv[cc])[e] = cs;
                }
% else:
            for (int i = 0; i < ${HALF}; ++i) sb[i] = sincos(clattn_rope_angle(kpos0 + r0, tt[i]), &cb[i]);
% endif
        }
        for (int j = 0; j < n; ++j) {
            const __global st_t* kp = pages + clattn_row_at(page_indices, p0, r0 + j, sink, wo, kvh, num_pages, 0);
% for i in range(NV):
            ${FV} k${i} = ${ld("kp + %d" % (i * V))};
% endfor
            if (rotary_mode) {
% if VECROT:
%   for cc in range(NRV):
                {
                    const ${FV} cs = cbv[${cc}] * cjv[j][${cc}] - sbv[${cc}] * sjv[j][${cc}];
                    const ${FV} sn = sbv[${cc}] * cjv[j][${cc}] + cbv[${cc}] * sjv[j][${cc}];
%     if INTERLEAVED:
                    k${cc} = (k${cc} * cs + k${cc}${SWAP} * (sn * ${SIGN})) * rope_att;
%     else:
                    const ${FV} x = k${cc}, y = k${cc + NRV};
                    k${cc} = (x * cs - y * sn) * rope_att;
                    k${cc + NRV} = (y * cs + x * sn) * rope_att;
%     endif
                }
%   endfor
% else:
                float f[${D}];
%   for i in range(NV):
                ${"f[%d] = k%d;" % (i, i) if V == 1 else "vstore%d(k%d, 0, f + %d);" % (V, i, i * V)}
%   endfor
${rotate_row("f")}
%   for i in range(NV):
                k${i} = ${("f[%d]" % i) if V == 1 else "vload%d(0, f + %d)" % (V, i * V)};
%   endfor
% endif
            }
% for g in range(G):
            {
                ${FV} t = q${g}_0 * k0;
%   for i in range(1, NV):
                t += q${g}_${i} * k${i};
%   endfor
                s${g}[j] = ${score(hsum("t"))};
            }
% endfor
        }
% for g in range(G):
        {
            const ${FT} sv = *(${FT}*)s${g};
            const float bm = ${hred("sv", "max", TILE)};
            const float mx = bm > m${g} ? bm : m${g};
            const float alpha = clattn_exp2_1(m${g} - mx);
            const ${FT} pv = clattn_exp2_${TILE}(sv - mx);
            *(${FT}*)s${g} = pv;
            const float sum = l${g} * alpha + ${hred("pv", "+", TILE)};
            m${g} = mx;
            l${g} = sum;
%   for i in range(NV):
            a${g}_${i} *= alpha;
%   endfor
        }
% endfor
        /* V: CB head_dim chunks at a time over the block's rows, so their CB x G
           accumulators stay in registers and each weight is loaded once per CB chunks */
<% CB = 2 if (NV % 2 == 0 and 2 * G + 3 <= 16) else 1 %>\
        const __global st_t* vrow[${TILE}];
        for (int j = 0; j < n; ++j)
            vrow[j] = pages + clattn_row_at(page_indices, p0, r0 + j, sink, wo, kvh, num_pages, 1);
% for i0 in range(0, NV, CB):
        for (int j = 0; j < n; ++j) {
%   for i in range(i0, i0 + CB):
            const ${FV} v${i - i0} = ${ld("vrow[j] + %d" % (i * V))};
%   endfor
%   for g in range(G):
            {
                const float p = s${g}[j];
%     for i in range(i0, i0 + CB):
                a${g}_${i} += p * v${i - i0};
%     endfor
            }
%   endfor
        }
% endfor
    }

% for g in range(G):
    {
        const int h = kvh * ${G} + ${g};
        const float inv = l${g} > 0.0f ? 1.0f / l${g} : 0.0f;
        const float st = l${g} > 0.0f ? m${g} + log2(l${g}) : -INFINITY;
        if (direct) {
            __global st_t* op = out + ((ulong)b * ${HQO} + h) * ${D};
%   for i in range(NV):
            ${c.storev(V, "a%d_%d * inv" % (g, i), "op + %d" % (i * V))}
%   endfor
            lse[(ulong)b * ${HQO} + h] = st;
        } else {
            __global float* op = ws_o + ((ulong)ws_at * ${HQO} + h) * ${D};
%   for i in range(NV):
            ${("op[%d] = a%d_%d * inv;" % (i, g, i)) if V == 1 else ("vstore%d(a%d_%d * inv, 0, op + %d);" % (V, g, i, i * V))}
%   endfor
            ws_s[(ulong)ws_at * ${HQO} + h] = st;
        }
    }
% endfor
}
% else:
<%
ROWS_IT = BDY * BDZ * TILE   # rows staged per step
SLICE = BDY * TILE           # rows each tz slice scores per step
%>\
__kernel __attribute__((reqd_work_group_size(${BDX}, ${BDY}, ${BDZ})))
% if REDUCE == "subgroup" and SGS:
__attribute__((intel_reqd_sub_group_size(${SGS})))
% endif
void clattn_decode(KERNEL_ARGS)
{
    const int tx = get_local_id(0), ty = get_local_id(1), tz = get_local_id(2);
    const int b = get_group_id(0);
    const int kvh = get_group_id(1) / ${GDZ};
    const int gi = (get_group_id(1) % ${GDZ}) * ${BDY} + ty;   /* head within the group */
    const int head_ok = gi < ${G};
    const int h = kvh * ${G} + min(gi, ${G - 1});
    const int part = get_group_id(2);
    SEQ_SETUP
    if (!valid_part) return;   /* uniform over the work-group */

% if USE_LOCAL:
    __local float k_tile[${ROWS_IT}][${D}];
    __local float v_tile[${ROWS_IT}][${D}];
% endif
% if REDUCE != "subgroup":
    __local float red[${BDZ}][${BDY}][${SLICE}][${BDX}];
% endif
    __local float o_red[${BDZ}][${BDY}][${D}];
    __local float md_red[${BDZ}][${BDY}][2];

    /* this thread's VEC dims of q (rotated, pre-scaled) */
    ${c.fv(VEC)} qv;
    {
        const __global st_t* qp = q + ((ulong)b * ${HQO} + h) * ${D};
        qv = ${c.loadv(VEC, "qp + tx * %d" % VEC)};
        ${rope_vec("qv", "qp", "q_pos[b]")}
        qv *= sm_scale${" * CLATTN_LOG2E" if SOFTCAP is None else ""};
    }
    const int kpos0 = rotary_mode ? k_pos_offset[b] : 0;
    ${c.fv(VEC)} acc = 0.0f;
    float m = -INFINITY, l = 0.0f;

    for (int t0 = r_lo; t0 < r_hi; t0 += ${ROWS_IT}) {
% if USE_LOCAL:
        /* stage ROWS_IT rows of K (rotated) and V in local memory */
        for (int j = 0; j < ${TILE}; ++j) {
            const int rs = (tz * ${BDY} + ty) * ${TILE} + j;
            const int row = t0 + rs;
            ${c.fv(VEC)} kx = 0.0f, vx = 0.0f;
            if (row < r_hi) {
                const ulong ka = clattn_row_at(page_indices, p0, row, sink, wo, kvh, num_pages, 0);
                const __global st_t* kp = pages + ka;
                kx = ${c.loadv(VEC, "kp + tx * %d" % VEC)};
                vx = ${c.loadv(VEC, "pages + ka + %d * %d * %d + tx * %d" % (HKV, PS, D, VEC))};
                ${rope_vec("kx", "kp", "kpos0 + row")}
            }
% if VEC == 1:
            k_tile[rs][tx] = kx;
            v_tile[rs][tx] = vx;
% else:
            vstore${VEC}(kx, 0, &k_tile[rs][tx * ${VEC}]);
            vstore${VEC}(vx, 0, &v_tile[rs][tx * ${VEC}]);
% endif
        }
        barrier(CLK_LOCAL_MEM_FENCE);
% endif
        /* scores of this tz slice's rows for head ty */
        float s[${SLICE}];
        for (int j = 0; j < ${SLICE}; ++j) {
            const int rs = tz * ${SLICE} + j;
            const int row = t0 + rs;
% if USE_LOCAL:
% if VEC == 1:
            const float kx = k_tile[rs][tx];
% else:
            const ${c.fv(VEC)} kx = vload${VEC}(0, &k_tile[rs][tx * ${VEC}]);
% endif
% else:
            ${c.fv(VEC)} kx = 0.0f;
            if (row < r_hi) {
                const __global st_t* kp = pages + clattn_row_at(page_indices, p0, row, sink, wo, kvh, num_pages, 0);
                kx = ${c.loadv(VEC, "kp + tx * %d" % VEC)};
                ${rope_vec("kx", "kp", "kpos0 + row")}
            }
% endif
            const ${c.fv(VEC)} pr = qv * kx;
% if REDUCE == "subgroup":
            s[j] = sub_group_reduce_add(${hsum("pr")});
% else:
            red[tz][ty][j][tx] = ${hsum("pr")};
% endif
        }
% if REDUCE != "subgroup":
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int j = 0; j < ${SLICE}; ++j) {
            float t = 0.0f;
            for (int x = 0; x < ${BDX}; ++x) t += red[tz][ty][j][x];
            s[j] = t;
        }
% endif
        float mx = m;
        for (int j = 0; j < ${SLICE}; ++j) {
            const int row = t0 + tz * ${SLICE} + j;
            s[j] = row < r_hi ? ${score("s[j]")} : -INFINITY;
            mx = fmax(mx, s[j]);
        }
        const float alpha = exp2(m - mx);   /* 0 while both are -inf is avoided below */
        float sum = mx == -INFINITY ? 0.0f : l * alpha;
        acc = mx == -INFINITY ? acc : acc * alpha;
        for (int j = 0; j < ${SLICE}; ++j) {
            const float pj = mx == -INFINITY ? 0.0f : exp2(s[j] - mx);
            sum += pj;
            const int rs = tz * ${SLICE} + j;
% if USE_LOCAL:
% if VEC == 1:
            acc += pj * v_tile[rs][tx];
% else:
            acc += pj * vload${VEC}(0, &v_tile[rs][tx * ${VEC}]);
% endif
% else:
            const int row = t0 + rs;
            if (row < r_hi) {
                const __global st_t* vp = pages + clattn_row_at(page_indices, p0, row, sink, wo, kvh, num_pages, 1);
                acc += pj * ${c.loadv(VEC, "vp + tx * %d" % VEC)};
            }
% endif
        }
        m = mx;
        l = sum;
% if USE_LOCAL or REDUCE != "subgroup":
        barrier(CLK_LOCAL_MEM_FENCE);   /* tiles and partial sums are rewritten next step */
% endif
    }

    /* merge the BDZ row slices' states */
% if VEC == 1:
    o_red[tz][ty][tx] = acc;
% else:
    vstore${VEC}(acc, 0, &o_red[tz][ty][tx * ${VEC}]);
% endif
    if (tx == 0) { md_red[tz][ty][0] = m; md_red[tz][ty][1] = l; }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (tz == 0 && head_ok) {
        float mt = -INFINITY;
        for (int z = 0; z < ${BDZ}; ++z) mt = fmax(mt, md_red[z][ty][0]);
        float lt = 0.0f;
        ${c.fv(VEC)} ot = 0.0f;
        if (mt != -INFINITY) {
            for (int z = 0; z < ${BDZ}; ++z) {
                const float w = exp2(md_red[z][ty][0] - mt);
                lt += md_red[z][ty][1] * w;
% if VEC == 1:
                ot += o_red[z][ty][tx] * w;
% else:
                ot += vload${VEC}(0, &o_red[z][ty][tx * ${VEC}]) * w;
% endif
            }
        }
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
        const float st = lt > 0.0f ? mt + log2(lt) : -INFINITY;
        ot *= inv;
        if (direct) {
            __global st_t* op = out + ((ulong)b * ${HQO} + h) * ${D} + tx * ${VEC};
            ${c.storev(VEC, "ot", "op")}
            if (tx == 0) lse[(ulong)b * ${HQO} + h] = st;
        } else {
            __global float* op = ws_o + ((ulong)ws_at * ${HQO} + h) * ${D} + tx * ${VEC};
% if VEC == 1:
            op[0] = ot;
% else:
            vstore${VEC}(ot, 0, op);
% endif
            if (tx == 0) ws_s[(ulong)ws_at * ${HQO} + h] = st;
        }
    }
}
% endif
