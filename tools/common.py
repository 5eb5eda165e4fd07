"""What the tools in ``tools/`` share: the package on the import path, the benchmark's models
and page size, a model's spec, the bytes a decode moves, and small command-line helpers.

A tool run as ``python tools/NAME.py`` finds this module beside it; a test that loads a tool
by its path puts ``tools/`` on ``sys.path`` first.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

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
    """The spec of a model of :data:`MODELS` on pages of :data:`PAGE` rows, with the
    model's logit soft-cap; ``fmt`` stores both K and V pages."""
    m = MODELS[name]
    return AttentionSpec(m.num_qo_heads, m.num_kv_heads, m.head_dim, page_size=PAGE,
                         dtype=dtype, k_format=fmt, v_format=fmt, softcap=m.softcap)


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


#: the vector and matrix extensions a benchmark line names, as /proc/cpuinfo spells them
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "sve", "asimd")


def cpu_description() -> str:
    """The host CPU for a benchmark's header: model, cores, vector extensions and the
    last-level cache as Linux reports them (``/proc/cpuinfo``, sysfs); what cannot be read
    is left out."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and val.strip():
                    model = val.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    isa = [f for f in ISA_FLAGS if f in flags]
    llc = None
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        llc = size
    if llc and llc.endswith("K") and llc[:-1].isdigit() and int(llc[:-1]) >= 1024:
        llc = f"{int(llc[:-1]) / 1024:g} MiB"
    parts = [model, f"{os.cpu_count()} CPUs", " ".join(isa) or "no vector extensions listed"]
    if llc:
        parts.append(f"last-level cache {llc}")
    return ", ".join(parts)


def driver_description(devices: Iterable[Any]) -> list[str]:
    """One line per OpenCL device: platform, device name, platform version and driver
    build (the builds a figure depends on); for PoCL also ``POCL_AFFINITY`` (pinned
    workers run launches of few work-groups up to 1.7x faster on small VMs)."""
    out = []
    for d in devices:
        line = (f"{d.platform.name.strip()} {d.platform.version.strip()} / {d.name.strip()}, "
                f"driver {d.driver_version.strip()}")
        if "portable computing language" in d.platform.name.lower():
            line += f", POCL_AFFINITY={os.environ.get('POCL_AFFINITY', 'unset')}"
        out.append(line)
    return out


__all__ = ["GiB", "ISA_FLAGS", "MODELS", "PAGE", "ROOT", "cpu_description", "csv",
           "driver_description", "gib", "io_bytes", "kv_bytes", "log", "model_spec",
           "page_bytes"]
