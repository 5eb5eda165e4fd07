"""The clattn KV file: sequences of a paged KV cache on storage (format version 1).

A file holds the pages of some sequences of a :class:`clattn.PagedKVCache`, every layer,
exactly as the pools store them, and what the cache needs to hold those sequences again.
docs/kv_file.md is the format's reference; in short (every integer little-endian)::

    offset           bytes  field
    0                8      magic b"CLATTNKV"
    8                4      uint32 format version (1)
    12               4      uint32 H: bytes of the header
    16               H      header: UTF-8 JSON (spec, sequences, layers, ...)
    16 + H           pad    zero bytes up to data_offset, the next multiple of 64
    data_offset      L x B  layer l's pages at data_offset + l * B (B = layer_bytes):
                            num_pages pages of page_shape, page_dtype, back to back
    end - 16         8      magic b"CLKVEND\\0"
    end - 8          4      uint32 CRC-32 (zlib) of bytes [0, data_offset)
    end - 4          4      uint32 zero

Each layer's bytes carry their own CRC-32 in the header (``layers[l].crc32``), so every
byte of a file is covered by one CRC-32 and a changed byte anywhere is found (a CRC-32
finds every error burst of up to 32 bits). Only numpy and the standard library are needed
to read a file (:func:`open_verified`, ``KVFile.layer``); nothing is pickled. A file is
written through a synced temporary file in the same folder and ``os.replace`` (a crash
leaves the old file or none), its layers streamed one at a time.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .fileio import atomic_file

__all__ = ["FORMAT_VERSION", "KVFile", "KVFileCorruptError", "KVFileError",
           "KVFileMismatchError", "KVFileVersionError", "open_verified", "write"]

#: the format version this clattn writes and the newest it reads
FORMAT_VERSION = 1
MAGIC = b"CLATTNKV"
END_MAGIC = b"CLKVEND\0"
_PREFIX = struct.Struct("<8sII")  # magic, version, header bytes
_TRAILER = struct.Struct("<8sII")  # end magic, CRC-32 of [0, data_offset), zero
ALIGN = 64
#: the header's CRC fields are 8 hex digits, so a header's length does not depend on them
_CRC_PLACEHOLDER = "00000000"


class KVFileError(ValueError):
    """A KV file the cache cannot load; the cache was not changed."""


class KVFileCorruptError(KVFileError):
    """Not a KV file, truncated, or a byte changed (a CRC-32 disagrees)."""


class KVFileVersionError(KVFileError):
    """A KV file of a format version newer than this clattn reads."""


class KVFileMismatchError(KVFileError):
    """A sound KV file written for another cache: its attention spec (page format
    included), layer count or RoPE mode differ from the loading cache's."""


def data_offset(header_bytes: int) -> int:
    """Where the pages start for a header of ``header_bytes`` bytes."""
    return -(-(_PREFIX.size + header_bytes) // ALIGN) * ALIGN


def write(path: str | os.PathLike[str], header: dict, layers: Iterable[np.ndarray], *,
          num_layers: int, layer_bytes: int) -> int:
    """Write a KV file atomically; returns its size in bytes.

    Parameters
    ----------
    path : path-like
        The file; replaced only once the new one is complete and synced.
    header : dict
        The header's JSON fields (docs/kv_file.md) but ``version``, ``data_offset``,
        ``layer_bytes`` and ``layers``, which are filled in here.
    layers : iterable of numpy arrays
        ``num_layers`` arrays of ``layer_bytes`` bytes each (C-contiguous), in layer
        order; each is written before the next is asked for.
    num_layers, layer_bytes : int
        What ``layers`` yields.
    """
    fields = dict(header, version=FORMAT_VERSION, layer_bytes=int(layer_bytes),
                  layers=[{"crc32": _CRC_PLACEHOLDER} for _ in range(num_layers)])
    start = 0
    while True:  # the offset is written in the header whose length it depends on
        text = _header_text(fields, start)
        if data_offset(len(text)) == start:
            break
        start = data_offset(len(text))
    with atomic_file(path, "w+b") as f:
        f.write(b"\0" * start)
        crcs = []
        for n, arr in enumerate(layers):
            buf = memoryview(np.ascontiguousarray(arr)).cast("B")
            if buf.nbytes != layer_bytes:
                raise ValueError(f"layer {n}: {buf.nbytes} bytes, expected {layer_bytes}")
            crcs.append(f"{zlib.crc32(buf):08x}")
            f.write(buf)
        if len(crcs) != num_layers:
            raise ValueError(f"{len(crcs)} layers written, expected {num_layers}")
        fields["layers"] = [{"crc32": c} for c in crcs]
        text = _header_text(fields, start)  # as long as before: fixed-width CRCs
        head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(text)) + text
        head += b"\0" * (start - len(head))
        f.seek(0)
        f.write(head)
        f.seek(0, os.SEEK_END)
        f.write(_TRAILER.pack(END_MAGIC, zlib.crc32(head), 0))
        size = f.tell()
    return size


def _header_text(fields: dict, offset: int) -> bytes:
    return json.dumps(dict(fields, data_offset=int(offset)), sort_keys=True,
                      separators=(",", ":")).encode("utf-8")


class KVFile:
    """An open, verified KV file: its header and its layers as memory-mapped arrays.

    Made by :func:`open_verified`; close it (or use it as a context manager) once the
    arrays :meth:`layer` gave are no longer used.
    """

    def __init__(self, path: Path, mm: mmap.mmap, header: dict) -> None:
        self.path, self.header = path, header
        self._mm = mm

    @property
    def page_shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.header["page_shape"])

    def layer(self, index: int) -> np.ndarray:
        """Layer ``index``'s pages ``[num_pages, *page_shape]`` of ``page_dtype``: a view
        of the mapped file (no copy)."""
        h = self.header
        shape = (int(h["num_pages"]),) + self.page_shape
        return np.frombuffer(self._mm, np.dtype(h["page_dtype"]).newbyteorder("<"),
                             int(np.prod(shape)),
                             int(h["data_offset"]) + index * int(h["layer_bytes"])
                             ).reshape(shape)

    def close(self) -> None:
        """Unmap the file; while arrays from :meth:`layer` live on, the mapping stays
        until they are gone."""
        try:
            self._mm.close()
        except BufferError:  # views still exported: the mapping closes with the last one
            pass

    def __enter__(self) -> "KVFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_verified(path: str | os.PathLike[str], *, threads: int = 2) -> KVFile:
    """Open a KV file and check every byte of it; raise a :class:`KVFileError` if it is
    not sound.

    The prefix is read first (magic, then the version: :class:`KVFileVersionError` for
    a newer one), then the trailer's CRC of the header, the header, the file's size, and
    each layer's CRC (``threads`` layers at a time; zlib releases the GIL).
    """
    p = Path(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise KVFileCorruptError(f"{p}: {size} bytes, too short for a clattn KV file "
                                     f"(truncated?)")
        magic, version, hlen = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise KVFileCorruptError(f"{p}: not a clattn KV file (magic {magic!r}, expected "
                                     f"{MAGIC!r})")
        if version > FORMAT_VERSION:
            raise KVFileVersionError(f"{p}: format version {version}, newer than this "
                                     f"clattn reads ({FORMAT_VERSION}); update clattn")
        if version < 1:
            raise KVFileCorruptError(f"{p}: format version {version} does not exist")
        start = data_offset(hlen)
        if size < start + _TRAILER.size:
            raise KVFileCorruptError(f"{p}: {size} bytes, shorter than its header says "
                                     f"({start + _TRAILER.size} at least): truncated")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        header = _check(p, mm, size, start, hlen, threads)
    except BaseException:
        mm.close()
        raise
    return KVFile(p, mm, header)


def _check(p: Path, mm: mmap.mmap, size: int, start: int, hlen: int, threads: int) -> dict:
    end_magic, crc, zero = _TRAILER.unpack(mm[size - _TRAILER.size:])
    if end_magic != END_MAGIC or zero != 0:
        raise KVFileCorruptError(f"{p}: no end marker: truncated or damaged")
    if zlib.crc32(mm[:start]) != crc:
        raise KVFileCorruptError(f"{p}: the header's CRC-32 disagrees: the file is damaged")
    try:
        header = json.loads(mm[_PREFIX.size:_PREFIX.size + hlen].decode("utf-8"))
        layer_bytes = int(header["layer_bytes"])
        crcs = [int(layer["crc32"], 16) for layer in header["layers"]]
        ok = int(header["data_offset"]) == start and layer_bytes >= 0
    except (ValueError, KeyError, TypeError) as exc:
        raise KVFileCorruptError(f"{p}: the header cannot be read ({exc})") from None
    if not ok:
        raise KVFileCorruptError(f"{p}: the header's data_offset disagrees with its length")
    expect = start + len(crcs) * layer_bytes + _TRAILER.size
    if size != expect:
        raise KVFileCorruptError(f"{p}: {size} bytes, its header says {expect}: "
                                 f"{'truncated' if size < expect else 'bytes added'}")
    view = memoryview(mm)
    try:
        def crc_of(i: int) -> int:
            lo = start + i * layer_bytes
            return zlib.crc32(view[lo:lo + layer_bytes])

        with ThreadPoolExecutor(max(1, threads)) as pool:
            got = list(pool.map(crc_of, range(len(crcs))))
    finally:
        view.release()
    bad = [i for i, (a, b) in enumerate(zip(got, crcs)) if a != b]
    if bad:
        raise KVFileCorruptError(f"{p}: the CRC-32 of layers {bad[:8]} disagrees: the file "
                                 f"is damaged")
    return header
