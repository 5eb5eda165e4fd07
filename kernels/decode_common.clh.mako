<%doc>
Pieces shared by the two decode templates (decode_rows.cl.mako, decode_tiled.cl.mako):
the per-sequence set-up (attended chunk, partition rows) and the K/V row address.
Parameters: PS, HKV, D, DV (the widths of a K and a V row: a pool of unequal widths is
a byte pool), SLIDING, SOFTCAP, FUSED (the append fused in: fused_append), FOLD (the split merge folded in: fold_parts, merge_state.clh.mako's merges),
FIXUP (the pointer fix-up rendered from the
decode argument table, clattn.signatures.DECODE), and the page storage: KFMT, VFMT
("half", "float", "q8_0", "q4_0"), BYTE_POOL (the pool is bytes: K or V not stored
as DTYPE), PAGE_BYTES, K_REGION, V_REGION (bytes of a page and of one (kind, head)
region), K_ROWB, V_ROWB (data bytes per row), VIN_K (a V row is the leading DV values
of its K row: addressed as the K row, with K's stride and scales); clattn.quant has the
layout.
</%doc>
<%namespace name="a" file="append_row.clh.mako"/>
<%namespace name="m" file="merge_state.clh.mako"/>
<%def name="setup()">
/* the attended chunk of sequence b and the rows [r_lo, r_hi) of partition p */
#define SEQ_SETUP \
    ${FIXUP} \
    const int p0 = clamp(page_indptr[b], 0, nnz); \
    const int p1 = clamp(page_indptr[b + 1], p0, nnz); \
    const int npages = num_pages > 0 ? p1 - p0 : 0; \
    const int stored = npages > 0 ? (npages - 1) * ${PS} + clamp(last_page_len[b], 1, ${PS}) : 0; \
    SEQ_WINDOW \
    const int chunk = stored - wo + sink; \
    const int nparts_b = split ? max(part_indptr[b + 1] - part_indptr[b], 1) : 1; \
    const int r_lo = nparts_b > 1 ? (int)min((long)part * part_rows, (long)chunk) : 0; \
    const int r_hi = (nparts_b > 1 && part < nparts_b - 1) ? (int)min((long)r_lo + part_rows, (long)chunk) : chunk; \
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

/* the stored offset of chunk row `row`: the sinks first, then the window */
inline int clattn_offset_of(const int row, const int sink, const int wo)
{
    return row < sink ? row : row - sink + wo;
}

/* the page holding chunk row `row` (its index clamped into the pool) and the row's slot
   in it: one page-table read can serve several rows of a page */

inline int clattn_page_of(const __global int* page_indices, const int p0, const int row,
                          const int sink, const int wo, const int num_pages)
{
    const int pg = page_indices[p0 + clattn_offset_of(row, sink, wo) / ${PS}];
    return pg < 0 ? 0 : (pg >= num_pages ? num_pages - 1 : pg);
}

inline int clattn_slot_of(const int row, const int sink, const int wo)
{
    return clattn_offset_of(row, sink, wo) % ${PS};
}

typedef ${"uchar" if BYTE_POOL else "st_t"} kv_t;   /* element of the pool */
% if FOLD:

/* FOLD: the partitions of a split sequence that write a workspace state and then count
   in on its counter: p in [0, min(nparts_b, launched)) with first + p in [0, n_ws)
   (valid_part), whatever the tables hold, so the last of them is known and resets the
   counter to 0; the one that reads count - 1 from it is that last */
inline int clattn_fold_parts(const int first, const int nparts_b, const int launched,
                             const int n_ws)
{
    const long lo = max((long)first, 0L);
    const long hi = min((long)first + min(nparts_b, launched), (long)n_ws);
    return hi > lo ? (int)(hi - lo) : 0;
}
${m.split_dead("float", NATIVE_HALF, fresh=True)}
% endif
% if FUSED:
${a.helpers()}
% endif
% if BYTE_POOL:

/* byte offset of the (kind kv, head kvh) region of page `page` */
inline ulong clattn_region_of(const int page, const int kv, const int kvh)
{
    return (ulong)page * ${PAGE_BYTES} + (kv ? ${HKV * K_REGION} + kvh * ${V_REGION} : kvh * ${K_REGION});
}
% endif
</%def>

## Declare pointers to the K (kind 0) or V (kind 1) row of chunk row `row` named `name`:
## float pools: an element pointer; byte pools: the data bytes and, when quantized, the
## row's f16 scales (name_s).
<%def name="row_ptr(kind, name, row)">\
${page_ptr(kind, name, "clattn_page_of(page_indices, p0, %s, sink, wo, num_pages)" % row, "clattn_slot_of(%s, sink, wo)" % row)}\
</%def>
## Declare pointers to the K (kind 0) or V (kind 1) row in slot `slot` of the (clamped)
## page `page`, with row_ptr's names.
<%def name="page_ptr(kind, name, page, slot)">\
% if not BYTE_POOL:
const __global kv_t* ${name} = pages + ((((ulong)(${page}) * 2 + ${kind}) * ${HKV} + kvh) * ${PS} + (${slot})) * ${D};\
% else:
<% fmt, rowb, width = (KFMT, K_ROWB, D) if kind == 0 or VIN_K else (VFMT, V_ROWB, DV) %>\
const ulong ${name}_reg = clattn_region_of(${page}, ${0 if VIN_K else kind}, kvh);
            const __global uchar* ${name} = pages + ${name}_reg + (ulong)(${slot}) * ${rowb};\
%   if fmt in ("q8_0", "q4_0"):

            const __global ushort* ${name}_s = (const __global ushort*)(pages + ${name}_reg + ${PS * rowb}) + (${slot}) * ${width // 32};\
%   endif
% endif
</%def>
## FUSED (clattn.signatures.DECODE_APPEND, float pools): the append of a one-token step
## in the decode launch. When `writer` holds (the partition holding the chunk's last row,
## the new token's), token b's K/V rows of head kvh go to slot slots[b] as clattn_append
## writes them (append_row.clh.mako), lanes `e0s` of `vec` elements each; the kernel then
## reads them through its normal path (a work-item sees its own writes in program order;
## `fence` orders a work-group's). No other partition touches the row.
<%def name="fused_append(writer, e0s, vec, fence=False)">
% if FUSED:
    /* the fused append: written before any row of this partition is read */
    if (${writer}) do {
        const long cap = (long)max(num_pages, 0) * ${PS};
${a.row_setup("b", "kvh", "break")}
%   for e0 in e0s:
${a.lanes(e0, vec, "append_rope")}
%   endfor
    } while (0);
%   if fence:
    barrier(CLK_GLOBAL_MEM_FENCE);
%   endif
% endif
</%def>
## inline helpers the quantized lane expressions call
<%def name="q4_helpers()">
% if BYTE_POOL and ("q4_0" in (KFMT, VFMT) or "q8_0" in (KFMT, VFMT)):
/* exact f16 -> f32 of one scale (normals, subnormals, zero, inf, nan) without library
   calls: one hardware conversion where the device has one (clang's __fp16 as
   common.clh.mako's clattn_h2f, or cl_khr_fp16), else integer operations */
%   if STORAGE_HALF:
typedef __fp16 clattn_hs_t __attribute__((ext_vector_type(2)));
inline float clattn_h2f_1(const ushort u)
{
    return __builtin_convertvector(__builtin_astype((ushort2)(u, 0), clattn_hs_t), float2).x;
}
%   elif NATIVE_HALF:
inline float clattn_h2f_1(const ushort u)
{
    return convert_float(as_half(u));
}
%   else:
inline float clattn_h2f_1(const ushort u)
{
    const uint h = u;
    const uint em = (h & 0x7fffu) << 13;
    const uint sgn = (h & 0x8000u) << 16;
    const uint e = em >> 23;
    uint bits = e == 0u ? as_uint((float)(em >> 13) * 0x1p-24f) : em + (112u << 23);
    bits = em >= (0x7c00u << 13) ? (em | 0x7f800000u) : bits;   /* inf, nan */
    return as_float(bits | sgn);
}
%   endif
% endif
</%def>


## The page and slot of rows [r, r + n) of the chunk into pg[], sl[] (n <= the arrays'
## length): one page-table read per page the rows touch (the rows of a page are
## consecutive slots; a new page starts at a slot PS or where the sinks end).
<%def name="block_pages(r, n, pg, sl)">            {
                int cur_pg = clattn_page_of(page_indices, p0, ${r}, sink, wo, num_pages);
                int cur_sl = clattn_slot_of(${r}, sink, wo);
                for (int j = 0; j < ${n}; ++j) {
                    if (j > 0 && (++cur_sl == ${PS} || ${r} + j == sink)) {
                        cur_pg = clattn_page_of(page_indices, p0, ${r} + j, sink, wo, num_pages);
                        cur_sl = clattn_slot_of(${r} + j, sink, wo);
                    }
                    ${pg}[j] = cur_pg;
                    ${sl}[j] = cur_sl;
                }
            }
</%def>

## Prefetch the K and V rows in slot slv of page pgv (a row of a later block) into the
## cache, one hint per 64-byte line: the pages of a sequence lie anywhere in the pool, and a
## CPU's own prefetchers stop at each page of the pool, so every block would otherwise
## start with a full memory latency. Locality 2 (x86: prefetcht1, into L2) measured
## faster than 3 (into L1) on both CPU drivers: the L1's miss buffers are kept for the
## block being computed. A quantized row's block scales lie apart from its codes (the
## page's scale region): their line is prefetched with them, one hint per row. VIN_K: the
## K row alone (it holds the values).
<%def name="prefetch_row(pgv, slv)">\
<% rowb = [K_ROWB, V_ROWB] if BYTE_POOL else [D * (2 if DTYPE == "half" else 4)] * 2 %>\
            {
% for kind in ((0,) if VIN_K else (0, 1)):
                ${page_ptr(kind, "pf%d" % kind, pgv, slv)}
%   for off in range(0, rowb[kind], 64):
                __builtin_prefetch((const __global uchar*)pf${kind} + ${off}, 0, 2);
%   endfor
%   if BYTE_POOL and (KFMT, VFMT)[kind] in ("q8_0", "q4_0"):
                __builtin_prefetch((const __global uchar*)pf${kind}_s, 0, 2);
%   endif
% endfor
            }
</%def>
