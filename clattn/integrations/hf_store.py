"""A :class:`~clattn.integrations.hf_cache.ClattnCache` saved to a folder and loaded back.

The folder holds one KV file (:mod:`clattn.kv_file`) per layer kind: ``full.clkv`` for
the full-attention layers, ``window-N.clkv`` for those of window ``N``; each is written
atomically (the files of one save share a save id, which a load checks) and its
header's ``extra`` keeps what transformers counts besides the tokens
(the batch's rows, each layer's seen positions) and the shape the kind attends with. A
load checks every file before it adds a sequence, and a kind whose file is refused takes
back the kinds loaded before it: the cache is then as it was.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from clattn.cache_store import read_header
from clattn.kv_file import KVFileMismatchError

from .hf_mla import latent_attention

__all__ = ["load", "save"]


def _check_model(cache: Any, shape: dict, path: Path) -> None:
    """Refuse a file whose heads, head_dim or multi-head latent attention form are not
    those the cache's model attends with."""
    config = cache.config
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    d = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    if latent_attention(config):  # one row [latent | rope key], or per-head nope + rope
        rope = int(config.qk_rope_head_dim)
        kv, d = (1, int(config.kv_lora_rank) + rope) if cache.latent else \
            (kv, int(config.qk_nope_head_dim) + rope)
    want = {"heads": heads, "kv_heads": kv, "head_dim": int(d), "latent": bool(cache.latent)}
    got = {k: shape.get(k, False) for k in want}
    if got != want:
        raise KVFileMismatchError(f"{path}: written for attention of {got}, the model has "
                                  f"{want}")


def _file(folder: Path, window: int | None) -> Path:
    return folder / ("full.clkv" if window is None else f"window-{int(window)}.clkv")


def save(cache: Any, path: str | os.PathLike[str]) -> int:
    """Write every layer kind of ``cache`` into the folder ``path``; returns the bytes."""
    if cache.rows is None:
        raise ValueError("clattn: the ClattnCache holds no sequences yet (no forward ran)")
    folder = Path(path)
    size = 0
    save_id = uuid.uuid4().hex  # the files of one save carry the same
    for window, g in cache.groups.items():
        extra = {"rows": list(cache.rows), "window": window, "shape": cache.kind_shape(window),
                 "seen": [layer.cumulative_length for layer in cache.layers],
                 "save": save_id}
        size += g.cache.save(_file(folder, window), cache.rows, extra=extra)
    return size


def load(cache: Any, path: str | os.PathLike[str]) -> None:
    """Load the folder ``path`` that :func:`save` wrote into ``cache`` (no sequences)."""
    if cache.rows is not None:
        raise ValueError("clattn: load into a ClattnCache that holds no sequences (a new "
                         "one, or after reset())")
    folder = Path(path)
    windows = list(dict.fromkeys(cache.windows))
    headers = {w: read_header(_file(folder, w))["extra"] for w in windows}
    for w in windows:
        _check_model(cache, headers[w]["shape"], _file(folder, w))
    if len({h["save"] for h in headers.values()}) > 1:
        raise KVFileMismatchError(f"{folder}: its layer kinds' files come from different "
                                  f"saves (a save stopped part-way?)")
    rows = headers[windows[0]]["rows"]
    made = [w for w in windows if w not in cache.groups]
    done = []
    try:
        for w in windows:
            g = cache.kind(w, headers[w]["shape"], batch=len(rows))
            g.cache.load(_file(folder, w), new_ids=rows)
            done.append(g)
    except BaseException:
        for g in done:
            for sid in rows:
                g.cache.remove(sid)
        for w in made:  # the kinds this load made go again: a forward makes its own
            cache.groups.pop(w, None)
        raise
    cache.adopt_rows(rows)
    for layer, seen in zip(cache.layers, headers[windows[0]]["seen"]):
        layer.cumulative_length = int(seen)
