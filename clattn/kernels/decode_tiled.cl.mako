<%doc>
clattn paged-KV decode attention, "tiled" strategy (GPUs; the work-group decomposition of
the seed, TVM's paged-KV decode kernel): one work-group per (sequence b, KV head x GDZ
head slices, partition p); local (BDX, BDY, BDZ): tx across head_dim (VEC each), ty across
query heads of the group, tz across row slices; TILE rows per (ty, tz) per step; a final
merge of the BDZ slices' states. The semantics are docs/contract.md's.

Template parameters (clattn.codegen.render_decode, from clattn.fit.DecodeGeometry):
  D, HQO, HKV, G, PS, ROT, INTERLEAVED, SLIDING, SOFTCAP, DTYPE, NATIVE_HALF  as in rows
  VEC, TILE            floats per work-item; rows per (ty, tz) per step
  BDX, BDY, BDZ, GDZ   work-group shape (BDX = D / VEC); head slices per KV head
  USE_LOCAL            stage K/V tiles in local memory
  REDUCE, SGS          "local" or "subgroup" dot-product reduction; the required
                       sub-group size (None: the device's own)
  SG_ATTR              the attribute that requests SGS (vendor extension), or ""
  SIGNATURE, FIXUP     parameter list and pointer fix-up from clattn.signatures.DECODE
Every index read from the page table is clamped: no input makes the kernel read or
write out of bounds.
</%doc>
<%namespace name="c" file="common.clh.mako"/>
<%namespace name="d" file="decode_common.clh.mako"/>
${c.prelude()}
${d.setup()}
${d.q4_helpers()}
<% NV = D // VEC %>\
<%
def hsum(v):
    return d.attr.hsum(v, VEC)
def score(x):
    return d.attr.score(x, SOFTCAP)
def kl(kind, vec, name, lane):
    """float<vec> of lanes [lane, lane + vec) of a K (0) / V (1) row, any page format."""
    return d.attr.lanes(kind, vec, name, lane, KFMT, VFMT, BYTE_POOL, False,
                        lambda v, ptr: capture(c.loadv, v, ptr))
%>\
## rotate float<VEC> x holding dims tx*VEC.. of the row at storage pointer src
<%def name="rope_vec(x, src, pos, kind=None)">\
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
                    const float partner = ${capture(c.loadv, 1, src + " + pd") if kind is None else kl(kind, 1, src, "pd")};
                    xf[e] = (xf[e] * cs + sgn * partner * sn) * rope_att;
                }
            }
        }
</%def>

<%
ROWS_IT = BDY * BDZ * TILE   # rows staged per step
SLICE = BDY * TILE           # rows each tz slice scores per step
%>\
__kernel __attribute__((reqd_work_group_size(${BDX}, ${BDY}, ${BDZ})))
${SG_ATTR}
void clattn_decode(${SIGNATURE})
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
    __local float row_sum[${BDZ}][${BDY}][${SLICE}];
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
                ${d.row_ptr(0, "kp", "row")}
                ${d.v_ptr_from_k("vp", "kp")}
                kx = ${kl(0, VEC, "kp", "tx * %d" % VEC)};
                vx = ${kl(1, VEC, "vp", "tx * %d" % VEC)};
                ${rope_vec("kx", "kp", "kpos0 + row", 0)}
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
                ${d.row_ptr(0, "kp", "row")}
                kx = ${kl(0, VEC, "kp", "tx * %d" % VEC)};
                ${rope_vec("kx", "kp", "kpos0 + row", 0)}
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
        /* two stages: lane tx sums row tx's BDX partials (once per row, not once per
           lane), then every lane reads the SLICE sums */
        for (int j = tx; j < ${SLICE}; j += ${BDX}) {
            float t = 0.0f;
            for (int x = 0; x < ${BDX}; ++x) t += red[tz][ty][j][x];
            row_sum[tz][ty][j] = t;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int j = 0; j < ${SLICE}; ++j) s[j] = row_sum[tz][ty][j];
% endif
        float mx = m;
        for (int j = 0; j < ${SLICE}; ++j) {
            const int row = t0 + tz * ${SLICE} + j;
            s[j] = row < r_hi ? ${score("s[j]")} : -INFINITY;
            mx = fmax(mx, s[j]);
        }
        /* a slice with no row in this step keeps its state; rows scoring -inf weigh 0,
           also while the slice has seen nothing else (clattn_exp_base) */
        const int has_rows = t0 + tz * ${SLICE} < r_hi;
        const float base = clattn_exp_base(mx);
        const float alpha = has_rows ? exp2(m - base) : 1.0f;
        float sum = l * alpha;
        acc *= alpha;
        for (int j = 0; j < ${SLICE}; ++j) {
            const float pj = t0 + tz * ${SLICE} + j < r_hi ? exp2(s[j] - base) : 0.0f;
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
                ${d.row_ptr(1, "vp", "row")}
                acc += pj * ${kl(1, VEC, "vp", "tx * %d" % VEC)};
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
        for (int z = 0; z < ${BDZ}; ++z) mt = clattn_max_nan(mt, md_red[z][ty][0]);
        float lt = 0.0f;
        ${c.fv(VEC)} ot = 0.0f;
        for (int z = 0; z < ${BDZ}; ++z) {
            const float w = clattn_state_weight(md_red[z][ty][0], mt);   /* empty slice: 0 */
            lt += md_red[z][ty][1] * w;
% if VEC == 1:
            ot += o_red[z][ty][tx] * w;
% else:
            ot += vload${VEC}(0, &o_red[z][ty][tx * ${VEC}]) * w;
% endif
        }
        /* rows that all scored -inf: broken, or for a split-KV partition empty with its
           output marked NaN (decode_rows.cl.mako) */
        const float inv = clattn_part_inv(lt, r_hi > r_lo);
        const float st = direct ? clattn_part_lse(mt, lt, r_hi > r_lo) : clattn_state_lse(mt, lt);
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
