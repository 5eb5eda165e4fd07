#!/usr/bin/env python
"""Through Hugging Face transformers: a prompt and the tokens after it with
``attn_implementation="clattn"`` beside a peer (``sdpa``; ``eager`` for Gemma-2, whose
soft-cap transformers' sdpa refuses), alternated round by round in one process on the same
model.

The model has a real model's shape (hidden size, MLP, heads, layers, soft-caps and windows,
from its published config) and random weights, its vocabulary cut to ``--vocab`` entries
(a full vocabulary's output layer would set each token's time on its own). Each round runs,
for every backend in turn, the prompt as one forward and then ``--new`` greedy one-token
forwards over the cache (a ``ClattnCache`` for clattn, a ``DynamicCache`` for the peer).

Printed per backend and round: the prompt's seconds and the seconds its attention calls
took; a new token's median seconds (one whole forward) and its attention calls' median
microseconds; for clattn, the one-token calls' kernel time from the OpenCL events (what the
device ran; the rest of the call is host work and the wait for the driver), and the call's
parts by the host clock around clattn's kernel enqueues (before the first, in them, after
the last); and how many new tokens each backend chose alike. The summary gives the peer's
time over clattn's (> 1: clattn faster), medians over the rounds. A first pass with a short
prompt builds clattn's kernels before round 0.

Example
  python tools/bench_hf.py --device pocl --model Qwen2.5-0.5B --prompt 2048 --new 24
"""
from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time
import warnings
from typing import Any, Callable

from common import MODELS, cpu_description, driver_description, log  # first: the path

#: the benchmark's models: the transformers config class and the fields of each model's
#: published config.json beside its attention shape (:func:`config_fields` takes the heads,
#: head_dim, layers and soft-cap from ``clattn.models``)
SHAPES: dict[str, tuple[str, dict]] = {
    "Qwen2.5-0.5B": ("Qwen2Config", dict(
        hidden_size=896, intermediate_size=4864, rope_theta=1000000.0,
        tie_word_embeddings=True)),
    "Llama-3.2-1B": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, rope_theta=500000.0,
        tie_word_embeddings=True)),
    "Gemma-2-2B": ("Gemma2Config", dict(
        hidden_size=2304, intermediate_size=9216, sliding_window=4096,
        query_pre_attn_scalar=256, final_logit_softcapping=30.0)),
}


def config_fields(name: str) -> dict:
    """The config fields of :data:`SHAPES` ``name``: its attention shape from
    ``clattn.models`` and the rest from :data:`SHAPES`."""
    m = MODELS[name]
    fields = dict(num_attention_heads=m.num_qo_heads, num_key_value_heads=m.num_kv_heads,
                  head_dim=m.head_dim, num_hidden_layers=m.layers)
    if m.softcap:
        fields["attn_logit_softcapping"] = m.softcap
    return dict(fields, **SHAPES[name][1])


def build_model(name: str, layers: int, vocab: int, dtype: Any, seed: int) -> Any:
    """The model of :data:`SHAPES` ``name`` with random weights (``layers`` > 0: that many
    layers), in eval mode."""
    import torch
    import transformers

    fields = dict(config_fields(name), vocab_size=vocab, max_position_embeddings=131072)
    if layers:
        fields["num_hidden_layers"] = layers
    cfg = getattr(transformers, SHAPES[name][0])(**fields)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


class CallTimes:
    """The host clock's ``(start, end)`` of each call of the wrapped functions, by name,
    while on (the attention functions; clattn's kernel enqueues)."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, list[tuple[float, float]]] = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if self.on:
                    self.calls.setdefault(name, []).append((t, time.perf_counter()))
        return timed

    def take(self, name: str) -> list[tuple[float, float]]:
        return self.calls.pop(name, [])


def seconds(spans: list[tuple[float, float]]) -> list[float]:
    """Each span's length."""
    return [end - start for start, end in spans]


def call_parts(calls: list[tuple[float, float]],
               launches: list[tuple[float, float]]) -> dict[str, float]:
    """Where the calls that enqueued kernels spent their time, medians in microseconds:
    ``before_us`` from the call's start to its first enqueue (the host work before the
    launch), ``enqueue_us`` in its enqueues (summed), ``after_us`` from its last enqueue's
    return to the call's end (the rest of the kernel, the wait, the copy out, the output).
    Empty when no call enqueued a kernel (clattn's numpy backend, the peer)."""
    before, enqueue, after = [], [], []
    launches = sorted(launches)
    j = 0
    for start, end in sorted(calls):
        while j < len(launches) and launches[j][0] < start:
            j += 1  # an enqueue outside any timed call
        mine = []
        while j < len(launches) and launches[j][1] <= end:
            mine.append(launches[j])
            j += 1
        if mine:
            before.append(mine[0][0] - start)
            enqueue.append(sum(b - a for a, b in mine))
            after.append(end - mine[-1][1])
    if not before:
        return {}
    return dict(before_us=statistics.median(before) * 1e6,
                enqueue_us=statistics.median(enqueue) * 1e6,
                after_us=statistics.median(after) * 1e6)


class KernelTimes:
    """The OpenCL events of ``PagedKVCache.attend`` results while on; their kernel seconds
    (end - start of every event of a call, summed), read once they completed."""

    def __init__(self) -> None:
        self.on = False
        self.results: list[Any] = []

    def wrap(self, fn: Callable) -> Callable:
        def attend(*args: Any, **kw: Any) -> Any:
            res = fn(*args, **kw)
            if self.on and getattr(res, "events", None):
                self.results.append(res)
            return res
        return attend

    def take(self) -> list[float]:
        results, self.results = self.results, []
        try:
            return [sum(e.profile.end - e.profile.start for e in res.events) * 1e-9
                    for res in results]
        except Exception:  # noqa: BLE001 - a queue without profiling: no figure
            return []


def run_backend(model: Any, impl: str, ids: Any, new: int, cache_len: int, calls: CallTimes,
                kernels: KernelTimes) -> dict:
    """One prompt and ``new`` greedy one-token forwards with ``impl``; timings and tokens."""
    import torch
    from transformers import DynamicCache

    from clattn.integrations.transformers import ClattnCache

    model.set_attn_implementation(impl)
    if impl == "clattn":
        cache = ClattnCache(model, max_cache_len=cache_len)
    else:
        try:
            cache = DynamicCache(config=model.config)  # per-layer kinds (transformers 5)
        except TypeError:
            cache = DynamicCache()
    name = "clattn" if impl == "clattn" else "peer"
    with torch.inference_mode():
        calls.on = True
        t = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True)
        prompt_s = time.perf_counter() - t
        prompt_attn = sum(seconds(calls.take(name)))
        calls.take("launch")
        nxt = out.logits[:, -1:].argmax(-1)
        tokens, steps = [int(nxt[0, 0])], []
        kernels.on = True
        for _ in range(new):
            t = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True)
            steps.append(time.perf_counter() - t)
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(int(nxt[0, 0]))
        calls.on = kernels.on = False
    spans = calls.take(name)
    one = seconds(spans)
    parts = call_parts(spans, calls.take("launch"))
    kern = kernels.take()
    layers = len(one) // max(new, 1)
    row = dict(backend=impl, prompt_s=prompt_s, prompt_attn_s=prompt_attn,
               token_ms=statistics.median(steps) * 1e3 if steps else None,
               call_us=statistics.median(one) * 1e6 if one else None,
               attn_token_ms=sum(one) / max(new, 1) * 1e3 if one else None, layers=layers,
               tokens=tokens)
    if kern:
        row["kernel_us"] = statistics.median(kern) * 1e6
    row.update(parts)
    return row


def summary(rows: list[dict], peer: str) -> list[str]:
    """Lines: the medians over the rounds of each figure, and the peer's over clattn's."""
    def med(impl: str, key: str) -> float | None:
        vals = [r[key] for r in rows if r["backend"] == impl and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    out = []
    for key, what in (("prompt_s", "prompt s"), ("prompt_attn_s", "prompt attention s"),
                      ("token_ms", "token ms"), ("call_us", "one-token attention call us"),
                      ("attn_token_ms", "attention ms per token")):
        a, b = med("clattn", key), med(peer, key)
        if a is not None and b is not None:
            out.append(f"| {what} | {a:.4g} | {b:.4g} | {b / a:.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None,
                    help="clattn's device: pocl, intel, a device name (default: clattn's)")
    ap.add_argument("--backend", default="auto", choices=("auto", "opencl", "cpu"),
                    help="clattn's backend (cpu: its numpy backend)")
    ap.add_argument("--model", default="Qwen2.5-0.5B", choices=tuple(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="layers (default: the model's)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--new", type=int, default=24, help="greedy tokens after the prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peer", default="auto", choices=("auto", "sdpa", "eager"),
                    help="the attention clattn is timed beside (auto: eager for a model "
                         "that soft-caps its scores, which transformers' sdpa refuses; "
                         "sdpa otherwise)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary entries")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's threads (default: the CPUs this process may run on)")
    ap.add_argument("--warmup", type=int, default=64, help="prompt tokens of the first pass")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.peer == "auto":
        args.peer = "eager" if MODELS[args.model].softcap else "sdpa"
    for name in ("prompt", "new", "rounds", "vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")

    warnings.simplefilter("ignore")
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import clattn.integrations.transformers as hf
    from clattn import PagedKVCache
    from clattn.launch import BoundKernel, Launcher
    from clattn.tune.ceilings import host_cpus

    hf.register(device=args.device, backend=args.backend)
    threads = args.threads or host_cpus()
    torch.set_num_threads(threads)
    calls, kernels = CallTimes(), KernelTimes()
    AttentionInterface.register("clattn", calls.wrap("clattn", hf.attention))
    peer = "sdpa" if args.peer == "sdpa" else "eager_t"
    PagedKVCache.attend = kernels.wrap(PagedKVCache.attend)
    BoundKernel.launch = calls.wrap("launch", BoundKernel.launch)
    Launcher.__call__ = calls.wrap("launch", Launcher.__call__)

    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, args.layers, args.vocab, dtype, args.seed)
    if args.peer == "sdpa":
        AttentionInterface.register("sdpa", calls.wrap("peer", sdpa_attention_forward))
    else:
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        AttentionInterface.register("eager_t", calls.wrap("peer", _eager_forward(model)))
        AttentionMaskInterface.register("eager_t", eager_mask)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (1, args.prompt), generator=gen)
    cache_len = args.prompt + args.new + 1
    log("warm-up pass (builds clattn's kernels)")
    for impl in ("clattn", peer):
        run_backend(model, impl, ids[:, :max(1, min(args.warmup, args.prompt))], 2,
                    cache_len, calls, kernels)
    started = time.perf_counter()
    rows = []
    for rnd in range(args.rounds):
        for impl in ("clattn", peer):
            row = run_backend(model, impl, ids, args.new, cache_len, calls, kernels)
            row["round"] = rnd
            rows.append(row)
            log(f"round {rnd} {impl}: prompt {row['prompt_s']:.2f} s, token "
                f"{row['token_ms']:.1f} ms")
    elapsed = time.perf_counter() - started
    _print(args, argv, rows, peer, threads, elapsed)
    return 0


def _eager_forward(model: Any) -> Callable:
    """The model's own eager attention function (Gemma-2's soft-caps the scores)."""
    return sys.modules[type(model).__module__].eager_attention_forward


def _print(args: argparse.Namespace, argv: list[str] | None, rows: list[dict], peer: str,
           threads: int, elapsed: float) -> None:
    import torch
    import transformers

    from clattn import runtime

    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    cmd = "python tools/bench_hf.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"## `{cmd}`\n")
    print(f"- {when}, host {platform.node()}, {elapsed:.0f} s")
    print(f"- CPU: {cpu_description()}")
    if args.backend != "cpu":
        try:
            dev = runtime.select_device(args.device)
            print(f"- device: {driver_description([dev])[0] if dev is not None else 'none'}")
        except Exception as exc:  # noqa: BLE001 - the header only
            print(f"- device: {args.device or 'default'} ({exc})")
    else:
        print("- clattn: its numpy CPU backend")
    print(f"- transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{threads} torch threads; {args.model} shape, {rows[0]['layers']} layers, "
          f"{args.dtype}, vocabulary {args.vocab}, random weights; prompt {args.prompt} "
          f"tokens, then {args.new} greedy tokens; peer: {args.peer}")
    print("- token: one whole one-token forward (median); attention call: one layer's "
          "attention function, one-token forwards (median); kernel: clattn's kernels of "
          "such a call by their OpenCL events (median); the call's parts by the host clock "
          "(medians): before its first kernel enqueue, in its enqueues, after the last "
          "enqueue returned\n")
    print("| round | backend | prompt s | prompt attention s | token ms | attention call us | "
          "attention ms per token | kernel us | before launch us | enqueue us | "
          "after enqueue us | new tokens alike |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        ref = next(x for x in rows if x["round"] == r["round"] and x["backend"] == "clattn")
        alike = sum(a == b for a, b in zip(r["tokens"], ref["tokens"]))
        kern, before, enq, after = (f"{r[k]:.1f}" if k in r else "-" for k in (
            "kernel_us", "before_us", "enqueue_us", "after_us"))
        print(f"| {r['round']} | {args.peer if r['backend'] == peer else 'clattn'} | "
              f"{r['prompt_s']:.4g} | {r['prompt_attn_s']:.4g} | {r['token_ms']:.1f} | "
              f"{r['call_us']:.1f} | {r['attn_token_ms']:.2f} | {kern} | {before} | {enq} | "
              f"{after} | {alike} of {len(r['tokens'])} |")
    print(f"\n| median of the rounds | clattn | {args.peer} | {args.peer} / clattn |")
    print("|---|---:|---:|---:|")
    for line in summary(rows, peer):
        print(line)
    print()


if __name__ == "__main__":
    sys.exit(main())
