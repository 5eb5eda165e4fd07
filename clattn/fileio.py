"""Atomic file writes: a reader (or a Ctrl-C) never sees half a file."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "wb", *,
                sync_dir: bool = True) -> Iterator[IO]:
    """A temporary file beside ``path`` to write; once the block ends it is synced and
    renamed over ``path`` (``os.replace``), and (``sync_dir``) the folder synced so the
    rename is on storage too. An exception in the block removes it and leaves ``path``
    as it was."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if sync_dir:
        _sync_dir(target.parent)


def _sync_dir(folder: Path) -> None:
    """fsync the folder so the rename itself is on storage (where the OS allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a synced temporary file and ``os.replace``."""
    with atomic_file(path, "w", sync_dir=False) as f:
        f.write(text)
    return Path(path)
