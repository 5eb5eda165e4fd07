<%doc>
clattn paged-KV prefill, "rows" strategy (CPU drivers): one work-item per (work unit,
KV head); global (n_units, HKV), local (1, 1). A unit is up to QB consecutive queries of
one sequence; with the G query heads of the KV head that makes QB * G rows (query i,
head g -> row i * G + g), padded to M, a multiple of the vector width. Everything a row
keeps is in private arrays (a CPU core's L1):
  * q transposed, qt[d] = the M rows' element d as NRV vectors, so that scores, the
    causal mask and the online softmax run across rows, VEC rows per vector, with no
    horizontal sums: scores of NK keys x RG row vectors per register tile;
  * the accumulators row-major, acc[r] = head_dim_v as NVV vectors: the values are added
    in register tiles of MV rows x NI vectors, each weight broadcast from memory;
  * keys and values, KB rows per block, converted to f32 (keys rotated) once per block.
The semantics are docs/prefill.md's.

Template parameters (clattn.codegen.render_prefill, from clattn.fit.PrefillGeometry):
  D, DV, HQO, HKV, G, PS  head_dim (q, K), head_dim_v (V, out), query heads, KV heads,
                       group size, page size
  ROT, ROPE            rotary dims; their pairing (clattn.kernel_exprs.RopePairs)
  SLIDING, SOFTCAP     window + sinks compiled in; soft-cap value or None
  DTYPE, NATIVE_HALF   storage type of q and out; native half conversions (cl_khr_fp16)
  DENORMS              the device keeps f32 subnormals (cheaper exact f16 conversion)
  VEC                  floats per vector (along head_dim, and across rows)
  QB, KB               queries per work-item; keys per block
  SIGNATURE, FIXUP     parameter list and pointer fix-up from clattn.signatures.PREFILL
  KFMT, VFMT, ...      the page storage (decode_common.clh.mako)
</%doc>
<%namespace name="c" file="common.clh.mako"/>
<%namespace name="d" file="decode_common.clh.mako"/>
<%namespace name="pc" file="prefill_common.clh.mako"/>
<%! from clattn import kernel_exprs as kx %>\
${c.prelude(poly=True)}
${pc.setup()}
## private vectors go through aligned pointers, q and out through the raw vector loads and
## stores, and selects are written as ?: (vloadN/vstoreN/select and scalar half loads are
## library calls some CPU drivers do not inline: scalar loads of q cost up to 25% of a
## 128-query prefill on Intel's runtime)
<%
assert KB <= 25, "clattn_mask_bits gives a block's bits in one word"
V, NV, NVV = VEC, D // VEC, DV // VEC            # vectors of a q/K row, of a V row
M, NRV, RG, NK, MV, NI = kx.prefill_rows_tiles(QB * G, KB, NVV, V)
FV, IV = kx.vtype("float", V), kx.vtype("int", V)
def lane(kind, i, name):
    """float<V> of head_dim chunk i of the K (0) / V (1) row at `name`, any format."""
    return kx.lanes(kind, V, name, i * V, KFMT, VFMT, BYTE_POOL, True,
                    lambda vec, ptr: kx.raw_load(ptr, V, DTYPE, NATIVE_HALF))
%>\
${c.raw_loads(V)}
${d.q4_helpers()}
% if V > 1:
${c.exp2_poly(V)}
% endif
${pc.basev(V)}
% if NATIVE_HALF and DTYPE == "half":
typedef ${"half" if V == 1 else "half%d" % V} __attribute__((aligned(2))) ldn_t;
% endif

## the value tiles of rows r .. r + MV - 1 over keys 0 .. jend - 1 of the block: MV rows x NI
## head_dim vectors of accumulators scaled by the rows' alpha, each weight broadcast
<%def name="value_tiles(jend, MV, NI, NVV, FV)">\
                for (int e = 0; e < ${NVV}; e += ${NI}) {
% for a in range(MV):
%   for ci in range(NI):
                    ${FV} o${a}_${ci} = acc[r + ${a}][e + ${ci}] * alpha[r + ${a}];
%   endfor
% endfor
                    for (int j = 0; j < ${jend}; ++j) {
% for ci in range(NI):
                        const ${FV} v${ci} = vf[j][e + ${ci}];
% endfor
% for a in range(MV):
                        {
                            const float p = pt[j][r + ${a}];
%   for ci in range(NI):
                            o${a}_${ci} += p * v${ci};
%   endfor
                        }
% endfor
                    }
% for a in range(MV):
%   for ci in range(NI):
                    acc[r + ${a}][e + ${ci}] = o${a}_${ci};
%   endfor
% endfor
                }
</%def>
__kernel void clattn_prefill(${SIGNATURE})
{
    const int u = get_global_id(0);
    const int kvh = get_global_id(1);
    UNIT_SETUP
    if (nq <= 0) return;
    const int rows = nq * ${G};                            /* live rows */
    const int rows_v = (rows + ${MV - 1}) / ${MV} * ${MV};     /* rows the value tiles cover */

    ${FV} qt[${D}][${NRV}];                /* q, transposed: element d of every row */
    ${FV} acc[${M}][${NVV}];               /* accumulators, row-major */
    ${FV} mr[${NRV}], lr[${NRV}];          /* running max and sum of every row */
    ${IV} lim[${NRV}];                     /* last chunk row every row attends; -1: none */
    ${IV} mk[${KB}][${NRV}];               /* the custom mask of the block: -1 kept, 0 not */
    float pt[${KB}][${M}] __attribute__((aligned(64)));   /* weights of the block: key-major */
    float alpha[${M}] __attribute__((aligned(64)));
    ${FV} kf[${KB}][${NV}], vf[${KB}][${NVV}];
    float cs[${ROT // 2}], sn[${ROT // 2}];

    /* q of every row: rotated at its query's position, scaled (log2 units) */
    const float qscale = sm_scale${" * CLATTN_LOG2E" if SOFTCAP is None else ""};
    for (int r = 0; r < ${M}; ++r) {
        const int i = r / ${G};
        float f[${D}] __attribute__((aligned(64)));
        ((int*)lim)[r] = QLIM(i);
        if (i < nq) {
            const __global st_t* qp = q + ((ulong)(qs + i) * ${HQO} + kvh * ${G} + r % ${G}) * ${D};
            for (int e = 0; e < ${NV}; ++e)
                ${kx.private_store(kx.raw_load("qp + e * %d" % V, V, DTYPE, NATIVE_HALF), "f + e * %d" % V, FV)}
            if (rotary_mode) {
                clattn_rope_cs(qpos0 + i, tt, cs, sn);
                clattn_rotate_cs(f, cs, sn, rope_att);
            }
        } else {
            for (int e = 0; e < ${D}; ++e) f[e] = 0.0f;
        }
        for (int e = 0; e < ${D}; ++e) ((float*)qt[e])[r] = f[e] * qscale;
        for (int e = 0; e < ${NVV}; ++e) acc[r][e] = 0.0f;
    }
    for (int v = 0; v < ${NRV}; ++v) {
        mr[v] = -INFINITY;
        lr[v] = 0.0f;
        for (int j = 0; j < ${KB}; ++j) mk[j][v] = -1;
    }
    /* RoPE of the keys: the angle of row r0 + j is angle(r0) + angle(j); those of
       j = 0 .. KB-1 once, those of r0 per block, composed exactly (two rotations) */
    float cj[${KB}][${ROT // 2}], sj[${KB}][${ROT // 2}];
    if (rotary_mode)
        for (int j = 0; j < ${KB}; ++j) clattn_rope_cs(j, tt, cj[j], sj[j]);

    for (int r0 = 0; r0 < r_end; r0 += ${KB}) {
        const int n = min(${KB}, r_end - r0);
        /* the block's keys (rotated) and values as f32; rows past the end are 0 */
        if (rotary_mode) clattn_rope_cs(kpos0 + r0, tt, cs, sn);
        for (int j = 0; j < ${KB}; ++j) {
            if (j < n) {
                ${d.row_ptr(0, "kp", "r0 + j")}
                ${d.row_ptr(1, "vp", "r0 + j")}
% for i in range(NV):
                kf[j][${i}] = ${lane(0, i, "kp")};
% endfor
% for i in range(NVV):
                vf[j][${i}] = ${lane(1, i, "vp")};
% endfor
                if (rotary_mode) {
                    float c2[${ROT // 2}], s2[${ROT // 2}];
                    for (int e = 0; e < ${ROT // 2}; ++e) {
                        c2[e] = cs[e] * cj[j][e] - sn[e] * sj[j][e];
                        s2[e] = sn[e] * cj[j][e] + cs[e] * sj[j][e];
                    }
                    clattn_rotate_cs((float*)kf[j], c2, s2, rope_att);
                }
            } else {
                for (int e = 0; e < ${NV}; ++e) kf[j][e] = 0.0f;
                for (int e = 0; e < ${NVV}; ++e) vf[j][e] = 0.0f;
            }
        }
        /* the custom mask of the block's keys for every live row (one word of bits per
           query); mfull: it keeps them all */
        int mfull = 1;
        if (use_mask) {
            for (int i = 0; i < nq; ++i) {
                const uint w = clattn_mask_bits(mask, mask_bytes, mbit0 + (long)i * chunk + r0);
                for (int j = 0; j < ${KB}; ++j) {
                    const int keep = j < n && ((w >> j) & 1u);
                    mfull &= keep || j >= n;
                    for (int g = 0; g < ${G}; ++g) ((int*)mk[j])[i * ${G} + g] = keep ? -1 : 0;
                }
            }
        }
        /* scores of NK keys x RG row vectors per tile, the masks, the online softmax:
           every row vector at once; a row with no attended key in the block keeps its
           state (r0, the block's first key, is attended iff r0 <= lim). A whole block
           (every live row attends all KB keys) skips the masks: padding rows then carry
           finite scores of q = 0 that no output reads */
        const int whole = mfull && r0 + ${KB - 1} <= QLIM(0);
% for masked in (False, True):
        ${"if (whole) {" if not masked else "} else {"}
        ${FV} bm[${NRV}];
        for (int v = 0; v < ${NRV}; ++v) bm[v] = -INFINITY;
        for (int j = 0; j < ${KB}; j += ${NK})
        for (int g = 0; g < ${NRV}; g += ${RG}) {
%   for k in range(NK):
%     for v in range(RG):
            ${FV} t${k}_${v} = 0.0f;
%     endfor
%   endfor
            for (int e = 0; e < ${D}; ++e) {
%   for v in range(RG):
                const ${FV} q${v} = qt[e][g + ${v}];
%   endfor
%   for k in range(NK):
                {
                    const float kk = ((const float*)kf[j + ${k}])[e];
%     for v in range(RG):
                    t${k}_${v} += kk * q${v};
%     endfor
                }
%   endfor
            }
%   for k in range(NK):
%     for v in range(RG):
            {
%       if masked:
                const ${FV} sv = (${kx.causal_mask("r0 + j + %d" % k, "g + %d" % v, V)} & mk[j + ${k}][g + ${v}]) ? ${kx.score("t%d_%d" % (k, v), SOFTCAP)} : (${FV})(-INFINITY);
%       else:
                const ${FV} sv = ${kx.score("t%d_%d" % (k, v), SOFTCAP)};
%       endif
                bm[g + ${v}] = ${kx.select_max("bm[g + %d]" % v, "sv")};
                ${kx.private_store("sv", "pt[j + %d] + (g + %d) * %d" % (k, v, V), FV)}
            }
%     endfor
%   endfor
        }
        for (int v = 0; v < ${NRV}; ++v) {
%   if masked:
            const ${IV} live = ${kx.causal_mask("r0", "v", V)};
            const ${FV} mx = live ? ${kx.select_max("mr[v]", "bm[v]")} : mr[v];
            const ${FV} base = clattn_basev(mx);
            const ${FV} al = live ? clattn_exp2_${V}(mr[v] - base) : (${FV})1.0f;
%   else:
            const ${FV} mx = ${kx.select_max("mr[v]", "bm[v]")};
            const ${FV} base = clattn_basev(mx);
            const ${FV} al = clattn_exp2_${V}(mr[v] - base);
%   endif
            ${FV} sum = 0.0f;
            for (int j = 0; j < ${KB}; ++j) {
%   if masked:
                const ${FV} p = ${kx.causal_mask("r0 + j", "v", V)} ? clattn_exp2_${V}(${kx.private_load("pt[j] + v * %d" % V, FV)} - base) : (${FV})0.0f;
%   else:
                const ${FV} p = clattn_exp2_${V}(${kx.private_load("pt[j] + v * %d" % V, FV)} - base);
%   endif
                sum += p;
                ${kx.private_store("p", "pt[j] + v * %d" % V, FV)}
            }
            lr[v] = lr[v] * al + sum;
            mr[v] = mx;
            ${kx.private_store("al", "alpha + v * %d" % V, FV)}
        }
% endfor
        }
        /* values: where every row attends every key of the block (rows past the end
           are 0), MV rows x NI head_dim vectors per tile. On the causal diagonal (no
           custom mask drops a key) the same tiles over the keys every row of the tile
           attends (jt, the fewest), then each row alone over the rest of its own; under
           a custom mask row by row over the keys the row attends. A masked key's value
           is never multiplied (0 * inf would be NaN) */
        if (mfull && r0 + n - 1 <= QLIM(0)) {
            for (int r = 0; r < rows_v; r += ${MV}) {
${value_tiles(KB, MV, NI, NVV, FV)}
            }
        } else if (mfull) {
            for (int r = 0; r < rows_v; r += ${MV}) {
                int jt = n;
% for a in range(MV):
                jt = min(jt, max(((int*)lim)[r + ${a}] - r0 + 1, 0));
% endfor
${value_tiles("jt", MV, NI, NVV, FV)}
% for a in range(MV):
                {
                    const int ja = min(n, ((int*)lim)[r + ${a}] - r0 + 1);
                    for (int j = jt; j < ja; ++j)
                        for (int e = 0; e < ${NVV}; ++e)
                            acc[r + ${a}][e] += pt[j][r + ${a}] * vf[j][e];
                }
% endfor
            }
        } else {
            for (int r = 0; r < rows; ++r) {
                const int jn = min(n, ((int*)lim)[r] - r0 + 1);
                for (int e = 0; e < ${NVV}; ++e) {
                    ${FV} o = acc[r][e] * alpha[r];
                    for (int j = 0; j < jn; ++j)
                        if (((int*)mk[j])[r]) o += pt[j][r] * vf[j][e];
                    acc[r][e] = o;
                }
            }
        }
    }

    for (int r = 0; r < rows; ++r) {
        const int i = r / ${G};
        const ulong at = (ulong)(qs + i) * ${HQO} + kvh * ${G} + r % ${G};
        float l = ((float*)lr)[r], mf = ((float*)mr)[r];
        const int seen = KEEPS_ANY(i, ((int*)lim)[r]);   /* rows attended: all scoring -inf breaks it */
        ${c.add_sink("mf", "l", "CLATTN_SINK(use_sinks, kvh * %d + r %% %d)" % (G, G))}
        const float inv = clattn_part_inv(l, seen) * alpha;
        __global st_t* op = out + at * ${DV};
        for (int e = 0; e < ${NVV}; ++e) {
            ${kx.raw_store("acc[r][e] * inv", "op + e * %d" % V, V, DTYPE, NATIVE_HALF)}
        }
        lse[at] = clattn_part_lse(mf, l, seen);
    }
}
