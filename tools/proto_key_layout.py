"""Decode over keys stored dimension-major in a page: a prototype timed beside BatchDecode.

The rows decode kernel reads a page's keys as the contract stores them, row-major
(``[page_size][head_dim]``): a (head, row) score is a vector of head_dim partial products
whose lanes a tree of shuffles and adds sums, 16 rows at a time (``kernel_exprs.block_sums``;
for Qwen2.5-0.5B's 7 heads of 64 dims that tree is about a fifth of the kernel's vector
work). Stored dimension-major (``[head_dim][page_size]``), a page's keys give each head's
16 scores as 16 lanes directly: for every dimension, one key column times the query's
element broadcast from memory, and no tree. This script measures what that layout would
buy before the pages, the appends and every kernel change for it: three kernels for one
model's KV-head group (f16 pages of 16 rows, vectors of 16 floats: a CPU device whose rows
decode runs at 16, i.e. AVX-512; no RoPE, no window),
built on the prelude of BatchDecode's own kernel for the device (its 2^x, f16 loads and
halving sums):

* ``dims16``: keys dimension-major, a block of one page;
* ``dims32``: keys dimension-major, a block of two pages (each broadcast query element
  serves two key columns);
* ``rows16``: keys row-major with the same simplified structure and BatchDecode's block
  sums, to tell the layout's gain from the structure's (whole pages, no masks).

Each writes its partitions' states (BatchDecode's split into the same number of
partitions), merged on the host and checked against float64 attention. All four are
called in turns (``ab_decode.alternate``), the order reversed every other turn: hot (the
same pages every call) and cold (each call the next copy of the pages its kernel reads,
one rotation per pool whoever calls, the copies spanning ``--cold-gib``), the pools made
as ``BatchDecode.empty_pages`` makes them (huge pages where the driver's memory is the
host's).

    python tools/proto_key_layout.py --device pthread-intel --model Qwen2.5-0.5B

A developer script, not a test.
"""
from __future__ import annotations

import argparse
import warnings
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
from ab_decode import alternate
from common import MODELS, PAGE, cpu_description, driver_description  # first: clattn on the path

import clattn
from clattn import host_memory
from clattn import kernel_exprs as kx

VEC = 16
LOG2E = 1.4426950408889634


def _state_lines(G: int, NC: int) -> list[str]:
    return [f"    float16 {', '.join(f'a{h}_{c} = 0.0f' for c in range(NC))}, lv{h} = 0.0f; "
            f"float m{h} = -INFINITY, base{h} = 0.0f;" for h in range(G)]


def _softmax(h: int, sv: str, NC: int) -> str:
    """Online softmax of head h over a block of scores ``sv`` (float16 expressions)."""
    parts = sv.split(",")
    mx_expr = parts[0] if len(parts) == 1 else "fmax(%s)" % ", ".join(parts)
    scale = " ".join(f"a{h}_{c} *= alpha;" for c in range(NC))
    out = [f"""        if (any({mx_expr} > (float16)(m{h}))) {{
            const float bm = {kx.hred(mx_expr, "max", VEC)};
            const float mx = bm > m{h} ? bm : m{h};
            const float alpha = clattn_exp2_1(m{h} - mx);
            {scale} lv{h} *= alpha;
            base{h} = mx; m{h} = mx;
        }}"""]
    for i, s in enumerate(parts):
        out.append(f"        {{ const float16 p = clattn_exp2_16({s} - base{h}); "
                   f"*(float16*)(pt[{h}] + {16 * i}) = p; lv{h} += p; }}")
    return "\n".join(out)


def kernel_source(prelude: str, load: str, G: int, D: int, layout: str,
                  pages_per_block: int, ahead: int = 1) -> str:
    """OpenCL source of ``proto``: global (KV heads, partitions), each partition ``ppp``
    whole pages of ``page_indices`` from ``part * ppp``, the pages of the ``ahead`` next
    blocks prefetched; writes per (partition, head) the normalised output and the base-2
    lse."""
    NC, R = D // VEC, PAGE * pages_per_block

    def ld(ptr: str) -> str:
        return load % ptr

    L = [prelude, f"""
__kernel void proto(const __global st_t* q, const __global kv_t* pages, const __global int* idx,
                    const int ppp, const int hkv, __global float* ws_o, __global float* ws_s,
                    const float qscale)
{{
    const int kvh = get_global_id(0), part = get_global_id(1);
    float pt[{G}][{R}] __attribute__((aligned(64)));"""]
    if layout == "dims":
        L.append(f"    float qs[{G}][{D}] __attribute__((aligned(64)));")
        L.append(f"""    for (int h = 0; h < {G}; ++h)
        for (int c = 0; c < {NC}; ++c)
            *(float16*)(qs[h] + c * 16) = {ld(f"q + (kvh * {G} + h) * {D} + c * 16")} * qscale;""")
    else:
        for h in range(G):
            L.append("    " + " ".join(
                f"const float16 q{h}_{c} = "
                f"{ld(f'q + (kvh * {G} + {h}) * {D} + {16 * c}')} * qscale;" for c in range(NC)))
            L.append(f"    float16 tv{h}[{PAGE}];")
    L += _state_lines(G, NC)
    base = f"pages + ((size_t)(%s * 2 + %d) * hkv + kvh) * {PAGE * D}"
    L.append(f"""    for (int pi = 0; pi < ppp; pi += {pages_per_block}) {{""")
    for b in range(pages_per_block):
        L.append(f"""        const int pg{b} = idx[part * ppp + pi + {b}];
        const __global kv_t* kp{b} = {base % (f"pg{b}", 0)};
        const __global kv_t* vp{b} = {base % (f"pg{b}", 1)};""")
    last = (1 + ahead) * pages_per_block
    L.append(f"""        for (int nx = {pages_per_block}; nx < {last}; ++nx)
        if (pi + nx < ppp) {{
            const int pn = idx[part * ppp + pi + nx];
            const __global uchar* kn = (const __global uchar*)({base % ("pn", 0)});
            const __global uchar* vn = (const __global uchar*)({base % ("pn", 1)});
            for (int l = 0; l < {PAGE * D * 2}; l += 64) {{
                __builtin_prefetch(kn + l);
                __builtin_prefetch(vn + l);
            }}
        }}""")
    if layout == "dims":
        L.append("        " + " ".join(f"float16 s{h}_{b} = 0.0f;" for h in range(G)
                                      for b in range(pages_per_block)))
        L.append(f"        for (int d = 0; d < {D}; ++d) {{")
        for b in range(pages_per_block):
            L.append(f"            const float16 kc{b} = {ld(f'kp{b} + d * {PAGE}')};")
        for h in range(G):
            L.append(f"            {{ const float qv = qs[{h}][d]; "
                     + " ".join(f"s{h}_{b} += qv * kc{b};" for b in range(pages_per_block)) + " }")
        L.append("        }")
        for h in range(G):
            L.append(_softmax(h, ",".join(f"s{h}_{b}" for b in range(pages_per_block)), NC))
    else:
        L.append(f"        for (int j = 0; j < {PAGE}; ++j) {{")
        L.append("            " + " ".join(
            f"const float16 k{c} = {ld(f'kp0 + j * {D} + {16 * c}')};" for c in range(NC)))
        for h in range(G):
            dot = " + ".join(f"q{h}_{c} * k{c}" for c in range(NC))
            L.append(f"            tv{h}[j] = {dot};")
        L.append("        }")
        for h in range(G):
            lines, expr = kx.block_sums(f"tv{h}", f"bs{h}", 0, VEC, VEC)
            L += ["        " + x for x in lines]
            L.append(f"        const float16 sv{h} = {expr};")
            L.append(_softmax(h, f"sv{h}", NC))
    L.append(f"        for (int r = 0; r < {R}; ++r) {{")
    vrow = f"vp0 + r * {D}" if pages_per_block == 1 else \
        f"(r < {PAGE} ? vp0 + r * {D} : vp1 + (r - {PAGE}) * {D})"
    L.append(f"            const __global kv_t* vr = {vrow};")
    L.append("            " + " ".join(
        f"const float16 v{c} = {ld(f'vr + {16 * c}')};" for c in range(NC)))
    for h in range(G):
        L.append(f"            {{ const float p = pt[{h}][r]; "
                 + " ".join(f"a{h}_{c} += p * v{c};" for c in range(NC)) + " }")
    L.append("        }\n    }")
    for h in range(G):
        L.append(f"    {{ const int at = (part * hkv + kvh) * {G} + {h}; "
                 f"const float l = {kx.hred(f'lv{h}', '+', VEC)};")
        L.append("      " + " ".join(f"vstore16(a{h}_{c} / l, 0, ws_o + at * {D} + {16 * c});"
                                   for c in range(NC)) + f" ws_s[at] = m{h} + log2(l); }}")
    L.append("}")
    return "\n".join(L) + "\n"


class Rotation:
    """The cold copies of one pool, handed out in turn: copies 1 .. ``copies`` - 1 (copy
    0 is the hot calls'). One per pool, whichever kernels read it: kernels in turns that
    each counted their own copies would read one copy after the other, the second out of
    the caches the first had just filled."""

    def __init__(self, copies: int) -> None:
        self.copies, self.at = copies, 0

    def next(self) -> int:
        self.at = self.at % (self.copies - 1) + 1
        return self.at


class Copies:
    """One kernel's calls as :func:`ab_decode.alternate` makes a decoder's: ``run()``
    launches over copy 0 (``rotation`` None: hot) or over the pool's next cold copy, and
    returns what has the launch's ``events``."""

    def __init__(self, launch: Callable[[int], list], rotation: Rotation | None) -> None:
        self.launch, self.rotation = launch, rotation

    def run(self, plan: None = None) -> SimpleNamespace:
        return SimpleNamespace(events=self.launch(self.rotation.next() if self.rotation else 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="pocl")
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--cold-gib", type=float, default=2.0)
    ap.add_argument("--ahead", type=int, default=1, help="blocks prefetched ahead")
    ap.add_argument("--in-order", action="store_true",
                    help="each copy's pages in pool order (default: shuffled, as tools/bench.py)")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    m = MODELS[a.model]
    hqo, hkv, D = m.num_qo_heads, m.num_kv_heads, m.head_dim
    G = hqo // hkv
    spec = clattn.AttentionSpec(hqo, hkv, D, page_size=PAGE, dtype="float16")
    dec = clattn.BatchDecode(spec, device=a.device)
    queue = dec.setup.runtime.queue
    if dec.geometry.strategy != "rows" or dec.geometry.vec != VEC:
        raise SystemExit(f"{a.device}: the prototypes are written for the rows decode at "
                         f"{VEC}-float vectors (AVX-512 CPUs); this device's decode runs "
                         f"{dec.geometry.strategy} at {dec.geometry.vec}")
    native = dec.geometry.native_fp16
    prelude = dec.source().split("__kernel void")[0]
    load = kx.raw_load("%s", VEC, "half", native)
    P = a.ctx // PAGE
    indptr_h, last_h = np.array([0, P], np.int32), np.array([PAGE], np.int32)
    plan = dec.plan(indptr_h, last_h)
    parts = plan.num_parts if plan.split else 1
    if P % (2 * parts):
        raise SystemExit(f"--ctx {a.ctx}: {parts} partitions of whole page pairs do not fit")
    ppp = P // parts
    rng = np.random.default_rng(0)
    kv = rng.uniform(-1, 1, (P, 2, hkv, PAGE, D)).astype(np.float16)
    kvt = kv.copy()
    kvt[:, 0] = np.ascontiguousarray(kv[:, 0].transpose(0, 1, 3, 2)).reshape(P, hkv, PAGE, D)
    q = (2 * rng.standard_normal((1, hqo, D))).astype(np.float16)
    idx = (np.arange(P) if a.in_order else rng.permutation(P)).astype(np.int32)
    K = kv[idx, 0].transpose(1, 0, 2, 3).reshape(hkv, -1, D).astype(np.float64)
    V = kv[idx, 1].transpose(1, 0, 2, 3).reshape(hkv, -1, D).astype(np.float64)
    s = np.einsum("hgd,hrd->hgr", q[0].astype(np.float64).reshape(hkv, G, D), K) / np.sqrt(D)
    w = np.exp(s - s.max(-1, keepdims=True))
    ref = (np.einsum("hgr,hrd->hgd", w, V) / w.sum(-1, keepdims=True)).reshape(hqo, D)

    sets = max(2, int(np.ceil(a.cold_gib * (1 << 30) / kv.nbytes)))
    pools = {}
    for name, arr in (("rows", kv), ("dims", kvt)):
        buf = host_memory.empty(queue, (sets * P,) + kv.shape[1:], np.float16)
        for i in range(sets):
            buf[i * P:(i + 1) * P].set(arr)
        pools[name] = buf
    idxs = [cla.to_device(queue, (idx + i * P).astype(np.int32)) for i in range(sets)]
    d_q = cla.to_device(queue, q)
    tables = (cla.to_device(queue, indptr_h), cla.to_device(queue, last_h))
    ws_o = cla.empty(queue, (parts, hkv, G, D), np.float32)
    ws_s = cla.empty(queue, (parts, hkv, G), np.float32)
    qscale = np.float32(LOG2E / np.sqrt(D))

    def batch_decode(i: int) -> list:
        return dec.run(d_q, pools["rows"], tables[0], idxs[i], tables[1], plan=plan).events

    runs = {"BatchDecode": batch_decode}
    layouts = {"BatchDecode": "rows"}  # the pool each kernel reads
    errs = {}
    for name, layout, ppb in (("rows16", "rows", 1), ("dims16", "dims", 1), ("dims32", "dims", 2)):
        src = kernel_source(prelude, load, G, D, layout, ppb, a.ahead)
        prg = cl.Program(queue.context, src).build()
        knl, pool = prg.proto, pools[layout]

        def run(i: int, knl=knl, pool=pool) -> list:
            return [knl(queue, (hkv, parts), (1, 1), d_q.data, pool.data, idxs[i].data,
                        np.int32(ppp), np.int32(hkv), ws_o.data, ws_s.data, qscale)]
        run(0)
        queue.finish()
        o, st = ws_o.get().astype(np.float64), ws_s.get().astype(np.float64)
        wt = np.exp2(st - st.max(0))
        out = ((o * wt[..., None]).sum(0) / wt.sum(0)[..., None]).reshape(hqo, D)
        errs[name] = float(np.abs(out - ref).max())
        runs[name], layouts[name] = run, layout
    got = dec.run(d_q, pools["rows"], tables[0], idxs[0], tables[1], plan=plan).out.get()
    errs["BatchDecode"] = float(np.abs(got[0].astype(np.float64) - ref).max())

    rotations = {name: Rotation(sets) for name in pools}
    calls = {(n, t): dict(dec=Copies(f, rotations[layouts[n]] if t == "cold" else None),
                          args=(), plan=None, queue=queue, ms=[])
             for n, f in runs.items() for t in ("cold", "hot")}
    turn = alternate(list(calls.values()), a.seconds)
    ms = {k: c["ms"] for k, c in calls.items()}
    mb = 2 * a.ctx * hkv * D * 2 / 1e6
    print(cpu_description())
    print(*driver_description([queue.device]))
    print(f"{a.model} (G {G}, head_dim {D}), f16, B=1, {a.ctx} rows in {parts} partitions, "
          f"{turn} turns, {a.ahead} blocks prefetched, pages "
          f"{'in order' if a.in_order else 'shuffled'}; cold: {sets} copies of the pages "
          f"({sets * kv.nbytes / (1 << 30):.1f} GiB)")
    print("| kernel | hot ms | cold ms | cold GB/s | BatchDecode hot / this | cold | max abs err |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    bh, bc = np.median(ms[("BatchDecode", "hot")]), np.median(ms[("BatchDecode", "cold")])
    for n in runs:
        h, c = np.median(ms[(n, "hot")]), np.median(ms[(n, "cold")])
        print(f"| {n} | {h:.3f} | {c:.3f} | {mb / c:.1f} | {bh / h:.2f}x | {bc / c:.2f}x "
              f"| {errs[n]:.1e} |")


if __name__ == "__main__":
    main()
