"""Save sequences of a :class:`clattn.PagedKVCache` to a KV file and load them back.

:func:`save` writes the named sequences' pages (every layer, exactly as the pools hold
them: f16/f32 values or q8_0/q4_0 codes and scales), each page that several of them share
once, and what the page table knows of them (lengths, pages given back by windows,
windows, sinks, positions), with the cache's spec, layer count and RoPE mode, in the
format of :mod:`clattn.kv_file`. :func:`load` checks the whole file, then that it fits
the cache (spec, layers, RoPE mode, new ids, free pages), and only then takes pages from
the free ones as a step would and writes them: per layer, one transfer from the mapped
file per run of consecutive pool pages (one run when the free pages hold one). A refused
file changes nothing. The cache's own methods (``save``, ``load``, ``offload``,
``restore``) call these under the cache's lock and outside a step.
"""
from __future__ import annotations

import os
from typing import Any, Hashable, Iterator, Sequence

import numpy as np

from . import kv_file, runtime
from .cache_tables import SeqState
from .kv_file import KVFileCorruptError, KVFileMismatchError
from .spec import INT32_MAX, AttentionSpec

__all__ = ["load", "save"]

#: the AttentionSpec fields a file records (with these the spec is made again)
SPEC_FIELDS = ("num_qo_heads", "num_kv_heads", "head_dim", "head_dim_v", "page_size", "dtype",
               "sliding_window", "rope_scaling", "rotary_dim", "softcap",
               "max_position_embeddings", "k_format", "v_format", "value_in_key")
#: fields a file written before they existed lacks, with the value they had then
SPEC_DEFAULTS = {"value_in_key": False}


def save(cache: Any, path: str | os.PathLike[str], seq_ids: Sequence[Hashable] | None = None,
         extra: dict | None = None) -> int:
    """Write ``seq_ids`` (default: every sequence) of ``cache`` to ``path``; returns the
    file's bytes. ``extra``: JSON-able fields an app keeps with them (``header["extra"]``)."""
    ids = list(cache.sequences if seq_ids is None else seq_ids)
    if len(set(map(_key, ids))) != len(ids):
        raise ValueError("save: a sequence id is given twice")
    states = [cache.table.state(i) for i in ids]
    held = np.concatenate([s.pages for s in states]) if states else np.zeros(0, np.int64)
    pages = np.unique(held)  # every page once, ascending (runs of the pool stay runs)
    seqs = [dict(id=_encode_id(i), length=s.length, dropped=s.dropped, window=s.window,
                 sink=s.sink, pos_offset=s.pos_offset,
                 pages=np.searchsorted(pages, s.pages).tolist())
            for i, s in zip(ids, states)]
    spec = cache.spec
    shape = spec.pool_shape(len(pages))
    header = dict(
        format="clattn-kv", spec={f: getattr(spec, f) for f in SPEC_FIELDS},
        num_layers=cache.num_layers, page_shape=list(shape[1:]),
        page_dtype=spec.pool_dtype.name, page_bytes=cache.page_bytes,
        num_pages=len(pages), rope=_rope(cache), sequences=seqs, extra=extra or {})
    layers = (_read_pages(cache, layer, pages) for layer in range(cache.num_layers))
    return kv_file.write(path, header, layers, num_layers=cache.num_layers,
                         layer_bytes=len(pages) * cache.page_bytes)


def load(cache: Any, path: str | os.PathLike[str],
         new_ids: Sequence[Hashable] | None = None) -> tuple:
    """Add the sequences of the file ``path`` to ``cache`` (under ``new_ids``, in the
    file's order, when given); returns their ids.

    Raises (the cache unchanged) :class:`~clattn.kv_file.KVFileCorruptError`,
    :class:`~clattn.kv_file.KVFileVersionError`,
    :class:`~clattn.kv_file.KVFileMismatchError`,
    :class:`~clattn.cache_tables.DuplicateSequenceError` (an id present or given twice)
    or :class:`~clattn.CacheFullError` (too few free pages).
    """
    with kv_file.open_verified(path) as f:
        h = f.header
        _check_fits(cache, f)
        items = _items(f, new_ids)
        got = cache.table.install(items, int(h["num_pages"]))
        ids = tuple(i for i, _ in items)
        try:
            for layer in range(cache.num_layers):
                data = f.layer(layer)
                _write_pages(cache, layer, got, data)
                del data
        except BaseException:
            for i in ids:
                cache.table.remove(i)
            raise
    return ids


def read_header(path: str | os.PathLike[str]) -> dict:
    """The verified header of a KV file (its ``extra`` holds what the app saved)."""
    with kv_file.open_verified(path) as f:
        return f.header


# -- the file against the cache ----------------------------------------------------------
def _rope(cache: Any) -> dict:
    return dict(mode=cache.rope, theta=cache.rope_theta, scale=cache.rope_scale)


def _check_fits(cache: Any, f: kv_file.KVFile) -> None:
    h, p = f.header, f.path
    try:
        spec = AttentionSpec(**{k: h["spec"][k] if k not in SPEC_DEFAULTS else
                                h["spec"].get(k, SPEC_DEFAULTS[k]) for k in SPEC_FIELDS})
    except (KeyError, TypeError, ValueError) as exc:
        raise KVFileCorruptError(f"{p}: the header's spec cannot be read ({exc})") from None
    mine = cache.spec
    if spec != mine:
        diff = [f"{k}: file {getattr(spec, k)!r}, cache {getattr(mine, k)!r}"
                for k in SPEC_FIELDS if getattr(spec, k) != getattr(mine, k)]
        what = "page format" if any(d.startswith(("k_format", "v_format", "value_in_key"))
                                    for d in diff) \
            else "attention spec"
        raise KVFileMismatchError(f"{p}: written for another {what} ({'; '.join(diff)}); "
                                  f"load it into a cache of the file's spec")
    if int(h["num_layers"]) != cache.num_layers:
        raise KVFileMismatchError(f"{p}: {h['num_layers']} layers, the cache has "
                                  f"{cache.num_layers}")
    rope, want = h["rope"], _rope(cache)
    if rope["mode"] != want["mode"] or (want["mode"] is not None and rope != want):
        raise KVFileMismatchError(f"{p}: keys stored for RoPE {rope}, the cache runs {want} "
                                  f"(keys rotated at append, or positions rotated in the "
                                  f"kernel, would disagree)")
    if list(f.page_shape) != list(mine.pool_shape(1)[1:]) or \
            h["page_dtype"] != mine.pool_dtype.name or int(h["page_bytes"]) != cache.page_bytes:
        raise KVFileCorruptError(f"{p}: the page shape {h['page_shape']} ({h['page_dtype']}) "
                                 f"disagrees with the file's spec")


def _items(f: kv_file.KVFile, new_ids: Sequence[Hashable] | None) -> list:
    """``[(id, SeqState)]`` of the file's sequences (pages: indices into the file's)."""
    h, p = f.header, f.path
    seqs, n, ps = h["sequences"], int(h["num_pages"]), int(h["spec"]["page_size"])
    if new_ids is not None:
        new_ids = list(new_ids)
        if len(new_ids) != len(seqs):
            raise ValueError(f"load: new_ids has {len(new_ids)} ids, the file holds "
                             f"{len(seqs)} sequences")
    items, used = [], np.zeros(n, bool)
    try:
        for k, s in enumerate(seqs):
            pages = np.asarray(s["pages"], np.int64).reshape(-1)
            st = SeqState(length=int(s["length"]), dropped=int(s["dropped"]),
                          window=None if s["window"] is None else int(s["window"]),
                          sink=int(s["sink"]), pos_offset=int(s["pos_offset"]), pages=pages)
            stored = st.length - st.dropped * ps
            if stored < 0 or len(pages) != -(-stored // ps) or \
                    (len(pages) and (pages.min() < 0 or pages.max() >= n)):
                raise ValueError(f"sequence {k}: {len(pages)} pages for {stored} stored rows")
            windowed = st.window is not None
            if (windowed and (not h["spec"]["sliding_window"] or st.window < 1)) or \
                    st.sink < 0 or (st.sink and not windowed) or st.dropped < 0 or \
                    (st.dropped and not windowed) or not 0 <= st.pos_offset <= INT32_MAX:
                raise ValueError(f"sequence {k}: window {st.window}, sink {st.sink}, "
                                 f"dropped {st.dropped}, pos_offset {st.pos_offset}")
            used[pages] = True
            items.append((_decode_id(s["id"]) if new_ids is None else new_ids[k], st))
    except (KeyError, TypeError, ValueError) as exc:
        raise KVFileCorruptError(f"{p}: the header's sequences are inconsistent ({exc})") \
            from None
    if not used.all():
        raise KVFileCorruptError(f"{p}: {int((~used).sum())} pages no sequence holds")
    return items


# -- ids in JSON: str, int, None, bool and tuples of them ---------------------------------
def _encode_id(i: Hashable) -> Any:
    if isinstance(i, tuple):
        return {"tuple": [_encode_id(x) for x in i]}
    if i is None or isinstance(i, (str, bool)):
        return i
    if isinstance(i, (int, np.integer)):
        return int(i)
    raise TypeError(f"save: sequence id {i!r} ({type(i).__name__}) cannot be written; ids "
                    f"of str, int, bool, None and tuples of them can")


def _decode_id(x: Any) -> Hashable:
    if isinstance(x, dict):
        return tuple(_decode_id(y) for y in x["tuple"])
    if x is None or isinstance(x, (str, int)):
        return x
    raise TypeError(f"sequence id {x!r}")


def _key(i: Hashable) -> Any:
    return (type(i).__name__, i)


# -- pages between pools and host memory -----------------------------------------------
def _runs(pages: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """``(first pool page, first index, count)`` of each run of consecutive pages."""
    if not len(pages):
        return
    cut = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(pages)]])
    for a, b in zip(starts.tolist(), ends.tolist()):
        yield int(pages[a]), a, b - a


def _read_pages(cache: Any, layer: int, pages: np.ndarray) -> np.ndarray:
    """Layer ``layer``'s ``pages`` (ascending) as a host array ``[n, *page_shape]``."""
    pool = cache.pools[layer]
    if isinstance(pool, np.ndarray):
        return pool[pages]
    cl = runtime.cl()
    out = np.empty((len(pages),) + tuple(pool.shape[1:]), pool.dtype)
    pb = cache.page_bytes
    flat = out.reshape(len(pages), -1)
    evts = [cl.enqueue_copy(pool.queue, flat[i:i + n], pool.base_data,
                            src_offset=pool.offset + first * pb, is_blocking=False,
                            wait_for=pool.events or None)
            for first, i, n in _runs(pages)]
    if evts:
        cl.wait_for_events(evts)
    return out


def _write_pages(cache: Any, layer: int, pages: np.ndarray, data: np.ndarray) -> None:
    """Write ``data [n, *page_shape]`` into layer ``layer``'s ``pages`` (ascending):
    one transfer per run of consecutive pages, done when this returns."""
    pool = cache.pools[layer]
    if isinstance(pool, np.ndarray):
        pool[pages] = data
        return
    cl = runtime.cl()
    pb = cache.page_bytes
    flat = data.reshape(len(pages), -1)
    evts = [cl.enqueue_copy(pool.queue, pool.base_data, flat[i:i + n],
                            dst_offset=pool.offset + first * pb, is_blocking=False,
                            wait_for=pool.events or None)
            for first, i, n in _runs(pages)]
    if evts:
        cl.wait_for_events(evts)
