<%doc>
Pieces shared by the two decode templates (decode_rows.cl.mako, decode_tiled.cl.mako):
the per-sequence set-up (attended chunk, partition rows) and the K/V row address.
Parameters: PS, HKV, D, SLIDING, SOFTCAP, FIXUP (the pointer fix-up rendered from the
decode argument table, clattn.signatures.DECODE).
</%doc>
<%!
def hsum(v, vec):
    """Horizontal sum of a float<vec> expression, as a balanced tree."""
    terms = ["(%s)" % v] if vec == 1 else ["(%s).s%x" % (v, i) for i in range(vec)]
    while len(terms) > 1:
        terms = ["(%s + %s)" % (terms[i], terms[i + 1]) for i in range(0, len(terms), 2)]
    return terms[0]


def score(x, softcap):
    """Score in log2 units; q was pre-scaled by sm_scale (and log2 e without soft-cap)."""
    if softcap is None:
        return "(%s)" % x
    return "(%.9ef * tanh((%s) * %.9ef) * CLATTN_LOG2E)" % (softcap, x, 1.0 / softcap)
%>
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
    const int r_lo = nparts_b > 1 ? min(part * part_rows, chunk) : 0; \
    const int r_hi = (nparts_b > 1 && part < nparts_b - 1) ? min(r_lo + part_rows, chunk) : chunk; \
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

/* element offset of the K row (kv = 0) or V row (kv = 1) of chunk row `row` */
inline ulong clattn_row_at(const __global int* page_indices, const int p0, const int row,
                           const int sink, const int wo, const int kvh, const int num_pages,
                           const int kv)
{
    const int off = row < sink ? row : row - sink + wo;
    const int pg = page_indices[p0 + off / ${PS}];
    const int page = pg < 0 ? 0 : (pg >= num_pages ? num_pages - 1 : pg);
    return ((((ulong)page * 2 + kv) * ${HKV} + kvh) * ${PS} + (off % ${PS})) * ${D};
}

</%def>
