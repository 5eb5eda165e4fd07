<%doc>
clattn paged-KV decode attention, "tiled" strategy (GPUs): one work-group per (sequence b,
KV head x GDZ head slices, partition p); local (BDX, 1, BDZ): tx across head_dim (VEC
floats each), tz across row slices. Every work-item keeps q, the running state and the
accumulator of all GI = ceil(G / GDZ) query heads (V and out: DV dims, lane tx holding the
VEC-wide chunks tx, tx + BDX, ... of them, NC chunks; NC = 1 when DV == D) of its head slice in registers, so each
K and V row is loaded from global memory once per work-group and serves every head. A
step is BDZ x TILE rows (slice tz scores TILE of them); the BDX partial dot products of a
row are reduced through sub-groups (REDUCE == "subgroup": a sub-group is one slice, no
barrier in the row loop) or through local memory (two barriers per step: one after the
partials, one after their sums); the page-table entry of each row is read once per
work-group (a lane's read shared by sub-group broadcast or through local memory). A final
merge of the BDZ slices' states. The semantics are docs/contract.md's.

Template parameters (clattn.codegen.render_decode, from clattn.fit.DecodeGeometry):
  D, DV, HQO, HKV, G, PS, ROT, ROPE, SLIDING, SOFTCAP, DTYPE, NATIVE_HALF  as in rows
  VEC, TILE            floats per work-item; rows per slice per step
  BDX, BDY, BDZ, GDZ   work-group shape (BDX = D / VEC, BDY = 1); head slices per KV head
  USE_LOCAL            unused (K/V live in registers; clattn.fit always sets it off)
  REDUCE, SGS          "local" or "subgroup" dot-product reduction; the required
                       sub-group size (None: the device's own)
  SG_ATTR              the attribute that requests SGS (vendor extension), or ""
  FUSED                the append of a one-token step fused in (decode_common's
                       fused_append, one head slice per KV head: GDZ == 1)
  SINKS                the learned-sink epilogue compiled in (built only for calls that
                       pass sink_logits: without it a CPU compiler keeps its best code)
  FOLD                 the split merge folded in: of a split sequence's work-groups of a
                       head slice, the last to finish merges the slice's states
                       (merge_state.clh.mako's tiled merge, clattn_merge_varlen's
                       arithmetic, BDX lanes per head) into out/lse, counting on
                       counters[b * HKV * GDZ + group id 1]
  SIGNATURE, FIXUP     parameter list and pointer fix-up from clattn.signatures.DECODE
Every index read from the page table is clamped: no input makes the kernel read or
write out of bounds (counters: the host sizes it for the launch's batch, B x HKV x GDZ).
</%doc>
<%namespace name="c" file="common.clh.mako"/>
<%namespace name="d" file="decode_common.clh.mako"/>
<%namespace name="m" file="merge_state.clh.mako"/>
<%! from clattn import kernel_exprs as kx %>\
${c.prelude()}
${d.setup()}
${d.q4_helpers()}
<%
def hsum(v):
    return kx.hsum(v, VEC)
def score(x):
    return kx.score(x, SOFTCAP)
def kl(kind, vec, name, lane):
    """float<vec> of lanes [lane, lane + vec) of a K (0) / V (1) row, any page format."""
    return kx.lanes(kind, vec, name, lane, KFMT, VFMT, BYTE_POOL, False,
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
                    const int i = ${ROPE.freq("d")};
                    const int pd = ${ROPE.partner("d")};
                    const float sgn = ${ROPE.sign("d")};
                    float cs;
                    const float sn = sincos(clattn_rope_angle(${pos}, tt[i]), &cs);
                    const float partner = ${capture(c.loadv, 1, src + " + pd") if kind is None else kl(kind, 1, src, "pd")};
                    xf[e] = (xf[e] * cs + sgn * partner * sn) * rope_att;
                }
            }
        }
</%def>

<%
GI = GH                      # query heads per work-item (clattn.fit.slice_heads)
ROWS = BDZ * TILE            # rows per step
PAIRS = TILE * GI            # (row, head) scores per slice per step
LOCAL_RED = REDUCE != "subgroup"
# local memory (clattn.fit.tiled_local, which the fit reads too): the loop's partials and
# their sums, then (reused) the merge's states
SCRATCH = LOCAL.scratch
VC = kx.LaneChunks(DV, BDX, VEC)   # the V chunks of each lane
NC, vlane, vguard = VC.count, VC.at, VC.held
%>\
__kernel __attribute__((reqd_work_group_size(${BDX}, 1, ${BDZ})))
${SG_ATTR}
void clattn_decode(${SIGNATURE})
{
    const int tx = get_local_id(0), tz = get_local_id(2);
    const int b = get_group_id(0);
    const int kvh = get_group_id(1) / ${GDZ};
    const int g0 = (get_group_id(1) % ${GDZ}) * ${GI};   /* first head of the slice */
    const int part = get_group_id(2);
    SEQ_SETUP
    if (!valid_part) return;   /* uniform over the work-group */
% if FUSED:
${d.fused_append("part == nparts_b - 1 && tz == 0", ["tx * %d" % VEC], VEC, fence=True)}
% endif

    __local float scratch[${SCRATCH}];
% if LOCAL_RED:
    __local float* red = scratch;                       /* [BDZ][PAIRS][BDX] partials */
    __local float* rsum = scratch + ${LOCAL.partials};  /* [BDZ][PAIRS] their sums */
    __local int pg_step[${LOCAL.pages}];                        /* pages of the step's rows */
    const int lid = tz * ${BDX} + tx;
% endif

    /* q of the slice's heads for this thread's VEC dims (rotated, pre-scaled) */
    ${c.fv(VEC)} qv[${GI}];
    for (int g = 0; g < ${GI}; ++g) {
        const int h = kvh * ${G} + min(g0 + g, ${G - 1});
        const __global st_t* qp = q + ((ulong)b * ${HQO} + h) * ${D};
        qv[g] = ${c.loadv(VEC, "qp + tx * %d" % VEC)};
        ${rope_vec("qv[g]", "qp", "q_pos[b]")}
        qv[g] *= sm_scale${" * CLATTN_LOG2E" if SOFTCAP is None else ""};
    }
    const int kpos0 = rotary_mode ? k_pos_offset[b] : 0;
    ${c.fv(VEC)} acc[${GI}][${NC}];
    float m[${GI}], l[${GI}];
    for (int g = 0; g < ${GI}; ++g) {
        for (int cc = 0; cc < ${NC}; ++cc) acc[g][cc] = 0.0f;
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }

% if LOCAL_RED:
    /* the first step's pages, one page-table read per row */
    for (int i = lid; i < ${ROWS}; i += ${BDX * BDZ})
        pg_step[i] = r_lo + i < r_hi ? clattn_page_of(page_indices, p0, r_lo + i, sink, wo, num_pages) : 0;
    barrier(CLK_LOCAL_MEM_FENCE);
% endif
    /* Every loop of a step over its rows, heads, value chunks and partials has a trip
       count the template fixes: each is unrolled (#pragma unroll), so that s[][], pg[]
       and acc[][] are registers and a row costs no loop control, whatever the device
       compiler's own unrolling heuristics (counted under Oclgrind: tools/gpu_model.md) */
    for (int t0 = r_lo; t0 < r_hi; t0 += ${ROWS}) {
        const int r0 = t0 + tz * ${TILE};   /* this slice's first row */
        int pg[${TILE}];                     /* pages of its rows */
        float s[${TILE}][${GI}];             /* their scores, then weights, per head */
% if not LOCAL_RED:
        /* lane j reads row j's page; a broadcast gives it to the slice */
        #pragma unroll
        for (int j0 = 0; j0 < ${TILE}; j0 += ${BDX}) {
            const int own = r0 + j0 + tx;
            const int mine = j0 + tx < ${TILE} && own < r_hi ?
                clattn_page_of(page_indices, p0, own, sink, wo, num_pages) : 0;
            #pragma unroll
            for (int j = j0; j < min(j0 + ${BDX}, ${TILE}); ++j)
                pg[j] = sub_group_broadcast(mine, (uint)(j - j0));
        }
% endif
        /* K: partial dot products of this thread's dims with every head's q */
        #pragma unroll
        for (int j = 0; j < ${TILE}; ++j) {
            const int row = r0 + j;
% if LOCAL_RED:
            pg[j] = pg_step[tz * ${TILE} + j];
% endif
            ${c.fv(VEC)} kx = 0.0f;
            if (row < r_hi) {
                ${d.page_ptr(0, "kp", "pg[j]", "clattn_slot_of(row, sink, wo)")}
                kx = ${kl(0, VEC, "kp", "tx * %d" % VEC)};
                ${rope_vec("kx", "kp", "kpos0 + row", 0)}
            }
            #pragma unroll
            for (int g = 0; g < ${GI}; ++g) {
                const ${c.fv(VEC)} pr = qv[g] * kx;
% if LOCAL_RED:
                red[((tz * ${TILE} + j) * ${GI} + g) * ${BDX} + tx] = ${hsum("pr")};
% else:
                s[j][g] = sub_group_reduce_add(${hsum("pr")});
% endif
            }
        }
% if LOCAL_RED:
        barrier(CLK_LOCAL_MEM_FENCE);
        /* lane tx sums the BDX partials of pairs tx, tx + BDX, ... of its slice (each
           partial read once); meanwhile the next step's pages are read */
        for (int i = tx; i < ${PAIRS}; i += ${BDX}) {
            const __local float* pt = red + (tz * ${PAIRS} + i) * ${BDX};
            float t = 0.0f;
            #pragma unroll
            for (int x = 0; x < ${BDX}; ++x) t += pt[x];
            rsum[tz * ${PAIRS} + i] = t;
        }
        for (int i = lid; i < ${ROWS}; i += ${BDX * BDZ}) {
            const int row = t0 + ${ROWS} + i;
            pg_step[i] = row < r_hi ? clattn_page_of(page_indices, p0, row, sink, wo, num_pages) : 0;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        #pragma unroll
        for (int j = 0; j < ${TILE}; ++j)
            #pragma unroll
            for (int g = 0; g < ${GI}; ++g) s[j][g] = rsum[tz * ${PAIRS} + j * ${GI} + g];
% endif
        /* per head: scores -> weights against the new running max; a slice with no row
           in this step keeps its state; rows scoring -inf weigh 0, also while the slice
           has seen nothing else (clattn_exp_base) */
        const int has_rows = r0 < r_hi;
        #pragma unroll
        for (int g = 0; g < ${GI}; ++g) {
            float mx = m[g];
            #pragma unroll
            for (int j = 0; j < ${TILE}; ++j) {
                s[j][g] = r0 + j < r_hi ? ${score("s[j][g]")} : -INFINITY;
                mx = fmax(mx, s[j][g]);
            }
            const float base = clattn_exp_base(mx);
            const float alpha = has_rows ? exp2(m[g] - base) : 1.0f;
            float sum = l[g] * alpha;
            #pragma unroll
            for (int j = 0; j < ${TILE}; ++j) {
                s[j][g] = r0 + j < r_hi ? exp2(s[j][g] - base) : 0.0f;
                sum += s[j][g];
            }
            #pragma unroll
            for (int cc = 0; cc < ${NC}; ++cc) acc[g][cc] *= alpha;
            m[g] = mx;
            l[g] = sum;
        }
        /* V: each row loaded once, accumulated into every head */
        #pragma unroll
        for (int j = 0; j < ${TILE}; ++j) {
            const int row = r0 + j;
            if (row < r_hi) {
                ${d.page_ptr(1, "vp", "pg[j]", "clattn_slot_of(row, sink, wo)")}
% for cc in range(NC):
                if (${vguard(cc)}) {
                    const ${c.fv(VEC)} vx = ${kl(1, VEC, "vp", vlane(cc))};
                    #pragma unroll
                    for (int g = 0; g < ${GI}; ++g) acc[g][${cc}] += s[j][g] * vx;
                }
% endfor
            }
        }
    }

    /* merge the BDZ row slices' states: o_red[BDZ][GI][DV], md[BDZ][GI][2] */
% if LOCAL_RED:
    barrier(CLK_LOCAL_MEM_FENCE);   /* the loop's local arrays are reused */
% endif
    __local float* o_red = scratch;
    __local float* md = scratch + ${LOCAL.states};
    for (int g = 0; g < ${GI}; ++g) {
% for cc in range(NC):
        if (${vguard(cc)})
%   if VEC == 1:
            o_red[(tz * ${GI} + g) * ${DV} + ${vlane(cc)}] = acc[g][${cc}];
%   else:
            vstore${VEC}(acc[g][${cc}], 0, o_red + (tz * ${GI} + g) * ${DV} + ${vlane(cc)});
%   endif
% endfor
        if (tx == 0) { md[(tz * ${GI} + g) * 2] = m[g]; md[(tz * ${GI} + g) * 2 + 1] = l[g]; }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int g = tz; g < ${GI} && g0 + g < ${G}; g += ${BDZ}) {   /* slice tz merges heads tz, tz + BDZ, ... */
        const int h = kvh * ${G} + g0 + g;
        float mt = -INFINITY;
        for (int z = 0; z < ${BDZ}; ++z) mt = clattn_max_nan(mt, md[(z * ${GI} + g) * 2]);
        float lt = 0.0f;
        ${c.fv(VEC)} ot[${NC}];
        for (int cc = 0; cc < ${NC}; ++cc) ot[cc] = 0.0f;
        for (int z = 0; z < ${BDZ}; ++z) {
            const int zi = z * ${GI} + g;
            const float w = clattn_state_weight(md[zi * 2], mt);   /* empty slice: 0 */
            lt += md[zi * 2 + 1] * w;
% for cc in range(NC):
            if (${vguard(cc)})
%   if VEC == 1:
                ot[${cc}] += o_red[zi * ${DV} + ${vlane(cc)}] * w;
%   else:
                ot[${cc}] += vload${VEC}(0, o_red + zi * ${DV} + ${vlane(cc)}) * w;
%   endif
% endfor
        }
        /* rows that all scored -inf: broken, or for a split-KV partition empty with its
           output marked NaN (decode_rows.cl.mako) */
        /* the learned sink joins the final state only (the merge adds it to a split) */
        ${c.add_sink("mt", "lt", "CLATTN_SINK(direct && use_sinks, h)", SINKS)}
        const float inv = clattn_part_inv(lt, r_hi > r_lo) * alpha;
        const float st = direct ? clattn_part_lse(mt, lt, r_hi > r_lo) : clattn_state_lse(mt, lt);
        if (direct) {
% for cc in range(NC):
            if (${vguard(cc)}) {
                __global st_t* op = out + ((ulong)b * ${HQO} + h) * ${DV} + ${vlane(cc)};
                ${c.storev(VEC, "ot[%d] * inv" % cc, "op")}
            }
% endfor
            if (tx == 0) lse[(ulong)b * ${HQO} + h] = st;
        } else {
% for cc in range(NC):
            if (${vguard(cc)}) {
                __global float* op = ws_o + ((ulong)ws_at * ${HQO} + h) * ${DV} + ${vlane(cc)};
%   if VEC == 1:
                op[0] = ot[${cc}] * inv;
%   else:
                vstore${VEC}(ot[${cc}] * inv, 0, op);
%   endif
            }
% endfor
            if (tx == 0) ws_s[(ulong)ws_at * ${HQO} + h] = st;
        }
    }
% if FOLD:
    /* the fold: the group's states are stored; one work-item, fenced, counts a split
       sequence's group in on its head slice's counter; the last group to count in (it
       reads count - 1) resets the counter for the next launch and merges the states of
       every partition of the slice's heads, read after a second fence through volatile
       loads (merge_state.clh.mako's `fresh`). Every group reaches the barriers (under
       `if (!direct)` they crashed PoCL 3.1's launches with heap corruption); the flag
       "this group is the last" lies in the scratch, which the slices' merge above reads
       before the first barrier */
    __local int* fold_last = (__local int*)scratch;
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    if (tx == 0 && tz == 0) {
        int last = 0;
        if (!direct) {
            mem_fence(CLK_GLOBAL_MEM_FENCE);
            volatile __global int* ctr = counters + (ulong)b * ${HKV * GDZ} + get_group_id(1);
            last = atomic_inc(ctr) == clattn_fold_parts(part_indptr[b], nparts_b, (int)get_num_groups(2), n_ws) - 1;
            if (last) atomic_xchg(ctr, 0);
        }
        fold_last[0] = last;
    }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    if (fold_last[0]) {
        mem_fence(CLK_GLOBAL_MEM_FENCE);
        const int lo = clamp(part_indptr[b], 0, n_ws);
        const int hi = clamp(part_indptr[b + 1], lo, n_ws);
        for (int g = tz; g < ${GI} && g0 + g < ${G} && hi - lo >= 2; g += ${BDZ}) {
            const int h = kvh * ${G} + g0 + g;
%   for cc in range(NC):
            if (${vguard(cc)})
${m.varlen_tiled("ws_o", "ws_s", "out", "lse", "b", "h", HQO, "lo", "hi", "1", "(%d + tx)" % (cc * BDX), VEC, "float", SINKS, fresh=True)}
%   endfor
        }
    }
% endif
}
