"""Multi-head latent attention in the latent (absorbed) form (``mla="latent"``, issue 41;
docs/transformers.md, "Multi-head latent attention"): what one layer's attention gives
against eager's within the bound of the reassociation, what the pools hold per token,
the option, the refusals, and a latent cache saved and loaded.

Greedy generation in both forms (DeepSeek-V2-Lite, DeepSeek-V3, MiniCPM3; devices, the CPU
backend, a padded batch, the GPU kernels) is tests/test_transformers_mla.py's; prompt
lookup and assisted decoding tests/test_speculative.py's.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from cases import F32_EPS
from hf_sweep import tiny_model
from test_transformers_mla import CONFIGS, MLA, model
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v2 import modeling_deepseek_v2

import clattn.integrations.transformers as cltf
from clattn.integrations import hf_mla
from clattn.integrations.hf_cache import ClattnCache, UnsupportedFeatureError
from clattn.kv_file import KVFileMismatchError

U = 2.0 ** -24  # the unit roundoff of f32


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of an n-term f32 sum
    of products."""
    return n * U / (1 - n * U)


def _where(where) -> dict:
    return dict(backend="cpu") if where == "cpu" else dict(device=where, backend="opencl")


# --------------------------------------------------------------------- one layer's bound
def _layer0_steps(monkeypatch, m, ids: torch.Tensor, nxt: torch.Tensor, impl: str,
                  cache) -> tuple[list, list]:
    """Layer 0's attention output (the input of its o_proj) for a prompt forward and one
    decode forward, and (eager) the query and scale its attention function was given."""
    outs: list = []
    seen: list = []
    eager = modeling_deepseek_v2.eager_attention_forward

    def capture(module, query, key, value, attention_mask, **kw):
        if module.layer_idx == 0:
            seen.append((query.detach().clone(), float(kw["scaling"])))
        return eager(module, query, key, value, attention_mask, **kw)

    monkeypatch.setattr(modeling_deepseek_v2, "eager_attention_forward", capture)
    attn = m.model.layers[0].self_attn
    hook = attn.o_proj.register_forward_pre_hook(
        lambda mod, args: outs.append(args[0].detach().clone()))
    m.set_attn_implementation(impl)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m(ids, cache=cache)
            m(nxt, cache=cache)
    finally:
        hook.remove()
        m.set_attn_implementation("eager")
    return outs, seen


def absorption_bound(query: torch.Tensor, scale: float, latent: torch.Tensor,
                     k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                     first: int) -> torch.Tensor:
    """The bound of docs/transformers.md ("Multi-head latent attention") on |latent-form
    output - eager output| per element ``[L, H, v]``, from the tensors of one forward:
    queries ``[H, L, nope + rope]`` at positions ``first, first + 1, ...``, the layer's
    latents ``[K, rank]`` and rope keys ``[K, rope]``, ``W_UK [H, nope, rank]``,
    ``W_UV [H, v, rank]``."""
    f = torch.float64
    H, L, _ = query.shape
    nope, rank, rope = w_uk.shape[1], w_uk.shape[2], k_pe.shape[-1]
    q, c, kp, wk, wv = (x.to(f) for x in (query, latent, k_pe, w_uk, w_uv))
    qn, qp = q[..., :nope], q[..., nope:]
    K = first + L
    c, kp = c[:K], kp[:K]
    s = scale * (torch.matmul(torch.matmul(qn, wk), c.T) + torch.matmul(qp, kp.T))  # [H,L,K]
    mag = torch.matmul(torch.matmul(qn.abs(), wk.abs()), c.abs().T) + \
        torch.matmul(qp.abs(), kp.abs().T)
    pos = torch.arange(first, K)[:, None]
    keep = torch.arange(K)[None, :] <= pos                                        # [L, K]
    s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s, dim=-1)
    n = keep.sum(-1).to(f)                                                       # [L]
    # scores: each side's (nope + rank + rope + 1)-term sums, scaled
    delta = scale * 2 * gamma(nope + rank + rope + 1) * mag.masked_fill(~keep, 0).amax(-1)
    v = torch.matmul(c, wv.transpose(-1, -2))                                    # [H, K, v]
    vmax = torch.stack([v[:, :i + 1].abs().amax(1) for i in range(first, K)], 1)  # [H,L,v]
    cv = torch.matmul(p, torch.matmul(c.abs(), wv.abs().transpose(-1, -2)))      # [H, L, v]
    kc = torch.stack([c[:i + 1].abs().amax() for i in range(first, K)])          # [L]
    kc = kc[None, :, None] * wv.abs().sum(-1)[:, None, :]                        # [H, L, v]
    smax = s.masked_fill(~keep, 0).abs().amax(-1)                                # [H, L]
    nk = n[None, :, None]
    bound = (torch.expm1(2 * delta)[..., None] * vmax                 # the scores' reorder
             + 2 * (nk + rank + 1) * U / (1 - (nk + rank + 1) * U) * cv  # the values' reorder
             + F32_EPS * (4 + smax[..., None] + nk.sqrt()) * (vmax + kc))  # softmax, each side
    return bound.transpose(0, 1)                                                 # [L, H, v]


def check_layer_bound(monkeypatch, where) -> None:
    """DeepSeek-V2-Lite's shapes (16 heads, rank 512, nope 128, rope 64, v 128, yarn
    mscale): layer 0's attention output in the latent form against eager's, for a
    10-token prompt (prefill kernel) and one decode step, within the bound computed
    from the very tensors; and the bound itself under 1% of the values' scale."""
    dev = where
    m = model("DeepSeek-V2-Lite")
    g = torch.Generator().manual_seed(5)
    ids, nxt = torch.randint(3, 1000, (1, 10), generator=g), torch.tensor([[7]])
    ref_cache = DynamicCache(config=m.config)
    ref, seen = _layer0_steps(monkeypatch, m, ids, nxt, "eager", ref_cache)
    got, _ = _layer0_steps(monkeypatch, m, ids, nxt, "clattn",
                           ClattnCache(m, max_cache_len=32, mla="latent", **_where(dev)))
    latent = ref_cache.layers[0].keys[0, 0]    # the normalized latents the model cached
    k_pe = ref_cache.layers[0].values[0, 0]    # and its RoPE'd shared keys
    layer = hf_mla.LatentLayer(m.model.layers[0].self_attn, m.config, 0)
    vmax = float(torch.matmul(latent.double(), layer.w_uv.double().transpose(-1, -2)).abs().max())
    first = 0
    for (query, scale), r, o in zip(seen, ref, got):
        H, L = query.shape[1], query.shape[2]
        bound = absorption_bound(query[0], scale, latent, k_pe, layer.w_uk, layer.w_uv,
                                 first)
        diff = (o[0].view(L, H, -1).double() - r[0].view(L, H, -1).double()).abs()
        assert torch.all(diff <= bound), \
            f"{float((diff - bound).max())} over the bound at step from {first}"
        # a worst-case bound (gamma_n, not sqrt(n) u: the seen differences are ~1e-7), but
        # under 1% of the values' scale: a wrong layout or scale is far outside it
        assert float(bound.max()) < 1e-2 * vmax, (float(bound.max()), vmax)
        first += L
    assert first == 11


def test_one_layer_within_the_absorption_bound_on_the_cpu_backend(monkeypatch):
    check_layer_bound(monkeypatch, "cpu")


def test_one_layer_within_the_absorption_bound_on_a_device(monkeypatch, device):
    check_layer_bound(monkeypatch, device)


# ------------------------------------------------------------------ what the pools hold
@pytest.mark.parametrize("name", list(MLA))
def test_latent_pool_bytes_per_token(name):
    """One row per token and layer: kv_lora_rank + qk_rope values (DeepSeek-V2-Lite: 576
    against 16 x (192 + 128) decompressed): the values are read from the rows."""
    m = model(name)
    rank, rope = MLA[name]
    cfg = CONFIGS[name]
    per_token = {}
    for form in ("latent", "decompressed"):
        cache = ClattnCache(m, max_cache_len=16, backend="cpu", mla=form)
        m.set_attn_implementation("clattn")
        try:
            with torch.no_grad():
                m(torch.tensor([[5, 6, 7]]), cache=cache)
        finally:
            m.set_attn_implementation("eager")
        (g,) = cache.groups.values()
        per_token[form] = g.cache.page_bytes / g.spec.page_size
    itemsize = 4
    assert per_token["latent"] == (rank + rope) * itemsize
    assert hf_mla.stored_values_per_token(rank, rope) == rank + rope
    heads = cfg["num_attention_heads"]
    assert per_token["decompressed"] == heads * (
        cfg["qk_nope_head_dim"] + rope + cfg["v_head_dim"]) * itemsize


# --------------------------------------------------------------------- option, refusals
def test_the_option_is_checked_and_other_models_ignore_it():
    with pytest.raises(ValueError, match=r"mla='compressed'.*'latent'.*'decompressed'"):
        cltf.register(mla="compressed")
    cltf.register()
    m = model("MiniCPM3-4B")
    with pytest.raises(ValueError, match="mla="):
        ClattnCache(m, mla="LATENT")
    assert ClattnCache(m).latent and not ClattnCache(m, mla="decompressed").latent
    llama = tiny_model("llama")
    assert not ClattnCache(llama, mla="latent").latent


def _generate(m, **register):
    cltf.register(backend="cpu", **register)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return m.generate(torch.tensor([[5, 9, 11, 4, 7]]), max_new_tokens=4,
                              do_sample=False, attn_implementation="clattn")
    finally:
        cltf.register()


def test_a_kv_b_proj_with_a_bias_is_refused_naming_the_decompressed_form():
    m = tiny_model("deepseek_v2")
    attn = m.model.layers[0].self_attn
    old = attn.kv_b_proj
    attn.kv_b_proj = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        attn.kv_b_proj.weight.copy_(old.weight)
    with pytest.raises(UnsupportedFeatureError, match=r"layer 0.*bias.*mla='decompressed'"):
        _generate(m)
    ref = m.generate(torch.tensor([[5, 9, 11, 4, 7]]), max_new_tokens=4, do_sample=False)
    assert torch.equal(_generate(m, mla="decompressed"), ref)


def test_an_expansion_of_another_layout_is_refused():
    """A model whose keys are not [W_UK c | k_pe] per head (here: its heads' keys in
    reverse order) cannot be absorbed: refused at the layer's first call, by name."""
    m = tiny_model("deepseek_v2")
    attn = m.model.layers[1].self_attn
    expand = attn.expand_kv

    def reversed_heads(kv_nope, k_rot):
        k, v = expand(kv_nope, k_rot)
        return k.flip(1), v
    attn.expand_kv = reversed_heads
    with pytest.raises(UnsupportedFeatureError, match=r"layer 1.*keys are not"):
        _generate(m)


# ------------------------------------------------------------------------- save and load
def test_a_latent_cache_saved_and_loaded_continues(tmp_path):
    """The files hold the latent rows; a latent cache loads them and continues with the
    uninterrupted run's tokens, a decompressed one refuses them."""
    m = tiny_model("deepseek_v2")
    m.set_attn_implementation("clattn")
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache = ClattnCache(m, max_cache_len=64, backend="cpu")
            turn1 = m.generate(torch.tensor([[5, 9, 11, 4, 7, 8]]), cache=cache, **gen)
            cache.save(tmp_path / "chat")
            turn2 = torch.cat([turn1, torch.tensor([[12, 13, 14]])], 1)
            ref = m.generate(turn2, cache=cache, **gen)
            other = ClattnCache(m, max_cache_len=64, backend="cpu", mla="decompressed")
            with pytest.raises(KVFileMismatchError, match="latent"):
                other.load(tmp_path / "chat")
            loaded = ClattnCache(m, max_cache_len=64, backend="cpu")
            loaded.load(tmp_path / "chat")
            got = m.generate(turn2, cache=loaded, **gen)
    finally:
        m.set_attn_implementation("eager")
    assert torch.equal(got, ref)


def _forward_4x(self, hidden_states, attention_mask=None, cache=None,
                position_embeddings=None, **kwargs):
    """DeepSeek-V2's attention as transformers 4.x wrote it: the expanded per-head keys
    and values go to the cache update, not the latents."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    B, L = hidden_states.shape[:-1]
    q = self.q_proj(hidden_states) if self.q_lora_rank is None else \
        self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(B, L, -1, self.qk_head_dim).transpose(1, 2)
    q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
        [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv = self.kv_a_layernorm(kv).view(B, 1, L, self.kv_lora_rank)
    q_pe, k_pe = modeling_deepseek_v2.apply_rotary_emb(
        q_pe, k_pe.view(B, 1, L, self.qk_rope_head_dim), position_embeddings)
    key, value = self.expand_kv(kv, k_pe)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                               modeling_deepseek_v2.eager_attention_forward)
    out, weights = fn(self, torch.cat((q_nope, q_pe), -1), key, value, attention_mask,
                      scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(B, L, -1)), weights


def test_a_model_that_caches_expanded_keys_runs_decompressed(monkeypatch):
    """transformers 4.x's DeepSeek-V2 hands the cache its expanded keys and values: there
    are no latents to store, so the default latent form runs decompressed, with one
    warning saying so, and gives eager's tokens."""
    monkeypatch.setattr(modeling_deepseek_v2.DeepseekV2Attention, "forward", _forward_4x)
    m = tiny_model("deepseek_v2")
    ref = m.generate(torch.tensor([[5, 9, 11, 4, 7]]), max_new_tokens=4, do_sample=False)
    cache = ClattnCache(m, max_cache_len=32, backend="cpu")
    m.set_attn_implementation("clattn")
    try:
        with pytest.warns(RuntimeWarning, match="runs in the decompressed form"):
            got = m.generate(torch.tensor([[5, 9, 11, 4, 7]]), max_new_tokens=4,
                             do_sample=False, cache=cache)
    finally:
        m.set_attn_implementation("eager")
    assert torch.equal(got, ref)
    assert not cache.latent
    assert [g.spec.num_kv_heads for g in cache.groups.values()] == [m.config.num_key_value_heads]


def test_latent_spec_reads_values_from_the_rows_and_refuses_another_value_format():
    """The latent form's values are the rows' own: stored in the key format; a different
    value format is refused naming the option that gives one."""
    kw = dict(num_qo_heads=4, num_kv_heads=1, head_dim=96, head_dim_v=64, dtype="float16")
    spec = hf_mla.latent_spec(**kw, k_format="q8_0", v_format=None)
    assert spec.value_in_key and spec.v_format == "q8_0"
    assert hf_mla.latent_spec(**kw, k_format="q8_0", v_format="q8_0").value_in_key
    with pytest.raises(ValueError, match="v_format='q4_0'.*mla='decompressed'"):
        hf_mla.latent_spec(**kw, k_format="q8_0", v_format="q4_0")
