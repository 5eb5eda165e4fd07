"""What the tools in ``tools/`` share: the package on the import path, the benchmark's models
and page size, a model's spec, the bytes a decode moves, and small command-line helpers.

A tool run as ``python tools/NAME.py`` finds this module beside it; a test that loads a tool
by its path puts ``tools/`` on ``sys.path`` first.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

#: the repository root (holds ``clattn/``, ``tests/`` and ``tools/``)
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from clattn.models import MODEL_SHAPES, ModelShape  # noqa: E402
from clattn.spec import AttentionSpec  # noqa: E402

#: the benchmark's models by name
MODELS: dict[str, ModelShape] = {m.name: m for m in MODEL_SHAPES}
#: rows per page of every benchmark pool
PAGE = 16
GiB = 1 << 30


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def csv(text: str | None, cast: Callable = str) -> list | None:
    """``"a,b"`` -> ``[cast("a"), cast("b")]``; None stays None."""
    return None if text is None else [cast(x.strip()) for x in text.split(",") if x.strip()]


def gib(n: float) -> str:
    """``1.5 GiB``."""
    return f"{n / GiB:.2f} GiB"


def model_spec(name: str, dtype: str, fmt: str | None = None) -> AttentionSpec:
    """The spec of a model of :data:`MODELS` on pages of :data:`PAGE` rows; ``fmt`` stores
    both K and V pages."""
    m = MODELS[name]
    return AttentionSpec(m.num_qo_heads, m.num_kv_heads, m.head_dim, page_size=PAGE,
                         dtype=dtype, k_format=fmt, v_format=fmt)


def page_bytes(spec: AttentionSpec) -> int:
    """Bytes of one page of the spec's pool (K and V, every KV head, scales and padding)."""
    return int(np.prod(spec.pool_shape(1))) * spec.pool_dtype.itemsize


def kv_bytes(spec: AttentionSpec, B: int, ctx: int) -> int:
    """Bytes of the K and V rows a decode reads (data and block scales of the page format)."""
    return int(B * ctx * spec.bytes_per_token)


def io_bytes(spec: AttentionSpec, B: int, ctx: int) -> int:
    """Bytes a decode must move: K and V attended, q in, out and lse written."""
    hqo, d = spec.num_qo_heads, spec.head_dim
    return kv_bytes(spec, B, ctx) + 2 * B * hqo * d * spec.itemsize + B * hqo * 4


__all__ = ["GiB", "MODELS", "PAGE", "ROOT", "csv", "gib", "io_bytes", "kv_bytes", "log",
           "model_spec", "page_bytes"]
