"""Hugging Face transformers on clattn: ``attn_implementation="clattn"``.

Importing this module registers (:func:`register` with the defaults):

* the attention function ``"clattn"`` with ``transformers.AttentionInterface`` and its
  mask function with ``transformers.masking_utils.AttentionMaskInterface``;
* a :class:`ClattnCache` for ``generate``: when the model attends with ``"clattn"`` and
  ``generate`` would make a ``DynamicCache``, it gets a ClattnCache instead (keys and
  values in :class:`clattn.PagedKVCache` page pools on the OpenCL device), sized for the
  call's ``max_length``; ``generate(..., attn_implementation="clattn")`` switches the
  model for that call.

Every step attends through :class:`clattn.PagedKVCache`, which chooses its kernels:
decode steps on the decode kernel, prompts on the prefill kernel (the tokens past the
point where a sliding window begins to slide inside the prompt on the decode kernel). A
forward without a ClattnCache (``use_cache=False``, another cache class) runs the model's
eager attention in torch, with one warning. Where a model's generate code drops the cache
to recompute every position (Phi-3's longrope models when the sequence reaches
``original_max_position_embeddings``), the ClattnCache is reset and handed back, so that
the recompute runs on clattn too. docs/transformers.md has the details: what is refused,
padding, copies, timings.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings
from typing import Any, Callable

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from clattn import CacheFullError, runtime

from .hf_cache import (
    DEFAULTS,
    NAME,
    PENDING,
    RETURNED,
    ClattnCache,
    GroupForward,
    UnsupportedFeatureError,
    check_config,
    check_form,
    expanded_from,
)
from .hf_mla import LatentLayer, caches_latents

__all__ = ["ClattnCache", "ClattnMask", "UnsupportedFeatureError", "attention",
           "check_model", "mask", "register"]



def register(device: Any = None, *, prefill: bool = True, page_size: int = 16,
             backend: str = "auto", profile: Any = None, k_format: str | None = None,
             v_format: str | None = None, mla: str = "latent",
             patch_generate: bool = True) -> None:
    """Register ``attn_implementation="clattn"`` with transformers (done at import).

    Parameters
    ----------
    device : None, str, pyopencl.Device/Context/CommandQueue
        Where the caches made from now on live: ``"pocl"``, ``"intel"``, a device name,
        a pyopencl object; None: ``PYOPENCL_CTX``, else clattn's default device.
    prefill : bool
        Prompt steps on the prefill kernel (True: the cache chooses it for prompt
        chunks) or every token on the cache's decode kernel, one row per prompt token.
    page_size : int
        Tokens per page of the caches made for ``generate``.
    backend, profile
        As for :class:`clattn.PagedKVCache` (``backend="cpu"``: numpy, no device).
    k_format, v_format : {None, "float16", "float32", "q8_0", "q4_0"}
        How the caches store keys and values (None: the model's dtype); ``"q8_0"`` and
        ``"q4_0"`` quantize on append (llama.cpp's ``--cache-type-k/-v``).
    mla : {"latent", "decompressed"}
        How a multi-head latent attention model (DeepSeek-V2/V3, MiniCPM3, ...:
        ``config.kv_lora_rank``) runs: ``"latent"`` caches one row ``[latent | rope
        key]`` per token and layer, shared by every head, and attends with the
        expansion absorbed into the queries and the output; ``"decompressed"`` caches
        the per-head keys and values the model expands. Other models ignore it.
    patch_generate : bool
        Give ``generate`` a ClattnCache when the model attends with clattn, accept
        ``generate(..., attn_implementation=...)`` (transformers' own ``generate`` has
        no such argument), and keep the ClattnCache a model's generate code drops to
        recompute the sequence (longrope models at their switch of rotary factors).
    """
    DEFAULTS.update(device=device, prefill=bool(prefill), page_size=int(page_size),
                    backend=backend, profile=profile, k_format=k_format, v_format=v_format,
                    mla=check_form(mla))
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)
    _patch_models()
    if patch_generate:
        _patch_generate()


def check_model(model: Any) -> None:
    """Raise :class:`UnsupportedFeatureError` when ``model`` cannot attend with clattn.

    A model class whose attention does not call transformers' ``AttentionInterface``
    (GPT-Neo, Falcon, Bloom, MPT: their attention modules are their own code) never
    reaches clattn's attention function whatever ``attn_implementation`` says; a config
    clattn's cache cannot hold (encoder-decoder) is refused
    as :class:`ClattnCache` refuses it. Run when ``"clattn"`` is asked of a model (its
    creation, ``set_attn_implementation``, ``generate(attn_implementation=...)``).
    """
    cls = type(model)
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise UnsupportedFeatureError(
            f"clattn: {cls.__name__} does not attend through transformers' "
            f"AttentionInterface (its attention module is its own code), so "
            f"attn_implementation={NAME!r} cannot reach it; it runs with 'eager' (or "
            f"'sdpa') only. docs/transformers.md lists the architectures that run on clattn")
    cfg = model.config
    check_config(cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg)


def _patch_models() -> None:
    """Wrap ``PreTrainedModel._check_and_adjust_attn_implementation`` (model creation,
    and switching a model that uses the interface) and ``set_attn_implementation``
    (which only logs for a model that does not) so that asking ``"clattn"`` of a model
    that cannot run it raises :func:`check_model`'s error. Once; other names untouched."""
    from transformers import PreTrainedModel

    if getattr(PreTrainedModel, "_clattn_checked", False):
        return
    adjust = PreTrainedModel._check_and_adjust_attn_implementation
    set_impl = PreTrainedModel.set_attn_implementation

    @functools.wraps(adjust)
    def _check_and_adjust_attn_implementation(self, attn_implementation: Any, *args: Any,
                                              **kw: Any) -> Any:
        if attn_implementation == NAME:
            check_model(self)
        return adjust(self, attn_implementation, *args, **kw)

    @functools.wraps(set_impl)
    def set_attn_implementation(self, attn_implementation: Any, *args: Any, **kw: Any) -> Any:
        asked = attn_implementation.get("") if isinstance(attn_implementation, dict) else \
            attn_implementation
        if asked == NAME:
            check_model(self)
        return set_impl(self, attn_implementation, *args, **kw)

    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation
    PreTrainedModel.set_attn_implementation = set_attn_implementation
    PreTrainedModel._clattn_checked = True


# ------------------------------------------------------------------------------ the mask
class ClattnMask:
    """What the ``"clattn"`` mask function returns instead of a dense mask: the 2D
    padding mask and the mask arguments, from which the pattern is checked (causal, or
    causal with the sliding window of the layers it is for) and, only for a forward
    without a ClattnCache, the eager mask is built."""

    def __init__(self, args: dict) -> None:
        self.args = args
        self.padding = args.get("attention_mask")  # bool [B, past + q] or None
        self.q_length = int(args["q_length"])
        self.kv_length = int(args["kv_length"])
        self._patterns: dict = {}
        self._dense = None
        self._index: Any = None  # what __getitem__ took of the dense mask

    @property
    def shape(self) -> tuple:
        return (int(self.args["batch_size"]), 1, self.q_length, self.kv_length)

    def __getattr__(self, name: str) -> Any:
        """Any other tensor attribute: the model computes with the mask itself (adds a
        bias to it: ALiBi, Doge's dynamic mask), which clattn does not attend."""
        if name.startswith("__") or name in ("args", "_patterns", "_dense", "_index"):
            raise AttributeError(name)
        raise UnsupportedFeatureError(
            f"clattn: the model computes with the attention mask (mask.{name}: a bias "
            f"added to the scores through the mask, as ALiBi and Doge's dynamic mask "
            f"attention do); clattn attends causal (or sliding-window) masks only")

    def __getitem__(self, index: Any) -> "ClattnMask":
        """The mask of the last query positions only, ``mask[:, :, slice(-n, None), :]``
        (Gemma-4 runs its shared-KV layers on the positions whose logits it keeps); any
        other index is refused by name."""
        ok = isinstance(index, tuple) and len(index) == 4 and \
            all(i == slice(None) for i in (index[0], index[1], index[3])) and \
            isinstance(index[2], slice) and index[2].step is None and \
            index[2].stop is None and (index[2].start or 0) <= 0
        if not ok:
            raise UnsupportedFeatureError(f"clattn: the model indexes the attention mask with "
                                          f"{index!r}; clattn keeps the last query positions "
                                          f"of a mask only (mask[:, :, -n:, :])")
        out = ClattnMask(self.args)
        out._patterns = self._patterns
        out.q_length = len(range(self.q_length)[index[2]])
        out._index = index
        return out

    def dense(self) -> torch.Tensor | None:
        """transformers' eager (additive float) mask for the same arguments."""
        if self._dense is None:
            self._dense = eager_mask(**self.args)
            if self._index is not None and self._dense is not None:
                self._dense = self._dense[self._index]
        return self._dense

    def check_pattern(self, window: int | None, layer: int) -> None:
        """Raise unless the mask function is causal (with ``window``: and keeps the last
        ``window`` positions), the only patterns clattn's cache attends."""
        if window in self._patterns:
            return
        fn = self.args.get("mask_function")
        what = "causal" if window is None else f"causal with a sliding window of {window}"
        if self.args.get("use_vmap"):
            raise UnsupportedFeatureError(
                f"clattn: layer {layer}: the model overlays its own mask function on the "
                f"{what} mask (images, blocks, packed sequences); clattn attends {what} "
                f"only")
        ok = fn is not None and _mask_matches(fn, window)
        if not ok:
            raise UnsupportedFeatureError(
                f"clattn: layer {layer}: the model's mask pattern is not {what} (chunked, "
                f"bidirectional or a custom mask function); clattn attends {what} only")
        self._patterns[window] = True


_MATCHES: dict = {}  # (the mask function's code and closure, window) -> bool
_PLAIN = (int, float, str, bool, type(None))


def _mask_matches(fn: Callable, window: int | None) -> bool:
    """Whether the mask function is causal (with the window), memoized on its code and
    closure values (transformers makes a new closure per forward)."""
    key = _function_key(fn)
    if key is None:  # a closure over data (tensors, ...): evaluated every time
        return _evaluate_mask(fn, window)
    hit = _MATCHES.get((key, window))
    if hit is None:
        hit = _MATCHES[key, window] = _evaluate_mask(fn, window)
    return hit


def _function_key(obj: Any, depth: int = 0) -> Any:
    """A hashable key of a function made of its code and, recursively, its closure's
    values; None when a value is not a plain constant or function."""
    if isinstance(obj, _PLAIN):
        return obj
    if depth > 8:
        return None
    if isinstance(obj, tuple):
        parts = tuple(_function_key(o, depth + 1) for o in obj)
        return None if any(p is None and o is not None for p, o in zip(parts, obj)) else parts
    code = getattr(obj, "__code__", None)
    if code is None or getattr(obj, "__defaults__", None):
        return None
    cells = tuple(c.cell_contents for c in obj.__closure__ or ())
    inner = _function_key(cells, depth + 1)
    return None if inner is None else (code, inner)


def _evaluate_mask(fn: Callable, window: int | None) -> bool:
    """Evaluate the mask function at the positions that tell causal and the window apart."""
    w = window or 4096
    q = torch.tensor([0, 1, 2, 7, w - 1, w, w + 1, 3 * w + 5])
    off = torch.tensor([-w - 2, -w - 1, -w, -w + 1, -2, -1, 0, 1, 2])
    kv = (q[:, None] + off[None, :]).clamp(min=0)
    want = kv <= q[:, None]
    if window is not None:
        want &= kv > q[:, None] - window
    try:
        zero = torch.tensor(0)
        got = torch.as_tensor(fn(zero, zero, q[:, None], kv)).to(torch.bool)
        return bool(torch.equal(got.expand_as(want), want))
    except Exception:  # noqa: BLE001 - a function that needs vmap or data: not ours
        return False


def mask(batch_size: int, q_length: int | None = None, kv_length: int | None = None,
         q_offset: int = 0, kv_offset: int = 0, mask_function: Callable | None = None,
         attention_mask: torch.Tensor | None = None, **kwargs: Any) -> ClattnMask:
    """The ``AttentionMaskInterface`` function: no dense mask is built (see ClattnMask).
    transformers before 5 passes ``cache_position`` (the new positions) for ``q_length``."""
    if q_length is None:
        q_length = int(kwargs["cache_position"].shape[0])
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                **kwargs)
    if mask_function is not None:
        args["mask_function"] = mask_function
    return ClattnMask(args)


# ------------------------------------------------------------------------------ attention
def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
              scaling: float | None = None, is_causal: bool | None = None,
              position_bias: torch.Tensor | None = None, **kwargs: Any) -> tuple:
    """The ``AttentionInterface`` function ``"clattn"``.

    ``query [B, H, L, D]`` (RoPE applied by the model), ``key [B, H_kv, L, D]``,
    ``value [B, H_kv, L, D_v]``: the new tokens, as a :class:`ClattnCache` returned them
    (or, multi-head latent attention, expanded from what it returned). Returns ``(out
    [B, L, H, D_v], None)``.
    """
    pending, PENDING.value = PENDING.value, None
    if _GENERATING.calls:
        _GENERATING.calls[-1] += 1
    if pending is None:
        pending = _shared_kv(module, key, value)
    if pending is None or not expanded_from(pending[0], pending[2:], key, value):
        if pending is not None:
            exc = UnsupportedFeatureError(
                f"clattn: layer {pending[1]}: the keys/values given to attention are not the "
                f"ones the ClattnCache returned (the model changes them between the cache "
                f"update and attention: differential attention as in DiffLlama, JetMoE's "
                f"mixture of attention heads); clattn attends the keys and values it stored")
            pending[0].fail(exc)
            raise exc
        return _eager(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    owner, index = pending[0], pending[1]
    try:
        return _paged(owner, index, module, query, key, value, attention_mask, dropout,
                      scaling, is_causal, position_bias, kwargs, pending[2:]), None
    except BaseException as exc:  # the cache no longer agrees with transformers' count
        owner.fail(exc)
        raise


def _shared_kv(module: Any, key: torch.Tensor, value: torch.Tensor) -> tuple | None:
    """``(owner, layer, key, value)`` when ``module`` is a shared-KV layer of the cache of
    this thread's forward (``ClattnCache.sources``) attending with the tensors its
    source layer's ``update`` returned; None otherwise (no cache: the eager fallback)."""
    owner, index = RETURNED.owner, getattr(module, "layer_idx", None)
    if owner is None or index not in owner.sources:
        return None
    source = owner.sources[index]
    got = RETURNED.kv.get(source)
    if got is None or got[0] is not key or got[1] is not value:
        exc = RuntimeError(f"clattn: layer {index} shares layer {source}'s keys and values "
                           f"(num_kv_shared_layers) and was given others; clattn attends "
                           f"the ones layer {source} stored")
        owner.fail(exc)
        raise exc
    return owner, index, key, value


def _paged(owner: ClattnCache, index: int, module: Any, query: torch.Tensor,
           key: torch.Tensor, value: torch.Tensor, attention_mask: Any, dropout: float,
           scaling: float | None, is_causal: Any, position_bias: Any,
           kwargs: dict, cached: tuple = ()) -> torch.Tensor:
    """Layer ``index``'s attention over the owner's paged cache (begins and ends the
    layer kind's step). ``cached``: what the layer's cache update was given (the
    latents and rope keys of a multi-head latent attention model in the latent form)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    _refuse(module, query, dropout, is_causal, position_bias, attention_mask, kwargs, index)
    window = owner.windows[index]
    asked = kwargs.get("sliding_window")
    if (asked or None) != window:
        raise UnsupportedFeatureError(
            f"clattn: layer {index} attends with sliding_window={asked}, the cache was "
            f"made for {window} from the config (layer_types / sliding_window)")
    if isinstance(attention_mask, ClattnMask):
        attention_mask.check_pattern(window, index)
    absorb = None
    if owner.latent and not caches_latents(owner.config, cached):
        owner.run_decompressed()  # the model caches its expanded keys (transformers 4.x)
    if owner.latent:  # MLA's latent form: the rows and absorbed queries (hf_mla)
        absorb = LatentLayer(module, owner.config, index)
        if index not in owner.latent_checked:
            absorb.check_expansion(*cached, key, value)
            owner.latent_checked.add(index)
        query, key, value = absorb.inputs(query, *cached)
    B, _, L, _ = query.shape
    rows = owner.rows_for(B)
    g = owner.group(index, module, query, key, value, scaling, kwargs.get("softcap"))
    step = g.step
    local = g.local[index]
    if step is not None and index in step.done:
        raise RuntimeError("clattn: an earlier forward stopped half-way (an error in the "
                           "model); the cache lost track of it: call cache.reset()")
    if step is None:
        step = g.step = _begin(g, rows, attention_mask, B, L, owner.layers[index])
    out = _run_layer(g, step, local, query, key, value, _sink_logits(kwargs),
                     append=index not in owner.sources)
    step.done.add(index)
    if len(step.done) == len(g.members):
        if step.begun:
            g.cache.end()
        g.step = None
    return out if absorb is None else absorb.output(out)


def _refuse(module: Any, query: torch.Tensor, dropout: float, is_causal: Any,
            position_bias: Any, attention_mask: Any, kwargs: dict, index: int) -> None:
    """A clear error for each call feature clattn cannot compute."""
    if dropout and module.training:
        raise UnsupportedFeatureError("clattn: attention dropout in training mode; clattn "
                                      "runs inference (model.eval())")
    if torch.is_grad_enabled() and query.requires_grad:
        raise UnsupportedFeatureError("clattn: gradients through attention; clattn runs "
                                      "inference (torch.no_grad() / torch.inference_mode())")
    # is_causal=False beside a clattn mask (GPT-2 in transformers 4.x: "use the mask"):
    # the mask's pattern is checked to be causal (ClattnMask.check_pattern)
    if (is_causal is False and not isinstance(attention_mask, ClattnMask)) or \
            not getattr(module, "is_causal", True):
        raise UnsupportedFeatureError(f"clattn: layer {index} is not causal; clattn "
                                      f"attends causally")
    if position_bias is not None:
        raise UnsupportedFeatureError("clattn: an additive position bias (T5/ALiBi style)")
    if isinstance(attention_mask, torch.Tensor):
        raise UnsupportedFeatureError(
            f"clattn: a prepared {attention_mask.dim()}D attention mask was given; clattn "
            f"takes the 2D padding mask (attention_mask [batch, tokens]) and attends "
            f"causally")


def _begin(g: Any, rows: list, attention_mask: Any, B: int, L: int, layer: Any) -> Any:
    """Begin the layer kind's step: the new tokens of each row that are not padding."""
    step = GroupForward()
    step.L = L
    cache = g.cache
    past = layer.cumulative_length - L
    valid = None
    pad = attention_mask.padding if isinstance(attention_mask, ClattnMask) else None
    if pad is not None:
        if tuple(pad.shape) != (B, past + L):
            raise ValueError(f"clattn: the attention mask is {tuple(pad.shape)}, the cache "
                             f"has seen {past} positions and this forward adds {L} to each "
                             f"of {B} rows; pass the mask of every position so far")
        pad = pad.detach().to("cpu", torch.bool).numpy()
        held = np.array([cache.length(r) for r in rows])
        if not np.array_equal(pad[:, :past].sum(axis=1), held):
            raise ValueError("clattn: the attention mask marks other past positions as "
                             "padding than the earlier forwards did; clattn stored only the "
                             "positions that were not padding then")
        new = pad[:, past:]
        if not new.all():
            valid = new
            if g.window is not None:
                late = (held[:, None] > 0) | (np.cumsum(new, axis=1) > 0)
                if np.any(late & ~new):
                    raise UnsupportedFeatureError(
                        f"clattn: padding after a sequence's first token with sliding-window "
                        f"layers (window {g.window}); pad on the left "
                        f"(tokenizer.padding_side='left')")
    if valid is None:
        ids, lengths, step.T = rows, [L] * B, B * L
    else:
        counts = valid.sum(axis=1)
        keep = np.flatnonzero(counts)
        ids, lengths = [rows[b] for b in keep], [int(counts[b]) for b in keep]
        step.T = int(counts.sum())
        step.sel = torch.from_numpy(np.flatnonzero(valid.reshape(-1)))
    if g.window is not None:  # the window keeps what a crop may take back (see crop)
        g.recorded = g.recorded + L if layer.record_past else 0
        cache.rollback = g.recorded
    if step.T == 0:
        g.owner.steps["empty"] += 1
        return step
    try:
        cache.begin(ids, lengths)
    except CacheFullError as exc:
        raise CacheFullError(f"{exc}. With transformers: ClattnCache(model, max_cache_len=...) "
                             f"(tokens per sequence), num_pages= or budget_bytes=", exc.needed,
                             exc.free) from None
    step.begun = True
    if max(lengths) > 1:
        step.mode = "prefill" if cache.step_kernels == ("prefill",) else "chunk"
    g.owner.steps[step.mode] += 1
    return step


def _sink_logits(kwargs: dict) -> np.ndarray | None:
    """The layer's learned attention sinks (gpt-oss passes ``s_aux=module.sinks``, one
    logit per query head) as float32 numpy, or None."""
    for name in ("s_aux", "sinks"):
        s = kwargs.get(name)
        if s is not None:
            return s.detach().to("cpu", torch.float32).contiguous().numpy()
    return None


def _tokens(x: torch.Tensor, step: Any) -> np.ndarray:
    """``x [B, heads, L, D]`` as the step's tokens ``[T, heads, D]`` (numpy view of a
    contiguous CPU tensor: no copy when the model's layout is token-major already)."""
    B, h, L, D = x.shape
    t = x.detach().transpose(1, 2).reshape(B * L, h, D)
    if step.sel is not None:
        t = t.index_select(0, step.sel.to(t.device))
    return t.to("cpu").contiguous().numpy()


def _run_layer(g: Any, step: Any, local: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, sinks: np.ndarray | None,
               append: bool = True) -> torch.Tensor:
    """One layer's append (``append=False``: a shared-KV layer, whose source appended
    this step's keys and values to the pool ``local``) and attention."""
    B, H, L, _ = query.shape
    D = value.shape[-1]   # the output is as wide as the values
    out = (torch.empty if step.sel is None else torch.zeros)((B, L, H, D), dtype=query.dtype)
    if step.T == 0:
        return out.to(query.device)
    if L != step.L:  # the last positions' queries only (a Gemma-4 shared-KV layer)
        full = query.new_zeros((B, H, step.L, D))
        full[:, :, step.L - L:] = query
        return _run_layer(g, step, local, full, key, value, sinks, append)[:, step.L - L:]
    cache = g.cache
    if append:
        k = _tokens(key, step)
        v = None if g.shape.latent else _tokens(value, step)  # latent: values in the rows
        cache.append(local, k, v)
    q = _tokens(query, step)
    flat = out.view(B * L, H, D)
    dest = flat.numpy() if step.sel is None else np.empty((step.T, H, D), q.dtype)
    if g.on_device and not cache.device.shares_host_io(local, step.T):
        cl = runtime.cl()
        dq, dout, dlse = g.buffers_for(step.T)
        if not (append and cache.device.takes_host_q(local)):
            up = cl.enqueue_copy(g.queue, dq.base_data, q, dst_offset=dq.offset,
                                 is_blocking=False)
            dq.events[:] = [up]
            q = dq  # else q goes up with the held append's k and v, in one write
        res = cache.attend(local, q, out=dout, lse=dlse, sink_logits=sinks)
        cl.enqueue_copy(g.queue, dest, dout.base_data, src_offset=dout.offset,
                        wait_for=[res.event] if res.event is not None else None,
                        is_blocking=True)
    else:  # the CPU backend, or host arrays in shared memory (clattn.shared_io)
        cache.attend(local, q, out=dest, lse=np.empty((step.T, H), np.float32),
                     sink_logits=sinks)
    if step.sel is not None:
        flat[step.sel] = torch.from_numpy(dest)
    return out.to(query.device)


# ------------------------------------------------------------------------------ fallback
def _eager(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: Any, dropout: float, scaling: float | None, kwargs: dict) -> tuple:
    """No ClattnCache: the model's own eager attention over the keys and values given."""
    warnings.warn("clattn: this forward has no ClattnCache (use_cache=False or another "
                  "cache class); its attention runs eager in torch, not on the OpenCL "
                  "device", RuntimeWarning, stacklevel=2)  # once per place (default filter)
    dense = attention_mask.dense() if isinstance(attention_mask, ClattnMask) else attention_mask
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return fn(module, query, key, value, dense, dropout=dropout, scaling=scaling, **kwargs)


# ------------------------------------------------------------------------------ generate
def _uses_clattn(model: Any) -> bool:
    cfg = model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return NAME in (getattr(cfg, "_attn_implementation", None),
                    getattr(text, "_attn_implementation", None))


def _speculative(arguments: dict, gen: Any) -> bool:
    """Whether the cache prepared with these ``_prepare_cache_for_generation`` arguments
    will be cropped: the main model of assisted or prompt-lookup decoding, or a draft
    model (a generate inside another's). transformers 5 asks for it itself
    (``activate_past_recording``); 4.x crops without asking."""
    mode = str(arguments.get("generation_mode") or "").lower()
    return "assisted" in mode or arguments.get("assistant_model") is not None or \
        bool(getattr(gen, "prompt_lookup_num_tokens", None)) or len(_GENERATING.sizes) > 1


class _Generating(threading.local):
    """The ``generate`` calls in progress in this thread, outermost first: the tokens per
    sequence each one's cache is sized for (0 until its cache is prepared). An assistant
    model's ``generate`` runs inside the main model's, once per draft, and keeps the
    cache its first call made: that cache is sized for the main call's length, which no
    draft passes (transformers caps each draft at the main ``max_length`` less one)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        #: calls of the "clattn" attention function during each generate in progress
        self.calls: list[int] = []


def _check_reached(model: Any, calls: int) -> None:
    """A generate of a model set to clattn that never called clattn's attention (its
    attention is its own code that the class does not declare, or it has no attention
    layers: transformers 4.x's OpenAI-GPT and Mamba) is an error naming it, not a silent
    run on the model's own code."""
    if calls == 0 and _uses_clattn(model):
        raise UnsupportedFeatureError(
            f"clattn: {type(model).__name__} generated without a single call of clattn's "
            f"attention (its attention does not go through transformers' "
            f"AttentionInterface, or it has no attention layers); it ran on its own code")


_GENERATING = _Generating()


def _patch_generate() -> None:
    """Wrap ``GenerationMixin._prepare_cache_for_generation`` (a ClattnCache where it
    would make a DynamicCache for a clattn model) and ``generate`` (accepts
    ``attn_implementation=``). Once; inert for models that do not attend with clattn."""
    from transformers.generation.utils import GenerationMixin

    if getattr(GenerationMixin, "_clattn_patched", False):
        return
    prepare = GenerationMixin._prepare_cache_for_generation
    prepare_sig = inspect.signature(prepare)

    @functools.wraps(prepare)
    def _prepare_cache_for_generation(self, *args: Any, **kw: Any) -> Any:
        ours = _uses_clattn(self) and not getattr(self.config, "is_encoder_decoder", False)
        try:
            a = prepare_sig.bind(self, *args, **kw).arguments
        except TypeError:  # another transformers' signature: leave it alone
            return prepare(self, *args, **kw)
        gen = a.get("generation_config")
        model_kwargs = a.get("model_kwargs") or {}
        user_cache = any(model_kwargs.get(n) is not None for n in ("cache", "past_key_values"))
        if ours and not user_cache and getattr(gen, "cache_implementation", None) not in \
                (None, "dynamic"):  # e.g. Gemma-2's "hybrid": the K/V live in clattn's pools
            warnings.warn(f"clattn: cache_implementation={gen.cache_implementation!r} ignored; "
                          f"the keys and values live in a ClattnCache", RuntimeWarning,
                          stacklevel=3)
            gen.cache_implementation = None
        res = prepare(self, *args, **kw)
        size = a.get("max_cache_length")
        # prompt lookup's verify step may run past max_length by its draft
        if size and getattr(gen, "prompt_lookup_num_tokens", None):
            size += int(gen.prompt_lookup_num_tokens)
        outer = _GENERATING.sizes
        if ours and size and outer:
            # a generate inside another's (an assistant model drafting): its cache lives
            # on across the outer call's drafts, which never run past the outer length
            size = max(size, max(outer))
        if outer and size:
            outer[-1] = max(outer[-1], int(size))
        if ours:
            _keep_cache_on_restart(type(self))
            for name in ("cache", "past_key_values"):
                c = model_kwargs.get(name)
                if type(c) is DynamicCache and not getattr(c, "_is_user_defined", False):
                    made = model_kwargs[name] = ClattnCache(self, max_cache_len=size,
                                                            page_size=DEFAULTS["page_size"])
                    if any(getattr(layer, "record_past", False) for layer in c.layers) or \
                            _speculative(a, gen):
                        for layer in made.layers:  # (4.x's Cache has no such method)
                            layer.activate_past_recording()
        return res

    generate = GenerationMixin.generate

    @functools.wraps(generate)
    def _generate(self, *args: Any, attn_implementation: str | None = None, **kw: Any) -> Any:
        _GENERATING.sizes.append(0)  # the cache length this call sizes for (see above)
        _GENERATING.calls.append(0)
        try:
            if attn_implementation is None:
                out = generate(self, *args, **kw)
                _check_reached(self, _GENERATING.calls[-1])
                return out
            before = self.config._attn_implementation
            self.set_attn_implementation(attn_implementation)
            try:
                out = generate(self, *args, **kw)
                _check_reached(self, _GENERATING.calls[-1])
                return out
            finally:
                self.set_attn_implementation(before)
        finally:
            _GENERATING.sizes.pop()
            _GENERATING.calls.pop()

    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    GenerationMixin.generate = _generate
    GenerationMixin._clattn_patched = True


def _keep_cache_on_restart(cls: type) -> None:
    """Wrap ``cls.prepare_inputs_for_generation`` (once per class) so that a ClattnCache
    the model's own code drops survives: when the inputs it prepares carry no cache and
    hold every position seen so far (a forward that recomputes the whole sequence, as
    Phi-3's longrope models make when the sequence reaches
    ``original_max_position_embeddings``, whose rotary factors change there), the cache
    is reset and given back, so that the recompute and every later step run on clattn
    with the keys the model rotates anew. Inputs that keep the cache, or drop it while
    holding only part of the sequence, are returned unchanged."""
    prepare = cls.prepare_inputs_for_generation
    if getattr(prepare, "_clattn_keeps_cache", False):
        return

    @functools.wraps(prepare)
    def prepare_inputs_for_generation(self, *args: Any, **kw: Any) -> Any:
        inputs = prepare(self, *args, **kw)
        name = next((n for n in ("cache", "past_key_values") if n in kw), None)
        given = kw.get(name) if name is not None else None
        if not isinstance(given, ClattnCache) or not isinstance(inputs, dict) or \
                any(inputs.get(n) is not None for n in ("cache", "past_key_values")):
            return inputs
        new = inputs.get("input_ids")
        if new is None:
            new = inputs.get("inputs_embeds")
        seen = kw.get("attention_mask")
        if not isinstance(seen, torch.Tensor) or seen.dim() != 2:
            seen = args[0] if args else kw.get("input_ids")
        if new is not None and seen is not None and new.shape[1] == seen.shape[1]:
            given.reset()  # the recompute appends every position from 0
            given.restarts += 1
            inputs[name] = given
        return inputs

    prepare_inputs_for_generation._clattn_keeps_cache = True
    cls.prepare_inputs_for_generation = prepare_inputs_for_generation


register()
