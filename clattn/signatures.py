"""The argument table of every clattn kernel (the one description of its signature).

Templates render their parameter lists from these tables and the launchers set
arguments by these names (:mod:`clattn.launch`). ``st_t`` is the storage type of q and out
(half or float), ``kv_t`` the element of the page pool (``st_t``, or ``uchar`` for a
byte pool with quantized pages); ``in_t`` that of the states a merge reads.
"""
from __future__ import annotations

from .launch import ArgTable, Buffer, Scalar

#: decode (both strategies): one query token per sequence over the paged cache
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
    Scalar("rotary_mode", "int"), Scalar("sm_scale", "float"),
    Buffer("rope_turns", "float2", offset=None), Scalar("long_from", "int"),
    Scalar("rope_att", "float"),
])

#: in-place pairwise merge: v, s <- merge((v, s), (vo, so)) over NH (state, head) rows
MERGE_PAIR = ArgTable("clattn_merge_pair", [
    Buffer("v", "st_t", const=False), Buffer("s", "float", const=False),
    Buffer("vo", "st_t"), Buffer("so", "float"), Scalar("NH", "int"),
])

#: K-way merge of the states [lo, hi) of each output row (indptr, or fixed_k per row)
MERGE_VARLEN = ArgTable("clattn_merge_varlen", [
    Buffer("vin", "in_t"), Buffer("sv", "float"), Buffer("indptr", "int"),
    Scalar("fixed_k", "int"), Scalar("skip_single", "int"), Scalar("n_states", "int"),
    Buffer("out", "st_t", const=False), Buffer("lse", "float", const=False),
    Scalar("N", "int"), Scalar("H", "int"),
])

ALL = (DECODE, MERGE_PAIR, MERGE_VARLEN)
