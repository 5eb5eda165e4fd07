<%doc>
clattn paged-KV decode attention, "rows" strategy (CPU drivers): one work-item per
(sequence b, KV head x GDZ head slices, partition p); global (B, HKV x GDZ, NP), local
(1, 1, 1). Blocks of TILE rows; private accumulators for the GH = ceil(G / GDZ) query
heads of the work-item's head slice, every loop over head_dim chunks (NV = D / VEC of q
and K, NVV = DV / VEC of V and out) and heads unrolled, so a CPU compiler keeps them in
registers. The last slice's heads past G compute a copy of head G - 1 and store nothing.
The semantics are docs/contract.md's.

Template parameters (clattn.codegen.render_decode, from clattn.fit.DecodeGeometry):
  D, DV, HQO, HKV, G, PS  head_dim (q, K), head_dim_v (V, out), query heads, KV heads,
                       group size, page size
  ROT, ROPE            rotary dims; their pairing (clattn.kernel_exprs.RopePairs)
  SLIDING, SOFTCAP     window + sinks compiled in; soft-cap value or None
  DTYPE, NATIVE_HALF   storage type; convert half vectors natively (cl_khr_fp16)
  DENORMS              the device keeps f32 subnormals (cheaper exact f16 conversion)
  GDZ, GH              head slices per KV head (clattn.fit.rows_head_slices); query heads
                       per slice (clattn.fit.slice_heads)
  VEC, TILE            floats per vector load; rows scored per block, as TILE / W
                       vectors of W = min(TILE, VEC) lanes (so no vector is wider than
                       the loads, which the compiler builds)
  VEC_ROPE             keys rotated VEC lanes at a time (else through a private row)
  V_CHUNKS             chunks of V accumulated per pass over a block's rows
  PREFETCH             blocks ahead whose K/V rows are prefetched (0: none; clang's
                       __builtin_prefetch, where clattn.compiler_probe found it works)
  STORAGE_HALF         f16 converted through clang's __fp16 (common.clh.mako)
  FUSED                the append of a one-token step fused in (decode_common's
                       fused_append; clattn.signatures.DECODE_APPEND; GDZ == 1)
  SINKS                the learned-sink epilogue compiled in (built only for calls that
                       pass sink_logits: without it a CPU compiler keeps its best code)
  FOLD                 the split merge folded in: of a split sequence's partitions, the
                       last to finish merges its states (merge_state.clh.mako's rows
                       merge, clattn_merge_varlen's arithmetic) of the slice's heads
                       into out/lse, counting on counters[b * HKV * GDZ + global id 1]
  SIGNATURE, FIXUP     parameter list and pointer fix-up from clattn.signatures.DECODE
Every index read from the page table is clamped: no input makes the kernel read or
write out of bounds (counters: the host sizes it for the launch's batch, B x HKV x GDZ).
</%doc>
<%namespace name="c" file="common.clh.mako"/>
<%namespace name="d" file="decode_common.clh.mako"/>
<%namespace name="m" file="merge_state.clh.mako"/>
<%! from clattn import kernel_exprs as kx %>\
${c.prelude(poly=True)}
${d.setup()}
<% NV, NVV = D // VEC, DV // VEC %>\
## the query head of slot g of the slice (a padded slot of the last slice: head G - 1)
<%def name="head(g)">kvh * ${G} + ${("min(g0 + %d, %d)" % (g, G - 1)) if GDZ > 1 else g}</%def>\
## slot g holds one of the slice's heads (a padded slot stores nothing)
<%def name="real(g)">${"g0 + %d < %d" % (g, G) if G % GDZ else "1"}</%def>\
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
<% x, y = ROPE.dims("i") %>\
                const float a = ${f}[${x}], bb = ${f}[${y}];
                ${f}[${x}] = (a * cs - bb * sn) * rope_att;
                ${f}[${y}] = (bb * cs + a * sn) * rope_att;
            }
        }
</%def>
## Straight-line code: every loop over head_dim chunks (NV) and group heads (G) is
## unrolled here, so the accumulators are plain variables a CPU compiler keeps in
## registers; the loads are unaligned vector loads through a typedef (no vload
## library calls, which some CPU drivers do not inline). Quantized kinds: a block's
## scale multiplies its partial dot product (K) or the weight (V) once, not every value:
## CPB chunks of V values per block of 32. Quantized keys are scaled chunk by chunk
## instead (KDQ) where that takes fewer multiplies: NV per row against GH x NB.
<%
V, HALF, CPB, NB, NBV = VEC, ROT // 2, max(32 // VEC, 1), D // 32, DV // 32
FV, UI = kx.vtype("float", V), kx.vtype("uint", V)
NRV = ROPE.vectors(V) if VEC_ROPE else 0   # rotated vectors
KQ, VQ = KFMT in kx.QUANTIZED, VFMT in kx.QUANTIZED
KDQ = KQ and NV < GH * NB
%>\
${c.raw_loads(V)}
${d.q4_helpers()}
% if NATIVE_HALF and DTYPE == "half":
typedef ${"half" if V == 1 else "half%d" % V} __attribute__((aligned(2))) ldn_t;
% endif


<%
W = min(TILE, VEC)   # lanes of a score vector: a block is scored NH vectors at a time
NH = TILE // W
FT, IT = kx.vtype("float", W), kx.vtype("int", W)
def ld(ptr):
    return kx.raw_load(ptr, V, DTYPE, NATIVE_HALF)
def lane(kind, i, name, sname=None, scale=None):
    """float<V> of head_dim chunk i of the K (0) / V (1) row at `name`, any format."""
    return kx.lanes(kind, V, name, i * V, KFMT, VFMT, BYTE_POOL, True,
                    lambda vec, ptr: ld(ptr), sname, scale)
%>\
% if W > 1:
${c.exp2_poly(W)}
% endif

__kernel void clattn_decode(${SIGNATURE})
{
    const int b = get_global_id(0);
% if GDZ > 1:
    const int kvh = get_global_id(1) / ${GDZ};
    const int g0 = (get_global_id(1) % ${GDZ}) * ${GH};   /* first head of the slice */
% else:
    const int kvh = get_global_id(1);
% endif
    const int part = get_global_id(2);
    SEQ_SETUP
    if (!valid_part) return;
% if FUSED:
${d.fused_append("part == nparts_b - 1", [i * VEC for i in range(D // VEC)], VEC)}
% endif

    /* q of the slice's heads: rotated, scaled, in registers */
% for g in range(GH):
%   for i in range(NV):
    ${FV} q${g}_${i};
%   endfor
% endfor
    {
        const float qscale = sm_scale${" * CLATTN_LOG2E" if SOFTCAP is None else ""};
        float f[${D}];
% for g in range(GH):
        {
            const __global st_t* qp = q + ((ulong)b * ${HQO} + ${head(g)}) * ${D};
## f16: vector loads (PoCL calls vload_half per element); f32: the plain loop (vector
## loads measured 6% slower at Gemma-2's shape on Intel's runtime)
%   if DTYPE == "half":
%     for i in range(NV):
            ${("f[%d] = %s;" % (i, ld("qp + %d" % i))) if V == 1 else ("vstore%d(%s, 0, f + %d);" % (V, ld("qp + %d" % (i * V)), i * V))}
%     endfor
%   else:
            for (int i = 0; i < ${D}; ++i) f[i] = qp[i];
%   endif
            if (rotary_mode) {
${rotate_row("f", "q_pos[b]")}
            }
%   for i in range(NV):
            q${g}_${i} = ${("f[%d]" % i) if V == 1 else "vload%d(0, f + %d)" % (V, i * V)} * qscale;
%   endfor
        }
% endfor
    }
% for g in range(GH):
    /* running max, the exponent base it gives, and the sums of the weights lane by lane
       (one sum per row of a block, added up after the loop) */
    float m${g} = -INFINITY, base${g} = 0.0f;
    ${FT} lv${g} = 0.0f;
%   for i in range(NVV):
    ${FV} a${g}_${i} = 0.0f;
%   endfor
% endfor
    const int kpos0 = rotary_mode ? k_pos_offset[b] : 0;
    const __global float2* tt = rope_turns + rope_table * ${HALF};
% if VEC_ROPE:
    /* RoPE of the keys, vectorised: cos/sin of the block start (per block) composed with
       those of 0..TILE-1 positions (once) */
    ${FV} cjv[${TILE}][${NRV}], sjv[${TILE}][${NRV}], cbv[${NRV}], sbv[${NRV}];
    if (rotary_mode) {
        for (int j = 0; j < ${TILE}; ++j)
            for (int cc = 0; cc < ${NRV}; ++cc)
                for (int e = 0; e < ${V}; ++e) {
                    const int fi = ${ROPE.vector_lane_freq("cc", "e", V)};
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
% if PREFETCH:
        /* the rows PREFETCH blocks ahead, one per row of this block (a burst of a whole
           block's lines at once fills the miss queues and measured slower) */
        int pf_pg[${TILE}], pf_sl[${TILE}];
        const int pf_n = clamp(r_hi - r0 - ${PREFETCH * TILE}, 0, ${TILE});
        if (pf_n > 0)
${d.block_pages("(r0 + %d)" % (PREFETCH * TILE), "pf_n", "pf_pg", "pf_sl")}
% endif
        int pg[${TILE}], sl[${TILE}];
${d.block_pages("r0", "n", "pg", "sl")}
        /* per head: each row's partial dot products (summed across rows below, one
           tree for the whole block) and then the block's weights */
% for g in range(GH):
        float s${g}[${TILE}] __attribute__((aligned(64)));
        ${FV} tv${g}[${TILE}];
% endfor
        if (n < ${TILE}) {
            for (int j = n; j < ${TILE}; ++j) {
% for g in range(GH):
                tv${g}[j] = 0.0f;
% endfor
            }
        }
        if (rotary_mode) {
% if VEC_ROPE:
            for (int cc = 0; cc < ${NRV}; ++cc)
                for (int e = 0; e < ${V}; ++e) {
                    const int fi = ${ROPE.vector_lane_freq("cc", "e", V)};
                    float cs;
                    ((float*)&sbv[cc])[e] = sincos(clattn_rope_angle(kpos0 + r0, tt[fi]), &cs);
                    ((float*)&cbv[cc])[e] = cs;
                }
% else:
            for (int i = 0; i < ${HALF}; ++i) sb[i] = sincos(clattn_rope_angle(kpos0 + r0, tt[i]), &cb[i]);
% endif
        }
        for (int j = 0; j < n; ++j) {
% if PREFETCH:
            if (j < pf_n)
${d.prefetch_row("pf_pg[j]", "pf_sl[j]")}
% endif
            ${d.page_ptr(0, "kp", "pg[j]", "sl[j]")}
% if KQ:
            if (!rotary_mode) {   /* scores from the codes, one scale per block */
%   for bb in range(NB):
                const float ks${bb} = clattn_h2f_1(kp_s[${bb}]);
%   endfor
%   for i in range(NV):
                const ${FV} c${i} = ${lane(0, i, "kp", scale="1.0f")}${(" * ks%d" % (i // CPB)) if KDQ else ""};
%   endfor
%   for g in range(GH):
%     if KDQ:
                ${FV} t${g} = q${g}_0 * c0;
%       for i in range(1, NV):
                t${g} += q${g}_${i} * c${i};
%       endfor
                tv${g}[j] = t${g};
%     else:
                {
                    ${FV} t;
%     for bb in range(NB):
                    {
                        ${FV} tb = q${g}_${bb * CPB} * c${bb * CPB};
%       for i in range(bb * CPB + 1, (bb + 1) * CPB):
                        tb += q${g}_${i} * c${i};
%       endfor
                        ${"t = tb * ks0;" if bb == 0 else "t += tb * ks%d;" % bb}
                    }
%     endfor
                    tv${g}[j] = t;
                }
%     endif
%   endfor
                continue;
            }
% endif
            if (!rotary_mode) {   /* chunk by chunk: each chunk of k dies after its G uses */
%   for i in range(NV):
                const ${FV} kc${i} = ${lane(0, i, "kp")};
%     for g in range(GH):
                ${("%s t%d = q%d_0 * kc0;" % (FV, g, g)) if i == 0 else ("t%d += q%d_%d * kc%d;" % (g, g, i, i))}
%     endfor
%   endfor
%   for g in range(GH):
                tv${g}[j] = t${g};
%   endfor
                continue;
            }
% for i in range(NV):
            ${FV} k${i} = ${lane(0, i, "kp")};
% endfor
            {
% if VEC_ROPE:
%   for cc in range(NRV):
                {
                    const ${FV} cs = cbv[${cc}] * cjv[j][${cc}] - sbv[${cc}] * sjv[j][${cc}];
                    const ${FV} sn = sbv[${cc}] * cjv[j][${cc}] + cbv[${cc}] * sjv[j][${cc}];
%     for line in ROPE.rotate_vector("k", cc, V, FV):
                    ${line}
%     endfor
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
% for g in range(GH):
            {
                ${FV} t = q${g}_0 * k0;
%   for i in range(1, NV):
                t += q${g}_${i} * k${i};
%   endfor
                tv${g}[j] = t;
            }
% endfor
        }
% for g in range(GH):
        {
%   for h in range(NH):
<% bs_lines, bs = kx.block_sums("tv%d" % g, "bs%d_%d" % (g, h), h * W, V, W) %>\
%     for line in bs_lines:
            ${line}
%     endfor
            ${FT} sv${h} = ${kx.score(bs, SOFTCAP)};
%     if TILE > 1:
            sv${h} = n < ${(h + 1) * W} ? select(sv${h}, (${FT})(-INFINITY), (${IT})(${", ".join(str(h * W + j) for j in range(W))}) >= n) : sv${h};
%     endif
%   endfor
            /* the max is looked for only when a row beats it (rare after the first
               blocks): otherwise the base stands, alpha is exactly 1, and the block's
               weights only add to the sums */
            {
                const ${IT} up = ${" | ".join("(sv%d > (%s)(m%d))" % (h, FT, g) for h in range(NH))};
                if (${kx.hred_or("up", W)}) {
                    float bm = ${kx.hred("sv0", "max", W)};
%   for h in range(1, NH):
                    { const float bh = ${kx.hred("sv%d" % h, "max", W)}; bm = bh > bm ? bh : bm; }
%   endfor
                    const float mx = bm > m${g} ? bm : m${g};
                    const float nb = clattn_exp_base(mx);
                    if (mx > m${g}) {
                        const float alpha = clattn_exp2_1(m${g} - nb);
%   for i in range(NVV):
                        a${g}_${i} *= alpha;
%   endfor
                        lv${g} *= alpha;
                    }
                    base${g} = nb;
                    m${g} = mx;
                }
            }
%   for h in range(NH):
            {
                const ${FT} pv = clattn_exp2_${W}(sv${h} - base${g});
                *(${FT}*)(s${g} + ${h * W}) = pv;
                lv${g} += pv;
            }
%   endfor
        }
% endfor
        /* V: V_CHUNKS head_dim chunks at a time over the block's rows, so their
           V_CHUNKS x G accumulators stay in registers and each weight is loaded once
           per V_CHUNKS chunks */
        const __global kv_t* vrow[${TILE}];
% if VFMT in ("q8_0", "q4_0"):
        const __global ushort* vrow_s[${TILE}];
% endif
        for (int j = 0; j < n; ++j) {
            ${d.page_ptr(1, "vp", "pg[j]", "sl[j]")}
            vrow[j] = vp;
% if VFMT in ("q8_0", "q4_0"):
            vrow_s[j] = vp_s;
% endif
        }
% if VQ:
        /* quantized values, block by block: the weights times the block's scales, W rows
           at a time (rows past n: scale 0, weight 0), then the codes, VCH chunks of the
           block per pass over the rows */
<% VCH = max(k for k in range(1, CPB + 1) if CPB % k == 0 and k <= V_CHUNKS) %>
%   for bb in range(NBV):
        {
            float vsc[${TILE}] __attribute__((aligned(64)));
            for (int j = 0; j < ${TILE}; ++j)
                vsc[j] = j < n ? clattn_h2f_1(vrow_s[j][${bb}]) : 0.0f;
%     for g in range(GH):
            float w${g}[${TILE}] __attribute__((aligned(64)));
%       for h in range(NH):
            ${kx.private_store("%s * %s" % (kx.private_load("s%d + %d" % (g, h * W), FT), kx.private_load("vsc + %d" % (h * W), FT)), "w%d + %d" % (g, h * W), FT)}
%       endfor
%     endfor
%     for i0 in range(bb * CPB, (bb + 1) * CPB, VCH):
            for (int j = 0; j < n; ++j) {
%       for i in range(i0, i0 + VCH):
                const ${FV} v${i - i0} = ${lane(1, i, "vrow[j]", scale="1.0f")};
%       endfor
%       for g in range(GH):
                {
                    const float p = w${g}[j];
%         for i in range(i0, i0 + VCH):
                    a${g}_${i} += p * v${i - i0};
%         endfor
                }
%       endfor
            }
%     endfor
        }
%   endfor
% else:
% for i0 in range(0, NVV, V_CHUNKS):
        for (int j = 0; j < n; ++j) {
%   for i in range(i0, i0 + V_CHUNKS):
            const ${FV} v${i - i0} = ${lane(1, i, "vrow[j]", "vrow_s[j]")};
%   endfor
%   for g in range(GH):
            {
                const float p = s${g}[j];
%     for i in range(i0, i0 + V_CHUNKS):
                a${g}_${i} += p * v${i - i0};
%     endfor
            }
%   endfor
        }
% endfor
% endif
    }

% for g in range(GH):
    if (${real(g)}) {
        const int h = ${head(g)};
        /* a split-KV partition whose rows all scored -inf is empty to the merge (lse
           -inf, weight 0) and marks its output NaN: the merge breaks the sequence when
           every partition is empty and one is so marked */
        float l${g} = ${kx.hred("lv%d" % g, "+", W)};
        /* the learned sink joins the final state only (a partition stays sink-free: the
           merge adds it once) */
        ${c.add_sink("m%d" % g, "l%d" % g, "CLATTN_SINK(direct && use_sinks, h)", SINKS)}
        const float inv = clattn_part_inv(l${g}, r_hi > r_lo) * alpha;
        const float st = direct ? clattn_part_lse(m${g}, l${g}, r_hi > r_lo)
                                : clattn_state_lse(m${g}, l${g});
        if (direct) {
            __global st_t* op = out + ((ulong)b * ${HQO} + h) * ${DV};
%   for i in range(NVV):
            ${kx.raw_store("a%d_%d * inv" % (g, i), "op + %d" % (i * V), V, DTYPE, NATIVE_HALF)}
%   endfor
            lse[(ulong)b * ${HQO} + h] = st;
        } else {
            __global float* op = ws_o + ((ulong)ws_at * ${HQO} + h) * ${DV};
%   for i in range(NVV):
            ${("op[%d] = a%d_%d * inv;" % (i, g, i)) if V == 1 else ("vstore%d(a%d_%d * inv, 0, op + %d);" % (V, g, i, i * V))}
%   endfor
            ws_s[(ulong)ws_at * ${HQO} + h] = st;
        }
    }
% endfor
% if FOLD:
    if (!direct) {
        /* the fold: this partition's states are stored; fenced, it counts in on the
           counter of its sequence's head slice, and the last partition to count in (it
           reads count - 1) resets the counter for the next launch and merges the slice's
           states of every partition, read after a second fence (an atomic orders them after the
           others' stores) */
        mem_fence(CLK_GLOBAL_MEM_FENCE);
        volatile __global int* ctr = counters + (ulong)b * ${HKV * GDZ} + get_global_id(1);
        if (atomic_inc(ctr) == clattn_fold_parts(part_indptr[b], nparts_b, (int)get_global_size(2), n_ws) - 1) {
            atomic_xchg(ctr, 0);
            mem_fence(CLK_GLOBAL_MEM_FENCE);
            const int lo = clamp(part_indptr[b], 0, n_ws);
            const int hi = clamp(part_indptr[b + 1], lo, n_ws);
            if (hi - lo >= 2) {   /* clattn_merge_varlen's skip_single */
%   for g in range(GH):
                if (${real(g)}) {
                    const int h = ${head(g)};
${m.varlen_rows("ws_o", "ws_s", "out", "lse", "b", "h", HQO, "lo", "hi", "1", VEC, "float", SINKS)}
                }
%   endfor
            }
        }
    }
% endif
}
