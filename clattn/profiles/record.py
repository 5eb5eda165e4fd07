"""The device profile: every choice the kernels take, as one typed record."""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

STRATEGIES = ("rows", "tiled")
REDUCTIONS = ("local", "subgroup")
#: the fields that may be null (None): "the kernel's own choice" / "none required"
NULLABLE = ("subgroup_size", "prefill_qb", "prefill_kb", "prefill_tc", "prefill_rm",
            "prefill_vec")


#: keys profiles may still name that are no longer settings, and why
RETIRED = {
    "use_local_kv": "the kernels decide where K/V rows go: the tiled prefill always stages "
                    "them in local memory, the decode kernels keep each row in registers",
}


def drop_retired(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``params`` without the :data:`RETIRED` keys, each dropped with a warning that names
    it, ``where`` it was and why it no longer counts."""
    out = dict(params)
    for key, why in RETIRED.items():
        if key in out:
            del out[key]
            warnings.warn(f"clattn: {where}: {key!r} is no longer a profile setting ({why}); "
                          f"ignored, remove it", RuntimeWarning, stacklevel=3)
    return out


@dataclass(frozen=True)
class Profile:
    """Kernel parameters for one device family.

    strategy
        ``"rows"``: one work-item per (sequence, KV head, partition) walks the rows
        with private accumulators for its whole query-head group; no barriers
        (CPU drivers). ``"tiled"``: work-groups of threads across head_dim x row
        slices, each thread serving every query head of the group, cross-thread dot
        products.
    thread_limit
        Upper bound on work-items per work-group (tiled).
    tile_rows
        KV rows each row-slice handles per step (tiled; the seed's TILE_SIZE_PER_BDX):
        a step of row slices x tile_rows rows costs two barriers with the local-memory
        reduction. rows: rows per block (a power of two up to 16; more than 8 only while
        their K and V rows fit in ``clattn.fit.ROWS_BLOCK_BYTES``).
    vec
        Elements each work-item loads at once along head_dim (1, 2, 4, 8 or 16). rows:
        at most the device's native float width where that is 8 or more (CPU profiles
        ask 16: AVX-512 keeps it, AVX2 takes 8).
    reduction / subgroup_size
        How a tiled work-group sums partial dot products: ``"local"`` memory, or
        ``"subgroup"`` reductions with the given required sub-group size (falls back
        to ``"local"`` on a device without sub-groups).
    native_fp16
        Load f16 with native ``half`` types where cl_khr_fp16 exists (else vload_half).
    wgs_per_cu, min_partition_rows, max_partitions, split_min_rows
        Split-KV planning: work-groups in flight per compute unit that "fill" the
        device, the shortest partition worth its own work-group, a cap on partitions
        per sequence, and the least work (the larger of work-groups and compute units,
        times the longest chunk, in rows) that pays for the extra merge pass.
    merge_threads
        Work-group size of the merge kernels.
    prefill_qb, prefill_kb
        Prefill (:func:`clattn.fit.prefill_geometry`): queries per work unit (rows: per
        work-item; tiled: per work-group) and keys per block. None: derived (rows:
        queries whose q and accumulators fill about 4096 floats, keys per block from
        ``tile_rows``; tiled: as many queries as the row groups hold, ``2 * prefill_tc``
        keys).
    prefill_vec
        Rows prefill: floats per vector (across rows in the scores, along head_dim in
        the values), cut as ``vec``. None: the wider of ``vec`` and the device's native
        float vector width (16 with AVX-512: 1.7-1.9x the speed of 8 on a Zen 5, PoCL and
        Intel's runtime).
    prefill_tc, prefill_rm
        Tiled prefill: the row-group shape, ``prefill_tc`` threads per row group (keys in
        the score phase, head_dim in the value phase) x ``prefill_rm`` (query, head) rows
        per thread. None: 16 x 4.
    fuse_append
        :class:`~clattn.PagedKVCache` steps of one token per sequence write each layer's
        new rows inside its decode launch (one launch per layer instead of two) where the
        pool stores float rows; False keeps the append kernel's own launch (docs/cache.md).
    fold_merge
        A split-KV decode merges its partitions in the decode launch itself (the last
        partition of a sequence to finish merges them: one launch instead of two, the
        same bits); False keeps the merge kernel's own launch (docs/contract.md,
        "Split-KV").
    """

    name: str = "generic"
    source: str = "conservative default"
    strategy: str = "tiled"
    thread_limit: int = 256
    tile_rows: int = 1
    vec: int = 4
    reduction: str = "local"
    subgroup_size: int | None = None
    native_fp16: bool = False
    wgs_per_cu: int = 4
    min_partition_rows: int = 256
    max_partitions: int = 64
    split_min_rows: int = 0
    merge_threads: int = 64
    prefill_qb: int | None = None
    prefill_kb: int | None = None
    prefill_tc: int | None = None
    prefill_rm: int | None = None
    fuse_append: bool = True
    fold_merge: bool = True
    prefill_vec: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy={self.strategy!r} (allowed: {', '.join(STRATEGIES)})")
        if self.reduction not in REDUCTIONS:
            problems.append(f"reduction={self.reduction!r} (allowed: {', '.join(REDUCTIONS)})")
        if self.vec not in (1, 2, 4, 8, 16):
            problems.append(f"vec={self.vec!r} (allowed: 1, 2, 4, 8, 16)")
        for k in ("fuse_append", "fold_merge"):
            if not isinstance(getattr(self, k), bool):
                problems.append(f"{k}={getattr(self, k)!r} (true or false)")
        if self.prefill_vec not in (None, 1, 2, 4, 8, 16):
            problems.append(f"prefill_vec={self.prefill_vec!r} (allowed: null, 1, 2, 4, 8, 16)")
        for k in ("thread_limit", "tile_rows", "wgs_per_cu", "min_partition_rows",
                  "max_partitions", "merge_threads", "split_min_rows"):
            v = getattr(self, k)
            low = 0 if k == "split_min_rows" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                problems.append(f"{k}={v!r} (an integer >= {low})")
        for k in NULLABLE:
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                problems.append(f"{k}={v!r} (a positive integer or null)")
        if problems:
            raise ValueError(f"profile {self.name!r}: invalid " + "; ".join(problems))

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base: "Profile | None" = None,
                  where: str = "profile") -> "Profile":
        """Layer ``data`` over ``base`` (or the defaults); unknown keys raise, retired
        ones (:data:`RETIRED`) are dropped with one warning each."""
        data = drop_retired(data, where)
        allowed = cls.keys()
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed keys: {allowed}")
        return replace(base or cls(), **dict(data))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> "Profile":
        return replace(self, **changes)
