"""The page bookkeeping of :class:`clattn.cache.PagedKVCache`: host only, no device.

A sequence holds an ordered list of pool pages. Its *stored rows* are the rows of that
list, in order: the kernels' offsets. Without a window they are the sequence's tokens;
with a window, whole pages that fell between the sinks and the window were given back
(``dropped`` of them), so stored offset ``o`` is token ``o`` below the sink pages and
token ``o + dropped * page_size`` after them. Pages carry reference counts: a fork shares
them, and a write into a shared page that holds rows copies it first (copy-on-write).

:meth:`PageTable.reserve` takes the pages a step needs (or raises
:class:`CacheFullError` with nothing changed) and builds the step's tables;
:meth:`PageTable.commit` makes the step's tokens part of their sequences and gives back
what a window dropped; :meth:`PageTable.release` undoes a reservation.

A step's queries are *virtual sequences* of the decode kernel: new token ``i`` of a
sequence attends to the stored rows up to and including its own (and its own window),
so a prompt chunk of ``n`` tokens is ``n`` causal decode rows in one launch.
:func:`prefill_runs` is the per-sequence view of the same step for the prefill kernel:
the runs of a chunk's tokens that one prefill sequence serves exactly, and the decode
tables of the tokens left to the decode kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from .numbers import is_int
from .spec import INT32_MAX, AttentionSpec

I32 = np.int32
_POS_LIMIT = INT32_MAX


class CacheFullError(RuntimeError):
    """The free pages cannot hold a step's new tokens; the cache is unchanged.

    ``needed`` and ``free`` are page counts.
    """

    def __init__(self, message: str, needed: int, free: int) -> None:
        super().__init__(message)
        self.needed, self.free = needed, free


class UnknownSequenceError(KeyError):
    """A sequence id the cache does not hold."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class DuplicateSequenceError(ValueError):
    """A sequence id given twice (add/fork of an id present, or twice in one step)."""


class PopTooLongError(ValueError):
    """A pop of more tokens than the sequence can give back."""


class _Seq:
    """One sequence: its pages, tokens, window and positions."""

    __slots__ = ("pages", "npages", "length", "dropped", "window", "sink", "pos_offset")

    def __init__(self, window: int | None, sink: int, pos_offset: int) -> None:
        self.pages = np.zeros(8, I32)  # capacity grows by doubling; [:npages] is the list
        self.npages = 0
        self.length = 0  # tokens, dropped ones included
        self.dropped = 0  # pages given back from between the sinks and the window
        self.window, self.sink, self.pos_offset = window, sink, pos_offset

    def copy(self) -> "_Seq":
        c = _Seq(self.window, self.sink, self.pos_offset)
        c.pages, c.npages = self.pages.copy(), self.npages
        c.length, c.dropped = self.length, self.dropped
        return c

    def stored(self, ps: int) -> int:
        return self.length - self.dropped * ps

    def first_retained(self, ps: int) -> int:
        """The first token after the sink pages that is still stored (window sequences)."""
        return (-(-self.sink // ps) + self.dropped) * ps

    def window_start(self, length: int) -> int:
        """The first token of the window (sinks before it) when the sequence has ``length``."""
        if self.window is None:
            return 0
        sink = min(self.sink, length)
        return max(sink, length - self.window)

    def ensure(self, n: int) -> None:
        if n > len(self.pages):
            grown = np.zeros(max(n, 2 * len(self.pages)), I32)
            grown[:self.npages] = self.pages[:self.npages]
            self.pages = grown


@dataclass(frozen=True)
class SeqState:
    """A sequence as :meth:`PageTable.state` gives it and :meth:`PageTable.install`
    takes it: tokens (``length``, dropped ones included), whole pages given back from
    between the sinks and the window (``dropped``), ``window``/``sink``/``pos_offset``
    as :meth:`PageTable.add` took them, and its page list (pool pages, or for install
    indices into the new pages)."""

    length: int
    dropped: int
    window: int | None
    sink: int
    pos_offset: int
    pages: np.ndarray


@dataclass
class StepTables:
    """One step's reservation and its tables (host, int32), tokens in ``begin``'s order.

    Decode tables (one virtual sequence per new token, ``T`` of them): ``page_indptr``,
    ``page_indices``, ``last_page_len``, ``window_offset``/``sink_size`` (window specs),
    ``q_pos``/``k_pos_offset`` (in-kernel RoPE). Append tables: ``slots [T]`` (flat slot
    ``page * page_size + slot``), ``k_pos [T]`` (absolute positions), ``copies [C * 3]``
    (copy-on-write: src page, dst page, rows). ``chunk [T]``: rows each token attends.
    """

    seq_ids: tuple
    lengths: tuple
    T: int
    page_indptr: np.ndarray
    page_indices: np.ndarray
    last_page_len: np.ndarray
    window_offset: np.ndarray | None
    sink_size: np.ndarray | None
    q_pos: np.ndarray
    k_pos_offset: np.ndarray
    slots: np.ndarray
    k_pos: np.ndarray
    copies: np.ndarray
    chunk: np.ndarray
    reserved: int
    undo: list = field(repr=False, default_factory=list)
    #: the step's prefill view (:func:`prefill_runs`), set by the cache; None: decode only
    prefill: "PrefillRuns | None" = None
    #: the step's packed custom mask ``(custom_mask, mask_indptr)`` over the prefill runs
    #: (:func:`clattn.mask.step_mask`), set by the cache; None: causal alone
    mask: tuple | None = None

    @property
    def n_copies(self) -> int:
        return len(self.copies) // 3

    def packed(self) -> tuple[np.ndarray, dict]:
        """Every table in one int32 array (one upload) and ``{name: (start, end)}``; the
        prefill view's tables are named ``prefill.<name>`` and ``decode.<name>``."""
        names = ["page_indptr", "page_indices", "last_page_len", "q_pos", "k_pos_offset",
                 "slots", "k_pos"]
        if self.window_offset is not None:
            names += ["window_offset", "sink_size"]
        if self.n_copies:
            names.append("copies")
        named = [(n, getattr(self, n)) for n in names]
        if self.prefill is not None:
            named += self.prefill.tables()
        ends = np.cumsum([len(a) for _, a in named])
        views = {n: (int(e - len(a)), int(e)) for (n, a), e in zip(named, ends)}
        return np.concatenate([a for _, a in named]).astype(I32, copy=False), views


@dataclass
class DecodeRows:
    """Decode tables of a step whose prefill view leaves some tokens to the decode kernel:
    the step's token tables with the tokens of prefill runs made empty (no pages; the
    decode kernel writes ``out = 0``, ``lse = -inf`` there, and the prefill launch after
    it writes those rows)."""

    page_indptr: np.ndarray
    page_indices: np.ndarray
    last_page_len: np.ndarray
    window_offset: np.ndarray | None
    sink_size: np.ndarray | None
    chunk: np.ndarray


@dataclass
class PrefillRuns:
    """The per-sequence view of a step for the prefill kernel (:func:`prefill_runs`).

    Run ``r`` is the ``n[r]`` consecutive tokens starting at step row ``q_start[r]``
    (``begin``'s order) of one sequence; its tables (``page_indptr [R + 1]``,
    ``page_indices``, ``last_page_len``, ``window_offset``/``sink_size``,
    ``k_pos_offset``, ``chunk [R]``) are those of its last token, so its tokens are the
    last ``n[r]`` rows of that chunk (docs/prefill.md). ``tokens [T]``: the step rows
    the runs serve; ``decode``: the tables of the other rows (None when runs serve every
    row). ``units``: the prefill plan's unit table, rows of q counted in the whole step
    (set by the device backend).
    """

    q_start: np.ndarray
    n: np.ndarray
    qo_indptr: np.ndarray
    page_indptr: np.ndarray
    page_indices: np.ndarray
    last_page_len: np.ndarray
    window_offset: np.ndarray | None
    sink_size: np.ndarray | None
    k_pos_offset: np.ndarray
    chunk: np.ndarray
    tokens: np.ndarray
    decode: DecodeRows | None
    units: np.ndarray | None = None

    @property
    def rows(self) -> np.ndarray:
        """The step rows the runs serve, run after run (ascending)."""
        return np.flatnonzero(self.tokens)

    def tables(self) -> list[tuple[str, np.ndarray]]:
        """``(name, int32 array)`` of every table the device kernels read."""
        names = ["page_indptr", "page_indices", "last_page_len", "k_pos_offset"]
        if self.window_offset is not None:
            names += ["window_offset", "sink_size"]
        out = [(f"prefill.{n}", getattr(self, n)) for n in names]
        if self.units is not None:
            out.append(("prefill.units", self.units.reshape(-1)))
        if self.decode is not None:
            d = self.decode
            out += [(f"decode.{n}", getattr(d, n)) for n in names[:3]]
            if d.window_offset is not None:
                out += [("decode.window_offset", d.window_offset),
                        ("decode.sink_size", d.sink_size)]
        return out


def prefill_runs(t: StepTables, long_from: int | None = None) -> PrefillRuns | None:
    """The runs of the step's tokens that the prefill kernel serves exactly; None when
    there are none (a decode step, or no chunk has two such tokens in a row).

    A token is served by a prefill run when its sequence brings several tokens and its
    own attended rows have no gap (no window, or ``window_offset == sink_size``: it
    attends every stored row up to its own). A run is two or more such consecutive tokens
    of one sequence; then the run's last token's tables give every token of the run
    exactly its own rows (the prefill kernel's causal rule). Tokens whose window has
    begun to slide (each has its own window start) and single tokens stay on the decode
    kernel. ``long_from`` (RoPE inside the kernels with long factors): a run does not
    cross the first long-factor query position, because the prefill kernel chooses the
    factors of a sequence by its last query as the decode kernel does per token.
    """
    T, B = t.T, len(t.lengths)
    if T == B:
        return None
    counts = np.asarray(t.lengths, np.int64)
    seq = np.repeat(np.arange(B), counts)
    key = np.repeat(counts > 1, counts).astype(np.int64)
    if t.window_offset is not None:
        key &= t.window_offset == t.sink_size
    if long_from is not None:
        key += 2 * (t.q_pos >= long_from)
    new = np.ones(T, bool)
    new[1:] = (seq[1:] != seq[:-1]) | (key[1:] != key[:-1])
    start = np.flatnonzero(new)
    n = np.diff(np.append(start, T))
    served = (key[start] & 1).astype(bool) & (n > 1)
    if not served.any():
        return None
    tokens = np.repeat(served, n)
    start, n = start[served], n[served]
    last = start + n - 1
    indptr = t.page_indptr.astype(np.int64)
    lo, npg = indptr[last], indptr[last + 1] - indptr[last]
    page_indptr = np.zeros(len(last) + 1, I32)
    np.cumsum(npg, out=page_indptr[1:])
    at = np.arange(int(page_indptr[-1])) + np.repeat(lo - page_indptr[:-1], npg)
    qo_indptr = np.zeros(len(n) + 1, I32)
    np.cumsum(n, out=qo_indptr[1:])
    windowed = t.window_offset is not None
    decode = None
    if not tokens.all():
        keep_pages = ~np.repeat(tokens, np.diff(indptr))
        dpg = np.where(tokens, 0, np.diff(indptr))
        dindptr = np.zeros(T + 1, I32)
        np.cumsum(dpg, out=dindptr[1:])
        decode = DecodeRows(
            page_indptr=dindptr, page_indices=t.page_indices[keep_pages],
            last_page_len=np.where(tokens, 0, t.last_page_len).astype(I32),
            window_offset=np.where(tokens, 0, t.window_offset).astype(I32) if windowed
            else None,
            sink_size=np.where(tokens, 0, t.sink_size).astype(I32) if windowed else None,
            chunk=np.where(tokens, 0, t.chunk).astype(I32))
    return PrefillRuns(
        q_start=start.astype(I32), n=n.astype(I32), qo_indptr=qo_indptr,
        page_indptr=page_indptr, page_indices=t.page_indices[at].astype(I32),
        last_page_len=t.last_page_len[last].astype(I32),
        window_offset=t.window_offset[last].astype(I32) if windowed else None,
        sink_size=t.sink_size[last].astype(I32) if windowed else None,
        k_pos_offset=t.k_pos_offset[last].astype(I32), chunk=t.chunk[last].astype(I32),
        tokens=tokens, decode=decode)


class PageTable:
    """Free pages, reference counts and the sequences' page lists of one pool size."""

    def __init__(self, spec: AttentionSpec, num_pages: int, rollback: int = 0) -> None:
        self.spec = spec
        self.rollback = rollback  # tokens behind a window kept for pop()
        self.ps = spec.page_size
        self.num_pages = num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives 0, 1, ...
        self.refcount = np.zeros(num_pages, I32)
        self.seqs: dict[Hashable, _Seq] = {}

    # -- lifecycle -------------------------------------------------------------------
    def seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self.seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(f"sequence {seq_id!r} is not in the cache (it holds "
                                       f"{_ids(self.seqs)})") from None

    def _new_id(self, seq_id: Hashable, what: str) -> None:
        try:
            hash(seq_id)
        except TypeError:
            raise TypeError(f"{what}: sequence id {seq_id!r} is not hashable") from None
        if seq_id in self.seqs:
            raise DuplicateSequenceError(f"{what}: sequence {seq_id!r} is already in the cache")

    def add(self, seq_id: Hashable, *, window: int | None, sink: int, pos_offset: int) -> None:
        self._new_id(seq_id, "add")
        if window is not None:
            if not self.spec.sliding_window:
                raise ValueError(f"add: window={window} needs a spec built with "
                                 f"sliding_window=True (the decode kernel compiles it in)")
            if not is_int(window) or window < 1:
                raise ValueError(f"add: window={window!r} must be a positive integer")
        if not is_int(sink) or sink < 0:
            raise ValueError(f"add: sink={sink!r} must be an integer >= 0")
        if sink and window is None:
            raise ValueError(f"add: sink={sink} without a window; sinks are the tokens kept "
                             f"besides a window")
        if not is_int(pos_offset) or not 0 <= pos_offset <= _POS_LIMIT:
            raise ValueError(f"add: pos_offset={pos_offset!r} must be an int32 >= 0")
        self.seqs[seq_id] = _Seq(None if window is None else int(window), int(sink),
                                 int(pos_offset))

    def remove(self, seq_id: Hashable) -> None:
        s = self.seq(seq_id)
        self._decref(s.pages[:s.npages])
        del self.seqs[seq_id]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        p = self.seq(parent)
        self._new_id(child, "fork")
        c = p.copy()
        self.refcount[c.pages[:c.npages]] += 1
        self.seqs[child] = c

    def poppable(self, seq_id: Hashable) -> int:
        """The most tokens :meth:`pop` can take back from the sequence now."""
        s = self.seq(seq_id)
        if s.dropped:  # the shorter window must not reach pages given back
            return max(0, s.length - s.window - s.first_retained(self.ps))
        return s.length

    def pop(self, seq_id: Hashable, n: int) -> None:
        s = self.seq(seq_id)
        if not is_int(n) or n < 0:
            raise ValueError(f"pop: n={n!r} must be an integer >= 0")
        most = self.poppable(seq_id)
        if n > most:
            why = "" if not s.dropped else \
                (f"; its window has given back tokens before {s.first_retained(self.ps)}, "
                 f"and the window of a shorter sequence would need them")
            raise PopTooLongError(f"pop: sequence {seq_id!r} holds {s.length} tokens; at most "
                                  f"{most} can be popped{why}")
        s.length -= n
        keep = -(-s.stored(self.ps) // self.ps)
        self._decref(s.pages[keep:s.npages])
        s.npages = keep
        if s.length == 0:
            s.dropped = 0

    # -- saved sequences (clattn.cache_store) -------------------------------------------
    def state(self, seq_id: Hashable) -> "SeqState":
        """What the table holds of one sequence, its pool pages included."""
        s = self.seq(seq_id)
        return SeqState(length=s.length, dropped=s.dropped, window=s.window, sink=s.sink,
                        pos_offset=s.pos_offset, pages=s.pages[:s.npages].copy())

    def install(self, items: Sequence[tuple[Hashable, "SeqState"]], num_pages: int) -> np.ndarray:
        """Add the sequences ``items`` (id, state), whose ``pages`` number ``num_pages``
        new pages ``0 .. num_pages - 1`` (shared ones repeated); returns the pool page of
        each new page. The pages are taken from the free ones as a step takes them
        (:class:`CacheFullError` when too few are free), one contiguous run when the free
        pages have one. Raises before anything is changed for an id present or given
        twice (:class:`DuplicateSequenceError`) or a full pool."""
        seen: set = set()
        for seq_id, _ in items:
            self._new_id(seq_id, "load")
            if seq_id in seen:
                raise DuplicateSequenceError(f"load: sequence {seq_id!r} given twice")
            seen.add(seq_id)
        if num_pages > len(self.free):
            raise self._full("load: the sequences need", num_pages,
                             "Remove or offload sequences")
        got = _contiguous_pick(self.free, num_pages)
        taken = set(got.tolist())
        self.free = [p for p in self.free if p not in taken]
        for seq_id, st in items:
            s = _Seq(st.window, st.sink, st.pos_offset)
            s.ensure(len(st.pages))
            s.npages = len(st.pages)
            s.pages[:s.npages] = got[np.asarray(st.pages, np.int64)]
            s.length, s.dropped = st.length, st.dropped
            np.add.at(self.refcount, s.pages[:s.npages], 1)
            self.seqs[seq_id] = s
        return got

    # -- the step ----------------------------------------------------------------------
    def reserve(self, seq_ids: Sequence[Hashable], lengths: Sequence[int] | None,
                rope: str | None) -> StepTables:
        ids, ns, seqs = self.check_step(seq_ids, lengths)
        ps = self.ps
        # pages each sequence needs, copies included, counted before anything changes
        rc: dict[int, int] = {}
        needed, plan = 0, []
        for s, n in zip(seqs, ns):
            st = s.length - s.dropped * ps
            grow = -(-(st + n) // ps) - s.npages
            cow = False
            if st % ps and self.refcount[s.pages[s.npages - 1]] > 1:
                last = int(s.pages[s.npages - 1])
                r = rc.setdefault(last, int(self.refcount[last]))
                if r > 1:  # shared and partly filled: this sequence copies it
                    cow, rc[last] = True, r - 1
            plan.append((grow, cow))
            needed += grow + cow
        if needed > len(self.free):
            raise self._full("begin: the step needs", needed,
                             "Remove or pop sequences, give them a window")
        copies: list[int] = []
        undo = []
        for s, (grow, cow) in zip(seqs, plan):
            if not (grow or cow):
                undo.append((s, s.npages, -1))
                continue
            st = s.stored(ps)
            old_last = int(s.pages[s.npages - 1]) if cow else -1
            undo.append((s, s.npages, old_last))
            s.ensure(s.npages + grow)
            if cow:
                new = self._take(1)[0]
                copies += [old_last, new, st % ps]
                s.pages[s.npages - 1] = new
                self.refcount[old_last] -= 1
            if grow:
                s.pages[s.npages:s.npages + grow] = self._take(grow)
                s.npages += grow
        t = self._tables(ids, ns, seqs, rope)
        t.copies = np.array(copies, I32)
        t.reserved, t.undo = needed, undo
        return t

    def commit(self, t: StepTables) -> None:
        """The step's tokens join their sequences; windows give back whole pages."""
        ps = self.ps
        for s, n in zip((self.seqs[i] for i in t.seq_ids), t.lengths):
            s.length += n
            if s.window is None:
                continue
            nsp = -(-s.sink // ps)
            keep_from = max(0, s.window_start(s.length) - self.rollback)
            lo = min(s.npages, keep_from // ps - s.dropped)
            k = lo - nsp
            if k > 0:
                self._decref(s.pages[nsp:lo].copy())
                s.pages[nsp:s.npages - k] = s.pages[lo:s.npages].copy()
                s.npages -= k
                s.dropped += k
        t.undo = []

    def release(self, t: StepTables, keep_copies: bool = False) -> None:
        """Undo :meth:`reserve`: pages back, lengths unchanged.

        ``keep_copies``: the sequences that copied a shared page keep their copy (the
        caller has copied every layer's rows into it): once a step has written, another
        holder may have written in place into the shared page beyond their rows.
        Otherwise the copies are undone too (nothing was launched).
        """
        for s, npages, old_last in reversed(t.undo):
            if old_last >= 0 and not keep_copies:
                self.refcount[old_last] += 1
                self._decref(s.pages[npages - 1:npages].copy())
                s.pages[npages - 1] = old_last
            self._decref(s.pages[npages:s.npages].copy())
            s.npages = npages
        t.undo = []

    # -- helpers ---------------------------------------------------------------------
    def _full(self, what: str, needed: int, advice: str) -> CacheFullError:
        return CacheFullError(
            f"{what} {needed} free pages, the pool has {len(self.free)} of {self.num_pages} "
            f"(page_size {self.ps}); nothing was changed. {advice}, or make the cache with "
            f"more num_pages= or budget_bytes=", needed, len(self.free))

    def _take(self, n: int) -> list[int]:
        got = self.free[-n:][::-1]
        del self.free[-n:]
        self.refcount[got] = 1
        return got

    def _decref(self, pages: np.ndarray) -> None:
        if len(pages):
            self.refcount[pages] -= 1
            self.free.extend(int(p) for p in pages[self.refcount[pages] == 0][::-1])

    def check_step(self, seq_ids: Sequence[Hashable],
                   lengths: Sequence[int] | None) -> tuple[tuple, tuple, list]:
        """``(ids, ns, seqs)`` of a step's ``seq_ids`` and ``lengths`` (any iterables, read
        once; ``ns`` all 1 when ``lengths`` is None), or the named ``ValueError`` of
        :meth:`reserve`; changes nothing."""
        ids = tuple(seq_ids) if not isinstance(seq_ids, np.ndarray) else tuple(seq_ids.tolist())
        if not ids:
            raise ValueError("begin: seq_ids is empty; a step needs at least one sequence")
        ns = (1,) * len(ids) if lengths is None else tuple(lengths)
        if len(ns) != len(ids):
            raise ValueError(f"begin: {len(ids)} seq_ids but {len(ns)} lengths")
        seqs = [self.seq(i) for i in ids]
        if len(set(ids)) != len(ids):
            i = next(i for k, i in enumerate(ids) if i in ids[:k])
            raise DuplicateSequenceError(f"begin: sequence {i!r} appears twice in seq_ids")
        if lengths is not None:
            for i, n in zip(ids, ns):
                if not is_int(n) or n < 1:
                    raise ValueError(f"begin: lengths for sequence {i!r} is {n!r}; each must "
                                     f"be an integer >= 1 (new tokens of the step)")
            ns = tuple(int(n) for n in ns)
        for i, s, n in zip(ids, seqs, ns):
            if s.pos_offset + s.length + n - 1 > _POS_LIMIT:
                raise ValueError(f"begin: sequence {i!r} would reach position "
                                 f"{s.pos_offset + s.length + n - 1}, beyond int32")
        return ids, ns, seqs

    def _tables(self, ids: tuple, ns: tuple, seqs: list, rope: str | None) -> StepTables:
        """The step's decode and append tables (pages already reserved), vectorised over
        the step's tokens: token ``i`` of a sequence sees its stored rows up to its own."""
        ps = self.ps
        B = len(seqs)
        counts = np.asarray(ns, np.int64)
        T = int(counts.sum())
        if T == B:
            return self._decode_tables(ids, ns, seqs)
        per = np.array([(s.length - s.dropped * ps, s.length, s.dropped, -1 if s.window is None
                         else s.window, s.sink, s.pos_offset, s.first_retained(ps), s.npages)
                        for s in seqs], np.int64).reshape(B, 8)
        seq = np.repeat(np.arange(B), counts)
        i = np.arange(T) - np.repeat(np.cumsum(counts) - counts, counts)
        st0, length0, dropped, window, sink0, pos, first, npages = per[seq].T
        stored = st0 + i + 1  # rows each new token sees, its own included
        npg = -(-stored // ps)
        length = length0 + i + 1
        sink = np.where(window < 0, 0, np.minimum(sink0, length))
        wo = np.where(window < 0, 0, np.maximum(sink, length - window))
        wo = np.where((window >= 0) & (wo >= first), wo - dropped * ps, wo)
        chunk = stored - wo + sink
        pages = np.concatenate([s.pages[:s.npages] for s in seqs])
        base = np.cumsum(per[:, 7]) - per[:, 7]  # where each sequence's pages start
        off = st0 + i  # the stored offset each new token is written at
        slots = pages[base[seq] + off // ps].astype(np.int64) * ps + off % ps
        # token t reads the first npg[t] pages of its sequence
        total = int(npg.sum())
        indices = pages[np.arange(total) + np.repeat(base[seq] - (np.cumsum(npg) - npg), npg)]
        indptr = np.zeros(T + 1, I32)
        np.cumsum(npg, out=indptr[1:])
        windowed = self.spec.sliding_window
        return StepTables(
            seq_ids=ids, lengths=ns, T=T, page_indptr=indptr, page_indices=indices.astype(I32),
            last_page_len=(stored - (npg - 1) * ps).astype(I32),
            window_offset=wo.astype(I32) if windowed else None,
            sink_size=sink.astype(I32) if windowed else None,
            q_pos=(pos + chunk - 1).astype(I32), k_pos_offset=pos.astype(I32),
            slots=slots.astype(I32), k_pos=(pos + length0 + i).astype(I32),
            copies=np.zeros(0, I32), chunk=chunk.astype(I32), reserved=0)


    def _decode_tables(self, ids: tuple, ns: tuple, seqs: list) -> StepTables:
        """:meth:`_tables` for a decode step (one new token per sequence) in plain Python
        per sequence: a handful of integers each, cheaper than numpy on tiny arrays."""
        ps = self.ps
        rows = []
        for s in seqs:
            stored, length = s.length - s.dropped * ps + 1, s.length + 1
            wo = sink = 0
            if s.window is not None:
                sink = min(s.sink, length)
                wo = max(sink, length - s.window)
                if wo >= s.first_retained(ps):
                    wo -= s.dropped * ps
            chunk = stored - wo + sink
            slot = int(s.pages[(stored - 1) // ps]) * ps + (stored - 1) % ps
            rows.append((s.npages, stored - (s.npages - 1) * ps, wo, sink,
                         s.pos_offset + chunk - 1, s.pos_offset, slot, s.pos_offset + s.length,
                         chunk))
        npg, last, wo, sink, qpos, kpo, slots, kpos, chunk = np.array(rows, I32).T.copy()
        indptr = np.zeros(len(seqs) + 1, I32)
        np.cumsum(npg, out=indptr[1:])
        windowed = self.spec.sliding_window
        return StepTables(
            seq_ids=ids, lengths=ns, T=len(seqs), page_indptr=indptr,
            page_indices=np.concatenate([s.pages[:s.npages] for s in seqs]), last_page_len=last,
            window_offset=wo if windowed else None, sink_size=sink if windowed else None,
            q_pos=qpos, k_pos_offset=kpo, slots=slots, k_pos=kpos, copies=np.zeros(0, I32),
            chunk=chunk, reserved=0)


def _contiguous_pick(free: list[int], n: int) -> np.ndarray:
    """``n`` of the ``free`` pages, ascending: the lowest run of ``n`` consecutive pages
    when there is one (a load then writes each layer's pages in one transfer), else the
    ``n`` lowest."""
    pages = np.sort(np.asarray(free, np.int64))
    if n == 0:
        return pages[:0]
    runs = np.flatnonzero(pages[n - 1:] - pages[:len(pages) - n + 1] == n - 1)
    first = int(runs[0]) if len(runs) else 0
    return pages[first:first + n] if len(runs) else pages[:n]


def _ids(seqs: dict) -> str:
    keys = list(seqs)
    if not keys:
        return "no sequences"
    return ", ".join(map(repr, keys[:8])) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
