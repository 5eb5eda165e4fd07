<%doc>
The K-way merge of one output row's states (docs/contract.md, "Merging"), written once:
clattn_merge_varlen (merge.cl.mako) runs it per (row, head), and the decode kernels built
with FOLD (decode_rows / decode_tiled) run it in the last partition of a split sequence
to finish, so the folded launch writes the same bits as the two separate launches.
Parameters of every def: the C names of the states (vin: values [*, H, DV] of storage
`vin_t`, sv: their lses), the output row's out/lse, head h of H, the range [lo, hi) of
states (already clamped), `skip` (the split-KV rule: a row whose states are all empty is
broken when one of them is marked dead) and the storage of out (DTYPE, NATIVE_HALF from
the including template) and the states' width DV (the values' width: the decode's
head_dim_v, the merge's D). The names it reads besides: sink_logits, use_sinks.
</%doc>
<%namespace name="c" file="common.clh.mako"/>
<%! from clattn import kernel_exprs as kx %>\
## clattn_split_dead(vin, lo, hi, H, h): states of storage vin_t ("half" | "float");
## `fresh`: float states read through volatile pointers (varlen_tiled's `fresh`)
<%def name="split_dead(vin_t, native_half, fresh=False)">
/* split-KV (skip_single), every partition of a sequence empty: true when one of them saw
   rows that all scored -inf (it marks its output NaN, decode_rows.cl.mako), which breaks
   the sequence; false when none saw rows */
inline int clattn_split_dead(const __global ${vin_t}* vin, const int lo, const int hi,
                             const int H, const int h)
{
    for (int k = lo; k < hi; ++k)
<% at = "vin + ((ulong)k * H + h) * %d" % DV %>\
        if (isnan(${("*(const volatile __global float*)(%s)" % at) if fresh else kx.storage_load(1, at, vin_t, native_half)})) return 1;
    return 0;
}
</%def>

## CPU form: one work-item walks all of DV, VEC lanes at a time (common.clh.mako's
## raw_loads(VEC) typedefs, and ldn_t for native half stores, in scope)
<%def name="varlen_rows(vin, sv, out, lse, n, h, H, lo, hi, skip, vec, vin_t, sinks)">
<%
NV = DV // vec
FV = kx.vtype("float", vec)
def rload(ptr):
    return kx.raw_load(ptr, vec, vin_t, NATIVE_HALF, by_dtype=True)
%>\
        float mx = -INFINITY;
        for (int k = ${lo}; k < ${hi}; ++k) mx = clattn_max_nan(mx, ${sv}[(ulong)k * ${H} + ${h}]);
        const int dead = ${skip} && mx == -INFINITY && clattn_split_dead(${vin}, ${lo}, ${hi}, ${H}, ${h});
% for i in range(NV):
        ${FV} acc${i} = 0.0f;
% endfor
        float tot = 0.0f;
        for (int k = ${lo}; k < ${hi}; ++k) {
            const float sk = ${sv}[(ulong)k * ${H} + ${h}];
            if (sk == -INFINITY) continue;   /* empty: weight 0, v not read */
            const float w = clattn_state_weight(sk, mx);
            tot += w;
            const __global ${vin_t}* ip = ${vin} + ((ulong)k * ${H} + ${h}) * ${DV};
% for i in range(NV):
            acc${i} += w * ${rload("ip + %d" % (i * vec))};
% endfor
        }
        ${c.add_sink("mx", "tot", "CLATTN_SINK(use_sinks, %s)" % h, sinks)}
        const float inv = clattn_part_inv(tot, dead) * alpha;
        __global st_t* op = ${out} + ((ulong)${n} * ${H} + ${h}) * ${DV};
% for i in range(NV):
        ${kx.raw_store("acc%d * inv" % i, "op + %d" % (i * vec), vec, DTYPE, NATIVE_HALF)}
% endfor
        ${lse}[(ulong)${n} * ${H} + ${h}] = clattn_part_lse(mx, tot, dead);
</%def>

## GPU form: DV / vec work-items per row, lane tx holding dims [tx * vec, tx * vec + vec);
## `fresh` (states of float storage stored by other work-groups of the same launch): the
## states are read through volatile pointers, so no line a GPU's non-coherent L1 cached
## before their stores is read (the same values: the bits do not change)
<%def name="varlen_tiled(vin, sv, out, lse, n, h, H, lo, hi, skip, tx, vec, vin_t, sinks, fresh=False)">
<%
def ld(vec_, ptr):
    if fresh:
        return "*(const volatile __global %s*)(%s)" % (kx.vtype("float", vec_), ptr)
    return kx.storage_load(vec_, ptr, vin_t, NATIVE_HALF)
def sload(idx):
    return ld(1, "%s + %s" % (sv, idx)) if fresh else "%s[%s]" % (sv, idx)
%>\
    {
        float mx = -INFINITY;
        for (int k = ${lo}; k < ${hi}; ++k) mx = clattn_max_nan(mx, ${sload("(ulong)k * %s + %s" % (H, h))});
        const int dead = ${skip} && mx == -INFINITY && clattn_split_dead(${vin}, ${lo}, ${hi}, ${H}, ${h});
        float tot = 0.0f;
        ${c.fv(vec)} acc = 0.0f;
        for (int k = ${lo}; k < ${hi}; ++k) {
            const float sk = ${sload("(ulong)k * %s + %s" % (H, h))};
            if (sk == -INFINITY) continue;   /* empty: weight 0, v not read */
            const float w = clattn_state_weight(sk, mx);
            tot += w;
            acc += w * ${ld(vec, "%s + ((ulong)k * %s + %s) * %d + %s * %d" % (vin, H, h, DV, tx, vec))};
        }
        ${c.add_sink("mx", "tot", "CLATTN_SINK(use_sinks, %s)" % h, sinks)}
        ${c.storev(vec, "acc * (clattn_part_inv(tot, dead) * alpha)", "%s + ((ulong)%s * %s + %s) * %d + %s * %d" % (out, n, H, h, DV, tx, vec))}
        if (${tx} == 0) ${lse}[(ulong)${n} * ${H} + ${h}] = clattn_part_lse(mx, tot, dead);
    }
</%def>
