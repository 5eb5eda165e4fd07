<%doc>
clattn attention-state merges (docs/contract.md, "Merging").

Template parameters: D, DTYPE (storage of v/out), VIN ("half"|"float": storage of the
states being merged), NATIVE_HALF, DENORMS, STRATEGY ("rows" | "tiled"), VEC, MH (heads
per work-group, tiled), SINKS (the learned-sink epilogue compiled in: builds for calls
that pass sink_logits only), PAIR_SIGNATURE/PAIR_FIXUP and VARLEN_SIGNATURE/VARLEN_FIXUP (from
the argument tables clattn.signatures.MERGE_PAIR and MERGE_VARLEN).

clattn_merge_pair   in place: v, s <- merge(v, s, v_other, s_other); v, s : [N, H(, D)]
clattn_merge_varlen out[n], lse[n] <- merge of states [lo, hi) where lo/hi come from
                    indptr (or n*K .. n*K+K when fixed_k >= 0, K = 0 giving empty states); with
                    skip_single, groups of
                    fewer than two states are left alone (split-KV: written directly).

rows : one work-item per (n, h) walks all of D.
tiled: D/VEC work-items per (n, h); in the pairwise merge every work-item of a head
       reads s before a barrier and only tx == 0 writes s after it (the seed's merge
       rewrote s with no barrier: a race).
</%doc>
<%namespace name="c" file="common.clh.mako"/>
<%namespace name="m" file="merge_state.clh.mako"/>
<%! from clattn import kernel_exprs as kx %>\
## PW: pairs of states whose weights the rows merge computes together, lane by lane
<% PW = 8 %>\
${c.prelude(poly=STRATEGY == "rows", lanes=(PW,) if STRATEGY == "rows" else ())}
<% NV = D // VEC %>\
typedef ${"half" if VIN == "half" else "float"} in_t;   /* the states merged (MERGE_VARLEN's vin) */

/* a pair merge of float<V> lanes (V = 1: float, the tiled merge's; PW: the rows merge's,
   names suffixed _V): normalised weights (wa, wb) of the two states and the merged lse */
<% V = PW if STRATEGY == "rows" else 1; T = "float" if V == 1 else "float%d" % V; S = "" if V == 1 else "_%d" % V %>\
inline void clattn_pair${S}(const ${T} s, const ${T} so, ${T}* wa, ${T}* wb, ${T}* lse)
{
    const ${T} mx = clattn_max_nan${S}(s, so);
    const ${T} a = clattn_state_weight${S}(s, mx), bb = clattn_state_weight${S}(so, mx);
    const ${T} t = a + bb;
    const ${T} inv = clattn_state_inv${S}(t);
    *wa = a * inv;
    *wb = bb * inv;
    *lse = clattn_state_lse${S}(mx, t);
}

${m.split_dead(VIN, NATIVE_HALF)}

% if STRATEGY == "rows":
${c.raw_loads(VEC)}
% if NATIVE_HALF:
typedef ${"half" if VEC == 1 else "half%d" % VEC} __attribute__((aligned(2))) ldn_t;
% endif
<%
FV = kx.vtype("float", VEC)
def rload(ptr, dt):
    """A vector of storage dtype dt at ptr, as float, with no library call."""
    return kx.raw_load(ptr, VEC, dt, NATIVE_HALF, by_dtype=True)
def rstore(val, ptr):
    return kx.raw_store(val, ptr, VEC, DTYPE, NATIVE_HALF)
%>\
/* CPU form: each work-item walks one contiguous range of (state, head) rows (work-groups
   of one work-item: no implicit work-item loop; a core streams its range in order, which
   the hardware prefetcher follows), head_dim unrolled into registers */
__kernel void clattn_merge_pair(${PAIR_SIGNATURE})
{
    ${PAIR_FIXUP}
    const int per = (NH + (int)get_global_size(0) - 1) / (int)get_global_size(0);
    const int nh_end = min(NH, ((int)get_global_id(0) + 1) * per);
    /* the weights of ${PW} rows at a time, lane by lane (the state math's exp2 and log2 are
       the longest chains of a row); rows past the range repeat its last */
    for (int nh0 = (int)get_global_id(0) * per; nh0 < nh_end; nh0 += ${PW}) {
        const int cnt = min(${PW}, nh_end - nh0);
        float sa[${PW}], sb[${PW}], wx[${PW}], wy[${PW}], wz[${PW}];
        for (int j = 0; j < ${PW}; ++j) {
            const int k = nh0 + min(j, cnt - 1);
            sa[j] = s[k];
            sb[j] = so[k];
        }
        {
            float${PW} wa, wb, z;
            clattn_pair_${PW}(vload${PW}(0, sa), vload${PW}(0, sb), &wa, &wb, &z);
            vstore${PW}(wa, 0, wx);
            vstore${PW}(wb, 0, wy);
            vstore${PW}(z, 0, wz);
        }
        for (int j = 0; j < cnt; ++j) {
            const int nh = nh0 + j;
            __global st_t* vp = v + (ulong)nh * ${D};
            const __global st_t* op = vo + (ulong)nh * ${D};
% for i in range(NV):
            {
                const ${FV} x = (sa[j] == -INFINITY ? (${FV})(0.0f) : ${rload("vp + %d" % (i * VEC), DTYPE)} * wx[j]) +
                                (sb[j] == -INFINITY ? (${FV})(0.0f) : ${rload("op + %d" % (i * VEC), DTYPE)} * wy[j]);
                ${rstore("x", "vp + %d" % (i * VEC))}
            }
% endfor
            s[nh] = wz[j];
        }
    }
}

__kernel void clattn_merge_varlen(${VARLEN_SIGNATURE})
{
    ${VARLEN_FIXUP}
    const int per = (N * H + (int)get_global_size(0) - 1) / (int)get_global_size(0);
    const int nh_end = min(N * H, ((int)get_global_id(0) + 1) * per);
    for (int nh = (int)get_global_id(0) * per; nh < nh_end; ++nh) {
        const int n = nh / H, h = nh % H;
        int lo = fixed_k >= 0 ? n * fixed_k : indptr[n];
        int hi = fixed_k >= 0 ? lo + fixed_k : indptr[n + 1];
        lo = lo < 0 ? 0 : (lo > n_states ? n_states : lo);
        hi = hi < lo ? lo : (hi > n_states ? n_states : hi);
        if (skip_single && hi - lo < 2) continue;
${m.varlen_rows("vin", "sv", "out", "lse", "n", "h", "H", "lo", "hi", "skip_single", VEC, VIN, SINKS)}
    }
}
% else:
__kernel __attribute__((reqd_work_group_size(${NV}, ${MH}, 1)))
void clattn_merge_pair(${PAIR_SIGNATURE})
{
    const int tx = get_local_id(0);
    const int nh = get_global_id(1);
    ${PAIR_FIXUP}
    float a = 0.0f, bb = 0.0f;
    if (nh < NH) { a = s[nh]; bb = so[nh]; }
    barrier(CLK_GLOBAL_MEM_FENCE);   /* every reader of s[nh] is done before it is rewritten */
    if (nh >= NH) return;
    float wa, wb, z;
    clattn_pair(a, bb, &wa, &wb, &z);
    __global st_t* vp = v + (ulong)nh * ${D} + tx * ${VEC};
    const ${c.fv(VEC)} zero = 0.0f;
    const ${c.fv(VEC)} x = (a == -INFINITY ? zero : ${c.loadv(VEC, "vp")} * wa) +
                           (bb == -INFINITY ? zero : ${c.loadv(VEC, "vo + (ulong)nh * %d + tx * %d" % (D, VEC))} * wb);
    ${c.storev(VEC, "x", "vp")}
    if (tx == 0) s[nh] = z;
}

__kernel __attribute__((reqd_work_group_size(${NV}, ${MH}, 1)))
void clattn_merge_varlen(${VARLEN_SIGNATURE})
{
    const int tx = get_local_id(0);
    const int nh = get_global_id(1);
    if (nh >= N * H) return;
    const int n = nh / H, h = nh % H;
    ${VARLEN_FIXUP}
    int lo, hi;
    if (fixed_k >= 0) { lo = n * fixed_k; hi = lo + fixed_k; }
    else { lo = indptr[n]; hi = indptr[n + 1]; }
    lo = clamp(lo, 0, n_states); hi = clamp(hi, lo, n_states);
    if (skip_single && hi - lo < 2) return;
${m.varlen_tiled("vin", "sv", "out", "lse", "n", "h", "H", "lo", "hi", "skip_single", "tx", VEC, VIN, SINKS)}
}
% endif
