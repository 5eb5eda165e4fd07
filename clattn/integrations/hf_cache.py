"""The transformers ``Cache`` whose keys and values live in :class:`clattn.PagedKVCache`.

:class:`ClattnCache` holds one :class:`~clattn.PagedKVCache` per *layer kind* (full
attention, or a sliding window of one size), each with a page pool per layer on the
OpenCL device. The batch's rows are sequences of those caches; a row's padding tokens are
never stored, so a padded position is never attended. One model forward is one step of
each kind's cache: the first layer of the kind begins it (``begin(seq_ids, lengths)``),
each layer appends its new keys and values and attends, the last layer ends it.

The attention function (:mod:`clattn.integrations.transformers`) finds the cache through
:data:`PENDING`: ``update`` records the layer and the tensors it returned, the attention
call that follows in the same thread takes them. A multi-head latent attention model
(``config.kv_lora_rank``: DeepSeek-V2/V3, MiniCPM3) hands ``update`` its new latents and
expands what it returns into per-head keys and values (the decompressed form): the
attention call then takes those expansions of the same new tokens
(:func:`expanded_from`). In the latent form (``mla="latent"``, the default) the cache
stores those latents themselves, one row per token and layer, and the attention call
absorbs the expansion into the queries and the output (:mod:`.hf_mla`); in the
decompressed form it stores the expansions. docs/transformers.md is the user's page.
"""
from __future__ import annotations

import collections
import math
import threading
import warnings
from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import clattn
from clattn import runtime
from clattn.spec import LSE_DTYPE, AttentionSpec

from .hf_errors import UnsupportedFeatureError
from .hf_mla import check_form, latent_attention, latent_spec

__all__ = ["ClattnCache", "ClattnLayer", "UnsupportedFeatureError", "check_config",
           "expanded_from", "layer_windows", "shared_kv_sources"]

NAME = "clattn"  # the attn_implementation a ClattnCache works with
#: the default device and options of the caches made for generate (what
#: clattn.integrations.transformers.register set last)
DEFAULTS: dict = {"device": None, "prefill": True, "backend": "auto", "profile": None,
                  "page_size": 16, "k_format": None, "v_format": None, "mla": "latent"}
#: torch dtypes clattn stores (pages, q and out), by the name clattn gives them
DTYPES = {torch.float16: "float16", torch.float32: "float32"}
#: tokens per sequence a cache is sized for when neither generate nor the caller says
DEFAULT_MAX_CACHE_LEN = 4096
_BUFFERS_KEPT = 4  # device q/out/lse arrays kept per layer kind (one per step size)


class _Pending(threading.local):
    """What the last ``ClattnLayer.update`` of this thread returned (None once taken)."""

    value: Any = None


PENDING = _Pending()


class _Returned(threading.local):
    """The keys and values each layer's ``update`` returned in this thread's current
    forward (``kv``: layer -> (keys, values)) and the cache they went to: a shared-KV
    layer (Gemma-3n) attends with the very tensors its source layer got back."""

    owner: Any = None
    kv: dict

    def __init__(self) -> None:
        self.kv = {}

    def record(self, owner: Any, index: int, key: Any, value: Any) -> None:
        if self.owner is not owner or index in self.kv:  # another cache, or a new forward
            self.owner, self.kv = owner, {}
        self.kv[index] = (key, value)


RETURNED = _Returned()


def check_config(config: Any) -> None:
    """Raise :class:`UnsupportedFeatureError` for a (text) config whose attention clattn
    cannot hold in its cache: an encoder-decoder, ALiBi, or a layer type other than full
    and sliding attention (:func:`layer_windows`)."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedFeatureError("clattn: encoder-decoder models (cross-attention) "
                                      "are not supported; decoder-only models are")
    if getattr(config, "alibi", False) is True:
        raise UnsupportedFeatureError(
            "clattn: ALiBi (config.alibi=True: a linear position bias added to the scores "
            "through the attention mask) is not supported; clattn attends with rotary or "
            "absolute positions")
    if getattr(config, "num_hidden_layers", None) is not None:
        layer_windows(config)


def shared_kv_sources(config: Any) -> dict[int, int]:
    """``{layer: source layer}`` of the layers that attend another layer's keys and values
    (``config.num_kv_shared_layers``, Gemma-3n and Gemma-4): the last
    ``num_kv_shared_layers`` layers store none and attend those of the last earlier layer
    of their own layer type, as transformers' Gemma-3n attention does."""
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    n = int(config.num_hidden_layers)
    if shared <= 0:
        return {}
    first = n - shared
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    out = {}
    for i in range(first, n):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise UnsupportedFeatureError(
                f"clattn: layer {i} shares the keys and values of an earlier "
                f"{types[i]!r} layer (num_kv_shared_layers={shared}) and there is none")
        out[i] = earlier[-1]
    return out


def expanded_from(owner: "ClattnCache", cached: tuple, key: torch.Tensor,
                  value: torch.Tensor) -> bool:
    """Whether the ``key``/``value`` an attention call got are what the cache update of
    its layer returned (``cached``): the same tensors, or, for multi-head latent
    attention, their expansions (per-head keys and values of the same batch rows and new
    positions)."""
    if cached[0] is key and cached[1] is value:
        return True
    return latent_attention(owner.config) and all(
        x.dim() == 4 and x.shape[0] == cached[0].shape[0] and x.shape[-2] == cached[0].shape[-2]
        for x in (key, value))


def layer_windows(config: Any) -> list[int | None]:
    """The sliding window of each layer (None: full attention), as transformers reads
    the config (``layer_types``, else ``sliding_window`` for every layer)."""
    n = int(config.num_hidden_layers)
    if not getattr(config, "is_causal", True):
        raise UnsupportedFeatureError("clattn: config.is_causal=False (bidirectional "
                                      "attention); clattn attends causally")
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        if getattr(config, "attention_chunk_size", None):
            raise UnsupportedFeatureError(
                f"clattn: chunked attention (config.attention_chunk_size="
                f"{config.attention_chunk_size}) is not supported")
        return [int(window) if window else None] * n
    out: list[int | None] = []
    for i, t in enumerate(list(types)[:n]):
        if t == "full_attention":
            out.append(None)
        elif t == "sliding_attention":
            if not window:
                raise UnsupportedFeatureError(f"clattn: layer {i} is 'sliding_attention' but "
                                              f"the config has no sliding_window")
            out.append(int(window))
        else:
            raise UnsupportedFeatureError(
                f"clattn: layer {i} has layer type {t!r}; clattn runs 'full_attention' and "
                f"'sliding_attention' layers only")
    return out


class ClattnLayer(CacheLayerMixin):
    """One layer of a :class:`ClattnCache`: counts the positions the model has seen (as
    ``DynamicLayer`` does, padding included) and hands its new keys and values to the
    attention call; the tokens themselves are in the owner's paged cache."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: "ClattnCache", index: int, window: int | None,
                 source: int | None = None) -> None:
        super().__init__()
        self.owner, self.index, self.window = owner, index, window
        #: the layer whose keys and values this one attends (a shared-KV layer: it never
        #: updates and holds no pages), else None
        self.source = source
        self.is_sliding = window is not None
        self.cumulative_length = 0
        self.is_initialized = True
        self.record_past = False

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None,
                                **kwargs: Any) -> None:
        """transformers' request (assisted and prompt-lookup decoding) to keep what was
        appended since the last ``crop``, so that crop can take it back: a window layer
        kind then keeps those tokens' pages behind its window.

        ``recurrent_states_to_keep`` (and any further keyword a later transformers
        passes) concerns the states of recurrent (linear-attention) layers; an attention
        layer has none, so it is accepted and has no effect here."""
        self.record_past = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the new keys and values; the attention call appends them (and needs the
        query, the mask and the module's scaling to do so). Returns them unchanged."""
        if self.owner.broken is not None:
            raise RuntimeError(f"clattn: this ClattnCache stopped at an error in a forward "
                               f"({self.owner.broken}); call reset() to use it again")
        impl = getattr(self.owner.config, "_attn_implementation", NAME)
        if impl != NAME:
            raise RuntimeError(
                f"clattn: a ClattnCache needs attn_implementation={NAME!r}; the model attends "
                f"with {impl!r} (which would see only the new tokens' keys and values): "
                f"model.set_attn_implementation({NAME!r}), or use another cache")
        stale, PENDING.value = PENDING.value, None
        if stale is not None and stale[0] is self.owner:  # (another cache's: it failed)
            raise RuntimeError(f"clattn: layer {self.index - 1 if self.index else 'last'}'s "
                               f"new keys and values were never attended (no {NAME!r} "
                               f"attention call after the cache update); call reset()")
        if self.source is not None:
            raise RuntimeError(f"clattn: layer {self.index} shares layer {self.source}'s keys "
                               f"and values (num_kv_shared_layers) and stores none; it was "
                               f"given new ones")
        self.cumulative_length += int(key_states.shape[-2])
        PENDING.value = (self.owner, self.index, key_states, value_states)
        RETURNED.record(self.owner, self.index, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: Any) -> tuple[int, int]:
        # an int (transformers 5), or the cache_position tensor of older versions
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.cumulative_length + q, 0

    def get_seq_length(self) -> int:
        if self.source is not None:
            return self.owner.layers[self.source].cumulative_length
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # abstract in transformers 4.56: no fixed size
        return -1

    # the sequence operations are the owner's, once for all layers
    def reset(self) -> None:
        self.cumulative_length = 0

    def offload(self) -> None:  # the pools stay on the OpenCL device
        pass

    def prefetch(self) -> None:
        pass


class ClattnCache(Cache):
    """A transformers ``Cache`` backed by :class:`clattn.PagedKVCache` on an OpenCL device.

    Parameters
    ----------
    model : PreTrainedModel, optional
        The model (its text config is read). Or ``config=``.
    device : None, str, pyopencl.Device/Context/CommandQueue
        As for :class:`clattn.BatchDecode` (``"pocl"``, ``"intel"``, a name; None:
        ``PYOPENCL_CTX`` or clattn's default). Default: the one given to
        :func:`clattn.integrations.transformers.register`.
    page_size : int, optional
        Tokens per page (default: register()'s, 16).
    max_cache_len : int, optional
        Tokens per sequence the pools are sized for (``generate`` passes its
        ``max_length``); default 4096. Ignored with ``num_pages``/``budget_bytes``.
    num_pages, budget_bytes : int, optional
        Pages per layer, or bytes for all the pools of all layer kinds together.
    prefill : bool
        Prompt steps on the prefill kernel (the cache chooses it for prompt chunks) or,
        False, every token on the cache's decode kernel.
    backend, profile
        As for :class:`clattn.PagedKVCache` (``backend="cpu"``: numpy pools).
    k_format, v_format : {None, "float16", "float32", "q8_0", "q4_0"}, optional
        Storage of the keys and values (default: register()'s, else the model's dtype);
        quantized formats need a head_dim that is a multiple of 32.
    mla : {None, "latent", "decompressed"}, optional
        The form of a multi-head latent attention model (``config.kv_lora_rank``):
        ``"latent"`` stores one row ``[latent | rope key]`` per token and layer and
        attends with absorbed queries, ``"decompressed"`` the per-head keys and values
        (default: register()'s, ``"latent"``). Other models ignore it.

    The pools are made at the first forward, from the shapes and dtype the model
    attends with (f16 or f32), one :class:`~clattn.PagedKVCache` per layer kind.
    """

    def __init__(self, model: Any = None, *, config: Any = None, device: Any = None,
                 page_size: int | None = None, max_cache_len: int | None = None,
                 num_pages: int | None = None, budget_bytes: int | None = None,
                 prefill: bool | None = None, backend: str | None = None,
                 profile: Any = None, k_format: str | None = None,
                 v_format: str | None = None, mla: str | None = None) -> None:
        if model is None and config is None:
            raise TypeError("ClattnCache: pass the model (or config=)")
        cfg = model.config if model is not None else config
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        check_config(cfg)
        self.config = cfg
        self.windows = layer_windows(cfg)
        #: shared-KV layer -> the layer whose pool it attends (no pool of its own)
        self.sources = shared_kv_sources(cfg)
        super().__init__(layers=[ClattnLayer(self, i, w, self.sources.get(i))
                                 for i, w in enumerate(self.windows)])
        d = DEFAULTS
        self.device = d["device"] if device is None else device
        self.page_size = int(d["page_size"] if page_size is None else page_size)
        self.tokens_per_sequence = max_cache_len  # (4.56: Cache.max_cache_len is a property)
        self.num_pages, self.budget_bytes = num_pages, budget_bytes
        self.use_prefill = d["prefill"] if prefill is None else bool(prefill)
        self.backend = d["backend"] if backend is None else backend
        self.profile = d["profile"] if profile is None else profile
        self.k_format = d["k_format"] if k_format is None else k_format
        self.v_format = d["v_format"] if v_format is None else v_format
        self.mla = check_form(d["mla"] if mla is None else mla)
        #: whether the layers attend in the latent form of multi-head latent attention
        self.latent = latent_attention(cfg) and self.mla == "latent"
        #: the layers whose expansion of the latents was checked against the absorption
        self.latent_checked: set = set()
        self.groups: dict = {}  # window (None = full) -> _Group, made at the first forward
        self.rows: list | None = None  # the sequence id of each batch row
        self._next_id = 0
        self._cl_device: Any = None
        #: steps run per layer kind, by path: "decode" (one token per sequence, the
        #: decode kernel), "prefill" (a prompt wholly on the prefill kernel), "chunk" (a
        #: prompt with tokens on the decode kernel: a window that slides inside it, a row
        #: of one token, or prefill=False), "empty" (nothing but padding)
        self.steps: collections.Counter = collections.Counter()
        #: forwards that recomputed every position after the model's generate code dropped
        #: the cache (the cache was reset and given back: Phi-3's longrope switch)
        self.restarts = 0
        self.broken: str | None = None  # the error a forward stopped at (reset() clears)

    def run_decompressed(self) -> None:
        """Run the decompressed form: the model caches its expanded per-head keys and
        values, not its latents (transformers 4.x's DeepSeek-V2/V3), so that there are
        no latents to store. Before the first pool only; one ``RuntimeWarning``."""
        if self.groups:
            raise RuntimeError("clattn: the latent form was given expanded keys after its "
                               "pools were made; call reset()")
        self.latent = False
        warnings.warn("clattn: this model's attention caches its expanded keys and values "
                      "(not its latents: transformers before 5), so it runs in the "
                      "decompressed form of multi-head latent attention (mla='latent' needs "
                      "the latents)", RuntimeWarning, stacklevel=3)

    # -- what the model sees ----------------------------------------------------------
    def __repr__(self) -> str:
        kinds = ", ".join(f"{'full' if w is None else f'window {w}'}: {len(g.layers)} layers"
                          for w, g in self.groups.items()) or "pools not made yet"
        return f"ClattnCache({len(self.layers)} layers; {kinds})"

    @property
    def batch_size(self) -> int:
        return -1 if self.rows is None else len(self.rows)

    def stats(self) -> dict:
        """``{"full" | "window N": clattn.cache.CacheStats}`` of each layer kind's cache."""
        return {("full" if w is None else f"window {w}"): g.cache.stats()
                for w, g in self.groups.items()}

    # -- sequence operations (once for every layer) ---------------------------------------
    def reset(self) -> None:
        """Forget every sequence (their pages go back); the pools are kept."""
        for g in self.groups.values():
            g.abort()
            for sid in list(g.cache.sequences):
                g.cache.remove(sid)
            g.recorded = 0
        self.rows = None
        self.broken = None
        PENDING.value = None
        for layer in self.layers:
            layer.reset()

    def fail(self, exc: BaseException) -> None:
        """A forward stopped at ``exc``: every step in progress is abandoned (its pages go
        back) and the cache refuses further forwards until :meth:`reset`, since the
        positions transformers counted and the tokens stored no longer agree."""
        for g in self.groups.values():
            g.abort()
        self.broken = f"{type(exc).__name__}: {exc}"

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (assisted decoding); a
        positive value (transformers 4.x) is the length to keep."""
        n = int(tokens_to_remove)
        if n > 0:  # transformers 4.x's form: the length to keep
            n = -max(0, self.get_seq_length() - n)
        if n == 0 or self.rows is None:
            return
        for g in self.groups.values():
            g.no_step("crop")
        for g in self.groups.values():  # every row of every kind, before the first pop
            for i, sid in enumerate(self.rows):
                most = g.cache.poppable(sid)
                if -n > most:
                    kind = "full attention" if g.window is None else f"window {g.window}"
                    raise ValueError(
                        f"clattn: crop({n}): row {i} of the {kind} layers can give back "
                        f"{most} tokens now; a window layer keeps the tokens behind its "
                        f"window only while transformers records the past "
                        f"(cache.activate_past_recording(), as assisted and prompt-lookup "
                        f"decoding do), and then those appended since the last crop; "
                        f"nothing was changed")
        for g in self.groups.values():
            for sid in self.rows:
                g.cache.pop(sid, -n)
            g.recorded = 0
        for layer in self.layers:
            layer.cumulative_length = max(0, layer.cumulative_length + n)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]`` (beam search): forks share pages."""
        self._reindex(beam_idx, "reorder_cache", "beam_idx")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (in that order): forks share pages."""
        self._reindex(indices, "batch_select_indices", "indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows is not None:
            self._reindex(torch.arange(len(self.rows)).repeat_interleave(int(repeats)),
                          "batch_repeat_interleave", "repeats")

    def _reindex(self, index: Any, what: str, name: str) -> None:
        """Row ``i`` becomes old row ``index[i]``. Every index is checked, and no layer
        kind may be in a step, before the first fork: a refused call changes nothing."""
        if self.rows is None:
            return
        idx = torch.as_tensor(index)
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise TypeError(f"clattn: {what}: {name} must hold integer row indices, got "
                            f"{idx.dtype}; nothing was changed")
        src = [int(i) for i in idx.reshape(-1).tolist()]
        old = self.rows
        for j, s in enumerate(src):
            if not 0 <= s < len(old):
                raise IndexError(f"clattn: {what}: {name}[{j}]={s} is not a row of the batch "
                                 f"(0..{len(old) - 1}); nothing was changed")
        for g in self.groups.values():
            g.no_step(f"{what} (a batch re-map)")
        new = [self._new_id() for _ in src]
        for g in self.groups.values():
            for s, sid in zip(src, new):
                g.cache.fork(old[s], sid)
            for sid in old:
                g.cache.remove(sid)
        self.rows = new

    # -- used by the attention function ------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def rows_for(self, batch: int) -> list:
        """The cache's sequence ids of a forward's ``batch`` rows (added on first use)."""
        if self.rows is None:
            self.rows = [self._new_id() for _ in range(batch)]
            for g in self.groups.values():
                g.add_rows(self.rows)
        elif len(self.rows) != batch:
            raise ValueError(f"clattn: the cache holds {len(self.rows)} sequences, this "
                             f"forward has a batch of {batch}; reset() the cache or make a "
                             f"new ClattnCache")
        return self.rows

    def group(self, index: int, module: Any, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, scaling: float, softcap: float | None) -> "_Group":
        """The layer kind of layer ``index``: made at its first call, checked after."""
        window = self.windows[index]
        g = self.groups.get(window)
        key_ = (query.shape[1], query.shape[-1], key.shape[1], key.shape[-1], value.shape[1],
                value.shape[-1], query.dtype, key.dtype, value.dtype, scaling, softcap)
        if g is not None and g.key == key_:  # the common case: as the kind's first layer
            return g
        shape = _Shape(query, key, value, scaling, softcap, self.latent)
        if g is None:
            g = self._make_group(window, shape)
        else:
            g.check(index, shape)
        return g

    def _make_group(self, window: int | None, shape: "_Shape",
                    batch: int | None = None) -> "_Group":
        kind = [i for i, w in enumerate(self.windows) if w == window]
        g = _Group(self, window, [i for i in kind if i not in self.sources], shape, batch)
        g.members = kind
        g.local.update({i: g.local[self.sources[i]] for i in kind if i in self.sources})
        g.key = shape.key()
        self.groups[window] = g
        if self.rows is not None:
            g.add_rows(self.rows)
        return g

    def kind(self, window: int | None, shape: dict, batch: int = 1) -> "_Group":
        """The layer kind of ``window``, made from ``shape`` (what ``kind_shape`` gave)
        for ``batch`` rows when no forward has made it yet, else checked against it."""
        made = _Shape.from_items(shape)
        g = self.groups.get(window)
        if g is None:
            return self._make_group(window, made, batch)
        g.check(g.layers[0], made)
        return g

    def kind_shape(self, window: int | None) -> dict:
        """What layer kind ``window`` attends with (JSON-able; :meth:`kind` takes it)."""
        return self.groups[window].shape.record()

    # -- sequences on storage (clattn.integrations.hf_store) -----------------------------
    def save(self, path: Any) -> int:
        """Write the cache's sequences (every layer kind) into the folder ``path``, one
        KV file per layer kind (docs/transformers.md, "Save and load"); returns bytes."""
        from .hf_store import save
        return save(self, path)

    def load(self, path: Any) -> None:
        """Load what :meth:`save` wrote into this cache, which holds no sequences yet and
        was made for the same model and formats; ``generate`` then continues from it."""
        from .hf_store import load
        load(self, path)

    def adopt_rows(self, rows: Sequence) -> None:
        """The batch's rows are the (loaded) sequences ``rows`` of every layer kind."""
        self.rows = list(rows)
        self._next_id = max([self._next_id] + [int(r) for r in self.rows])

    def _pool_pages(self, spec: AttentionSpec, layers: int, batch: int) -> dict:
        """``num_pages=`` or ``budget_bytes=`` for one layer kind's PagedKVCache."""
        if self.num_pages is not None:
            return {"num_pages": int(self.num_pages)}
        if self.budget_bytes is not None:  # shared by the kinds in proportion to layers
            return {"budget_bytes": int(self.budget_bytes) * layers //
                    (len(self.layers) - len(self.sources))}  # layers with pools
        tokens = self.tokens_per_sequence or DEFAULT_MAX_CACHE_LEN
        return {"num_pages": batch * (math.ceil(tokens / spec.page_size) + 1)}

    def cl_device(self) -> Any:
        """What the layer kinds' caches are made on: the caller's pyopencl device, context
        or queue as given (one context for the pools of every layer kind), else the
        device clattn selects for the name; None for the CPU backend."""
        if self._cl_device is None and self.backend != "cpu":
            pcl = runtime.cl()
            if isinstance(self.device, (pcl.Device, pcl.Context, pcl.CommandQueue)):
                self._cl_device = self.device
            else:
                self._cl_device = clattn.select_device(self.device)
            if self._cl_device is None and self.backend == "opencl":
                raise clattn.NoDeviceError(f"backend='opencl' but {runtime.no_device_reason()}")
        return self._cl_device


class _Shape:
    """What one layer attends with (the kind's spec is made from its first layer's)."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float, softcap: float | None, latent: bool = False) -> None:
        self.latent = bool(latent)  # rows [latent | rope key] of an MLA model's latent form
        self.heads, self.head_dim = int(query.shape[1]), int(query.shape[-1])
        self.head_dim_v = int(value.shape[-1])
        self.kv_heads = int(key.shape[1])
        self.dtype = query.dtype
        self.scaling = float(scaling)
        self.softcap = None if softcap is None else float(softcap)
        if key.shape[-1] != self.head_dim or value.shape[1] != self.kv_heads:
            raise UnsupportedFeatureError(
                f"clattn: q/k head sizes or k/v head counts differ (q {tuple(query.shape)}, "
                f"k {tuple(key.shape)}, v {tuple(value.shape)}); clattn needs one head_dim "
                f"for queries and keys (values may differ: head_dim_v) and as many value "
                f"heads as key heads")
        if self.dtype not in DTYPES or key.dtype != self.dtype or value.dtype != self.dtype:
            raise UnsupportedFeatureError(
                f"clattn: dtype {query.dtype} (k {key.dtype}, v {value.dtype}); clattn "
                f"stores float16 or float32: load the model in one of them "
                f"(dtype=torch.float16/float32, or model.half()/model.float())")

    def key(self) -> tuple:
        """The key ``ClattnCache.group`` compares a layer's tensors' shapes with."""
        d = self.head_dim
        return (self.heads, d, self.kv_heads, d, self.kv_heads, self.head_dim_v, self.dtype,
                self.dtype, self.dtype, self.scaling, self.softcap)

    def record(self) -> dict:
        """JSON-able fields that :meth:`from_items` makes the shape again from."""
        return {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "head_dim_v": self.head_dim_v, "dtype": DTYPES[self.dtype],
                "scaling": self.scaling, "softcap": self.softcap, "latent": self.latent}

    @classmethod
    def from_items(cls, rec: dict) -> "_Shape":
        """The shape :meth:`record` gave."""
        by_name = {v: k for k, v in DTYPES.items()}
        heads, kv, d, dt = (int(rec["heads"]), int(rec["kv_heads"]), int(rec["head_dim"]),
                            by_name[rec["dtype"]])
        dv = int(rec.get("head_dim_v", d))
        q, k = torch.empty(1, heads, 0, d, dtype=dt), torch.empty(1, kv, 0, d, dtype=dt)
        v = torch.empty(1, kv, 0, dv, dtype=dt)
        return cls(q, k, v, rec["scaling"], rec["softcap"], bool(rec.get("latent", False)))

    def items(self) -> dict:
        return {"query heads": self.heads, "kv heads": self.kv_heads,
                "head_dim": self.head_dim, "head_dim_v": self.head_dim_v,
                "dtype": self.dtype, "scaling": self.scaling,
                "softcap": self.softcap, "latent form": self.latent}


class _Group:
    """One layer kind: its PagedKVCache, device arrays and step."""

    def __init__(self, owner: ClattnCache, window: int | None, layers: list[int],
                 shape: _Shape, batch: int | None = None) -> None:
        self.owner, self.window, self.layers, self.shape = owner, window, layers, shape
        #: the model's layer -> its pool in the kind's cache (a shared-KV layer: its source's)
        self.local = {hf: i for i, hf in enumerate(layers)}
        #: every layer of the kind, shared-KV layers included: each attends once a step
        self.members = list(layers)
        self.spec = (latent_spec if shape.latent else AttentionSpec)(
            num_qo_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
            head_dim_v=shape.head_dim_v, page_size=owner.page_size, dtype=DTYPES[shape.dtype],
            sliding_window=window is not None, softcap=shape.softcap,
            k_format=owner.k_format, v_format=owner.v_format)
        dev = owner.cl_device()
        backend = "cpu" if dev is None else "opencl"
        pages = owner._pool_pages(self.spec, len(layers), batch or max(1, owner.batch_size))
        self.cache = clattn.PagedKVCache(self.spec, len(layers), device=dev, backend=backend,
                                         profile=owner.profile, rope=None,
                                         sm_scale=shape.scaling, prefill=owner.use_prefill,
                                         **pages)
        self.on_device = self.cache.backend != "cpu"
        if self.on_device:
            pool = self.cache.pools[0]
            self.queue, self.context = pool.queue, pool.context
        self.buffers: dict = {}
        self.step: GroupForward | None = None
        self.recorded = 0  # positions appended since the last crop while recording the past
        self.key: tuple = ()  # the shapes, dtypes, scaling and softcap of its first layer

    def add_rows(self, rows: Sequence) -> None:
        for sid in rows:
            if sid not in self.cache:
                self.cache.add(sid, window=self.window)

    def check(self, index: int, shape: _Shape) -> None:
        mine, theirs = self.shape.items(), shape.items()
        for name, v in theirs.items():
            if v != mine[name]:
                raise UnsupportedFeatureError(
                    f"clattn: layer {index} attends with {name}={v}, the other layers of its "
                    f"kind ({'full attention' if self.window is None else f'window {self.window}'}"
                    f") with {mine[name]}; clattn needs one value per layer kind")

    def no_step(self, what: str) -> None:
        if self.step is not None:
            raise RuntimeError(f"clattn: {what} during a model forward")

    def abort(self) -> None:
        """Abandon the step in progress (an error in the forward): its pages go back."""
        if self.step is not None:
            if self.step.begun:
                self.cache.cancel()
            self.step = None

    def buffers_for(self, T: int) -> tuple:
        """Device ``q`` [T, H, D], ``out`` [T, H, D_v] and ``lse`` [T, H] (reused per step
        size)."""
        hit = self.buffers.pop(T, None)
        if hit is None:
            cl = runtime.cl()
            H, D, dt = self.spec.num_qo_heads, self.spec.head_dim, self.spec.np_dtype
            hit = (cl.array.empty(self.queue, (T, H, D), dt),
                   cl.array.empty(self.queue, (T, H, self.spec.head_dim_v), dt),
                   cl.array.empty(self.queue, (T, H), LSE_DTYPE))
        self.buffers[T] = hit  # most recent last
        while len(self.buffers) > _BUFFERS_KEPT:
            self.buffers.pop(next(iter(self.buffers)))
        return hit


class GroupForward:
    """One forward over one layer kind: which of the ``B x L`` new positions are tokens
    (``sel``: their flat indices, None for all), the lengths given to ``begin`` and the
    path the cache chose (the ``steps`` counter it adds to)."""

    def __init__(self) -> None:
        self.begun = False
        self.done: set = set()
        self.sel: torch.Tensor | None = None
        self.T = 0
        self.L = 0  # new positions per row (padding included)
        self.mode = "decode"
