"""The device profile: every choice the kernels take, as one typed record."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

STRATEGIES = ("rows", "tiled")
REDUCTIONS = ("local", "subgroup")
#: the fields that may be null (None): "the kernel's own choice" / "none required"
NULLABLE = ("subgroup_size", "prefill_qb", "prefill_kb", "prefill_tc", "prefill_rm")


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
        Elements each work-item loads at once along head_dim (1, 2, 4, 8 or 16).
    use_local_kv
        Stage K/V tiles in local memory. The tiled prefill always does (noted when off);
        the tiled decode does not apply the wish (each work-item keeps a K/V row in
        registers for all its query heads, so the row is loaded once per work-group).
        Profile files may name it; the tuner does not search it.
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
    prefill_tc, prefill_rm
        Tiled prefill: the row-group shape, ``prefill_tc`` threads per row group (keys in
        the score phase, head_dim in the value phase) x ``prefill_rm`` (query, head) rows
        per thread. None: 16 x 4.
    """

    name: str = "generic"
    source: str = "conservative default"
    strategy: str = "tiled"
    thread_limit: int = 256
    tile_rows: int = 1
    vec: int = 4
    use_local_kv: bool = True
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

    def __post_init__(self) -> None:
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy={self.strategy!r} (allowed: {', '.join(STRATEGIES)})")
        if self.reduction not in REDUCTIONS:
            problems.append(f"reduction={self.reduction!r} (allowed: {', '.join(REDUCTIONS)})")
        if self.vec not in (1, 2, 4, 8, 16):
            problems.append(f"vec={self.vec!r} (allowed: 1, 2, 4, 8, 16)")
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
        """Layer ``data`` over ``base`` (or the defaults); unknown keys raise."""
        allowed = cls.keys()
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed keys: {allowed}")
        return replace(base or cls(), **dict(data))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> "Profile":
        return replace(self, **changes)
