"""What the tuner and the benchmarks run: model shapes, and decode and prefill inputs on
the device.

A real decode step reads each layer's KV once, so timings rotate over disjoint page sets
(:func:`rotating_tables`) that together span at least
:data:`~clattn.tune.ceilings.COLD_FACTOR` x the largest cache: no timed call finds its
pages in a cache. :class:`PagePool` is one model's pool of pages on the device;
:class:`Workload` is one (batch, context) shape on it. A prefill reads every key once per
tile of queries (compute-bound: :func:`prefill_flops`), so :class:`PrefillWorkload` (one
:class:`PrefillShape`) holds one page set, its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .. import host_memory, runtime
from ..models import MLAShape, ModelShape, mla_shape, model_shape
from ..spec import AttentionSpec
from .ceilings import fill_random


@dataclass(frozen=True)
class DecodeModel:
    """One model as the decode stage runs it: its name in the tables, its
    :class:`AttentionSpec`'s shape fields and the softmax scale its calls pass.

    Attributes
    ----------
    name : str
    num_qo_heads, num_kv_heads, head_dim : int
    head_dim_v : int or None
        Width of values and out (None: ``head_dim``).
    value_in_key : bool
        Values read from the leading ``head_dim_v`` values of each key row (a pool of
        key rows only).
    sm_scale : float or None
        Passed to every call (None: the kernel's ``1/sqrt(head_dim)``).
    """

    name: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None
    value_in_key: bool = False
    sm_scale: float | None = None

    @classmethod
    def of(cls, m: ModelShape) -> "DecodeModel":
        """A :class:`~clattn.models.ModelShape` (K and V ``head_dim`` wide)."""
        return cls(m.name, m.num_qo_heads, m.num_kv_heads, m.head_dim)

    @classmethod
    def latent(cls, m: MLAShape) -> "DecodeModel":
        """The latent form of an MLA model (:meth:`~clattn.models.MLAShape.spec`), named
        ``"<name> (latent)"``, at the model's softmax scale."""
        s = m.spec("latent")
        return cls(f"{m.name} (latent)", s.num_qo_heads, s.num_kv_heads, s.head_dim,
                   s.head_dim_v, s.value_in_key, m.sm_scale)


#: the tuner's models: a GQA-4 shape with head_dim 128 and a GQA-7 one with head_dim 64
MODELS: tuple[ModelShape, ...] = (model_shape("Llama-3-8B"), model_shape("Qwen2.5-0.5B"))
#: the full run's MLA models: DeepSeek-V2-Lite's latent form (one 576-wide key row per
#: token, values its leading 512)
MLA_MODELS: tuple[DecodeModel, ...] = (DecodeModel.latent(mla_shape("DeepSeek-V2-Lite")),)
#: (batch, context) points per model
FULL_POINTS = ((1, 1024), (8, 1024), (1, 8192), (8, 8192))
QUICK_POINTS = ((1, 1024), (8, 1024), (1, 8192))
#: (batch, context) points per :data:`MLA_MODELS` model (full runs only)
MLA_POINTS = ((1, 8192),)
#: (new tokens, cached tokens) per sequence of the prefill workloads: a prompt on an empty
#: cache and a chunk over a long cache (the tuner's and ``tools/bench.py``'s)
PREFILL_CHUNKS = ((512, 0), (128, 4096))
#: (batch, new, cached) prefill points per model
PREFILL_FULL_POINTS = tuple((1, n, c) for n, c in PREFILL_CHUNKS)
PREFILL_QUICK_POINTS = ((1, 128, 1024),)
PAGE_SIZE = 16
DTYPE = "float16"


def spec_for(model: ModelShape | DecodeModel | Shape, **kw: Any) -> AttentionSpec:
    """The :class:`AttentionSpec` of a :class:`~clattn.models.ModelShape`,
    :class:`DecodeModel` or :class:`Shape` (``dtype``, ``page_size`` and other spec fields
    as keywords; f16 pages of :data:`PAGE_SIZE` rows by default)."""
    m = DecodeModel.of(model) if isinstance(model, ModelShape) else model
    return AttentionSpec(m.num_qo_heads, m.num_kv_heads, m.head_dim, head_dim_v=m.head_dim_v,
                         value_in_key=m.value_in_key, page_size=kw.pop("page_size", PAGE_SIZE),
                         dtype=kw.pop("dtype", DTYPE), **kw)


@dataclass(frozen=True)
class Shape:
    """One decode workload: a model at (batch, context), every sequence ``context`` rows
    (``head_dim_v``, ``value_in_key``, ``sm_scale``: its :class:`DecodeModel`'s)."""

    model: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    context: int
    dtype: str = DTYPE
    page_size: int = PAGE_SIZE
    head_dim_v: int | None = None
    value_in_key: bool = False
    sm_scale: float | None = None

    @property
    def spec(self) -> AttentionSpec:
        """The shape's :class:`AttentionSpec` (:func:`spec_for`)."""
        return spec_for(self, dtype=self.dtype, page_size=self.page_size)

    @property
    def key(self) -> str:
        """``Llama-3-8B B=1 ctx=1024``."""
        return f"{self.model} B={self.batch} ctx={self.context}"

    @property
    def itemsize(self) -> int:
        """Bytes per element of q, pages and out."""
        return np.dtype(self.dtype).itemsize

    @property
    def pages_per_sequence(self) -> int:
        """Pages each sequence spans."""
        return max(1, math.ceil(self.context / self.page_size))

    @property
    def num_pages(self) -> int:
        """Pages of one call (one page set)."""
        return self.batch * self.pages_per_sequence

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (the pool's bytes per token x rows)."""
        return int(self.page_size * self.spec.bytes_per_token)

    @property
    def pages_bytes(self) -> int:
        """Bytes of one page set."""
        return self.num_pages * self.page_bytes

    @property
    def bytes_moved(self) -> int:
        """The pool's rows read (bytes per token: K and V, or the K rows alone when values
        are in them), plus q read and out written (lse and tables neglected)."""
        spec = self.spec
        kv = int(self.batch * self.context * spec.bytes_per_token)
        return kv + self.batch * self.num_qo_heads * (spec.head_dim + spec.head_dim_v) \
            * self.itemsize


def prefill_flops(num_qo_heads: int, head_dim: int, batch: int, new: int, cached: int) -> float:
    """Causal prefill FLOPs: 4 x H_qo x D per attended (query, key) pair (QK and PV); query
    ``i`` of ``new`` attends the ``cached`` rows and new rows ``0..i``."""
    return 4.0 * num_qo_heads * head_dim * batch * (new * cached + new * (new + 1) / 2)


@dataclass(frozen=True)
class PrefillShape:
    """One prefill workload: a model, ``batch`` sequences of ``new`` queries each over
    ``cached`` rows already stored (the new rows are appended: ``new + cached`` stored)."""

    model: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    new: int
    cached: int
    dtype: str = DTYPE
    page_size: int = PAGE_SIZE

    @property
    def key(self) -> str:
        """``Llama-3-8B B=1 new=128 cached=4096``."""
        return f"{self.model} B={self.batch} new={self.new} cached={self.cached}"

    @property
    def flops(self) -> float:
        """:func:`prefill_flops` of the shape."""
        return prefill_flops(self.num_qo_heads, self.head_dim, self.batch, self.new, self.cached)


def prefill_shapes_for(points: Iterable[tuple[int, int, int]],
                       models: Iterable[ModelShape] = MODELS) -> list[PrefillShape]:
    """Every (model, batch, new, cached), cheapest first (slow candidates pruned early)."""
    out = [PrefillShape(m.name, m.num_qo_heads, m.num_kv_heads, m.head_dim, b, n, c)
           for m in models for b, n, c in points]
    return sorted(out, key=lambda s: (s.flops, s.key))


def shapes_for(points: Iterable[tuple[int, int]],
               models: Iterable[ModelShape | DecodeModel] = MODELS,
               mla_points: Iterable[tuple[int, int]] = (),
               mla_models: Iterable[DecodeModel] = MLA_MODELS) -> list[Shape]:
    """Every (model, batch, context) of ``models`` at ``points`` and of ``mla_models`` at
    ``mla_points``, cheapest first (so slow candidates are pruned early)."""
    pairs = [(m, p) for m in models for p in points] + \
        [(m, p) for m in mla_models for p in mla_points]
    out = []
    for m, (b, c) in pairs:
        d = DecodeModel.of(m) if isinstance(m, ModelShape) else m
        out.append(Shape(d.name, d.num_qo_heads, d.num_kv_heads, d.head_dim, b, c,
                         head_dim_v=d.head_dim_v, value_in_key=d.value_in_key,
                         sm_scale=d.sm_scale))
    return sorted(out, key=lambda s: (s.bytes_moved, s.key))


def pool_pages(set_pages: int, page_bytes: int, cold_bytes: int) -> int:
    """Pages of a pool holding at least one set of ``set_pages`` and ``cold_bytes``."""
    return max(set_pages, math.ceil(cold_bytes / page_bytes))


def rotating_tables(rng: np.random.Generator, pool: int, batch: int, context: int,
                    page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page tables of ``batch`` sequences of ``context`` rows, one per disjoint page set.

    Parameters
    ----------
    rng : numpy.random.Generator
    pool : int
        Pages in the pool.
    batch, context, page_size : int

    Returns
    -------
    (indptr, last_page_len, indices)
        ``indptr [batch + 1]`` and ``last_page_len [batch]`` (int32) are shared by every
        set; ``indices [n_sets, batch x pages per sequence]`` (int32): set ``k`` uses the
        pages of region ``k`` of the pool, shuffled (pages scattered, as in a real pool).
    """
    per_seq = max(1, -(-context // page_size))
    per_set = batch * per_seq
    n_sets = pool // per_set
    if n_sets < 1:
        raise ValueError(f"a pool of {pool} pages cannot hold {per_set} pages")
    indices = np.stack([k * per_set + rng.permutation(per_set) for k in range(n_sets)])
    indptr = (np.arange(batch + 1) * per_seq).astype(np.int32)
    last = np.full(batch, context - (per_seq - 1) * page_size, np.int32)
    return indptr, last, indices.astype(np.int32)


class PagePool:
    """One model's pages on the device, pseudo-random in ``[-1, 1)``: ``[pages, 2, H_kv,
    page_size, D]``, or a byte pool (:attr:`AttentionSpec.byte_pool`: values in the key
    rows, or unequal widths) whose rows are all ``dtype`` (no quantized format)."""

    def __init__(self, rt: Any, spec: AttentionSpec, pages: int, seed: int) -> None:
        self.spec = spec
        self.pages = host_memory.empty(rt.queue, spec.pool_shape(pages), spec.pool_dtype)
        if not spec.byte_pool:
            fill_random(rt, self.pages, seed=seed)
            return
        lay = spec.layout
        if any(lay.format(k) != spec.dtype for k in lay.kinds):
            raise ValueError(f"PagePool: {spec.k_format}/{spec.v_format} pages; a byte pool "
                             f"is filled only where every row is {spec.dtype}")
        # every byte of such a page is a dtype value (no block scales): fill them as dtype
        fill_random(rt, self.pages.base_data, dtype=spec.np_dtype, seed=seed)

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return int(self.pages.shape[0])

    def host_pages(self, count: int) -> np.ndarray:
        """The first ``count`` pages (page set 0 of :func:`rotating_tables`) on the host."""
        return self.pages[:count].get()

    def release(self) -> None:
        """Free the device memory now."""
        _release(self.pages)


class Workload:
    """One shape's device inputs on a :class:`PagePool`: q, the tables of every page
    set, out and lse. ``args()``: the positional arguments of ``BatchDecode.run`` for the
    next cold call, ``args(hot=True)`` for a hot one; ``kw``: its keywords (``sm_scale``).

    Rule: the cold page sets rotate once per workload, not once per caller. Two variants
    timed in turns that each kept their own count would read the same set one after the
    other, and every variant but the first would read what the first had just brought
    into the caches. Set 0 is the hot calls' own; cold calls take the others in turn
    (set 0 only when it is the only one)."""

    def __init__(self, rt: Any, pool: PagePool, batch: int, context: int, seed: int,
                 sm_scale: float | None = None) -> None:
        cl = runtime.cl()
        q = rt.queue
        spec = pool.spec
        rng = np.random.default_rng(seed)
        self.pool = pool
        self.kw = {"sm_scale": sm_scale}
        self.indptr, self.last, sets = rotating_tables(rng, pool.num_pages, batch, context,
                                                       spec.page_size)
        self.indices = sets[0]
        self.n_sets = len(sets)
        self.q_host = rng.standard_normal((batch, spec.num_qo_heads, spec.head_dim)).astype(
            spec.np_dtype)
        self.q = cl.array.to_device(q, self.q_host)
        self.d_indptr = cl.array.to_device(q, self.indptr)
        self.d_last = cl.array.to_device(q, self.last)
        self._d_sets = cl.array.to_device(q, sets.reshape(-1))
        n = sets.shape[1]
        self.d_indices = [self._d_sets[k * n:(k + 1) * n] for k in range(self.n_sets)]
        self.out = cl.array.empty(q, (batch, spec.num_qo_heads, spec.head_dim_v), spec.np_dtype)
        self.lse = cl.array.empty(q, self.q_host.shape[:2], np.float32)
        self._cold_calls = 0
        q.finish()

    def args(self, *, hot: bool = False) -> tuple:
        """``(q, pages, indptr, indices, last_page_len)`` on the device: over set 0 when
        ``hot``, else over the next cold set of the workload's one rotation."""
        k = 0
        if not hot and self.n_sets > 1:
            k = 1 + self._cold_calls % (self.n_sets - 1)
            self._cold_calls += 1
        return (self.q, self.pool.pages, self.d_indptr, self.d_indices[k], self.d_last)

    def host_args(self) -> tuple:
        """Page set 0 on the host: the same call for the CPU backend."""
        used = int(self.indices.size)
        return (self.q_host, self.pool.host_pages(used), self.indptr, self.indices, self.last)

    def release(self) -> None:
        """Free the device memory now (not the pool's)."""
        _release(self.q, self.d_indptr, self.d_last, self._d_sets, self.out, self.lse)


class PrefillWorkload:
    """One :class:`PrefillShape`'s device inputs: its own pool (pseudo-random pages, each
    sequence's pages shuffled over it), the tables, q, out and lse. ``args()``: the
    positional arguments of ``BatchPrefill.run``; ``qo``, ``indptr``, ``last``: the host
    tables ``BatchPrefill.plan`` reads."""

    def __init__(self, rt: Any, spec: AttentionSpec, shape: PrefillShape, seed: int) -> None:
        cl = runtime.cl()
        q = rt.queue
        rng = np.random.default_rng(seed)
        B, rows = shape.batch, shape.new + shape.cached
        per_seq = max(1, -(-rows // spec.page_size))
        self.pool = PagePool(rt, spec, B * per_seq, seed)
        self.qo = (np.arange(B + 1) * shape.new).astype(np.int32)
        self.indptr = (np.arange(B + 1) * per_seq).astype(np.int32)
        self.last = np.full(B, rows - (per_seq - 1) * spec.page_size, np.int32)
        indices = rng.permutation(B * per_seq).astype(np.int32)
        q_host = rng.standard_normal((B * shape.new, spec.num_qo_heads, spec.head_dim))
        self.q = cl.array.to_device(q, q_host.astype(spec.np_dtype))
        self.d_tables = [cl.array.to_device(q, a) for a in (self.qo, self.indptr, indices,
                                                             self.last)]
        self.out = cl.array.empty(q, self.q.shape, spec.np_dtype)
        self.lse = cl.array.empty(q, self.q.shape[:2], np.float32)
        q.finish()

    def args(self) -> tuple:
        """``(q, pages, qo_indptr, page_indptr, page_indices, last_page_len)`` on the device."""
        qo, indptr, indices, last = self.d_tables
        return (self.q, self.pool.pages, qo, indptr, indices, last)

    def release(self) -> None:
        """Free the device memory now (the pool's included)."""
        _release(self.q, self.out, self.lse, *self.d_tables)
        self.pool.release()


def _release(*arrays: Any) -> None:
    for a in arrays:
        try:
            a.finish()
            a.base_data.release()
        except Exception:  # noqa: BLE001 - best effort: the GC frees it anyway
            pass


__all__ = ["DTYPE", "DecodeModel", "FULL_POINTS", "MLA_MODELS", "MLA_POINTS", "MODELS",
           "PAGE_SIZE", "PREFILL_CHUNKS", "PREFILL_FULL_POINTS", "PREFILL_QUICK_POINTS",
           "PagePool", "PrefillShape", "PrefillWorkload", "QUICK_POINTS", "Shape", "Workload",
           "pool_pages", "prefill_flops", "prefill_shapes_for", "rotating_tables", "shapes_for",
           "spec_for"]
