<%doc>
clattn paged-KV prefill, "tiled" strategy (GPUs): one work-group per (work unit, KV
head); local (TC, TR). A unit is up to QB consecutive queries of one sequence; with the G
query heads of the KV head that makes QB * G rows (query i, head g -> row i * G + g),
padded to MP = TR * RM. Thread (tc, tr) owns rows [tr * RM, tr * RM + RM). Per tile of KB
keys (FlashAttention-2's loop, without tensor cores):
  1. K (rotated) and V rows of the tile to local memory, f32;
  2. scores: each thread an RM x RK register tile (its rows x keys tc + TC * k), over
     head_dim from the local q and K tiles; the causal mask; the rows' tile maxima
     reduced across the TC threads of the row group through local memory;
  3. weights 2^(s - max) to local memory, their sums reduced the same way;
  4. values: each thread an RM x RD register tile (its rows x head_dim_v columns
     tc + TC * c), from the local weights and V tile.
The q tile is loaded (rotated, scaled) once. The semantics are docs/prefill.md's.

Template parameters (clattn.codegen.render_prefill, from clattn.fit.PrefillGeometry):
  D, DV, HQO, HKV, G, PS, ROT, ROPE, SLIDING, SOFTCAP, DTYPE, NATIVE_HALF  as in rows
  QB, KB               queries per work-group; keys per tile
  TC, TR, RM           threads per row group, row groups, rows per thread
  SIGNATURE, FIXUP     parameter list and pointer fix-up from clattn.signatures.PREFILL
  KFMT, VFMT, ...      the page storage (decode_common.clh.mako)
Every index read from a table is clamped: no input makes the kernel read or write out of
bounds.
</%doc>
<%namespace name="c" file="common.clh.mako"/>
<%namespace name="d" file="decode_common.clh.mako"/>
<%namespace name="pc" file="prefill_common.clh.mako"/>
<%! from clattn import kernel_exprs as kx %>\
${c.prelude()}
${pc.setup()}
${d.q4_helpers()}
<%
MP = TR * RM      # rows of the q tile (QB * G live at most)
RK = KB // TC     # keys per thread in the score phase
RD = DV // TC     # head_dim_v columns per thread in the value phase
NT = TC * TR
def kl(kind, name, lane):
    """One float of a K (0) / V (1) row at `name`, any page format."""
    return kx.lanes(kind, 1, name, lane, KFMT, VFMT, BYTE_POOL, False,
                    lambda v, ptr: capture(c.loadv, v, ptr))
%>\
## element e of a row rotated at position pos: x cos + sign * partner sin, times att
<%def name="rotated(x, partner_expr, e, pos)">\
{
                const int pi_ = ${ROPE.freq("(%s)" % e)};
                float cs_;
                const float sn_ = sincos(clattn_rope_angle(${pos}, tt[pi_]), &cs_);
                const float sg_ = ${ROPE.sign("(%s)" % e)};
                ${x} = (${x} * cs_ + sg_ * (${partner_expr}) * sn_) * rope_att;
            }\
</%def>
<%def name="partner(e)">(${ROPE.partner("(%s)" % e)})</%def>

__kernel __attribute__((reqd_work_group_size(${TC}, ${TR}, 1)))
void clattn_prefill(${SIGNATURE})
{
    const int tc = get_local_id(0), tr = get_local_id(1);
    const int tid = tr * ${TC} + tc;
    const int u = get_group_id(0);
    const int kvh = get_group_id(1);
    UNIT_SETUP
    if (nq <= 0) return;   /* uniform over the work-group */

    __local float q_tile[${MP}][${D}];
    __local float k_tile[${KB}][${D + 1}];    /* padded: threads read rows tc + TC * k */
    __local float v_tile[${KB}][${DV}];
    __local float p_tile[${MP}][${KB + 1}];
    __local float red_m[${MP}][${TC}];
    __local float red_l[${MP}][${TC}];

    /* the q tile: rows i * G + g, rotated at their query's position, scaled */
    const float qscale = sm_scale${" * CLATTN_LOG2E" if SOFTCAP is None else ""};
    for (int x = tid; x < ${MP * D}; x += ${NT}) {
        const int r = x / ${D}, e = x % ${D};
        const int i = r / ${G};
        float v = 0.0f;
        if (i < nq) {
            const __global st_t* qp = q + ((ulong)(qs + i) * ${HQO} + kvh * ${G} + r % ${G}) * ${D};
            v = ${c.loadv(1, "qp + e")};
            if (rotary_mode && e < ${ROT}) ${rotated("v", capture(c.loadv, 1, "qp + " + capture(partner, "e")), "e", "qpos0 + i")}
        }
        q_tile[r][e] = v * qscale;
    }

    int lim[${RM}];       /* last chunk row each of the thread's rows attends; -1: none */
    float m[${RM}], l[${RM}], acc[${RM}][${RD}];
    #pragma unroll
    for (int a = 0; a < ${RM}; ++a) {
        const int i = (tr * ${RM} + a) / ${G};
        lim[a] = QLIM(i);
        m[a] = -INFINITY;
        l[a] = 0.0f;
        #pragma unroll
        for (int cc = 0; cc < ${RD}; ++cc) acc[a][cc] = 0.0f;
    }

    /* every loop over the thread's register tile (RM rows, RK keys, RD value columns, TC
       partial maxima and sums) is unrolled (#pragma unroll), so that s, qa, kk, acc, m, l
       and lim are registers whatever the device compiler's own heuristics */
    for (int r0 = 0; r0 < r_end; r0 += ${KB}) {
        /* 1. K (rotated) and V of the tile; rows past r_end are 0 */
% if DV == D:
        for (int x = tid; x < ${KB * D}; x += ${NT}) {
            const int j = x / ${D}, e = x % ${D};
            const int row = r0 + j;
            float kx = 0.0f, vx = 0.0f;
            if (row < r_end) {
                ${d.row_ptr(0, "kp", "row")}
                ${d.row_ptr(1, "vp", "row")}
                kx = ${kl(0, "kp", "e")};
                vx = ${kl(1, "vp", "e")};
                if (rotary_mode && e < ${ROT}) ${rotated("kx", kl(0, "kp", capture(partner, "e")), "e", "kpos0 + row")}
            }
            k_tile[j][e] = kx;
            v_tile[j][e] = vx;
        }
% else:
        for (int x = tid; x < ${KB * D}; x += ${NT}) {
            const int j = x / ${D}, e = x % ${D};
            const int row = r0 + j;
            float kx = 0.0f;
            if (row < r_end) {
                ${d.row_ptr(0, "kp", "row")}
                kx = ${kl(0, "kp", "e")};
                if (rotary_mode && e < ${ROT}) ${rotated("kx", kl(0, "kp", capture(partner, "e")), "e", "kpos0 + row")}
            }
            k_tile[j][e] = kx;
        }
        for (int x = tid; x < ${KB * DV}; x += ${NT}) {
            const int j = x / ${DV}, e = x % ${DV};
            const int row = r0 + j;
            float vx = 0.0f;
            if (row < r_end) {
                ${d.row_ptr(1, "vp", "row")}
                vx = ${kl(1, "vp", "e")};
            }
            v_tile[j][e] = vx;
        }
% endif
        barrier(CLK_LOCAL_MEM_FENCE);

        /* 2. scores of the thread's RM rows x RK keys; tile maxima per row */
        float s[${RM}][${RK}];
        #pragma unroll
        for (int a = 0; a < ${RM}; ++a)
            #pragma unroll
            for (int k = 0; k < ${RK}; ++k) s[a][k] = 0.0f;
        for (int e = 0; e < ${D}; ++e) {
            float qa[${RM}], kk[${RK}];
            #pragma unroll
            for (int a = 0; a < ${RM}; ++a) qa[a] = q_tile[tr * ${RM} + a][e];
            #pragma unroll
            for (int k = 0; k < ${RK}; ++k) kk[k] = k_tile[tc + ${TC} * k][e];
            #pragma unroll
            for (int a = 0; a < ${RM}; ++a)
                #pragma unroll
                for (int k = 0; k < ${RK}; ++k) s[a][k] += qa[a] * kk[k];
        }
        #pragma unroll
        for (int a = 0; a < ${RM}; ++a) {
            float mx = -INFINITY;
            #pragma unroll
            for (int k = 0; k < ${RK}; ++k) {
                const int key = r0 + tc + ${TC} * k;
                s[a][k] = key <= lim[a] && MASK_KEEPS((tr * ${RM} + a) / ${G}, key) ? ${kx.score("s[a][k]", SOFTCAP)} : -INFINITY;
                mx = fmax(mx, s[a][k]);
            }
            red_m[tr * ${RM} + a][tc] = mx;
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* 3. weights and their sums; a row with no attended key in the tile keeps its
           state (r0 is the tile's first key: attended by a row iff r0 <= lim) */
        float alpha[${RM}];
        #pragma unroll
        for (int a = 0; a < ${RM}; ++a) {
            const int row = tr * ${RM} + a;
            float mx = m[a];
            #pragma unroll
            for (int t = 0; t < ${TC}; ++t) mx = clattn_max_nan(mx, red_m[row][t]);
            const int live = r0 <= lim[a];
            const float base = clattn_exp_base(mx);
            alpha[a] = live ? exp2(m[a] - base) : 1.0f;
            float sum = 0.0f;
            #pragma unroll
            for (int k = 0; k < ${RK}; ++k) {
                const float p = r0 + tc + ${TC} * k <= lim[a] ? exp2(s[a][k] - base) : 0.0f;
                p_tile[row][tc + ${TC} * k] = p;
                sum += p;
            }
            red_l[row][tc] = sum;
            m[a] = live ? mx : m[a];
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* 4. values: the thread's RM rows x columns tc + TC * c */
        #pragma unroll
        for (int a = 0; a < ${RM}; ++a) {
            const int row = tr * ${RM} + a;
            float sum = 0.0f;
            #pragma unroll
            for (int t = 0; t < ${TC}; ++t) sum += red_l[row][t];
            l[a] = l[a] * alpha[a] + sum;
            #pragma unroll
            for (int cc = 0; cc < ${RD}; ++cc) acc[a][cc] *= alpha[a];
        }
        /* on the causal diagonal (and under a custom mask) a row adds only the keys it
           attends: a masked key's value is never multiplied (0 * inf would be NaN);
           uniform over the group */
        const int full = !use_mask && min(r0 + ${KB}, r_end) - 1 <= QLIM(0);
        for (int j = 0; j < ${KB}; ++j) {
            float vv[${RD}];
            #pragma unroll
            for (int cc = 0; cc < ${RD}; ++cc) vv[cc] = v_tile[j][tc + ${TC} * cc];
            #pragma unroll
            for (int a = 0; a < ${RM}; ++a) {
                const float p = p_tile[tr * ${RM} + a][j];
                if (full || (r0 + j <= lim[a] && MASK_KEEPS((tr * ${RM} + a) / ${G}, r0 + j))) {
                    #pragma unroll
                    for (int cc = 0; cc < ${RD}; ++cc) acc[a][cc] += p * vv[cc];
                }
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);   /* the tiles are rewritten next step */
    }

    #pragma unroll
    for (int a = 0; a < ${RM}; ++a) {
        const int row = tr * ${RM} + a;
        const int i = row / ${G};
        if (i >= nq) break;
        const ulong at = (ulong)(qs + i) * ${HQO} + kvh * ${G} + row % ${G};
        const int seen = KEEPS_ANY(i, lim[a]);   /* rows attended: all scoring -inf breaks it */
        ${c.add_sink("m[a]", "l[a]", "CLATTN_SINK(use_sinks, kvh * %d + row %% %d)" % (G, G))}
        const float inv = clattn_part_inv(l[a], seen) * alpha;
        __global st_t* op = out + at * ${DV};
        #pragma unroll
        for (int cc = 0; cc < ${RD}; ++cc) {
            const float o = acc[a][cc] * inv;
            ${c.storev(1, "o", "op + tc + %d * cc" % TC)}
        }
        if (tc == 0) lse[at] = clattn_part_lse(m[a], l[a], seen);
    }
}
