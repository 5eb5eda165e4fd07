"""The argument table of every clattn kernel (the one description of its signature).

Templates render their parameter lists from these tables and the launchers set
arguments by these names (:mod:`clattn.launch`). ``st_t`` is the storage type of q and out
(half or float), ``kv_t`` the element of the page pool (``st_t``, or ``uchar`` for a
byte pool with quantized pages); ``in_t`` that of the states a merge reads.
"""
from __future__ import annotations

from .launch import ArgTable, Buffer, Scalar

#: decode (both strategies): one query token per sequence over the paged cache; a build with
#: the split merge folded in (clattn.codegen.render_decode's ``fold``) counts a split
#: sequence's finished partitions on ``counters`` (ints, zero between launches, one per
#: (sequence, KV head, head slice) of the launch: clattn.opencl_backend.OpenCLBackend.counters);
#: other builds never read it
DECODE = ArgTable("clattn_decode", [
    Buffer("q", "st_t"),
    Buffer("pages", "kv_t", offset="ulong"), Scalar("num_pages", "int"),
    Buffer("page_indptr", "int"), Buffer("page_indices", "int"), Scalar("nnz", "int"),
    Buffer("last_page_len", "int"), Buffer("window_offset", "int"), Buffer("sink_size", "int"),
    Buffer("q_pos", "int"), Buffer("k_pos_offset", "int"),
    Buffer("out", "st_t", const=False), Buffer("lse", "float", const=False),
    Buffer("ws_o", "float", const=False, offset=None),
    Buffer("ws_s", "float", const=False, offset=None), Scalar("n_ws", "int"),
    Buffer("part_indptr", "int", offset=None), Scalar("split", "int"), Scalar("part_rows", "int"),
    Buffer("counters", "int", const=False, offset=None),
    Scalar("rotary_mode", "int"), Scalar("sm_scale", "float"),
    Buffer("rope_turns", "float2", offset=None), Scalar("long_from", "int"),
    Scalar("rope_att", "float"),
    Buffer("sink_logits", "float"), Scalar("use_sinks", "int"),
])

#: decode with the append fused in (clattn.cache, one-token steps of float pools): DECODE's
#: arguments, the pool writable, and APPEND's rows: the work-item (rows) or work-group
#: (tiled) of sequence b's last partition writes token b's rows of its KV head into slot
#: slots[b] (keys rotated at k_pos[b] when append_rope is 1) before it reads them
DECODE_APPEND = ArgTable("clattn_decode", [
    *(Buffer("pages", "kv_t", const=False, offset="ulong") if a.name == "pages" else a
      for a in DECODE.args),
    Buffer("k", "st_t"), Buffer("v", "st_t"), Buffer("slots", "int"), Buffer("k_pos", "int"),
    Scalar("append_rope", "int"),
])

#: in-place pairwise merge: v, s <- merge((v, s), (vo, so)) over NH (state, head) rows
MERGE_PAIR = ArgTable("clattn_merge_pair", [
    Buffer("v", "st_t", const=False), Buffer("s", "float", const=False),
    Buffer("vo", "st_t"), Buffer("so", "float"), Scalar("NH", "int"),
])

#: K-way merge of the states [lo, hi) of each output row (indptr, or fixed_k per row);
#: skip_single (split-KV) leaves rows of fewer than two states alone and breaks (NaN) a row
#: whose states are all empty when one of them is marked dead (its v NaN); use_sinks adds the
#: learned sink sink_logits[h] (natural-log units) of head h to every merged row
MERGE_VARLEN = ArgTable("clattn_merge_varlen", [
    Buffer("vin", "in_t"), Buffer("sv", "float"), Buffer("indptr", "int"),
    Scalar("fixed_k", "int"), Scalar("skip_single", "int"), Scalar("n_states", "int"),
    Buffer("out", "st_t", const=False), Buffer("lse", "float", const=False),
    Scalar("N", "int"), Scalar("H", "int"),
    Buffer("sink_logits", "float"), Scalar("use_sinks", "int"),
])

#: KV-cache append (clattn.cache): token t's key/value rows of every KV head to flat slot
#: slots[t] = page * page_size + slot; keys rotated at k_pos[t] when rotary_mode is 1;
#: byte pools write nothing when flags[0] == epoch (set by APPEND_CHECK)
APPEND = ArgTable("clattn_append", [
    Buffer("k", "st_t"), Buffer("v", "st_t"),
    Buffer("pages", "kv_t", const=False, offset="ulong"), Scalar("num_pages", "int"),
    Buffer("slots", "int"), Scalar("n_tokens", "int"),
    Buffer("k_pos", "int"), Scalar("rotary_mode", "int"),
    Buffer("rope_turns", "float2", offset=None), Scalar("long_from", "int"),
    Scalar("rope_att", "float"),
    Buffer("flags", "int", const=False), Scalar("epoch", "int"),
])

#: byte pools: the append's first pass, with the append's arguments; sets flags[0] = epoch
#: when a block of a quantized kind holds inf/NaN or a scale beyond f16 (the append then
#: writes nothing)
APPEND_CHECK = ArgTable("clattn_append_check", APPEND.args)

#: copy-on-write of pages (clattn.cache): rows [0, rows) of page src to page dst, for
#: each (src, dst, rows) row of the [n_copies, 3] table
PAGE_COPY = ArgTable("clattn_page_copy", [
    Buffer("pages", "kv_t", const=False, offset="ulong"), Scalar("num_pages", "int"),
    Buffer("copies", "int"), Scalar("n_copies", "int"),
])

#: prefill (both strategies): the ragged queries q [total_q, H_qo, D] of each sequence
#: over the paged cache, causal or not; work unit u is a tile of one sequence's queries,
#: units[4u .. 4u+3] = (sequence, its first query in the tile, the sequence's queries, the
#: tile's first row of q), made by clattn.prefill's plan (tiles never share a row of q);
#: q_pos_mode 1: query i of sequence b at RoPE position q_pos[b] + i (0: at its chunk row);
#: use_mask 1: the packed custom mask of mask_bytes bytes, sequence b's bits from byte
#: mask_indptr[b] (clattn.mask's layout), restricts the rows each query attends
PREFILL = ArgTable("clattn_prefill", [
    Buffer("q", "st_t"), Scalar("total_q", "int"),
    Buffer("pages", "kv_t", offset="ulong"), Scalar("num_pages", "int"),
    Buffer("page_indptr", "int"), Buffer("page_indices", "int"), Scalar("nnz", "int"),
    Buffer("last_page_len", "int"), Buffer("window_offset", "int"), Buffer("sink_size", "int"),
    Buffer("q_pos", "int"), Buffer("k_pos_offset", "int"), Scalar("q_pos_mode", "int"),
    Scalar("batch", "int"), Buffer("units", "int"), Scalar("n_units", "int"),
    Scalar("causal", "int"),
    Buffer("mask", "uchar"), Buffer("mask_indptr", "int"), Scalar("mask_bytes", "int"),
    Scalar("use_mask", "int"),
    Buffer("out", "st_t", const=False), Buffer("lse", "float", const=False),
    Scalar("rotary_mode", "int"), Scalar("sm_scale", "float"),
    Buffer("rope_turns", "float2", offset=None), Scalar("long_from", "int"),
    Scalar("rope_att", "float"),
    Buffer("sink_logits", "float"), Scalar("use_sinks", "int"),
])

ALL = (DECODE, DECODE_APPEND, MERGE_PAIR, MERGE_VARLEN, APPEND, APPEND_CHECK, PAGE_COPY, PREFILL)
