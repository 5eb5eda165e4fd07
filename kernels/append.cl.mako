<%doc>
clattn KV-cache writes (clattn.cache.PagedKVCache; docs/cache.md):

clattn_append     the new tokens' keys and values into their slots: token t's rows of KV
                  head h go to flat slot slots[t] = page * PS + slot of the pool
                  [P, 2, HKV, PS, D]; with rotary_mode the key is rotated first at
                  position k_pos[t] (RoPE at append, for apps that cache rotated keys).
clattn_page_copy  copy-on-write: for each copy c of the [C, 3] table (src page, dst page,
                  rows), rows [0, rows) of every (kind, head) of page src go to page dst.

Template parameters (clattn.codegen.render_append; geometry clattn.fit.append_geometry):
  D, DV, HKV, PS      head_dim (K), head_dim_v (V: a byte pool where it differs), KV
                      heads, page size
  ROT, ROPE           rotary dims; their pairing (clattn.kernel_exprs.RopePairs)
  DTYPE, NATIVE_HALF, DENORMS, PRAGMAS   storage type and the prelude's switches
  STRATEGY, VEC, MH   rows (CPU drivers): work-groups of one work-item, each striding over
                      (token, head) rows, VEC elements at a time; tiled (GPUs): D/VEC
                      lanes per row, MH rows per work-group
  KFMT, VFMT, BYTE_POOL, PAGE_BYTES, K_REGION, V_REGION, K_ROWB, V_ROWB, VIN_K
                      page storage (clattn.codegen's pool parameters, clattn.quant's layout;
                      VIN_K: the values are in the key rows, only K rows are written)
  APPEND_SIGNATURE/APPEND_FIXUP, CHECK_SIGNATURE, COPY_SIGNATURE/COPY_FIXUP  from
                      clattn.signatures APPEND, APPEND_CHECK and PAGE_COPY
Every index is checked or clamped: a slot outside the pool, or a copy whose destination
is outside it, writes nothing; a copy's source page and row count are clamped. Values
without RoPE are copied bit for bit.

Byte pools (K or V not stored as DTYPE, or DV != D; append_bytes.clh.mako): one work-item
per (token, head, kind, block of up to 32 values: NBK key blocks, NBV value blocks),
whatever the strategy. clattn_append_check runs
first and sets flags[0] = epoch when a block of a quantized kind holds inf/NaN or a scale
beyond f16; clattn_append then writes nothing at all (the cache reports it).
</%doc>
<%namespace name="c" file="common.clh.mako"/>
${c.prelude()}
% if BYTE_POOL:
<%include file="append_bytes.clh.mako"/>
% else:
<%namespace name="a" file="append_row.clh.mako"/>
<% NV = D // VEC %>\
typedef st_t kv_t;      /* element of the pool */
${a.helpers()}
## one (copy, kind, head, row) of the page copy
<%def name="copy_setup()">
            const int cidx = it / ${2 * HKV * PS};
            const int rem = it % ${2 * HKV * PS};
            const int kind = rem / ${HKV * PS}, h = (rem / ${PS}) % ${HKV}, r = rem % ${PS};
            const int dst = copies[3 * cidx + 1];
            const int rows = clamp(copies[3 * cidx + 2], 0, ${PS});
            if (dst < 0 || dst >= num_pages || r >= rows) continue;
            const int src = clamp(copies[3 * cidx], 0, num_pages - 1);
            __global raw_t* dr = (__global raw_t*)pages + clattn_slot_at((ulong)dst, kind, h, (ulong)r);
            const __global raw_t* sr = (const __global raw_t*)pages + clattn_slot_at((ulong)src, kind, h, (ulong)r);
</%def>

% if STRATEGY == "rows":
__kernel void clattn_append(${APPEND_SIGNATURE})
{
    ${APPEND_FIXUP}
    const long cap = (long)max(num_pages, 0) * ${PS};
    for (int th = get_global_id(0); th < n_tokens * ${HKV}; th += get_global_size(0)) {
${a.row_setup("th / %d" % HKV, "th %% %d" % HKV, "continue")}
% for i in range(NV):
${a.lanes(i * VEC, VEC, "rotary_mode")}
% endfor
    }
}

__kernel void clattn_page_copy(${COPY_SIGNATURE})
{
    ${COPY_FIXUP}
    for (int it = get_global_id(0); it < n_copies * ${2 * HKV * PS}; it += get_global_size(0)) {
${copy_setup()}
% for i in range(NV):
        ${a.mv('dr + %d' % (i * VEC), 'sr + %d' % (i * VEC), VEC)}
% endfor
    }
}
% else:
__kernel __attribute__((reqd_work_group_size(${NV}, ${MH}, 1)))
void clattn_append(${APPEND_SIGNATURE})
{
    ${APPEND_FIXUP}
    const long cap = (long)max(num_pages, 0) * ${PS};
    const int lane = get_global_id(0);
    if (lane >= ${NV}) return;
    for (int th = get_global_id(1); th < n_tokens * ${HKV}; th += get_global_size(1)) {
${a.row_setup("th / %d" % HKV, "th %% %d" % HKV, "continue")}
${a.lanes("lane * %d" % VEC, VEC, "rotary_mode")}
    }
}

__kernel __attribute__((reqd_work_group_size(${NV}, ${MH}, 1)))
void clattn_page_copy(${COPY_SIGNATURE})
{
    ${COPY_FIXUP}
    const int lane = get_global_id(0);
    if (lane >= ${NV}) return;
    for (int it = get_global_id(1); it < n_copies * ${2 * HKV * PS}; it += get_global_size(1)) {
${copy_setup()}
        ${a.mv('dr + lane * %d' % VEC, 'sr + lane * %d' % VEC, VEC)}
    }
}
% endif
% endif
