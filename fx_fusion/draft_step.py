"""A whole DFlash-style draft step, built from Hugging Face transformers' own Qwen3 modules.

One call of a speculative-decoding draft (the z-lab DFlash algorithm, with its cache kept as HF's
`StaticCache` keeps one):

1. Context: every draft layer projects the target model's hidden states of this step's context tokens
   to K (per-head RMSNorm, RoPE at their positions) and V, and writes them into its own cache in place
   with `index_copy_`. These K/V branches all read the same hidden states: the fx_fusion pass fuses
   them into one group.
2. Draft: the noise block (the block being drafted) runs through the layers as a Qwen3 decoder layer
   does (input norm, attention, residual, post-attention norm, MLP, residual), each layer's queries
   attending non-causally over the visible rows of its cache and over the block's own K/V; a final
   norm gives the hidden states of the drafted block.

As in z-lab's reference (dflash/model.py, `DFlashDraftModel` / `Qwen3DFlashAttention`), the context K/V
skip the input norm and the block's queries see [context; block] without a causal mask. Unlike it, the
block's own K/V never enter the cache (the reference appends them and crops them off after the step), and
the target's hidden states arrive already projected (its `fc` + `hidden_norm` run before this step).

Nothing is downloaded: `qwen3_draft_step` builds the HF modules from a small or realistic random config
with deterministic random weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from .drafts import PRESETS, _init_weights_, qwen3_style_config

__all__ = ["DraftStep", "LayerCache", "draft_step_inputs", "qwen3_draft_step"]


class LayerCache(nn.Module):
    """One layer's context K/V cache: non-persistent buffers `k` and `v`, each [B, H_kv, max_len, D]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)


class DraftStep(nn.Module):
    """One DFlash-style draft step over HF `Qwen3DecoderLayer`s, with per-layer context K/V caches.

    layers: `Qwen3DecoderLayer`s; only their submodules are used (self_attn's q/k/v/o_proj, q_norm and
        k_norm; input_layernorm, post_attention_layernorm, mlp), not their forward.
    norm: the final `Qwen3RMSNorm`; rotary_emb: the `Qwen3RotaryEmbedding` shared by all layers.
    max_len: cache rows per layer; cache row p holds the token at position p (positions < max_len).
    cache_dtype: the caches' dtype (default: the weights'); an FP8 dtype stores `(k / k_scale).to(fp8)` and
        `(v / v_scale).to(fp8)` with per-tensor scales (buffers `k_scale`, `v_scale`, both `cache_scale`),
        dequantised `cache.to(dtype) * scale` before attention.

    The caches are module buffers, `caches[l].k` and `caches[l].v`, each [B, H_kv, max_len, D], updated in
    place: buffers mutated in place compile with `torch.compile(..., fullgraph=True)` without graph
    breaks, and the compiled graph writes the context K/V straight into them. `reset_caches` fills or
    reallocates them. Rows never written must hold finite values: masked rows still enter the attention
    matmuls with weight 0, and 0 * NaN is NaN.

    forward(target_hidden [B, T, hidden], ctx_positions [B, T] int64, noise [B, S, hidden],
    block_positions [B, S] int64) -> hidden states of the block [B, S, hidden].

    - target_hidden: the target model's hidden states of this step's T context tokens, already projected
      to the draft's hidden size; each layer writes their K (k_proj, k_norm, RoPE at ctx_positions) and V
      into cache rows `cache_position = ctx_positions[0]` with `index_copy_` along the row dim, as HF's
      `StaticCache` does (all batch rows must share positions).
    - noise: the noise block's hidden states (S = block size), at block_positions. Each layer's block
      queries see the cache rows below `ctx_end = cache_position.max() + 1` (a mask computed on the
      device: no host sync, no data-dependent shapes) and all S rows of the block's own K/V.

    Run it under `torch.no_grad()` or `torch.inference_mode()` (a draft step is inference).
    """

    def __init__(
        self,
        layers: list[Qwen3DecoderLayer] | nn.ModuleList,
        norm: Qwen3RMSNorm,
        rotary_emb: Qwen3RotaryEmbedding,
        max_len: int,
        batch_size: int = 1,
        cache_dtype: torch.dtype | None = None,
        cache_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.layers = layers if isinstance(layers, nn.ModuleList) else nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary_emb
        self.max_len = max_len
        self.cache_dtype = cache_dtype or norm.weight.dtype
        # FP8 caches hold k / k_scale and v / v_scale (per-tensor scales, as vLLM and SGLang keep them)
        quantized = self.cache_dtype != norm.weight.dtype
        scale = torch.tensor(cache_scale, dtype=torch.float32, device=norm.weight.device)
        self.register_buffer("k_scale", scale.clone() if quantized else None, persistent=False)
        self.register_buffer("v_scale", scale.clone() if quantized else None, persistent=False)
        self.caches = nn.ModuleList()
        self.reset_caches(batch_size)

    @property
    def hidden_size(self) -> int:
        return int(self.norm.weight.shape[0])

    def reset_caches(self, batch_size: int | None = None, fill_value: float = 0.0) -> None:
        """Fill every layer's K/V cache with `fill_value`, in place (compiled code keeps using the same
        buffers); with a new `batch_size`, allocate them anew as [batch_size, H_kv, max_len, D]."""
        if batch_size is None or (len(self.caches) and self.caches[0].k.shape[0] == batch_size):
            for cache in self.caches:
                cache.k.fill_(fill_value)
                cache.v.fill_(fill_value)
            return
        self.caches = nn.ModuleList()
        for layer in self.layers:
            attn = layer.self_attn
            weight = attn.k_proj.weight
            shape = (batch_size, weight.shape[0] // attn.head_dim, self.max_len, attn.head_dim)
            k = torch.full(shape, fill_value, device=weight.device).to(self.cache_dtype)
            self.caches.append(LayerCache(k, torch.full_like(k, fill_value)))

    def forward(
        self,
        target_hidden: torch.Tensor,
        ctx_positions: torch.Tensor,
        noise: torch.Tensor,
        block_positions: torch.Tensor,
    ) -> torch.Tensor:
        return self.attend_block(noise, block_positions, self.write_context(target_hidden, ctx_positions))

    def attend_block(
        self, noise: torch.Tensor, block_positions: torch.Tensor, cache_position: torch.Tensor
    ) -> torch.Tensor:
        """The block part alone: the draft layers over the noise block, each attending to its cache rows
        below `cache_position.max() + 1` (what `write_context` returned) and to the block itself."""
        key_rows = torch.arange(self.max_len + noise.shape[1], device=noise.device).view(1, -1)
        visible = (key_rows <= cache_position.max()) | (key_rows >= self.max_len)  # [1, max_len + S]
        cos_sin = self.rotary_emb(noise, block_positions)
        hidden = noise
        for layer, cache in zip(self.layers, self.caches):
            attention = self._attend(layer.self_attn, layer.input_layernorm(hidden), cos_sin, cache, visible)
            hidden = hidden + attention
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    def write_context(self, target_hidden: torch.Tensor, ctx_positions: torch.Tensor) -> torch.Tensor:
        """The context part alone: every layer's K/V of `target_hidden` into its cache rows
        `cache_position = ctx_positions[0]` (returned), quantised `(k / k_scale).to(fp8)` for FP8 caches."""
        cache_position = ctx_positions[0]
        cos, sin = self.rotary_emb(target_hidden, ctx_positions)
        for layer, cache in zip(self.layers, self.caches):
            attn = layer.self_attn
            shape = (*target_hidden.shape[:-1], -1, attn.head_dim)
            k = attn.k_norm(attn.k_proj(target_hidden).view(shape)).transpose(1, 2)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)  # k as q too: that output is unused
            v = attn.v_proj(target_hidden).view(shape).transpose(1, 2)
            if self.k_scale is None:
                cache.k.index_copy_(2, cache_position, k)
                cache.v.index_copy_(2, cache_position, v)
            else:  # index_copy_ has no FP8 kernel on CPU; StaticCache falls back to this spelling too
                cache.k[:, :, cache_position] = (k / self.k_scale).to(self.cache_dtype)
                cache.v[:, :, cache_position] = (v / self.v_scale).to(self.cache_dtype)
        return cache_position

    def _attend(
        self,
        attn: Qwen3Attention,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """The block's queries over [cache rows; the block's own K/V], non-causal, then o_proj."""
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        cached_k, cached_v = cache.k, cache.v
        if cached_k.dtype != k.dtype:  # FP8 caches: dequantised
            cached_k, cached_v = cached_k.to(k.dtype) * self.k_scale, cached_v.to(v.dtype) * self.v_scale
        keys = torch.cat([cached_k, k], dim=2)
        values = torch.cat([cached_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=attn.scaling, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).flatten(2))


def qwen3_draft_step(
    n_layers: int = 5,
    preset: str = "small",
    max_len: int = 1024,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    batch_size: int = 1,
    cache_dtype: torch.dtype | None = None,
    cache_scale: float = 1.0,
) -> DraftStep:
    """A `DraftStep` over `n_layers` HF `Qwen3DecoderLayer`s with deterministic random weights; caches in
    `cache_dtype` (default: `dtype`; an FP8 dtype quantises with the per-tensor scale `cache_scale`).

    Shapes from `fx_fusion.drafts.PRESETS[preset]`: "small" (hidden 64, 4 query / 2 KV heads of 32) or
    "realistic" (Qwen3-8B attention: hidden 4096, 32 query / 8 KV heads of 128); MLP width 3 * hidden,
    rope_theta 1e6, RMSNorm eps 1e-6. The caches, one `LayerCache` per layer, are zero-filled
    [batch_size, H_kv, max_len, D] buffers. The same arguments give the same weights (on the same device).
    """
    shape = PRESETS[preset]
    config = qwen3_style_config(
        Qwen3Config, shape, n_layers, intermediate_size=3 * shape["hidden_size"], rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
    )  # fmt: skip
    device = torch.device(device)
    # Built on the meta device (no wasted CPU init of realistic weights), then allocated on `device`.
    with torch.device("meta"):
        layers = nn.ModuleList(Qwen3DecoderLayer(config, layer_idx=i) for i in range(n_layers))
        norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    layers, norm = (m.to_empty(device=device).to(dtype) for m in (layers, norm))
    _init_weights_(nn.ModuleDict({"layers": layers, "norm": norm}), seed, device, dtype)
    # The rotary embedding computes inv_freq at init: built for real, its buffers fp32 as in HF.
    rotary = Qwen3RotaryEmbedding(config).to(device)
    return DraftStep(layers, norm, rotary, max_len, batch_size, cache_dtype, cache_scale).eval()


def draft_step_inputs(
    module: DraftStep,
    batch: int = 1,
    ctx_tokens: int = 16,
    block_size: int = 16,
    start: int = 0,
    seed: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target_hidden [batch, ctx_tokens, hidden], ctx_positions [batch, ctx_tokens] int64, noise
    [batch, block_size, hidden], block_positions [batch, block_size] int64) for `module`, in its dtype and
    on its device.

    The context tokens sit at positions start .. start + ctx_tokens - 1 and the block right after them
    (every batch row the same positions); the hidden states ~ randn. `start + ctx_tokens` must not
    exceed `module.max_len`.
    """
    param = module.norm.weight
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    target_hidden, noise = (
        torch.randn(batch, n, module.hidden_size, generator=gen).to(device=param.device, dtype=param.dtype)
        for n in (ctx_tokens, block_size)
    )
    ctx_positions, block_positions = (
        torch.arange(first, first + n, device=param.device).repeat(batch, 1)
        for first, n in ((start, ctx_tokens), (start + ctx_tokens, block_size))
    )
    return target_hidden, ctx_positions, noise, block_positions
