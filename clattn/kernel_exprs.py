"""OpenCL C expressions the kernel templates splice in, built in Python.

The templates (``kernels/*.mako``) read as OpenCL C with loops and substitutions;
every piece of C text that takes a decision to build (a reduction tree, a page-format
load, the RoPE pairing) comes from a function here, so that it can be tested alone.
Arguments named ``v``, ``ptr``, ``name``, ``lane`` or ``e`` are C expressions, spliced
into the result as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

#: page formats whose rows are blocks of 32 codes with one f16 scale each
QUANTIZED = ("q8_0", "q4_0")


def vtype(scalar: str, n: int) -> str:
    """The OpenCL type of ``n`` lanes of ``scalar`` (``n == 1``: the scalar itself)."""
    return scalar if n == 1 else "%s%d" % (scalar, n)


def hsum(v: str, vec: int) -> str:
    """Horizontal sum of a float<vec> expression, as a balanced tree."""
    terms = ["(%s)" % v] if vec == 1 else ["(%s).s%x" % (v, i) for i in range(vec)]
    while len(terms) > 1:
        terms = ["(%s + %s)" % (terms[i], terms[i + 1]) for i in range(0, len(terms), 2)]
    return terms[0]


def score(x: str, softcap: float | None) -> str:
    """Score in log2 units; q was pre-scaled by sm_scale (and log2 e without soft-cap)."""
    if softcap is None:
        return "(%s)" % x
    return "(%.9ef * tanh((%s) * %.9ef) * CLATTN_LOG2E)" % (softcap, x, 1.0 / softcap)


def select_max(a: str, b: str) -> str:
    """The larger of ``a`` and ``b`` by compare and select (max() is undefined for
    infinities in OpenCL C)."""
    return "(%s > %s ? %s : %s)" % (a, b, a, b)


def private_store(val: str, ptr: str, fv: str) -> str:
    """Statement storing the ``fv`` vector ``val`` at the private pointer ``ptr``."""
    return "*(%s*)(%s) = %s;" % (fv, ptr, val)


def private_load(ptr: str, fv: str) -> str:
    """The ``fv`` vector at the private pointer ``ptr``."""
    return "*(%s*)(%s)" % (fv, ptr)


def causal_mask(key: str, v: str, vec: int) -> str:
    """Whether chunk row ``key`` is attended by each row of row vector ``v`` (against
    the int<vec> ``lim[v]``, the last chunk row each row attends)."""
    if vec == 1:
        return "(%s <= lim[%s])" % (key, v)
    return "((%s)(%s) <= lim[%s])" % (vtype("int", vec), key, v)


def hred_or(v: str, n: int) -> str:
    """Whether any lane of an int<n> expression is nonzero (a tree of .lo | .hi)."""
    while n > 1:
        v = "(%s | %s)" % halves(v, n, "int")
        n //= 2
    return v


def halves(v: str, n: int, elem: str = "float") -> tuple[str, str]:
    """The low and high halves of an ``elem``<n> expression: ``.lo``/``.hi``, or for 16
    lanes vectors of its components (Oclgrind's uninitialised-value check reports the
    halves of a 16-lane vector that a loop computed as uninitialised; the components it
    tracks)."""
    if n != 16:
        return "(%s).lo" % v, "(%s).hi" % v
    return tuple("(%s8)(%s)" % (elem, ", ".join("(%s).s%x" % (v, i) for i in range(h, h + 8)))
                 for h in (0, 8))


def hred(v: str, op: str, n: int) -> str:
    """Reduce a float<n> expression to a float with a tree of halves
    (:func:`halves`).

    ``op`` is ``"+"`` (the sum) or ``"max"`` (:func:`select_max`).
    """
    while n > 1:
        a, b = halves(v, n)
        v = ("(%s + %s)" % (a, b)) if op == "+" else select_max(a, b)
        n //= 2
    return v


class LaneChunks(NamedTuple):
    """How the lanes of a row hold a ``width``-wide vector in ``vec``-wide chunks: lane
    ``tx`` of ``lanes`` holds chunks ``c = 0 .. count - 1`` at dims
    ``(c * lanes + tx) * vec ..`` (the tiled decode kernel's value accumulators)."""

    width: int
    lanes: int
    vec: int

    @property
    def count(self) -> int:
        """Chunks per lane."""
        return -(-self.width // (self.lanes * self.vec))

    def at(self, c: int) -> str:
        """The first dim of chunk ``c`` of lane ``tx`` (a C expression)."""
        return "(%d + tx) * %d" % (c * self.lanes, self.vec)

    def held(self, c: int) -> str:
        """The C condition that lane ``tx`` holds chunk ``c``: always, but in the last
        chunk of a width the lanes do not fill."""
        if (c * self.lanes + self.lanes) * self.vec <= self.width:
            return "1"
        return "%s < %d" % (self.at(c), self.width)


class PrefillRowsTiles(NamedTuple):
    """The register tiles of the rows prefill kernel (prefill_rows.cl.mako)."""

    m: int      #: (query, head) rows of a unit, padded to whole vectors
    nrv: int    #: row vectors
    rg: int     #: row vectors per score tile
    nk: int     #: keys per score tile
    mv: int     #: rows per value tile
    ni: int     #: head_dim vectors per value tile


def prefill_rows_tiles(rows: int, kb: int, nv: int, vec: int) -> PrefillRowsTiles:
    """Tiles for ``rows`` (query, head) rows, ``kb`` keys per block and ``nv`` float<vec>
    vectors per head_dim row.

    A score tile holds 8 accumulators, row vectors x keys (4 x 2 measured best on PoCL
    and Intel's CPU runtime), its key count dividing ``kb``; a value tile is up to 4 rows
    by up to 2 head_dim vectors, dividing both.
    """
    m = -(-rows // vec) * vec
    nrv = m // vec
    rg = 2 if nrv % 2 == 0 else 1
    nk = max(1, min(kb, 8 // rg))
    while kb % nk:
        nk -= 1
    mv = 4 if m % 4 == 0 else (2 if m % 2 == 0 else 1)
    ni = 2 if nv % 2 == 0 else 1
    return PrefillRowsTiles(m, nrv, rg, nk, mv, ni)


def storage_load(vec: int, ptr: str, dtype: str, native_half: bool) -> str:
    """float<vec> of the elements of OpenCL type ``dtype`` (``"float"``/``"half"``) at
    the element pointer ``ptr``, through the library's loads (natively converted half
    vectors with ``native_half``)."""
    if dtype == "float":
        return ("(%s)[0]" % ptr) if vec == 1 else ("vload%d(0, %s)" % (vec, ptr))
    if native_half:
        return ("convert_float((%s)[0])" % ptr) if vec == 1 else \
            ("convert_float%d(vload%d(0, %s))" % (vec, vec, ptr))
    return ("vload_half(0, %s)" % ptr) if vec == 1 else ("vload_half%d(0, %s)" % (vec, ptr))


def storage_store(vec: int, val: str, ptr: str, dtype: str) -> str:
    """Statement storing the float<vec> ``val`` as ``dtype`` at the element pointer
    ``ptr`` (f16 rounded to nearest even)."""
    if dtype == "float":
        return ("(%s)[0] = (%s);" % (ptr, val)) if vec == 1 else \
            ("vstore%d(%s, 0, %s);" % (vec, val, ptr))
    if vec == 1:
        return "vstore_half_rte(%s, 0, %s);" % (val, ptr)
    return "vstore_half%d_rte(%s, 0, %s);" % (vec, val, ptr)


def raw_load(ptr: str, vec: int, dtype: str, native_half: bool, by_dtype: bool = False) -> str:
    """float<vec> of the storage elements at ``ptr``, with no library call.

    The CPU kernels' load through common.clh.mako's ``raw_loads`` typedefs: ``dtype``
    ``"float"`` reads them as they are; ``"half"`` converts through ``ldn_t`` (the device
    converts half vectors itself, ``native_half``) or ``clattn_h2f``. The pointer is read
    as ``ld_t`` (the kernel's storage type), or with ``by_dtype`` as ``dtype``'s own
    (``ldf_t``/``ldh_t``: a kernel reading both types).
    """
    if dtype == "float":
        return "*(const __global %s*)(%s)" % ("ldf_t" if by_dtype else "ld_t", ptr)
    if native_half:
        return "convert_%s(*(const __global ldn_t*)(%s))" % (vtype("float", vec), ptr)
    return "clattn_h2f(*(const __global %s*)(%s))" % ("ldh_t" if by_dtype else "ld_t", ptr)


def raw_store(val: str, ptr: str, vec: int, dtype: str, native_half: bool) -> str:
    """Statement storing the float<vec> ``val`` as ``dtype`` at ``ptr``, no library call.

    The inverse of :func:`raw_load` with ``by_dtype``; f16 rounds to nearest even
    (natively through ``ldn_t``, or ``clattn_f2h``).
    """
    if dtype == "float":
        return "*(__global ldf_t*)(%s) = %s;" % (ptr, val)
    if native_half:
        return "*(__global ldn_t*)(%s) = convert_%s_rte(%s);" % (ptr, vtype("half", vec), val)
    return "*(__global ldh_t*)(%s) = clattn_f2h(%s);" % (ptr, val)


def lanes(kind: int, vec: int, name: str, lane: str | int, fmt_k: str, fmt_v: str,
          byte_pool: bool, raw: bool, loadv: Callable[[int, str], str],
          sname: str | None = None, scale: str | None = None) -> str:
    """float<vec> of lanes [lane, lane + vec) of a K or V row, any page format.

    Parameters
    ----------
    kind : int
        0: the K row (format ``fmt_k``); 1: the V row (``fmt_v``).
    vec : int
        Lanes read.
    name : str
        The row's pointer (decode_common.clh.mako's ``row_ptr``/``page_ptr``).
    lane : str or int
        The first lane; an int lets q4_0 pick its nibble when rendering.
    fmt_k, fmt_v : str
        Page formats: ``"half"``, ``"float"``, ``"q8_0"``, ``"q4_0"``.
    byte_pool : bool
        The pool is bytes (else an element pointer read through ``loadv``).
    raw : bool
        CPU-style loads (typedefs, exact inline f16 conversion, no library calls): the
        kernel's common.clh.mako ``raw_loads`` of ``vec`` lanes, whose types assume no
        more alignment than an element's (a byte pool's rows are 16-byte aligned, a
        vector of 16 floats 64).
    loadv : callable
        ``loadv(vec, ptr)``: the load of a storage-typed element pointer (float pools).
    sname : str, optional
        The row's scale pointer (default ``name + "_s"``).
    scale : str, optional
        A quantized block's scale expression instead of the row's own (``"1.0f"``: the
        codes, q4_0's minus 8).

    Returns
    -------
    str
    """
    fmt = fmt_k if kind == 0 else fmt_v
    if not byte_pool:
        return loadv(vec, "%s + %s" % (name, lane))
    fv = vtype("float", vec)
    if fmt == "float":
        return "*(const __global %s*)(%s + (%s) * 4)" % ("ldf_t" if raw else fv, name, lane)
    if fmt == "half":
        if raw:
            return "clattn_h2f(*(const __global ldh_t*)(%s + (%s) * 2))" % (name, lane)
        return ("vload_half(0, (const __global half*)(%s) + %s)" % (name, lane)) if vec == 1 else \
            ("vload_half%d(0, (const __global half*)(%s) + %s)" % (vec, name, lane))
    # a block's f16 scale: CPU kernels convert it inline (clattn_h2f_1: vload_half is a
    # library call some CPU drivers do not inline); GPU kernels through vload_half, which
    # every OpenCL device has and a GPU runs as one conversion
    sp = sname or name + "_s"
    scale = scale or ("clattn_h2f_1(%s[(%s) / 32])" % (sp, lane) if raw else
                      "vload_half((%s) / 32, (const __global half*)%s)" % (lane, sp))
    if fmt == "q8_0":
        c = "ldq8_t" if raw else vtype("char", vec)
        return "(convert_%s(*(const __global %s*)(%s + (%s))) * %s)" % (fv, c, name, lane, scale)
    # q4_0: byte j of a block holds value j (low nibble) and value j + 16 (high nibble),
    # so vec <= 16 lanes are one load of vec bytes and one shift, no shuffle
    u = vtype("uchar", vec)
    ld = "ldq4_t" if raw else u
    if isinstance(lane, int) and raw:
        # CPU: the nibble widened to 32 bits, set as the low mantissa bits of 2^23 (whose
        # spacing is 1), minus 2^23 + 8: nibble - 8 exactly, with no int -> float convert
        b = "convert_%s(*(const __global %s*)(%s + %d))" % (
            vtype("uint", vec), ld, name, lane // 32 * 16 + lane % 16)
        nib = "(%s & 15u)" % b if lane % 32 < 16 else "(%s >> 4)" % b
        return "((as_%s(%s | 0x4b000000u) - 8388616.0f) * %s)" % (fv, nib, scale)
    if isinstance(lane, int):
        b = "(*(const __global %s*)(%s + %d))" % (ld, name, lane // 32 * 16 + lane % 16)
        codes = "(%s & (%s)15)" % (b, u) if lane % 32 < 16 else "(%s >> (%s)4)" % (b, u)
    else:
        b = "(*(const __global %s*)(%s + ((%s) >> 5) * 16 + ((%s) & 15)))" % (ld, name, lane, lane)
        codes = "((%s >> (%s)((%s) & 16 ? 4 : 0)) & (%s)15)" % (b, u, lane, u)
    return "((convert_%s(%s) - 8.0f) * %s)" % (fv, codes, scale)


def block_sums(arr: str, name: str, r0: int, vec: int, w_out: int) -> tuple[list[str], str]:
    """Statements and expression of the float<w_out> of row sums of a block's dot products.

    Lane j of the result is the sum of the lanes of ``arr[r0 + j]`` (a float<vec>). The
    vectors are folded to ``w = min(vec, w_out)`` lanes, then each group of ``w`` is
    summed together by pairing, each level halving the lanes per row (lanes i < w/2 of
    pair(a, b) are a's lanes 2i + 2i+1, the rest b's; for w = 8 the pairing keeps to each
    half of four lanes, as x86's hadd does, and the halves are added last: 10-20% faster
    decode on both CPU drivers), and the groups' results joined; for w = 16, whole-vector
    adds of shuffled halves (:func:`_halving_sums`: per-lane scalar sums of 16 lanes were
    not vectorised, 1.4x slower decode than 8 lanes). Component swizzles only (no
    .even/.odd, nor a vector built from two halves: Oclgrind's uninitialised-value check
    crashes on both).

    Parameters
    ----------
    arr : str
        The array of float<vec> partial dot products, one per row.
    name : str
        Prefix of the temporaries declared (``name_*``).
    r0 : int
        The first row summed.
    vec, w_out : int
        Lanes of each partial, and rows (lanes) of the result.

    Returns
    -------
    (list of str, str)
        The declarations to emit first, and the float<w_out> expression.
    """
    w = vec
    ft = vtype("float", w_out)
    terms = ["%s[%d]" % (arr, r0 + j) for j in range(w_out)]
    while w > w_out:
        terms = ["(%s + %s)" % halves(t, w) for t in terms]
        w //= 2
    if w == 1:
        return [], (terms[0] if w_out == 1 else "(%s)(%s)" % (ft, ", ".join(terms)))
    if w == 16:
        return _halving_sums(terms, name)
    fw = "float%d" % w
    lines, groups = [], []
    for g0 in range(0, w_out, w):
        level = []
        for k, t in enumerate(terms[g0:g0 + w]):
            level.append("%s_%d_%d" % (name, g0, k))
            lines.append("const %s %s = %s;" % (fw, level[-1], t))
        depth = 0
        while len(level) > (2 if w == 8 else 1):
            depth += 1
            nxt = []
            for k, (a, b) in enumerate(zip(level[0::2], level[1::2])):
                nxt.append("%s_%d_%d_%d" % (name, g0, depth, k))
                if w == 8:   # within each half: a's pair sums then b's (x86 hadd's order)
                    ev, od = ([("%s.s%x" % (v, h + 2 * i + o)) for h in (0, 4) for v in (a, b)
                               for i in range(2)] for o in (0, 1))
                    lines.append("const %s %s = (%s)(%s) + (%s)(%s);" % (
                        fw, nxt[-1], fw, ", ".join(ev), fw, ", ".join(od)))
                else:
                    lines.append("const %s %s = (%s)(%s);" % (fw, nxt[-1], fw, ", ".join(
                        "%s.s%x + %s.s%x" % (v, 2 * i, v, 2 * i + 1) for v in (a, b)
                        for i in range(w // 2))))
            level = nxt
        if w == 8:   # halves hold rows 0-3 and 4-7 of each: add them across
            a, b = level
            level = ["%s_%d_x" % (name, g0)]
            lines.append("const float8 %s = (float8)(%s);" % (level[0], ", ".join(
                "%s.s%x + %s.s%x" % (v, i, v, i + 4) for v in (a, b) for i in range(4))))
        groups.append(level[0])
    return lines, (groups[0] if len(groups) == 1 else "(%s)(%s)" % (ft, ", ".join(groups)))


def _halving_order(w: int) -> list[int]:
    """The slot whose sum lane l of :func:`_halving_sums`'s result holds, for ``w`` slots."""
    level = [[i] for i in range(w)]
    while len(level) > 1:
        level = [[x for t in range(len(a)) for x in (a[t], b[t])]
                 for a, b in zip(level[0::2], level[1::2])]
    return level[0]


def _halving_sums(rows: list[str], name: str) -> tuple[list[str], str]:
    """:func:`block_sums` of ``w = len(rows)`` rows (expressions) of ``w`` lanes (``w`` a
    power of two): each level
    pairs vectors (a, b) holding groups of ``s`` lanes, one row's partials per group, and
    adds the halves of every group, a's in the group's first half and b's in its second:
    whole vector adds of a blend and a shuffle, log2(w) levels (no per-lane scalar sums,
    which a compiler may not vectorise). Rows enter in the order that leaves lane j
    holding row j."""
    w = len(rows)
    fw = "float%d" % w
    slots = [0] * w
    for lane, slot in enumerate(_halving_order(w)):
        slots[slot] = lane
    lines, level = [], []
    for k, row in enumerate(slots):
        level.append("%s_%d" % (name, k))
        lines.append("const %s %s = %s;" % (fw, level[-1], rows[row]))
    s, depth = w, 0
    while len(level) > 1:
        depth += 1
        nxt = []
        for k, (a, b) in enumerate(zip(level[0::2], level[1::2])):
            nxt.append("%s_%d_%d" % (name, depth, k))
            # a's first and b's second halves stay in their lanes (a blend, which runs
            # on more ports than a shuffle); a's second and b's first halves swap
            parts = [", ".join("%s.s%x" % (v, t * s + off + i) for t in range(w // s)
                               for v, off in pairs for i in range(s // 2))
                     for pairs in (((a, 0), (b, s // 2)), ((a, s // 2), (b, 0)))]
            lines.append("const %s %s = (%s)(%s) + (%s)(%s);" % (
                fw, nxt[-1], fw, parts[0], fw, parts[1]))
        level, s = nxt, s // 2
    return lines, level[0]


@dataclass(frozen=True)
class RopePairs:
    """The RoPE pairing rule: which dims of a row rotate together, and how.

    The first ``rot`` dims of a row rotate in ``rot / 2`` pairs (x, y), pair i by the
    angle of frequency i: x -> x cos - y sin, y -> y cos + x sin. GPT-J (``interleaved``)
    pairs dims (2i, 2i+1); every other RoPE pairs halves (i, i + rot/2). Seen from one dim
    e: its frequency, its partner, and the sign of the partner's term (-1 for x, +1 for y).
    """

    rot: int
    interleaved: bool

    @property
    def half(self) -> int:
        """Pairs (and frequencies) of a row: ``rot / 2``."""
        return self.rot // 2

    def dims(self, i: str) -> tuple[str, str]:
        """The dims (x, y) of pair ``i``."""
        if self.interleaved:
            return "2 * %s" % i, "2 * %s + 1" % i
        return i, "%s + %d" % (i, self.half)

    def freq(self, e: str) -> str:
        """The frequency index of dim ``e`` (``e < rot``)."""
        return "%s / 2" % e if self.interleaved else "%s %% %d" % (e, self.half)

    def element_decls(self, e: str) -> list[str]:
        """Declarations of dim ``e``'s frequency ``fi``, partner ``pe`` and sign ``sgn``,
        with no division (:meth:`freq` as a shift or a select)."""
        h = self.half
        if self.interleaved:
            return ["const int fi = %s >> 1, pe = %s;" % (e, self.partner(e)),
                    "const float sgn = %s;" % self.sign(e)]
        return ["const int fi = %s < %d ? %s : %s - %d;" % (e, h, e, e, h),
                "const int pe = %s;" % self.partner(e), "const float sgn = %s;" % self.sign(e)]

    def partner(self, e: str) -> str:
        """The dim that rotates with dim ``e`` (``e < rot``)."""
        h = self.half
        return "%s ^ 1" % e if self.interleaved else "%s < %d ? %s + %d : %s - %d" % (
            e, h, e, h, e, h)

    def sign(self, e: str) -> str:
        """The sign of the partner's sine term in dim ``e``'s rotation."""
        if self.interleaved:
            return "(%s & 1) ? 1.0f : -1.0f" % e
        return "%s < %d ? -1.0f : 1.0f" % (e, self.half)

    def vectors(self, vec: int) -> int:
        """float<vec> vectors of a row that :meth:`rotate_vector` rotates: every rotated
        vector (interleaved; each holds whole pairs) or those of the first half (each
        rotates with the vector ``half / vec`` later)."""
        return self.rot // vec if self.interleaved else self.half // vec

    def vector_lane_freq(self, cc: str, e: str, vec: int) -> str:
        """The frequency index of lane ``e`` of rotated vector ``cc`` (of :meth:`vectors`)."""
        d = "%s * %d + %s" % (cc, vec, e)
        return "(%s) / 2" % d if self.interleaved else d

    def rotate_vector(self, k: str, cc: int, vec: int, fv: str) -> list[str]:
        """Statements rotating vector ``cc`` of the float<vec> row vectors ``k<i>`` by the
        float<vec> ``cs``/``sn`` of its lanes' angles (:meth:`vector_lane_freq`), times
        ``rope_att``."""
        if self.interleaved:
            swap = "" if vec == 1 else ".s" + "".join("%x" % (i ^ 1) for i in range(vec))
            sign = "(%s)(%s)" % (fv, ", ".join("-1.0f" if i % 2 == 0 else "1.0f"
                                               for i in range(vec))) if vec > 1 else "1.0f"
            return ["%s%d = (%s%d * cs + %s%d%s * (sn * %s)) * rope_att;" % (
                k, cc, k, cc, k, cc, swap, sign)]
        y = cc + self.vectors(vec)
        return ["const %s x = %s%d, y = %s%d;" % (fv, k, cc, k, y),
                "%s%d = (x * cs - y * sn) * rope_att;" % (k, cc),
                "%s%d = (y * cs + x * sn) * rope_att;" % (k, y)]
