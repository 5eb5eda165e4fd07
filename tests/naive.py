"""A deliberately naive float64 oracle for clattn, written from SPEC.md only.

Nothing here imports clattn: this module is the independent reference the
library (CPU fallback and OpenCL kernels) is tested against.  Everything is
plain Python loops over sequences, heads and rows, in float64, so it is slow
but easy to read against the contract.

RoPE frequencies follow Hugging Face transformers' ``modeling_rope_utils``
(default, linear, llama3, longrope, yarn), with clattn's documented choices:
``llama4`` uses llama3's formula, ``gptj`` uses plain frequencies with
interleaved pairing ``(2i, 2i+1)``, ``dynamic`` is refused, and longrope picks
``long_factor`` per sequence when ``q_pos + 1 > original_max_position_embeddings``.
"""
from __future__ import annotations

import math

import numpy as np

LOG2E = 1.0 / math.log(2.0)


# --------------------------------------------------------------------------- RoPE
def rope_type_of(rope_scaling):
    """The scaling type of an HF ``rope_scaling`` dict (legacy key ``type`` accepted)."""
    if not rope_scaling:
        return "default"
    t = rope_scaling.get("rope_type", rope_scaling.get("type"))
    return "default" if t is None else str(t)


def _plain_inv_freq(rotary_dim, rope_theta):
    """HF default: inv_freq[i] = 1 / theta ** (2i / dim), i = 0 .. dim/2 - 1."""
    out = []
    for i in range(rotary_dim // 2):
        out.append(1.0 / (float(rope_theta) ** ((2.0 * i) / rotary_dim)))
    return out


def _llama3(inv, rs):
    factor = float(rs["factor"])
    low_freq_factor = float(rs["low_freq_factor"])
    high_freq_factor = float(rs["high_freq_factor"])
    old_context_len = float(rs["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for f in inv:
        wavelen = 2.0 * math.pi / f
        if wavelen < high_freq_wavelen:          # high frequency: unchanged
            out.append(f)
        elif wavelen > low_freq_wavelen:         # low frequency: interpolated
            out.append(f / factor)
        else:                                    # medium band: smooth blend
            if high_freq_factor == low_freq_factor:
                # the band is a single point; HF would divide 0 by 0 here
                out.append(f)
                continue
            smooth = ((old_context_len / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            out.append((1.0 - smooth) * f / factor + smooth * f)
    return out


def _longrope(rotary_dim, rope_theta, rs, max_position_embeddings, use_long):
    orig = rs.get("original_max_position_embeddings")
    if orig is None:
        orig = max_position_embeddings
    factor = rs.get("factor")
    if factor is None and max_position_embeddings is not None and orig:
        factor = max_position_embeddings / orig
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if factor is None or factor <= 1.0:
            attention_factor = 1.0
        else:
            attention_factor = math.sqrt(1.0 + math.log(factor) / math.log(orig))
    ext = rs["long_factor"] if use_long else rs["short_factor"]
    if len(ext) != rotary_dim // 2:
        raise ValueError(f"longrope factor list has {len(ext)} values, expected {rotary_dim // 2}")
    inv = []
    for i in range(rotary_dim // 2):
        inv.append(1.0 / (float(ext[i]) * float(rope_theta) ** ((2.0 * i) / rotary_dim)))
    return inv, float(attention_factor)


def _yarn_get_mscale(scale, mscale=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim, rope_theta, rs, max_position_embeddings):
    base = float(rope_theta)
    dim = rotary_dim
    factor = float(rs["factor"])
    attention_factor = rs.get("attention_factor")
    mscale = rs.get("mscale")
    mscale_all_dim = rs.get("mscale_all_dim")
    orig = rs.get("original_max_position_embeddings") or max_position_embeddings
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = (_yarn_get_mscale(factor, mscale)
                                / _yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1
    truncate = rs.get("truncate", True)

    def correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2.0 * math.pi))) / (2.0 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if truncate:
        low = math.floor(low)
        high = math.ceil(high)
    low = max(low, 0)
    high = min(high, dim - 1)
    if low == high:
        high += 0.001
    inv = []
    for i in range(dim // 2):
        pos_freq = base ** ((2.0 * i) / dim)
        extrapolation = 1.0 / pos_freq
        interpolation = 1.0 / (factor * pos_freq)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation_factor = 1.0 - ramp
        inv.append(interpolation * (1.0 - extrapolation_factor)
                   + extrapolation * extrapolation_factor)
    return inv, float(attention_factor)


def naive_inv_freq(rotary_dim, rope_theta, rope_scaling, max_position_embeddings=None,
                   use_long=False):
    """``(inv_freq[rotary_dim // 2] float64, attention_factor)`` for one HF rope_scaling dict."""
    if rotary_dim % 2:
        raise ValueError("rotary_dim must be even")
    rs = dict(rope_scaling) if rope_scaling else {}
    t = rope_type_of(rs)
    af = 1.0
    if t in ("default", "gptj"):
        inv = _plain_inv_freq(rotary_dim, rope_theta)
    elif t == "linear":
        inv = [f / float(rs["factor"]) for f in _plain_inv_freq(rotary_dim, rope_theta)]
    elif t in ("llama3", "llama4"):
        inv = _llama3(_plain_inv_freq(rotary_dim, rope_theta), rs)
    elif t == "longrope":
        inv, af = _longrope(rotary_dim, rope_theta, rs, max_position_embeddings, use_long)
    elif t == "yarn":
        inv, af = _yarn(rotary_dim, rope_theta, rs, max_position_embeddings)
    elif t == "dynamic":
        raise ValueError("dynamic RoPE needs the run-time sequence length: not supported")
    else:
        raise ValueError(f"unknown rope type {t!r}")
    return np.array(inv, dtype=np.float64), float(af)


def longrope_use_long(rope_scaling, q_pos, max_position_embeddings=None):
    """clattn's rule: the long factors apply when
    ``q_pos + 1 > original_max_position_embeddings``."""
    orig = rope_scaling.get("original_max_position_embeddings")
    if orig is None:
        orig = max_position_embeddings
    return int(q_pos) + 1 > int(orig)


def naive_rotate(x, pos, inv_freq, attention_factor, rotary_dim, interleaved):
    """Rotate the first ``rotary_dim`` dims of vector ``x`` (float64) at position ``pos``."""
    x = [float(v) for v in x]
    y = list(x)
    half = rotary_dim // 2
    for i in range(half):
        theta = float(pos) * float(inv_freq[i])
        c = math.cos(theta) * attention_factor
        s = math.sin(theta) * attention_factor
        if interleaved:
            a, b = 2 * i, 2 * i + 1
        else:
            a, b = i, i + half
        y[a] = x[a] * c - x[b] * s
        y[b] = x[b] * c + x[a] * s
    return np.array(y, dtype=np.float64)


# --------------------------------------------------------------------------- decode
class ScoredLse(np.ndarray):
    """A float64 lse array that also carries, per element, the sizes f32 arithmetic works
    at (not semantics; ``cases.compare`` derives its error bounds from them):

    * ``score_mag``: the largest sum of |q_d * k_d| * |sm_scale| * log2(e) over the rows,
    * ``rows``: how many rows were attended,
    * ``v_mag``: the largest |v| element among them.

    All three are 0 for an empty chunk. Indexing slices them along; arithmetic drops them
    (a derived array is not a reference any more).
    """

    FIELDS = ("score_mag", "rows", "v_mag")

    def __new__(cls, lse, **sizes):
        obj = np.asarray(lse, dtype=np.float64).view(cls)
        for f in cls.FIELDS:
            setattr(obj, f, np.asarray(sizes[f], dtype=np.float64))
        return obj

    def __array_finalize__(self, obj):
        for f in self.FIELDS:
            setattr(self, f, None)

    def __getitem__(self, key):
        res = super().__getitem__(key)
        if isinstance(res, ScoredLse):
            for f in self.FIELDS:
                full = getattr(self, f)
                setattr(res, f, None if full is None else full[key])
        return res


def chunk_offsets(stored, window_offset=None, sink_size=None):
    """Sequence offsets of the attended chunk rows, in row order (SPEC 'The attended chunk')."""
    if window_offset is None:
        return list(range(stored))
    wo, ss = int(window_offset), int(sink_size)
    rows = stored - wo + ss
    out = []
    for r in range(rows):
        out.append(r if r < ss else r - ss + wo)
    return out


def naive_decode(q, pages, page_indptr, page_indices, last_page_len, *, window_offset=None,
                 sink_size=None, q_pos=None, k_pos_offset=None, rotary_mode=0, rope_scale=1.0,
                 rope_theta=10000.0, sm_scale=None, rope_scaling=None, rotary_dim=None,
                 softcap=None, max_position_embeddings=None, interleaved=None, inv_freq_fn=None,
                 keep=None, sink_logits=None):
    """``(out[B, H_qo, D_v], lse[B, H_qo])`` in float64, lse base 2; empty chunk -> (0, -inf).

    ``pages``: the pool ``[P, 2, H_kv, page_size, D]`` (keys at ``[:, 0]``, values at
    ``[:, 1]``), or a pair ``(keys [P, H_kv, page_size, D], values [P, H_kv, page_size,
    D_v])`` for values of another width than the keys.

    ``keep``: per sequence, one bool per chunk row; only the rows it marks True are
    attended (none: empty, as an empty chunk).

    ``sink_logits[h]``: a learned attention sink of head h (gpt-oss): one more logit in the
    softmax's denominator with no value, as transformers' eager attention computes it
    (the scores and the sink concatenated, softmax, the sink's column dropped); an empty
    chunk then gives (0, sink * log2(e)).

    RoPE frequencies come from ``rope_scaling`` (clattn's contract: an HF rope_scaling dict
    as the caller gives it), or from ``inv_freq_fn(q_pos) -> (inv_freq, attention_factor)``
    when given (``hf_oracle``: a model's own reading of its config). ``interleaved``: pair
    dims (2i, 2i+1) instead of (i, i + rotary_dim/2); None means "when rope_type is gptj".
    """
    q = np.asarray(q).astype(np.float64)
    if isinstance(pages, tuple):
        kpages, vpages = (np.asarray(x) for x in pages)
    else:
        pages = np.asarray(pages)
        assert pages.shape[1] == 2
        kpages, vpages = pages[:, 0], pages[:, 1]
    page_indptr = [int(v) for v in np.asarray(page_indptr)]
    page_indices = [int(v) for v in np.asarray(page_indices)]
    last_page_len = [int(v) for v in np.asarray(last_page_len)]
    B, H_qo, D = q.shape
    _, H_kv, page_size, D2 = kpages.shape
    Dv = vpages.shape[-1]
    assert D2 == D and vpages.shape[:3] == kpages.shape[:3] and H_qo % H_kv == 0
    group = H_qo // H_kv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    sm_scale = float(sm_scale)
    rd = D if rotary_dim is None else int(rotary_dim)
    rtype = rope_type_of(rope_scaling)
    if interleaved is None:
        interleaved = rtype == "gptj"
    windowed = window_offset is not None

    out = np.zeros((B, H_qo, Dv), dtype=np.float64)
    lse = np.full((B, H_qo), -np.inf, dtype=np.float64)
    if sink_logits is not None:
        sink_logits = [float(x) for x in np.asarray(sink_logits)]
        lse[:] = np.array(sink_logits) * LOG2E  # what an empty chunk leaves
    sizes = {f: np.zeros((B, H_qo), dtype=np.float64) for f in ScoredLse.FIELDS}
    for b in range(B):
        begin, end = page_indptr[b], page_indptr[b + 1]
        npages = end - begin
        stored = 0 if npages == 0 else (npages - 1) * page_size + last_page_len[b]
        if windowed:
            offsets = chunk_offsets(stored, window_offset[b], sink_size[b])
        else:
            offsets = chunk_offsets(stored)
        kept = [r for r in range(len(offsets)) if keep is None or bool(keep[b][r])]
        if not kept:
            continue
        if rotary_mode == 1 and inv_freq_fn is not None:
            inv_freq, af = inv_freq_fn(int(q_pos[b]))
            assert len(inv_freq) == rd // 2, "inv_freq_fn gives rotary_dim // 2 frequencies"
        elif rotary_mode == 1:
            use_long = rtype == "longrope" and longrope_use_long(
                rope_scaling, q_pos[b], max_position_embeddings)
            inv_freq, af = naive_inv_freq(rd, rope_theta, rope_scaling,
                                          max_position_embeddings, use_long)
        for kvh in range(H_kv):
            keys, values = [], []
            for r in kept:
                o = offsets[r]
                page = page_indices[begin + o // page_size]
                slot = o % page_size
                k = kpages[page, kvh, slot].astype(np.float64)
                if rotary_mode == 1:
                    k = naive_rotate(k, (int(k_pos_offset[b]) + r) * float(rope_scale),
                                     inv_freq, af, rd, interleaved)
                keys.append(k)
                values.append(vpages[page, kvh, slot].astype(np.float64))
            for h in range(kvh * group, (kvh + 1) * group):
                qv = q[b, h]
                if rotary_mode == 1:
                    qv = naive_rotate(qv, int(q_pos[b]) * float(rope_scale), inv_freq, af, rd,
                                      interleaved)
                scores = []
                for k in keys:
                    s = float(np.dot(qv, k)) * sm_scale
                    if softcap is not None:
                        s = float(softcap) * math.tanh(s / float(softcap))
                    scores.append(s)
                sink = [] if sink_logits is None else [sink_logits[h]]
                m = max(scores + sink)
                total = 0.0
                acc = np.zeros(Dv, dtype=np.float64)
                for s, v in zip(scores, values):
                    w = math.exp(s - m)
                    total += w
                    acc += w * v
                total += sum(math.exp(s - m) for s in sink)  # the sink's column: no value
                out[b, h] = acc / total
                lse[b, h] = (m + math.log(total)) * LOG2E
                # not part of the semantics: the size of the terms each score sums (log2
                # units), which bounds what f32 arithmetic can get wrong (cases.compare)
                kabs = np.abs(np.array(keys))
                sizes["score_mag"][b, h] = float((kabs @ np.abs(qv)).max()) * abs(sm_scale) * LOG2E
                sizes["rows"][b, h] = len(keys)
                sizes["v_mag"][b, h] = float(np.abs(np.array(values)).max())
    return out, ScoredLse(lse, **sizes)


# --------------------------------------------------------------------------- merge
def _merge_pair(v1, s1, v2, s2):
    if s1 == -math.inf and s2 == -math.inf:
        return np.zeros_like(v1), -math.inf
    if s2 == -math.inf:
        return v1.copy(), s1
    if s1 == -math.inf:
        return v2.copy(), s2
    m = max(s1, s2)
    a = 2.0 ** (s1 - m)
    b = 2.0 ** (s2 - m)
    return (a * v1 + b * v2) / (a + b), m + math.log2(a + b)


def naive_merge(v, s, v_other, s_other):
    """Merge two attention states ``v [N, H, D]``, ``s [N, H]`` (base 2); returns new
    float64 arrays."""
    sides = (s, s_other)
    v = np.asarray(v).astype(np.float64)
    v_other = np.asarray(v_other).astype(np.float64)
    s = np.asarray(s).astype(np.float64)
    s_other = np.asarray(s_other).astype(np.float64)
    N, H, D = v.shape
    vo = np.zeros((N, H, D))
    so = np.zeros((N, H))
    for n in range(N):
        for h in range(H):
            vo[n, h], so[n, h] = _merge_pair(v[n, h], float(s[n, h]), v_other[n, h],
                                              float(s_other[n, h]))
    return vo, _merge_sizes(so, np.stack([v, v_other], 1), np.stack([s, s_other], 1), sides)


def _merge_sizes(so, vk, sk, sides=()):
    """The merged lse with the sizes f32 arithmetic works at (see ScoredLse): the
    non-empty states count as rows, their largest |v|; states that are themselves oracle
    results (a ScoredLse) bring their own sizes along."""
    live = ~np.isneginf(sk)                                   # [N, K, H]
    vmag = np.where(live[..., None], np.abs(vk), 0.0).max(axis=(1, 3), initial=0.0)
    score, rows = np.zeros_like(so), live.sum(axis=1).astype(np.float64)
    for k, side in enumerate(sides):
        if isinstance(side, ScoredLse) and side.score_mag is not None:
            score = np.maximum(score, side.score_mag)
            rows += np.where(live[:, k], side.rows - 1, 0)
            vmag = np.maximum(vmag, side.v_mag)
    return ScoredLse(so, score_mag=score, rows=rows, v_mag=vmag)


def naive_merge_k(v, s):
    """Merge K states at once: ``v [N, K, H, D]``, ``s [N, K, H]`` -> ``([N, H, D], [N, H])``."""
    v = np.asarray(v).astype(np.float64)
    s = np.asarray(s).astype(np.float64)
    N, K, H, D = v.shape
    vo = np.zeros((N, H, D))
    so = np.full((N, H), -np.inf)
    for n in range(N):
        for h in range(H):
            m = max(float(s[n, k, h]) for k in range(K)) if K else -math.inf
            if m == -math.inf:
                continue
            total = 0.0
            acc = np.zeros(D)
            for k in range(K):
                if float(s[n, k, h]) == -math.inf:
                    continue
                w = 2.0 ** (float(s[n, k, h]) - m)
                total += w
                acc += w * v[n, k, h]
            vo[n, h] = acc / total
            so[n, h] = m + math.log2(total)
    return vo, _merge_sizes(so, v, s)
