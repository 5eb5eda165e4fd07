<%doc>
clattn paged-KV decode attention, "rows" strategy (CPU drivers): one work-item per
(sequence b, KV head, partition p); global (B, HKV, NP), local (1, 1, 1). Blocks of TILE
rows; private accumulators for all G query heads of the KV head, every loop over
head_dim chunks (NV = D / VEC) and heads unrolled, so a CPU compiler keeps them in
registers. The semantics are docs/contract.md's.

Template parameters (clattn.codegen.render_decode, from clattn.fit.DecodeGeometry):
  D, HQO, HKV, G, PS   head_dim, query heads, KV heads, group size, page size
  ROT, INTERLEAVED     rotary dims; GPT-J pairs (2i, 2i+1) instead of halves (i, i + ROT/2)
  SLIDING, SOFTCAP     window + sinks compiled in; soft-cap value or None
  DTYPE, NATIVE_HALF   storage type; convert half vectors natively (cl_khr_fp16)
  DENORMS              the device keeps f32 subnormals (cheaper exact f16 conversion)
  VEC, TILE            floats per vector load; rows scored per block, as TILE / W
                       vectors of W = min(TILE, VEC) lanes (so no vector is wider than
                       the loads, which the compiler builds)
  VEC_ROPE             keys rotated VEC lanes at a time (else through a private row)
  V_CHUNKS             head_dim chunks of V accumulated per pass over a block's rows
  PREFETCH             blocks ahead whose K/V rows are prefetched (0: none; clang's
                       __builtin_prefetch, where clattn.compiler_probe found it works)
  STORAGE_HALF         f16 converted through clang's __fp16 (common.clh.mako)
  SIGNATURE, FIXUP     parameter list and pointer fix-up from clattn.signatures.DECODE
Every index read from the page table is clamped: no input makes the kernel read or
write out of bounds.
</%doc>
<%namespace name="c" file="common.clh.mako"/>
<%namespace name="d" file="decode_common.clh.mako"/>
${c.prelude(poly=True)}
${d.setup()}
<% NV = D // VEC %>\
<%
def score(x):
    return d.attr.score(x, SOFTCAP)
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
NRV = (HALF // V if not INTERLEAVED else ROT // V) if VEC_ROPE else 0  # rotated vectors
SWAP = "" if V == 1 else ".s" + "".join("%x" % (i ^ 1) for i in range(V))
SIGN = "(%s)(%s)" % (FV, ", ".join("-1.0f" if i % 2 == 0 else "1.0f" for i in range(V))) if V > 1 else "1.0f"
def lane(kind, i, name, sname=None, scale=None):
    """float<V> of head_dim chunk i of the K (0) / V (1) row at `name`, any format."""
    return d.attr.lanes(kind, V, name, i * V, KFMT, VFMT, BYTE_POOL, True,
                        lambda vec, ptr: ld(ptr), sname, scale)
# quantized kinds: a block's scale multiplies its partial dot product (K) or the weight
# (V) once, not every value: CPB chunks of V values per block of 32
KQ = KFMT in ("q8_0", "q4_0")
VQ = VFMT in ("q8_0", "q4_0")
CPB = max(32 // V, 1)
NB = D // 32
def ld(ptr):
    if DTYPE == "float":
        return "*(const __global ld_t*)(%s)" % ptr
    if NATIVE_HALF:  # the device converts half vectors itself (e.g. x86 F16C)
        return "convert_%s(*(const __global ldn_t*)(%s))" % (FV, ptr)
    return "clattn_h2f(*(const __global ld_t*)(%s))" % ptr
%>\
${c.raw_loads(V)}
${d.q4_helpers()}
% if NATIVE_HALF and DTYPE == "half":
typedef ${"half" if V == 1 else "half%d" % V} __attribute__((aligned(2))) ldn_t;
% endif


<%
W = min(TILE, VEC)   # lanes of a score vector: a block is scored NH vectors at a time
NH = TILE // W
FT = "float" if W == 1 else "float%d" % W
IT = "int" if W == 1 else "int%d" % W
def block_sums(arr, name, r0):
    """(statements, expression): the float<W> of the sums of arr[r0..r0+W-1]
    (float<VEC> each), lane j = row r0 + j. The vectors are folded to w = min(VEC, W)
    lanes, then each group of w is summed together by pairing, each level halving the
    lanes per row (lanes i < w/2 of pair(a, b) are a's lanes 2i + 2i+1, the rest b's;
    for w = 8 the pairing keeps to each half of four lanes, as x86's hadd does, and the
    halves are added last: 10-20% faster decode on both CPU drivers), and the groups'
    results joined. Component swizzles only (no .even/.odd, nor a vector built from two
    halves: Oclgrind's uninitialised-value check crashes on both); temporaries named
    name_*."""
    w = V
    terms = ["%s[%d]" % (arr, r0 + j) for j in range(W)]
    while w > W:
        terms = ["((%s).lo + (%s).hi)" % (t, t) for t in terms]
        w //= 2
    if w == 1:
        return [], (terms[0] if W == 1 else "(%s)(%s)" % (FT, ", ".join(terms)))
    fw = "float%d" % w
    lines, groups = [], []
    for g0 in range(0, W, w):
        level = []
        for k, t in enumerate(terms[g0:g0 + w]):
            level.append("%s_%d_%d" % (name, g0, k))
            lines.append("const %s %s = %s;" % (fw, level[-1], t))
        depth = 0
        while len(level) > (2 if w == 8 else 1):
            depth += 1
            nxt = []
            for k, (a, b) in enumerate(zip(level[0::2], level[1::2])):
                nxt.append("%s_%d_%d_%d" % (name, g0, depth, k))
                if w == 8:   # within each half: a's pair sums then b's (x86 hadd's order)
                    ev, od = ([("%s.s%x" % (v, h + 2 * i + o)) for h in (0, 4) for v in (a, b)
                               for i in range(2)] for o in (0, 1))
                    lines.append("const %s %s = (%s)(%s) + (%s)(%s);" % (
                        fw, nxt[-1], fw, ", ".join(ev), fw, ", ".join(od)))
                else:
                    lines.append("const %s %s = (%s)(%s);" % (fw, nxt[-1], fw, ", ".join(
                        "%s.s%x + %s.s%x" % (v, 2 * i, v, 2 * i + 1) for v in (a, b)
                        for i in range(w // 2))))
            level = nxt
        if w == 8:   # halves hold rows 0-3 and 4-7 of each: add them across
            a, b = level
            level = ["%s_%d_x" % (name, g0)]
            lines.append("const float8 %s = (float8)(%s);" % (level[0], ", ".join(
                "%s.s%x + %s.s%x" % (v, i, v, i + 4) for v in (a, b) for i in range(4))))
        groups.append(level[0])
    return lines, (groups[0] if len(groups) == 1 else "(%s)(%s)" % (FT, ", ".join(groups)))
def hred_or(v, n):
    """Whether any lane of an int<n> expression is nonzero (a tree of .lo | .hi)."""
    while n > 1:
        v = "((%s).lo | (%s).hi)" % (v, v)
        n //= 2
    return v
def hred(v, op, n):
    """Reduce a float<n> expression to a float with a tree of .lo/.hi halves."""
    while n > 1:
        a, b = "(%s).lo" % v, "(%s).hi" % v
        # max() is undefined for infinities in OpenCL C: compare and select instead
        v = ("(%s + %s)" % (a, b)) if op == "+" else ("(%s > %s ? %s : %s)" % (a, b, a, b))
        n //= 2
    return v
%>\
% if W > 1:
${c.exp2_poly(W)}
% endif

__kernel void clattn_decode(${SIGNATURE})
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
% for g in range(G):
    /* running max, the exponent base it gives, and the sums of the weights lane by lane
       (one sum per row of a block, added up after the loop) */
    float m${g} = -INFINITY, base${g} = 0.0f;
    ${FT} lv${g} = 0.0f;
%   for i in range(NV):
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
% for g in range(G):
        float s${g}[${TILE}] __attribute__((aligned(64)));
        ${FV} tv${g}[${TILE}];
% endfor
        if (n < ${TILE}) {
            for (int j = n; j < ${TILE}; ++j) {
% for g in range(G):
                tv${g}[j] = 0.0f;
% endfor
            }
        }
        if (rotary_mode) {
% if VEC_ROPE:
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
                const ${FV} c${i} = ${lane(0, i, "kp", scale="1.0f")};
%   endfor
%   for g in range(G):
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
%   endfor
                continue;
            }
% endif
            if (!rotary_mode) {   /* chunk by chunk: each chunk of k dies after its G uses */
%   for i in range(NV):
                const ${FV} kc${i} = ${lane(0, i, "kp")};
%     for g in range(G):
                ${("%s t%d = q%d_0 * kc0;" % (FV, g, g)) if i == 0 else ("t%d += q%d_%d * kc%d;" % (g, g, i, i))}
%     endfor
%   endfor
%   for g in range(G):
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
                tv${g}[j] = t;
            }
% endfor
        }
% for g in range(G):
        {
%   for h in range(NH):
<% bs_lines, bs = block_sums("tv%d" % g, "bs%d_%d" % (g, h), h * W) %>\
%     for line in bs_lines:
            ${line}
%     endfor
            ${FT} sv${h} = ${score(bs)};
%     if TILE > 1:
            sv${h} = n < ${(h + 1) * W} ? select(sv${h}, (${FT})(-INFINITY), (${IT})(${", ".join(str(h * W + j) for j in range(W))}) >= n) : sv${h};
%     endif
%   endfor
            /* the max is looked for only when a row beats it (rare after the first
               blocks): otherwise the base stands, alpha is exactly 1, and the block's
               weights only add to the sums */
            {
                const ${IT} up = ${" | ".join("(sv%d > (%s)(m%d))" % (h, FT, g) for h in range(NH))};
                if (${hred_or("up", W)}) {
                    float bm = ${hred("sv0", "max", W)};
%   for h in range(1, NH):
                    { const float bh = ${hred("sv%d" % h, "max", W)}; bm = bh > bm ? bh : bm; }
%   endfor
                    const float mx = bm > m${g} ? bm : m${g};
                    const float nb = clattn_exp_base(mx);
                    if (mx > m${g}) {
                        const float alpha = clattn_exp2_1(m${g} - nb);
%   for i in range(NV):
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
        /* quantized values: per block, the weight times the block's scale, then the codes
           (V_CHUNKS chunks of the block at a time, as below) */
<% VCH = max(k for k in range(1, CPB + 1) if CPB % k == 0 and k <= V_CHUNKS) %>
%   for bb in range(NB):
        {
            float vsc[${TILE}];
            for (int j = 0; j < n; ++j)
                vsc[j] = clattn_h2f_1(vrow_s[j][${bb}]);
%     for i0 in range(bb * CPB, (bb + 1) * CPB, VCH):
            for (int j = 0; j < n; ++j) {
%       for i in range(i0, i0 + VCH):
                const ${FV} v${i - i0} = ${lane(1, i, "vrow[j]", scale="1.0f")};
%       endfor
%       for g in range(G):
                {
                    const float p = s${g}[j] * vsc[j];
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
% for i0 in range(0, NV, V_CHUNKS):
        for (int j = 0; j < n; ++j) {
%   for i in range(i0, i0 + V_CHUNKS):
            const ${FV} v${i - i0} = ${lane(1, i, "vrow[j]", "vrow_s[j]")};
%   endfor
%   for g in range(G):
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

% for g in range(G):
    {
        const int h = kvh * ${G} + ${g};
        /* a split-KV partition whose rows all scored -inf is empty to the merge (lse
           -inf, weight 0) and marks its output NaN: the merge breaks the sequence when
           every partition is empty and one is so marked */
        const float l${g} = ${hred("lv%d" % g, "+", W)};
        const float inv = clattn_part_inv(l${g}, r_hi > r_lo);
        const float st = direct ? clattn_part_lse(m${g}, l${g}, r_hi > r_lo)
                                : clattn_state_lse(m${g}, l${g});
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
