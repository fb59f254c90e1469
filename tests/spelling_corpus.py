"""A spelling corpus: the same context K/V math, spelled the way public codebases spell it.

Every case is a small module holding N_LAYERS = 3 draft layers that all project the SAME hidden states `x`
and return, for each layer, K after (optional) per-head RMSNorm and RoPE, and V:

    k_l = RoPE(cos, sin)(RMSNorm_l(k_proj_l(x) split into heads))      v_l = v_proj_l(x)

with one cos/sin shared by the layers. Each case cites the repository and file whose spelling it follows
(looked up in the public sources; the code here is written for this corpus, not copied). The math is the
same in every `expect == "fuse"` case; only the spelling (ops, layouts, dtype casts, where the weight is
applied, how heads and rotary halves are cut) differs. `NEGATIVE_CASES` hold a layer whose math truly
differs: it must not be fused with the others, and the compiled result must still equal eager.

`CASES` is the list the tests iterate; `explain_vllm_model()` is a factory for
`python -m fx_fusion explain tests/spelling_corpus.py:explain_vllm_model`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma3TextConfig, Qwen3Config
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.gemma3n import modeling_gemma3n
from transformers.models.glm import modeling_glm
from transformers.models.gpt_neox import modeling_gpt_neox
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.hunyuan_v1_dense import modeling_hunyuan_v1_dense
from transformers.models.llama4 import modeling_llama4
from transformers.models.olmo import modeling_olmo
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen3 import modeling_qwen3

N_LAYERS = 3
HIDDEN = 64
KV_HEADS = 2
HEAD_DIM = 32
# tokens per sequence; SPELLING_CORPUS_TOKENS=600 runs every case past probe_sizes.LARGE (few-token probes)
TOKENS = int(os.environ.get("SPELLING_CORPUS_TOKENS", "6"))
BATCH = 2
MAX_POS = max(64, 2 * TOKENS + 16)
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    """One spelling. build(dtype) -> (module in eval mode with that dtype, example inputs)."""

    name: str
    source: str  # "owner/repo path/to/file.py (what)" -- where the spelling comes from
    build: Callable[[torch.dtype], tuple[nn.Module, tuple]]
    expect: str = "fuse"  # "fuse", or why the math differs (negative cases)
    offending_layer: Optional[int] = None  # negative cases: the layer that must stay out of any group (None: all)
    reason: Optional[str] = None  # negative cases the pass rejects: a regex its reason must match

    def __repr__(self) -> str:
        return f"Case({self.name})"


# ----------------------------------------------------------------------------------------------------------
# Shared helpers


def _finish(module: nn.Module, dtype: torch.dtype, *inputs) -> tuple[nn.Module, tuple]:
    """Cast the module to `dtype` and floating inputs to `dtype` (integer/complex inputs untouched)."""
    module = module.to(dtype).eval()
    cast = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    return module, cast


def _randomize_norm_weights(module: nn.Module, mean: float = 1.0) -> None:
    """RMSNorm weights away from their init so that a wrongly shared/omitted weight shows in the output."""
    for name, param in module.named_parameters():
        if param.dim() == 1 and "norm" in name and "weight" in name:
            with torch.no_grad():
                param.normal_(mean, 0.2)


def _hidden(batched: bool = True, tokens: int = TOKENS, batch: int = BATCH) -> torch.Tensor:
    return torch.randn(batch, tokens, HIDDEN) if batched else torch.randn(tokens, HIDDEN)


def _positions(tokens: int = TOKENS, offset: int = 3) -> torch.Tensor:
    return torch.arange(tokens) + offset


def _inv_freq(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def _cos_sin_cache(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """vLLM/SGLang RotaryEmbedding._compute_cos_sin_cache: [max_pos, rotary_dim] = cat(cos, sin) halves."""
    freqs = torch.einsum("i,j -> ij", torch.arange(MAX_POS, dtype=torch.float), _inv_freq(rotary_dim, base))
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


# The attention sizes every Hugging Face config in the corpus shares.
_HF_SIZES = dict(
    hidden_size=HIDDEN,
    num_attention_heads=4,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=MAX_POS,
    rms_norm_eps=EPS,
)


def _qwen3_config(**overrides) -> Qwen3Config:
    return Qwen3Config(**{**_HF_SIZES, **overrides})


# ----------------------------------------------------------------------------------------------------------
# 1, 14. Hugging Face Qwen3: the real Qwen3Attention modules and modeling_qwen3.apply_rotary_pos_emb
# huggingface/transformers src/transformers/models/qwen3/modeling_qwen3.py (Qwen3Attention.forward:
#   hidden_shape = (*input_shape, -1, head_dim); k_norm(k_proj(x).view(hidden_shape)).transpose(1, 2);
#   rotate_half by x[..., : d // 2] / x[..., d // 2 :] slices)


class HFQwen3Context(nn.Module):
    def __init__(self, attention_bias: bool = False, per_layer_rotary: bool = False):
        super().__init__()
        config = _qwen3_config(attention_bias=attention_bias)
        self.layers = nn.ModuleList(modeling_qwen3.Qwen3Attention(config, i) for i in range(N_LAYERS))
        self.per_layer_rotary = per_layer_rotary
        if per_layer_rotary:  # 14: every layer owns its rotary module (same config, same position_ids)
            self.rotary = nn.ModuleList(modeling_qwen3.Qwen3RotaryEmbedding(config) for _ in range(N_LAYERS))
        else:
            self.rotary_emb = modeling_qwen3.Qwen3RotaryEmbedding(config)
        _randomize_norm_weights(self)

    def forward(self, hidden_states, position_ids):
        input_shape = hidden_states.shape[:-1]
        if not self.per_layer_rotary:
            cos, sin = self.rotary_emb(hidden_states, position_ids)
        outs = []
        for i, attn in enumerate(self.layers):
            if self.per_layer_rotary:
                cos, sin = self.rotary[i](hidden_states, position_ids)
            hidden_shape = (*input_shape, -1, attn.head_dim)
            key_states = attn.k_norm(attn.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            value_states = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            _, key_states = modeling_qwen3.apply_rotary_pos_emb(key_states, key_states, cos, sin)
            outs += [key_states, value_states]
        return tuple(outs)


def build_hf_qwen3(dtype, attention_bias=False, per_layer_rotary=False):
    torch.manual_seed(0)
    module = HFQwen3Context(attention_bias, per_layer_rotary)
    return _finish(module, dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 2a. Megatron-LM: seq-first [S, B, ...], fused per-group qkv cut with torch.split, k_layernorm, and
# rope_utils._apply_rotary_pos_emb_bshd with `x1, x2 = torch.chunk(x, 2, dim=-1)`; cos/sin computed from
# the angles INSIDE every layer; partial rotary when the angles are narrower than the head.
# NVIDIA/Megatron-LM megatron/core/transformer/attention.py (SelfAttention.get_query_key_value_tensors),
# NVIDIA/Megatron-LM megatron/core/models/common/embeddings/rope_utils.py (_rotate_half,
# _apply_rotary_pos_emb_bshd), megatron/core/transformer/torch_norm.py (WrappedTorchNorm -> nn.RMSNorm)


def _megatron_rotate_half(x, rotary_interleaved):
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x_new = torch.stack((-x2, x1), dim=-1)
    return x_new.view(x_new.shape[0], x_new.shape[1], x_new.shape[2], -1)


def _megatron_apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, mscale=1.0):
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
    sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
    t = (t * cos_) + (_megatron_rotate_half(t, rotary_interleaved) * sin_)
    return torch.cat((t, t_pass), dim=-1)


class MegatronContext(nn.Module):
    def __init__(self, rotary_interleaved=False, num_attention_heads=4):
        super().__init__()
        self.ng, self.np, self.hn = KV_HEADS, num_attention_heads, HEAD_DIM  # query groups, heads, head dim
        width = self.ng * (self.np // self.ng + 2) * self.hn
        self.linear_qkv = nn.ModuleList(nn.Linear(HIDDEN, width, bias=False) for _ in range(N_LAYERS))
        self.k_layernorm = nn.ModuleList(nn.RMSNorm(self.hn, eps=EPS) for _ in range(N_LAYERS))
        self.rotary_interleaved = rotary_interleaved
        _randomize_norm_weights(self)

    def forward(self, hidden_states, rotary_pos_emb):  # [sq, b, h], [sq, 1, 1, rot_dim] angles
        outs = []
        for linear_qkv, k_layernorm in zip(self.linear_qkv, self.k_layernorm):
            mixed_qkv = linear_qkv(hidden_states)
            new_tensor_shape = mixed_qkv.size()[:-1] + (self.ng, (self.np // self.ng + 2) * self.hn)
            mixed_qkv = mixed_qkv.view(*new_tensor_shape)
            split_arg_list = [self.np // self.ng * self.hn, self.hn, self.hn]
            query, key, value = torch.split(mixed_qkv, split_arg_list, dim=3)
            key = k_layernorm(key)
            key = _megatron_apply_rotary_pos_emb_bshd(key, rotary_pos_emb, self.rotary_interleaved)
            outs += [key, value]
        return tuple(outs)


def build_megatron(dtype, rotary_interleaved=False, rotary_dim=HEAD_DIM // 2):
    torch.manual_seed(0)
    module = MegatronContext(rotary_interleaved)
    freqs = _positions().float()[:, None] * _inv_freq(rotary_dim)[None]  # RotaryEmbedding.forward
    if not rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    emb = emb[:, None, None, :]  # [seq, 1, 1, rot_dim], float32 as Megatron keeps it
    x = torch.randn(TOKENS, BATCH, HIDDEN)
    module, (x,) = _finish(module, dtype, x)
    return module, (x, emb)


# ----------------------------------------------------------------------------------------------------------
# 2b. torch.split rotate half, with the angles computed from positions inside apply_rope (float32 math,
# cast back at the end); Gemma-style: no K norm, [B, L, H, D].
# huggingface/lerobot lerobot/common/policies/pi0/paligemma_with_expert.py (apply_rope, "copied from the
# Pi0 jax codebase": `x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)`)


def _pi0_apply_rope(x, positions, max_wavelength=10_000):
    freq_exponents = (2.0 / x.shape[-1]) * torch.arange(x.shape[-1] // 2, dtype=torch.float32, device=x.device)
    timescale = max_wavelength**freq_exponents
    radians = positions[..., None].float() / timescale[None, None, :].float()
    radians = radians[..., None, :]
    sin, cos = torch.sin(radians), torch.cos(radians)
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    res = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return res.to(dtype=x.dtype)


class Pi0Context(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))

    def forward(self, hidden_states, position_ids):
        hidden_shape = (*hidden_states.shape[:-1], -1, HEAD_DIM)
        outs = []
        for k_proj, v_proj in zip(self.k_proj, self.v_proj):
            key_state = k_proj(hidden_states).view(hidden_shape)
            value_state = v_proj(hidden_states).view(hidden_shape)
            outs += [_pi0_apply_rope(key_state, position_ids), value_state]
        return tuple(outs)


def build_pi0(dtype):
    torch.manual_seed(0)
    return _finish(Pi0Context(), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 3, 13. vLLM native spelling: flat [num_tokens, H*D]; qkv_proj cut with qkv.split([q, kv, kv]); Qwen3
# k_norm on k.view(*k.shape[:-1], k.shape[-1] // head_dim, head_dim) and viewed back; RMSNorm.forward_native
# casts back BEFORE the weight (`x.to(orig_dtype) * self.weight`); RotaryEmbedding.forward_native gathers
# `cos_sin_cache.index_select(0, positions)`, chunks it, views the key as [num_tokens, -1, head_size],
# rotates key[..., :rotary_dim] with apply_rotary_emb_torch (neox: torch.chunk; gptj: x[..., ::2],
# x[..., 1::2] and torch.stack((o1, o2), dim=-1).flatten(-2)) and cats the pass-through back.
# vllm-project/vllm vllm/model_executor/models/qwen3.py (Qwen3Attention.forward),
# vllm-project/vllm vllm/model_executor/layers/layernorm.py (RMSNorm.forward_native),
# vllm-project/vllm vllm/model_executor/layers/rotary_embedding/base.py (RotaryEmbedding.forward_native),
# vllm-project/vllm vllm/model_executor/layers/rotary_embedding/common.py (apply_rotary_emb_torch)


class VllmRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = x.to(orig_dtype) * self.weight
        return x


def _vllm_apply_rotary_emb_torch(x, cos, sin, is_neox_style):
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


class VllmRotaryEmbedding(nn.Module):
    def __init__(self, head_size, rotary_dim, is_neox_style=True, base=10000.0):
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, is_neox_style
        self.register_buffer("cos_sin_cache", _cos_sin_cache(rotary_dim, base), persistent=False)

    def forward(self, positions, query, key):  # forward_native
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)

        query_shape = query.shape
        query = query.view(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_pass = query[..., self.rotary_dim :]
        query_rot = _vllm_apply_rotary_emb_torch(query_rot, cos, sin, self.is_neox_style)
        query = torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)

        key_shape = key.shape
        key = key.view(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_pass = key[..., self.rotary_dim :]
        key_rot = _vllm_apply_rotary_emb_torch(key_rot, cos, sin, self.is_neox_style)
        key = torch.cat((key_rot, key_pass), dim=-1).reshape(key_shape)
        return query, key


class VllmQwen3Attention(nn.Module):
    def __init__(self, rotary_emb, num_heads=4, qkv_bias=False, qk_norm=True, negative_slices=False):
        super().__init__()
        self.negative_slices = negative_slices
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, KV_HEADS, HEAD_DIM
        self.q_size, self.kv_size = num_heads * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.qkv_proj = nn.Linear(HIDDEN, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = VllmRMSNorm(HEAD_DIM)
            self.k_norm = VllmRMSNorm(HEAD_DIM)
        self.rotary_emb = rotary_emb

    def forward(self, positions, hidden_states):  # Qwen3Attention.forward up to self.attn(q, k, v)
        qkv = self.qkv_proj(hidden_states)
        if self.negative_slices:  # the same columns, counted from the end
            kv = self.kv_size
            q, k, v = qkv[..., : -2 * kv], qkv[..., -2 * kv : -kv], qkv[..., -kv:]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # qwen2 has none
            q_by_head = q.view(*q.shape[:-1], q.shape[-1] // self.head_dim, self.head_dim)
            q_by_head = self.q_norm(q_by_head)
            q = q_by_head.view(q.shape)
            k_by_head = k.view(*k.shape[:-1], k.shape[-1] // self.head_dim, self.head_dim)
            k_by_head = self.k_norm(k_by_head)
            k = k_by_head.view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return k, v


class VllmContext(nn.Module):
    def __init__(self, rotary_dim=HEAD_DIM, is_neox_style=True, qkv_bias=False, qk_norm=True, negative_slices=False):
        super().__init__()
        rotary_emb = VllmRotaryEmbedding(HEAD_DIM, rotary_dim, is_neox_style)  # get_rope is lru-cached: shared
        self.layers = nn.ModuleList(
            VllmQwen3Attention(rotary_emb, qkv_bias=qkv_bias, qk_norm=qk_norm, negative_slices=negative_slices)
            for _ in range(N_LAYERS)
        )
        _randomize_norm_weights(self)

    def forward(self, positions, hidden_states):  # [T], [T, hidden]
        outs = []
        for attn in self.layers:
            outs += list(attn(positions, hidden_states))
        return tuple(outs)


def build_vllm(dtype, **kwargs):
    torch.manual_seed(0)
    module, (x,) = _finish(VllmContext(**kwargs), dtype, _hidden(batched=False, tokens=BATCH * TOKENS))
    return module, (_positions(BATCH * TOKENS), x)


def explain_vllm_model():
    """A 3-layer vLLM-native Qwen3 context K/V for `python -m fx_fusion explain
    tests/spelling_corpus.py:explain_vllm_model` (a factory returning (module, example_args))."""
    module, (positions, hidden_states) = build_vllm(torch.float32)
    return module, (positions, hidden_states)


# ----------------------------------------------------------------------------------------------------------
# 3a. vLLM's DFlash context precompute, its custom ops written as the plain PyTorch they compute: the K/V
# weights of every layer stacked once ([L * 2 * kv, hidden]), one linear, the result viewed
# [T, L, 2, H, D] and made layer-major (`.permute(2, 1, 0, 3, 4).contiguous()`), K and V taken with [0] and
# [1]; each layer's K normed by its own k_norm (the custom op writes into `torch.empty_like(all_k)[i]`;
# here either that or a torch.stack), then one RoPE over all layers' rows at once: K viewed
# [L * T, kv], the cos/sin cache gathered at `positions.repeat(L)`. `respelled`: the layers cut with
# `unbind` and the positions repeated by `expand(L, T).reshape(-1)` (the same values); `chunked`: K and V
# taken as `all_kv.chunk(2, dim=0)`, each squeezed (a cut, a layout op, then each layer's cut). `one_norm`: all
# layers' K normed in one expression, RMSNorm.forward_native's math over the layer-major [L, T, H, D] K with
# the layers' weights stacked [L, 1, 1, D] ("stacked", a stacked-weights rewrite of the per-layer norms), one
# weight [D] for every layer ("shared") or none ("none", F.rms_norm without a weight).
# vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3Model._build_fused_kv_buffers,
# precompute_and_store_context_kv), vllm/model_executor/layers/layernorm.py (RMSNorm.forward_native),
# vllm/model_executor/layers/rotary_embedding/common.py (apply_rotary_emb_torch)


class VllmDflashPrecompute(nn.Module):
    def __init__(self, norms_into_empty=False, respelled=False, one_norm: Optional[str] = None, chunked=False):
        super().__init__()
        self.norms_into_empty, self.respelled, self.one_norm = norms_into_empty, respelled, one_norm
        self.chunked = chunked
        self.kv_size = KV_HEADS * HEAD_DIM
        self.hidden_norm = VllmRMSNorm(HIDDEN)
        self.fused_kv_weight = nn.Parameter(torch.randn(N_LAYERS * 2 * self.kv_size, HIDDEN) / HIDDEN**0.5)
        self.k_norms = nn.ModuleList(VllmRMSNorm(HEAD_DIM) for _ in range(N_LAYERS))
        self.register_buffer("cos_sin_cache", _cos_sin_cache(HEAD_DIM), persistent=False)
        _randomize_norm_weights(self)
        if one_norm == "stacked":
            stacked = torch.stack([norm.weight.detach() for norm in self.k_norms]).view(N_LAYERS, 1, 1, HEAD_DIM)
            self.k_norm_weights = nn.Parameter(stacked.clone())
        elif one_norm == "shared":
            self.k_norm_weights = nn.Parameter(self.k_norms[0].weight.detach().clone())

    def forward(self, context_states, context_positions):  # [T, hidden], [T]
        num_ctx = context_states.shape[0]
        all_kv_flat = F.linear(self.hidden_norm(context_states), self.fused_kv_weight)
        all_kv = all_kv_flat.view(num_ctx, N_LAYERS, 2, KV_HEADS, HEAD_DIM).permute(2, 1, 0, 3, 4).contiguous()
        if self.chunked:
            all_k, all_v = (half.squeeze(0) for half in all_kv.chunk(2, dim=0))
        else:
            all_k, all_v = all_kv[0], all_kv[1]  # [L, T, H, D]
        if self.one_norm == "none":
            all_k_normed = F.rms_norm(all_k, (HEAD_DIM,), None, self.k_norms[0].variance_epsilon)
        elif self.one_norm:
            x = all_k.to(torch.float32)
            x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.k_norms[0].variance_epsilon)
            all_k_normed = x.to(all_k.dtype) * self.k_norm_weights
        elif self.norms_into_empty:
            all_k_normed = torch.empty_like(all_k)
            for i in range(N_LAYERS):
                all_k_normed[i] = self.k_norms[i](all_k[i])
        elif self.respelled:
            all_k_normed = torch.stack([norm(k) for norm, k in zip(self.k_norms, all_k.unbind(0))])
        else:
            all_k_normed = torch.stack([self.k_norms[i](all_k[i]) for i in range(N_LAYERS)])
        all_k_flat = all_k_normed.view(N_LAYERS * num_ctx, self.kv_size)
        if self.respelled:
            positions = context_positions.unsqueeze(0).expand(N_LAYERS, num_ctx).reshape(-1)
        else:
            positions = context_positions.repeat(N_LAYERS)
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        k_rotated = _vllm_apply_rotary_emb_torch(all_k_flat.view(N_LAYERS * num_ctx, -1, HEAD_DIM), cos, sin, True)
        return k_rotated.view(N_LAYERS, num_ctx, KV_HEADS, HEAD_DIM), all_v


def build_vllm_dflash_precompute(dtype, norms_into_empty=False, respelled=False, one_norm=None, chunked=False):
    torch.manual_seed(0)
    module = VllmDflashPrecompute(norms_into_empty, respelled, one_norm, chunked)
    module, (x,) = _finish(module, dtype, _hidden(batched=False, tokens=BATCH * TOKENS))
    return module, (x, _positions(BATCH * TOKENS))


# ----------------------------------------------------------------------------------------------------------
# 3b. nano-vllm: [T, H, D] heads (q.view(-1, num_heads, head_dim)), k_norm on that, cos_sin_cache[positions]
# with the cache unsqueezed to [max_pos, 1, rotary_dim], rotation in float32 (torch.chunk(x.float(), 2)),
# and an RMSNorm written with IN-PLACE ops (x.mul_(rsqrt), x.to(orig_dtype).mul_(weight)).
# GeeeekExplorer/nano-vllm nanovllm/models/qwen3.py (Qwen3Attention.forward),
# GeeeekExplorer/nano-vllm nanovllm/layers/layernorm.py (RMSNorm.rms_forward),
# GeeeekExplorer/nano-vllm nanovllm/layers/rotary_embedding.py (apply_rotary_emb, RotaryEmbedding.forward)


class NanoVllmRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        orig_dtype = x.dtype
        x = x.float()
        var = x.pow(2).mean(dim=-1, keepdim=True)
        x.mul_(torch.rsqrt(var + self.eps))
        x = x.to(orig_dtype).mul_(self.weight)
        return x


def _nano_apply_rotary_emb(x, cos, sin):
    x1, x2 = torch.chunk(x.float(), 2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


class NanoVllmRotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim):
        super().__init__()
        self.register_buffer("cos_sin_cache", _cos_sin_cache(rotary_dim).unsqueeze_(1), persistent=False)

    def forward(self, positions, query, key):
        cos_sin = self.cos_sin_cache[positions]
        cos, sin = cos_sin.chunk(2, dim=-1)
        return _nano_apply_rotary_emb(query, cos, sin), _nano_apply_rotary_emb(key, cos, sin)


class NanoVllmContext(nn.Module):
    def __init__(self, num_heads=4):
        super().__init__()
        self.num_heads, self.q_size, self.kv_size = num_heads, num_heads * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.qkv_proj = nn.ModuleList(
            nn.Linear(HIDDEN, self.q_size + 2 * self.kv_size, bias=False) for _ in range(N_LAYERS)
        )
        self.q_norm = nn.ModuleList(NanoVllmRMSNorm(HEAD_DIM) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(NanoVllmRMSNorm(HEAD_DIM) for _ in range(N_LAYERS))
        self.rotary_emb = NanoVllmRotaryEmbedding(HEAD_DIM)
        _randomize_norm_weights(self)

    def forward(self, positions, hidden_states):
        outs = []
        for qkv_proj, q_norm, k_norm in zip(self.qkv_proj, self.q_norm, self.k_norm):
            qkv = qkv_proj(hidden_states)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, self.num_heads, HEAD_DIM)
            k = k.view(-1, KV_HEADS, HEAD_DIM)
            v = v.view(-1, KV_HEADS, HEAD_DIM)
            q = q_norm(q)
            k = k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
            outs += [k, v]
        return tuple(outs)


def build_nano_vllm(dtype):
    torch.manual_seed(0)
    module, (x,) = _finish(NanoVllmContext(), dtype, _hidden(batched=False, tokens=BATCH * TOKENS))
    return module, (_positions(BATCH * TOKENS), x)


# ----------------------------------------------------------------------------------------------------------
# 4, 13. SGLang native spelling: qkv.split; apply_qk_norm's unfused path reshapes to [-1, head_dim]
# (k.reshape(-1, head_dim) -> k_norm -> view(k.shape)); RMSNorm.forward_native applies the weight IN
# FLOAT32 and casts after (`(x * self.weight).to(orig_dtype)`); RotaryEmbedding.forward_native as vLLM's.
# The DFlash path (DFlashAttention.kv_proj_only) slices the fused qkv weight: F.linear(x,
# qkv_proj.weight[q_size : q_size + 2 * kv_size]), kv.split([kv, kv]), apply_k_norm(reshape(-1, head_dim),
# view_as), apply_k_rope(positions, k) with a `k.new_empty(k.shape)` dummy query, k.view(-1, H, D).
# sgl-project/sglang python/sglang/srt/layers/layernorm.py (RMSNorm.forward_native),
# sgl-project/sglang python/sglang/srt/layers/rotary_embedding.py (RotaryEmbedding.forward_native,
# _apply_rotary_emb), sgl-project/sglang python/sglang/srt/models/utils.py (apply_qk_norm),
# sgl-project/sglang python/sglang/srt/models/qwen3.py, sgl-project/sglang python/sglang/srt/models/dflash.py
# (DFlashAttention.kv_proj_only / apply_k_norm / apply_k_rope), python/sglang/srt/speculative/dflash_worker.py


class SglangRMSNorm(VllmRMSNorm):
    def forward(self, x):
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = (x * self.weight).to(orig_dtype)
        return x


class SglangContext(nn.Module):
    def __init__(self, dflash: bool = False, num_heads=4, qkv_bias=False):
        super().__init__()
        self.dflash = dflash
        self.head_dim, self.num_kv_heads = HEAD_DIM, KV_HEADS
        self.q_size, self.kv_size = num_heads * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.qkv_proj = nn.ModuleList(
            nn.Linear(HIDDEN, self.q_size + 2 * self.kv_size, bias=qkv_bias) for _ in range(N_LAYERS)
        )
        self.q_norm = nn.ModuleList(SglangRMSNorm(HEAD_DIM) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(SglangRMSNorm(HEAD_DIM) for _ in range(N_LAYERS))
        self.rotary_emb = VllmRotaryEmbedding(HEAD_DIM, HEAD_DIM)  # SGLang's forward_native == vLLM's
        _randomize_norm_weights(self)

    def _layer(self, i, positions, hidden_states):
        qkv_proj, q_norm, k_norm = self.qkv_proj[i], self.q_norm[i], self.k_norm[i]
        if self.dflash:
            kv_slice = slice(self.q_size, self.q_size + 2 * self.kv_size)
            weight = qkv_proj.weight[kv_slice]
            bias = qkv_proj.bias[kv_slice] if qkv_proj.bias is not None else None
            kv = F.linear(hidden_states, weight, bias)
            k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
            k_by_head = k.reshape(-1, self.head_dim)  # apply_k_norm
            k = k_norm(k_by_head).view_as(k)
            dummy_q = k.new_empty(k.shape)  # apply_k_rope
            _, k = self.rotary_emb(positions, dummy_q, k)
            return k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, self.head_dim)
        qkv = qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_by_head = q.reshape(-1, self.head_dim)  # apply_qk_norm, unfused path
        q = q_norm(q_by_head).view(q.shape)
        k_by_head = k.reshape(-1, self.head_dim)
        k = k_norm(k_by_head).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return k, v

    def forward(self, positions, hidden_states):
        outs = []
        for i in range(N_LAYERS):
            outs += list(self._layer(i, positions, hidden_states))
        return tuple(outs)


def build_sglang(dtype, **kwargs):
    torch.manual_seed(0)
    module, (x,) = _finish(SglangContext(**kwargs), dtype, _hidden(batched=False, tokens=BATCH * TOKENS))
    return module, (_positions(BATCH * TOKENS), x)


# ----------------------------------------------------------------------------------------------------------
# 5. gpt-fast: fused wqkv cut with .split([dim, kv, kv]), [B, T, H, D], interleaved (GPT-J pair) RoPE from
# a real-pair freqs_cis buffer gathered by input_pos: xshaped = x.float().reshape(*x.shape[:-1], -1, 2),
# stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(3).type_as(x), then transpose(1, 2). No K norm.
# pytorch-labs/gpt-fast model.py (precompute_freqs_cis, apply_rotary_emb, Attention.forward)


def _gpt_fast_apply_rotary_emb(x, freqs_cis):
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


class GptFastContext(nn.Module):
    def __init__(self, n_head=KV_HEADS):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = n_head, KV_HEADS, HEAD_DIM
        self.dim = n_head * HEAD_DIM
        kv_size = self.n_local_heads * self.head_dim
        self.wqkv = nn.ModuleList(nn.Linear(HIDDEN, self.dim + 2 * kv_size, bias=False) for _ in range(N_LAYERS))
        freqs = torch.outer(torch.arange(MAX_POS), _inv_freq(HEAD_DIM))
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
        self.register_buffer("freqs_cis", torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1), persistent=False)

    def forward(self, x, input_pos):
        bsz, seqlen, _ = x.shape
        freqs_cis = self.freqs_cis[input_pos]  # Transformer.forward
        kv_size = self.n_local_heads * self.head_dim
        outs = []
        for wqkv in self.wqkv:
            q, k, v = wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
            k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
            v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
            k = _gpt_fast_apply_rotary_emb(k, freqs_cis)
            k, v = map(lambda t: t.transpose(1, 2), (k, v))
            outs += [k, v]
        return tuple(outs)


def build_gpt_fast(dtype):
    torch.manual_seed(0)
    module, (x,) = _finish(GptFastContext(), dtype, _hidden())
    return module, (x, _positions())


# ----------------------------------------------------------------------------------------------------------
# 6. Meta Llama / torchtitan complex freqs_cis: view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)),
# reshape_for_broadcast, view_as_real(x_ * freqs_cis).flatten(3).type_as(x). No K norm, [B, T, H, D].
# meta-llama/llama llama/model.py (apply_rotary_emb, reshape_for_broadcast, Attention.forward),
# pytorch/torchtitan torchtitan/models/llama3/model/model.py (apply_rotary_emb)


def _llama_reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def _llama_apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = _llama_reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class LlamaComplexContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_local_kv_heads, self.head_dim = KV_HEADS, HEAD_DIM
        self.wk = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.wv = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))

    def forward(self, x, freqs_cis):  # freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen], complex64
        bsz, seqlen, _ = x.shape
        outs = []
        for wk, wv in zip(self.wk, self.wv):
            xk, xv = wk(x), wv(x)
            xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
            xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
            _, xk = _llama_apply_rotary_emb(xk, xk, freqs_cis=freqs_cis)
            outs += [xk, xv]
        return tuple(outs)


def build_llama_complex(dtype):
    torch.manual_seed(0)
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), _inv_freq(HEAD_DIM))
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # precompute_freqs_cis, complex64
    start_pos = 3
    module, (x,) = _finish(LlamaComplexContext(), dtype, _hidden())
    return module, (x, freqs_cis[start_pos : start_pos + TOKENS])


# ----------------------------------------------------------------------------------------------------------
# 7. nn.RMSNorm(head_dim) as q_norm/k_norm (torchtitan's Qwen3), or the same through F.rms_norm (what
# nn.RMSNorm.forward calls); HF-style rotate_half on [B, T, H, D] with cos/sin [B, T, D] unsqueezed at 2.
# pytorch/torchtitan torchtitan/models/qwen3/model/model.py (Attention: nn.RMSNorm(head_dim) q/k norms),
# pytorch/pytorch torch/nn/modules/normalization.py (RMSNorm.forward -> F.rms_norm)


class TorchRMSNormContext(nn.Module):
    def __init__(self, functional: bool = False):
        super().__init__()
        self.functional = functional
        self.wk = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.wv = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(nn.RMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS))
        _randomize_norm_weights(self)

    def forward(self, x, cos, sin):
        bs, seqlen, _ = x.shape
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        outs = []
        for wk, wv, k_norm in zip(self.wk, self.wv, self.k_norm):
            xk = wk(x).view(bs, seqlen, -1, HEAD_DIM)
            xv = wv(x).view(bs, seqlen, -1, HEAD_DIM)
            if self.functional:
                xk = F.rms_norm(xk, (HEAD_DIM,), k_norm.weight, k_norm.eps)
            else:
                xk = k_norm(xk)
            xk = (xk * cos) + (modeling_qwen3.rotate_half(xk) * sin)
            outs += [xk, xv]
        return tuple(outs)


def _hf_cos_sin(position_ids, rotary_dim=HEAD_DIM, base=10000.0):
    """HF rotary embedding's output: emb = cat(freqs, freqs); cos/sin [B, T, rotary_dim]."""
    freqs = position_ids[..., None].float() * _inv_freq(rotary_dim, base).to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def build_torch_rmsnorm(dtype, functional=False):
    torch.manual_seed(0)
    cos, sin = _hf_cos_sin(_positions()[None].expand(BATCH, -1))
    return _finish(TorchRMSNormContext(functional), dtype, _hidden(), cos, sin)


# ----------------------------------------------------------------------------------------------------------
# 7c. F.rms_norm as CUDA runs it: `torch.rms_norm` dispatches CUDA tensors to `aten._fused_rms_norm`, whose
# decomposition upcasts, normalises, makes the result contiguous (a real copy when K is a transposed view)
# and casts back; here with K normalised after `transpose(1, 2)` and no weight, then HF rotate_half RoPE.
# pytorch/pytorch torch/_decomp/decompositions.py (_fused_rms_norm), aten/src/ATen/native/layer_norm.cpp


class FusedRMSNormContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.wk = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        outs = []
        for wk in self.wk:
            k = wk(x).view(B, T, -1, HEAD_DIM).transpose(1, 2)
            k = torch.ops.aten._fused_rms_norm(k, [HEAD_DIM], None, EPS)[0]
            outs.append(k * cos.unsqueeze(1) + modeling_qwen3.rotate_half(k) * sin.unsqueeze(1))
        return tuple(outs)


def build_fused_rms_norm(dtype):
    torch.manual_seed(0)
    cos, sin = _hf_cos_sin(_positions()[None].expand(BATCH, -1))
    return _finish(FusedRMSNormContext(), dtype, _hidden(), cos, sin)


# ----------------------------------------------------------------------------------------------------------
# 7b, 10. modded-nanogpt: one qkv weight [3, hdim, dim] through F.linear(x, qkv_w.flatten(end_dim=1)),
# .view(B, T, 3 * H, D).chunk(3, dim=-2); weightless QK norm `F.rms_norm(x, (x.size(-1),))` in the INPUT
# dtype (no upcast); half-truncated Rotary (angular_freq zero-padded; y1 = x1 * cos + x2 * sin,
# y2 = x1 * (-sin) + x2 * cos: RoPE with sin negated) computed in float32, type_as(x) after.
# KellerJordan/modded-nanogpt train_gpt.py (norm, Rotary, CausalSelfAttention.forward)


class ModdedNanoGPTRotary(nn.Module):
    def __init__(self, dim, max_seq_len=MAX_POS):
        super().__init__()
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(dim // 4)])
        t = torch.arange(max_seq_len, dtype=torch.float32)
        theta = torch.einsum("i,j -> ij", t, angular_freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x_BTHD):
        cos, sin = self.cos[None, : x_BTHD.size(-3), None, :], self.sin[None, : x_BTHD.size(-3), None, :]
        x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x_BTHD)


def _modded_norm(x):
    return F.rms_norm(x, (x.size(-1),))


class ModdedNanoGPTContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = KV_HEADS, HEAD_DIM
        hdim = self.num_heads * self.head_dim
        self.qkv_w = nn.ParameterList(nn.Parameter(torch.randn(3, hdim, HIDDEN) * HIDDEN**-0.5) for _ in range(N_LAYERS))
        self.rotary = ModdedNanoGPTRotary(HEAD_DIM)

    def forward(self, x):
        B, T = x.size(0), x.size(1)
        outs = []
        for qkv_w in self.qkv_w:
            q, k, v = F.linear(x, qkv_w.flatten(end_dim=1).type_as(x)).view(B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=-2)
            q, k = _modded_norm(q), _modded_norm(k)
            q, k = self.rotary(q), self.rotary(k)
            outs += [k, v]
        return tuple(outs)


class ModdedNanoGPTFloat32Context(ModdedNanoGPTContext):
    """The same layers as the post-grad graph of torch 2.11 on CUDA spells them: F.rms_norm upcasts,
    normalises and casts back; the Rotary casts straight up again, and Inductor drops that round trip, so the
    weightless norm's float32 result feeds the float32 RoPE, rounded once at its end."""

    def forward(self, x):
        B, T = x.size(0), x.size(1)
        outs = []
        for qkv_w in self.qkv_w:
            q, k, v = F.linear(x, qkv_w.flatten(end_dim=1).type_as(x)).view(B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=-2)
            k32 = k.float()
            k32 = k32 * torch.rsqrt(k32.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)
            outs += [self.rotary(k32).type_as(k), v]
        return tuple(outs)


def build_modded_nanogpt(dtype, float32_rope=False):
    torch.manual_seed(0)
    module = ModdedNanoGPTFloat32Context() if float32_rope else ModdedNanoGPTContext()
    module, (x,) = _finish(module, dtype, _hidden())
    module.rotary.float()  # its cos/sin buffers stay float32 (train_gpt.py builds them after .bfloat16())
    return module, (x,)


# ----------------------------------------------------------------------------------------------------------
# 8. Gemma3n's RMSNorm spellings: `x / torch.sqrt(ms + eps)` (transformers 4.53), `x * torch.pow(ms + eps,
# -0.5)` (current transformers), and `x * (1 / torch.sqrt(ms + eps))` (no public source found: a
# hand-written variant); all in float32 with the weight applied in float32, then type_as(x). Gemma3n norms
# K on [B, T, H, D] and applies RoPE there (apply_rotary_pos_emb(k, cos, sin, unsqueeze_dim=2)), THEN
# transposes. (Gemma3n also RMS-normalises V with a weightless v_norm; left out: V is a plain projection.)
# huggingface/transformers src/transformers/models/gemma3n/modeling_gemma3n.py (Gemma3nRMSNorm._norm,
# Gemma3nTextAttention.forward)


class Gemma3nSpelledRMSNorm(nn.Module):
    def __init__(self, dim, spelling, eps=EPS):
        super().__init__()
        self.eps, self.spelling = eps, spelling
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        if self.spelling == "sqrt":
            return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.spelling == "reciprocal_sqrt":
            return x * (1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        raise ValueError(self.spelling)

    def forward(self, x):
        output = self._norm(x.float()) * self.weight.float()
        return output.type_as(x)


class Gemma3nContext(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        if spelling == "pow":
            norms = [modeling_gemma3n.Gemma3nRMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS)]
        else:
            norms = [Gemma3nSpelledRMSNorm(HEAD_DIM, spelling) for _ in range(N_LAYERS)]
        self.k_norm = nn.ModuleList(norms)
        _randomize_norm_weights(self)

    def forward(self, hidden_states, cos, sin):
        hidden_shape = (*hidden_states.shape[:-1], -1, HEAD_DIM)
        outs = []
        for k_proj, v_proj, k_norm in zip(self.k_proj, self.v_proj, self.k_norm):
            key_states = k_proj(hidden_states).view(hidden_shape)
            key_states = k_norm(key_states)
            key_states = modeling_gemma3n.apply_rotary_pos_emb(key_states, cos, sin, unsqueeze_dim=2)
            key_states = key_states.transpose(1, 2)
            value_states = v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            outs += [key_states, value_states]
        return tuple(outs)


def build_gemma3n(dtype, spelling):
    torch.manual_seed(0)
    cos, sin = _hf_cos_sin(_positions()[None].expand(BATCH, -1))
    return _finish(Gemma3nContext(spelling), dtype, _hidden(), cos, sin)


# ----------------------------------------------------------------------------------------------------------
# 9. Gemma3: Gemma3RMSNorm scales by (1 + weight) in float32; q/k norms run AFTER transpose(1, 2), on
# [B, H, T, D]; the real transformers modules and modeling_gemma3.apply_rotary_pos_emb.
# huggingface/transformers src/transformers/models/gemma3/modeling_gemma3.py (Gemma3RMSNorm,
# Gemma3Attention.forward, Gemma3RotaryEmbedding)


class Gemma3Context(nn.Module):
    def __init__(self):
        super().__init__()
        config = Gemma3TextConfig(
            **_HF_SIZES,
            num_hidden_layers=N_LAYERS,
            layer_types=["full_attention"] * N_LAYERS,
        )
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(modeling_gemma3.Gemma3RMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS))
        self.rotary_emb = modeling_gemma3.Gemma3RotaryEmbedding(config)
        _randomize_norm_weights(self, mean=0.0)  # Gemma's weight is an offset from 1

    def forward(self, hidden_states, position_ids):
        hidden_shape = (*hidden_states.shape[:-1], -1, HEAD_DIM)
        cos, sin = self.rotary_emb(hidden_states, position_ids, "full_attention")
        outs = []
        for k_proj, v_proj, k_norm in zip(self.k_proj, self.v_proj, self.k_norm):
            key_states = k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            value_states = v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            key_states = k_norm(key_states)
            _, key_states = modeling_gemma3.apply_rotary_pos_emb(key_states, key_states, cos, sin)
            outs += [key_states, value_states]
        return tuple(outs)


def build_gemma3(dtype):
    torch.manual_seed(0)
    return _finish(Gemma3Context(), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 10. The "no upcast" RMSNorm: everything in the input dtype, weight multiplied last; HF rotate_half.
# No single canonical source: the form of many minimal Llama ports (e.g. an RMSNorm written as
# `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight` without .float()).


class NoUpcastContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.k_norm_weight = nn.ParameterList(nn.Parameter(torch.ones(HEAD_DIM)) for _ in range(N_LAYERS))
        for w in self.k_norm_weight:
            nn.init.normal_(w, 1.0, 0.2)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        outs = []
        for k_proj, v_proj, weight in zip(self.k_proj, self.v_proj, self.k_norm_weight):
            k = k_proj(x).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + EPS) * weight
            k = (k * cos) + (modeling_qwen3.rotate_half(k) * sin)
            outs += [k, v_proj(x).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2)]
        return tuple(outs)


def build_no_upcast(dtype):
    torch.manual_seed(0)
    cos, sin = _hf_cos_sin(_positions()[None].expand(BATCH, -1))
    return _finish(NoUpcastContext(), dtype, _hidden(), cos, sin)


# ----------------------------------------------------------------------------------------------------------
# 11, 12. The stacked layout of SGLang's fused DFlash KV materialization: all layers' K/V weights stacked
# once ([L * 2 * kv, hidden]), ONE projection -> [T, L * 2 * kv] viewed [T, L, 2 * kv]; K = [..., :kv],
# V = [..., kv:]; a stacked [L, head_dim] norm weight broadcast over tokens and heads; float32 norm and
# RoPE from cos_sin_cache gathered by positions (neox halves), cast once at the end; outputs [L, T, H, D].
# `stack_of_cats` builds the same [T, L, 2 * kv] with torch.stack over layers of
# torch.cat([k_proj(x), v_proj(x)], -1) (the per-layer-modules way to the same tensor). `unbind`: the same
# projection viewed [T, L, 2, H, D] and cut by `.unbind(2)`; `shared_norm_weight`: one [head_dim] weight
# for every layer; `norm_weights_stacked_in_forward`: each layer's [head_dim] weight, `torch.stack`ed in the
# forward (respellings of the same layout).
# sgl-project/sglang python/sglang/kernels/ops/speculative/fused_kv_materialize.py
# (FusedKVMaterializeHelper: torch.stack(kv_weights).reshape(L * 2 * kv, -1); the reference math of
# _fused_norm_rope_kernel_stacked)


class SglangStackedContext(nn.Module):
    def __init__(self, stack_of_cats=False, unbind=False, shared_norm_weight=False, norm_weights_stacked_in_forward=False):
        super().__init__()
        self.stack_of_cats, self.unbind, self.shared_norm_weight = stack_of_cats, unbind, shared_norm_weight
        self.norm_weights_stacked_in_forward = norm_weights_stacked_in_forward
        self.n_layers, self.kv_size = N_LAYERS, KV_HEADS * HEAD_DIM
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, self.kv_size, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, self.kv_size, bias=False) for _ in range(N_LAYERS))
        kv_weights = [torch.cat([k.weight, v.weight]) for k, v in zip(self.k_proj, self.v_proj)]
        self.flat_kv_weight = nn.Parameter(torch.stack(kv_weights).reshape(N_LAYERS * 2 * self.kv_size, -1).clone())
        self.k_norm_weights = nn.Parameter(torch.randn(N_LAYERS, HEAD_DIM) * 0.2 + 1.0)
        if norm_weights_stacked_in_forward:
            self.layer_norm_weights = nn.ParameterList(nn.Parameter(w.detach().clone()) for w in self.k_norm_weights)
        self.register_buffer("cos_sin_cache", _cos_sin_cache(HEAD_DIM), persistent=False)

    def forward(self, ctx_hidden, positions):
        total_ctx = ctx_hidden.shape[0]
        if self.stack_of_cats:
            per_layer = [torch.cat([k(ctx_hidden), v(ctx_hidden)], -1) for k, v in zip(self.k_proj, self.v_proj)]
            kv = torch.stack(per_layer, dim=1)
        else:
            kv = F.linear(ctx_hidden, self.flat_kv_weight).view(total_ctx, self.n_layers, 2 * self.kv_size)
        if self.unbind:
            k, v = kv.view(total_ctx, self.n_layers, 2, KV_HEADS, HEAD_DIM).unbind(2)
        else:
            k = kv[..., : self.kv_size].reshape(total_ctx, self.n_layers, KV_HEADS, HEAD_DIM)
            v = kv[..., self.kv_size :].reshape(total_ctx, self.n_layers, KV_HEADS, HEAD_DIM)
        k_raw = k.float()
        inv_rms = torch.rsqrt(k_raw.pow(2).sum(-1, keepdim=True) / HEAD_DIM + EPS)
        if self.shared_norm_weight:
            weight = self.k_norm_weights[0]
        elif self.norm_weights_stacked_in_forward:
            weight = torch.stack(list(self.layer_norm_weights))[None, :, None, :]
        else:
            weight = self.k_norm_weights[None, :, None, :]
        k_normed = k_raw * inv_rms * weight.float()
        cos_sin = self.cos_sin_cache[positions].float()
        cos_v, sin_v = cos_sin[:, None, None, : HEAD_DIM // 2], cos_sin[:, None, None, HEAD_DIM // 2 :]
        k_first, k_second = k_normed[..., : HEAD_DIM // 2], k_normed[..., HEAD_DIM // 2 :]
        k_rot = torch.cat((k_first * cos_v - k_second * sin_v, k_second * cos_v + k_first * sin_v), dim=-1)
        return k_rot.to(v.dtype).permute(1, 0, 2, 3), v.permute(1, 0, 2, 3)


def build_sglang_stacked(dtype, stack_of_cats=False, unbind=False, shared_norm_weight=False, norm_weights_stacked_in_forward=False):
    torch.manual_seed(0)
    module = SglangStackedContext(stack_of_cats, unbind, shared_norm_weight, norm_weights_stacked_in_forward)
    module, (x,) = _finish(module, dtype, _hidden(batched=False, tokens=BATCH * TOKENS))
    return module, (x, _positions(BATCH * TOKENS))


# ----------------------------------------------------------------------------------------------------------
# 13b. litgpt: one qkv linear laid out per query group ([q_per_kv q heads, 1 k head, 1 v head] per group),
# viewed (B, T, n_query_groups, total_qkv, hs), permuted to (B, groups, total_qkv, T, hs) and split
# ((q_per_kv, 1, 1), dim=2); norm_k right after the split (norm_qk), K reshaped (B, -1, T, hs); partial RoPE through
# apply_rope on k[..., :rope_n_elem] (rotate half by slices, `.to(dtype=x.dtype)`), cat with the rest.
# Lightning-AI/litgpt litgpt/model.py (CausalSelfAttention.forward, apply_rope)


def _litgpt_apply_rope(x, cos, sin):
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    if cos.dim() > 1:
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class LitGPTContext(nn.Module):
    def __init__(self, rope_n_elem=HEAD_DIM // 2, n_head=KV_HEADS, norm_qk=True, bias=True):
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size, self.rope_n_elem = n_head, KV_HEADS, HEAD_DIM, rope_n_elem
        shape = (n_head + 2 * KV_HEADS) * HEAD_DIM
        self.attn = nn.ModuleList(nn.Linear(HIDDEN, shape, bias=bias) for _ in range(N_LAYERS))
        self.norm_qk = norm_qk
        self.norm_k = nn.ModuleList(nn.RMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS))  # litgpt RMSNorm-like
        _randomize_norm_weights(self)

    def forward(self, x, cos, sin):
        B, T, _ = x.size()
        q_per_kv = self.n_head // self.n_query_groups
        total_qkv = q_per_kv + 2
        outs = []
        for attn, norm_k in zip(self.attn, self.norm_k):
            qkv = attn(x)
            qkv = qkv.view(B, T, self.n_query_groups, total_qkv, self.head_size)
            qkv = qkv.permute(0, 2, 3, 1, 4)  # (B, n_query_groups, total_qkv, T, hs)
            q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
            if self.norm_qk:
                k = norm_k(k)
            k = k.reshape(B, -1, T, self.head_size)  # (B, nh_k, T, hs)
            v = v.reshape(B, -1, T, self.head_size)
            k_roped = _litgpt_apply_rope(k[..., : self.rope_n_elem], cos, sin)
            k = torch.cat((k_roped, k[..., self.rope_n_elem :]), dim=-1)
            outs += [k, v]
        return tuple(outs)


def build_litgpt(dtype, n_head=KV_HEADS):
    torch.manual_seed(0)
    freqs = _positions().float()[:, None] * _inv_freq(HEAD_DIM // 2)[None]
    emb = torch.cat((freqs, freqs), dim=-1)  # litgpt build_rope_cache: [T, rope_n_elem]
    return _finish(LitGPTContext(n_head=n_head), dtype, _hidden(), emb.cos(), emb.sin())


# ----------------------------------------------------------------------------------------------------------
# 16. Falcon's fused query_key_value, cut three ways (FalconAttention._split_heads), no K norm, HF rotate_half
# RoPE after `k.transpose(1, 2).reshape(B, heads, T, D)`:
#   multi_query (Falcon-7B):   qkv.view(B, T, H + 2, D); k = qkv[..., [-2], :], v = qkv[..., [-1], :] (index lists)
#   per head (multi_query=False): qkv.view(B, T, H, 3, D); k = qkv[..., 1, :] (a select)
#   new_decoder_architecture (Falcon-40B/180B): qkv.view(B, T, KV, H / KV + 2, D); k = qkv[:, :, :, [-2]]
#       broadcast to every query head (torch.broadcast_to, then flatten(2, 3)) before RoPE.
# huggingface/transformers src/transformers/models/falcon/modeling_falcon.py


class FalconContext(nn.Module):
    def __init__(self, layout: str, num_heads: int = 2 * KV_HEADS):
        super().__init__()
        self.layout, self.num_heads = layout, num_heads
        columns = {"multi_query": num_heads + 2, "per_head": 3 * num_heads, "new_decoder": num_heads + 2 * KV_HEADS}
        self.query_key_value = nn.ModuleList(
            nn.Linear(HIDDEN, columns[layout] * HEAD_DIM, bias=False) for _ in range(N_LAYERS)
        )

    def _split_k_v(self, qkv, B, T):
        if self.layout == "multi_query":
            qkv = qkv.view(B, T, self.num_heads + 2, HEAD_DIM)
            return qkv[..., [-2], :], qkv[..., [-1], :]
        if self.layout == "per_head":
            qkv = qkv.view(B, T, self.num_heads, 3, HEAD_DIM)
            return qkv[..., 1, :], qkv[..., 2, :]
        qkv = qkv.view(B, T, -1, self.num_heads // KV_HEADS + 2, HEAD_DIM)
        query = qkv[:, :, :, :-2]
        key = torch.broadcast_to(qkv[:, :, :, [-2]], query.shape).flatten(2, 3)
        return key, qkv[:, :, :, [-1]].flatten(2, 3)

    def forward(self, x, cos, sin):  # cos/sin [B, T, D]
        B, T, _ = x.shape
        outs = []
        for query_key_value in self.query_key_value:
            k, v = self._split_k_v(query_key_value(x), B, T)
            k = k.transpose(1, 2).reshape(B, -1, T, HEAD_DIM)
            k = k * cos.unsqueeze(1) + modeling_qwen3.rotate_half(k) * sin.unsqueeze(1)
            outs += [k, v]
        return tuple(outs)


def build_falcon(dtype, layout):
    torch.manual_seed(0)
    cos, sin = _hf_cos_sin(_positions()[None].expand(BATCH, -1))
    return _finish(FalconContext(layout), dtype, _hidden(), cos, sin)


# ----------------------------------------------------------------------------------------------------------
# 17. q, k, v = qkv.unbind(...): timm's EVA attention (`qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)`,
# `unbind(0)`, a per-head k_norm, then `apply_rot_embed_cat`: sin and cos as the halves of one table cut by
# `tensor_split(2, -1)`, pairs rotated by `stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)`); and
# flash-attention's packed qkv (`... (three h d) -> ... three h d`, `qkv.unbind(dim=2)`) with its torch
# rotary reference (cos/sin of half width, repeated to full width, rotate_half).
# huggingface/pytorch-image-models timm/models/eva.py, timm/layers/pos_embed_sincos.py;
# Dao-AILab/flash-attention flash_attn/modules/mha.py, flash_attn/layers/rotary.py


def _timm_rot(x):
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


class UnbindContext(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, 3 * KV_HEADS * HEAD_DIM, bias=True) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(nn.RMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS))
        _randomize_norm_weights(self)

    def forward(self, x, table):
        B, T, _ = x.shape
        outs = []
        for qkv_proj, k_norm in zip(self.qkv, self.k_norm):
            qkv = qkv_proj(x)
            if self.style == "timm_eva":  # table: cat([sin, cos], -1) [T, D], interleaved pairs
                _, k, v = qkv.reshape(B, T, 3, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
                sin_emb, cos_emb = table.tensor_split(2, -1)
                k = k_norm(k)
                k = k * cos_emb + _timm_rot(k) * sin_emb
            else:  # flash-attention: table: cat([cos, sin], -1) of half width [T, D], neox halves
                _, k, v = qkv.view(B, T, 3, KV_HEADS, HEAD_DIM).unbind(dim=2)
                cos, sin = table.chunk(2, dim=-1)
                cos, sin = (torch.cat([t, t], dim=-1)[:, None, :] for t in (cos, sin))
                k = k_norm(k)
                k = k * cos + modeling_qwen3.rotate_half(k) * sin
            outs += [k, v]
        return tuple(outs)


def build_unbind(dtype, style):
    torch.manual_seed(0)
    if style == "timm_eva":
        freqs = _positions().float()[:, None] * _inv_freq(HEAD_DIM)[None]
        freqs = freqs.repeat_interleave(2, dim=-1)  # one angle per (2j, 2j + 1) pair
        table = torch.cat([freqs.sin(), freqs.cos()], dim=-1)
    else:
        freqs = _positions().float()[:, None] * _inv_freq(HEAD_DIM)[None]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return _finish(UnbindContext(style), dtype, _hidden(), table)


# ----------------------------------------------------------------------------------------------------------
# 15. The z-lab DFlash reference draft: context K/V (from target_hidden) and noise-block K/V (from the
# draft's hidden states) concatenated along tokens BEFORE k_norm and RoPE:
#   k = torch.cat([k_proj(target_hidden), k_proj(hidden_states)], dim=1).view(bsz, ctx_len + q_len, -1, D)
#   k = k_norm(k).transpose(1, 2); apply_rotary_pos_emb with cos/sin over all ctx_len + q_len positions.
# z-lab/dflash dflash/model.py (Qwen3DFlashAttention.forward, apply_rotary_pos_emb)


class ZLabDFlashContext(nn.Module):
    """per_layer_noise: each layer's noise block differs (as a real draft's layers see their predecessor's
    output): the context rows fuse across layers, the noise rows keep their own path."""

    def __init__(self, per_layer_noise=False):
        super().__init__()
        self.per_layer_noise = per_layer_noise
        config = _qwen3_config()
        self.layers = nn.ModuleList(modeling_qwen3.Qwen3Attention(config, i) for i in range(N_LAYERS))
        self.rotary_emb = modeling_qwen3.Qwen3RotaryEmbedding(config)
        _randomize_norm_weights(self)

    def forward(self, hidden_states, target_hidden, position_ids):
        bsz, q_len = hidden_states.shape[:-1]
        ctx_len = target_hidden.shape[1]
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        outs = []
        for i, attn in enumerate(self.layers):
            noise = hidden_states * (1.0 + 0.5 * i) if self.per_layer_noise else hidden_states
            k_ctx = attn.k_proj(target_hidden)
            k_noise = attn.k_proj(noise)
            v_ctx = attn.v_proj(target_hidden)
            v_noise = attn.v_proj(noise)
            k = torch.cat([k_ctx, k_noise], dim=1).view(bsz, ctx_len + q_len, -1, attn.head_dim)
            v = torch.cat([v_ctx, v_noise], dim=1).view(bsz, ctx_len + q_len, -1, attn.head_dim)
            k = attn.k_norm(k).transpose(1, 2)
            v = v.transpose(1, 2)
            k = (k * cos.unsqueeze(1)) + (modeling_qwen3.rotate_half(k) * sin.unsqueeze(1))
            outs += [k, v]
        return tuple(outs)


def _dflash_inputs(batch: int, tokens: int, q_len: int) -> tuple:
    """(noise block, target hidden states, position ids over context then block) of a DFlash draft step."""
    noise, target = _hidden(tokens=q_len, batch=batch), _hidden(tokens=tokens, batch=batch)
    return noise, target, _positions(tokens + q_len)[None].expand(batch, -1)


def build_zlab_dflash(dtype, per_layer_noise=False, batch=BATCH, tokens=TOKENS, q_len=4):
    torch.manual_seed(0)
    return _finish(ZLabDFlashContext(per_layer_noise), dtype, *_dflash_inputs(batch, tokens, q_len))


# ----------------------------------------------------------------------------------------------------------
# 15b. DFlash drafts that join the context and noise rows elsewhere than z-lab's draft:
#   normed: each piece's K normalised on its own, the pieces joined along tokens, then one RoPE over all
#           positions (sgl-project/SpecForge specforge/modeling/draft/dflash.py, the revision with a
#           flash-attn path: k_norm of k_proj(target_hidden) and of k_proj(hidden_states), then torch.cat);
#   inputs: one projection over cat([context, noise]) along tokens, the K norm applied to the heads
#           flattened to rows (`k.reshape(-1, head_dim)`) and viewed back (an SGLang-style minimal
#           Qwen3 DFlash draft, Qwen3ForCausalLMDFlash, DFlashAttention.forward).
# Each layer's noise block is its own, as the layers of a real draft see their predecessor's output.


class JoinedDFlashContext(nn.Module):
    def __init__(self, joined_at: str):
        super().__init__()
        self.joined_at = joined_at
        config = _qwen3_config()
        self.layers = nn.ModuleList(modeling_qwen3.Qwen3Attention(config, i) for i in range(N_LAYERS))
        self.rotary_emb = modeling_qwen3.Qwen3RotaryEmbedding(config)
        _randomize_norm_weights(self)

    def _k_and_v(self, attn, context, noise):
        bsz, ctx_len, q_len, d = context.shape[0], context.shape[1], noise.shape[1], attn.head_dim
        if self.joined_at == "normed":
            k_ctx = attn.k_norm(attn.k_proj(context).view(bsz, ctx_len, -1, d))
            k_noise = attn.k_norm(attn.k_proj(noise).view(bsz, q_len, -1, d))
            v_ctx, v_noise = attn.v_proj(context).view(bsz, ctx_len, -1, d), attn.v_proj(noise).view(bsz, q_len, -1, d)
            return torch.cat([k_ctx, k_noise], dim=1), torch.cat([v_ctx, v_noise], dim=1)
        rows = torch.cat([context, noise], dim=1)
        k = attn.k_proj(rows).view(bsz, ctx_len + q_len, -1, d)
        k = attn.k_norm(k.reshape(-1, d)).view(bsz, ctx_len + q_len, -1, d)
        return k, attn.v_proj(rows).view(bsz, ctx_len + q_len, -1, d)

    def forward(self, hidden_states, target_hidden, position_ids):
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        outs = []
        for i, attn in enumerate(self.layers):
            k, v = self._k_and_v(attn, target_hidden, hidden_states * (1.0 + 0.5 * i))
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            k = (k * cos.unsqueeze(1)) + (modeling_qwen3.rotate_half(k) * sin.unsqueeze(1))
            outs += [k, v]
        return tuple(outs)


def build_joined_dflash(dtype, joined_at, batch=BATCH, tokens=TOKENS, q_len=4):
    torch.manual_seed(0)
    return _finish(JoinedDFlashContext(joined_at), dtype, *_dflash_inputs(batch, tokens, q_len))


# ----------------------------------------------------------------------------------------------------------
# 15c. A DFlash draft for GPT-OSS: z-lab's join of the projections (with bias, no K norm), rotated by GPT-OSS's
# own RoPE (`torch.chunk` halves against cos/sin of half the head size, cat of the two results).
# A GPT-OSS DFlash draft (GptOssDFlashAttention.forward, apply_rotary_pos_emb_dflash) over
# huggingface/transformers src/transformers/models/gpt_oss/modeling_gpt_oss.py (_apply_rotary_emb,
# GptOssRotaryEmbedding)


class GptOssDFlashContext(nn.Module):
    def __init__(self):
        super().__init__()
        config = modeling_gpt_oss.GptOssConfig(**_HF_SIZES, attention_bias=True)
        self.head_dim = config.head_dim
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM) for _ in range(N_LAYERS))
        self.rotary_emb = modeling_gpt_oss.GptOssRotaryEmbedding(config)

    def forward(self, hidden_states, target_hidden, position_ids):
        bsz, q_len = hidden_states.shape[:-1]
        kv_shape = (bsz, target_hidden.shape[1] + q_len, -1, self.head_dim)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        outs = []
        for i, (k_proj, v_proj) in enumerate(zip(self.k_proj, self.v_proj)):
            noise = hidden_states * (1.0 + 0.5 * i)
            k = torch.cat([k_proj(target_hidden), k_proj(noise)], dim=1).view(kv_shape).transpose(1, 2)
            v = torch.cat([v_proj(target_hidden), v_proj(noise)], dim=1).view(kv_shape).transpose(1, 2)
            outs += [modeling_gpt_oss._apply_rotary_emb(k, cos.unsqueeze(1), sin.unsqueeze(1)), v]
        return tuple(outs)


def build_gpt_oss_dflash(dtype, batch=BATCH, tokens=TOKENS, q_len=4):
    torch.manual_seed(0)
    return _finish(GptOssDFlashContext(), dtype, *_dflash_inputs(batch, tokens, q_len))


# ----------------------------------------------------------------------------------------------------------
# NEGATIVE cases: the HF Qwen3 spelling (case 1) where the LAST layer's math genuinely differs.


class DeviatingLastLayer(nn.Module):
    """HF Qwen3 context K/V; layer N_LAYERS - 1 deviates as `variant` says. B == T so that transposes of
    [B, T, ...] tensors keep their shape."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        config = _qwen3_config()
        self.layers = nn.ModuleList(modeling_qwen3.Qwen3Attention(config, i) for i in range(N_LAYERS))
        self.rotary_emb = modeling_qwen3.Qwen3RotaryEmbedding(config)
        self.other_rotary_emb = modeling_qwen3.Qwen3RotaryEmbedding(_qwen3_config(rope_theta=100.0))
        self.layer_norm = nn.LayerNorm(HEAD_DIM, eps=EPS)
        self.register_buffer("channel_perm", torch.randperm(HIDDEN, generator=torch.Generator().manual_seed(1)))
        _randomize_norm_weights(self)

    def _k_norm(self, attn, k, last):
        if last and self.variant == "layer_norm":
            return self.layer_norm(k)
        if last and self.variant == "eps_outside_rsqrt":
            x = k.to(torch.float32)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) + attn.k_norm.variance_epsilon
            return attn.k_norm.weight * x.to(k.dtype)
        if last and self.variant == "l2_norm":  # Dory's weightless K norm: a sum of squares, not a mean
            x = k.float()
            return (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + attn.k_norm.variance_epsilon)).type_as(k)
        return attn.k_norm(k)

    def forward(self, hidden_states, position_ids):
        input_shape = hidden_states.shape[:-1]
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        outs = []
        for i, attn in enumerate(self.layers):
            last = i == N_LAYERS - 1
            x, c, s = hidden_states, cos, sin
            if last and self.variant == "transposed_x":
                x = hidden_states.transpose(0, 1)
            if last and self.variant == "channel_shuffled_x":
                x = hidden_states[..., self.channel_perm]
            if last and self.variant == "cos_sin_transposed":
                c, s = cos.transpose(0, 1), sin.transpose(0, 1)
            if last and self.variant == "other_rope_theta":
                c, s = self.other_rotary_emb(hidden_states, position_ids)
            hidden_shape = (*input_shape, -1, attn.head_dim)
            key_states = self._k_norm(attn, attn.k_proj(x).view(hidden_shape), last).transpose(1, 2)
            value_states = attn.v_proj(x).view(hidden_shape).transpose(1, 2)
            if last and self.variant in ("k_multiplier", "k_unit_multiplier"):  # Falcon-H1: `k * key_multiplier`
                key_states = key_states * (0.5 if self.variant == "k_multiplier" else 1.0)
            _, key_states = modeling_qwen3.apply_rotary_pos_emb(key_states, key_states, c, s)
            outs += [key_states, value_states]
        return tuple(outs)


def build_deviating(dtype, variant):
    torch.manual_seed(0)
    square = TOKENS  # B == T
    position_ids = torch.stack([_positions(square, offset=o) for o in range(square)])  # rows differ
    return _finish(DeviatingLastLayer(variant), dtype, _hidden(tokens=square, batch=square), position_ids)


# ----------------------------------------------------------------------------------------------------------
# 18. A packed qkv cut by unflatten(-1, (3, hidden)).unsqueeze(0).transpose(0, -2).squeeze(-2), then one
# index per projection: Baichuan-2's W_pack (float32 HF rotate_half on [B, H, T, D], cos/sin cached as
# [1, 1, max_pos, D] and gathered by position_ids), and PyTorch's own `_in_projection_packed` (the
# nn.MultiheadAttention cut, `.contiguous()` and unpacked into q, k, v) with a RoPE after it.
# baichuan-inc/Baichuan2-7B-Base modeling_baichuan.py (Attention.forward, apply_rotary_pos_emb);
# pytorch/pytorch torch/nn/functional.py (_in_projection_packed)


class PackedQKVContext(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.style, self.width = style, KV_HEADS * HEAD_DIM  # MHA: q, k and v are equally wide
        self.W_pack = nn.ModuleList(nn.Linear(HIDDEN, 3 * self.width, bias=style == "torch_mha") for _ in range(N_LAYERS))

    def forward(self, x, cos_cached, sin_cached, position_ids):
        bsz, q_len, _ = x.shape
        outs = []
        for W_pack in self.W_pack:
            proj = W_pack(x).unflatten(-1, (3, self.width)).unsqueeze(0).transpose(0, -2).squeeze(-2)
            if self.style == "baichuan2":
                key_states, value_states = proj[1], proj[2]
            else:
                _, key_states, value_states = proj.contiguous()
            k = key_states.view(bsz, q_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = value_states.view(bsz, q_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
            cos = cos_cached.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
            sin = sin_cached.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
            if self.style == "baichuan2":
                k = ((k.float() * cos) + (modeling_qwen3.rotate_half(k.float()) * sin)).to(v.dtype)
            else:
                k = k * cos.to(k.dtype) + modeling_qwen3.rotate_half(k) * sin.to(k.dtype)
            outs += [k, v]
        return tuple(outs)


def build_packed_qkv(dtype, style):
    torch.manual_seed(0)
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), _inv_freq(HEAD_DIM))
    emb = torch.cat((freqs, freqs), dim=-1)
    module, (x,) = _finish(PackedQKVContext(style), dtype, _hidden())
    position_ids = _positions().unsqueeze(0).expand(BATCH, -1)
    return module, (x, emb.cos()[None, None], emb.sin()[None, None], position_ids)


# ----------------------------------------------------------------------------------------------------------
# 19. Qwen (v1): c_attn's qkv split, rotate_half through `rearrange(x, "... (j d) -> ... j d", j=2)` and
# unbind, float32 RoPE with the pass-through columns cast along and concatenated, [B, T, H, D] with cos/sin
# [1, T, 1, D]. QwenLM/Qwen modeling_qwen.py (QWenAttention.forward, _rotate_half, apply_rotary_pos_emb)


def _qwen_v1_rotate_half(x):
    x1, x2 = x.unflatten(-1, (2, x.shape[-1] // 2)).unbind(dim=-2)  # what the rearrange computes
    return torch.cat((-x2, x1), dim=-1)


class QwenV1Context(nn.Module):
    def __init__(self):
        super().__init__()
        self.split_size = KV_HEADS * HEAD_DIM
        self.c_attn = nn.ModuleList(nn.Linear(HIDDEN, 3 * self.split_size) for _ in range(N_LAYERS))

    def forward(self, x, cos, sin):
        bsz, q_len, _ = x.shape
        outs = []
        for c_attn in self.c_attn:
            _, key, value = c_attn(x).split(self.split_size, dim=2)
            key = key.view(bsz, q_len, KV_HEADS, HEAD_DIM)
            rot_dim = cos.shape[-1]
            t_, t_pass_ = key[..., :rot_dim].float(), key[..., rot_dim:].float()
            t_ = (t_ * cos) + (_qwen_v1_rotate_half(t_) * sin)
            outs += [torch.cat((t_, t_pass_), dim=-1).type_as(key), value.view(bsz, q_len, KV_HEADS, HEAD_DIM)]
        return tuple(outs)


def build_qwen_v1(dtype):
    torch.manual_seed(0)
    rotary_dim = HEAD_DIM // 2  # rotary_pct 0.5
    freqs = torch.outer(_positions().float(), _inv_freq(rotary_dim))
    emb = torch.cat((freqs, freqs), dim=-1).view(1, TOKENS, 1, rotary_dim)  # rearrange "n d -> 1 n 1 d"
    module, (x,) = _finish(QwenV1Context(), dtype, _hidden())
    return module, (x, emb.cos(), emb.sin())


# ----------------------------------------------------------------------------------------------------------
# 20. ChatGLM2/3: sequence-first [sq, b, heads, hn], a qkv split into multi-query groups, and a partial
# (hn / 2) GPT-J-pair RoPE from a [sq, b, rot / 2, 2] cache of stacked (cos, sin) gathered per batch row,
# through reshape / stack / flatten, the pass-through half concatenated after it.
# THUDM/ChatGLM3 modeling_chatglm.py (RotaryEmbedding.forward_impl, apply_rotary_pos_emb, SelfAttention)


def _chatglm_apply_rotary_pos_emb(x, rope_cache):
    sq, np = x.size(0), x.size(2)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rope_cache = rope_cache[:sq]
    xshaped = x.reshape(sq, -1, np, rot_dim // 2, 2)
    rope_cache = rope_cache.view(sq, -1, 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    return torch.cat((x_out2.flatten(3), x_pass), dim=-1)


class ChatGLMContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.sizes = [2 * KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]  # q heads, k and v groups
        self.query_key_value = nn.ModuleList(nn.Linear(HIDDEN, sum(self.sizes)) for _ in range(N_LAYERS))

    def forward(self, hidden_states, rotary_pos_emb):  # [sq, b, hidden], [sq, b, rot / 2, 2]
        outs = []
        for query_key_value in self.query_key_value:
            _, key_layer, value_layer = query_key_value(hidden_states).split(self.sizes, dim=-1)
            key_layer = key_layer.view(key_layer.size()[:-1] + (KV_HEADS, HEAD_DIM))
            value_layer = value_layer.view(value_layer.size()[:-1] + (KV_HEADS, HEAD_DIM))
            outs += [_chatglm_apply_rotary_pos_emb(key_layer, rotary_pos_emb), value_layer]
        return tuple(outs)


def build_chatglm(dtype):
    torch.manual_seed(0)
    rot = HEAD_DIM // 2
    idx_theta = torch.outer(torch.arange(MAX_POS, dtype=torch.float), _inv_freq(rot))
    cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
    cache = cache if dtype == torch.float32 else cache.to(dtype)  # the model casts its cache to half types
    rotary_pos_emb = cache[_positions().unsqueeze(0).expand(BATCH, -1)].transpose(0, 1).contiguous()
    module, (x,) = _finish(ChatGLMContext(), dtype, _hidden().transpose(0, 1).contiguous())
    return module, (x, rotary_pos_emb)


# ----------------------------------------------------------------------------------------------------------
# 21. InternLM2: wqkv laid out per KV group as (query heads of the group, k, v), viewed
# `b q (h gs d) -> b q h gs d` and cut with `[..., -2, :]` / `[..., -1, :]`; HF rotate_half on [B, H, T, D].
# InternLM/InternLM modeling_internlm2.py (InternLM2Attention.forward)


class InternLM2Context(nn.Module):
    def __init__(self):
        super().__init__()
        self.groups = 2  # query heads per KV head
        self.wqkv = nn.ModuleList(
            nn.Linear(HIDDEN, (self.groups + 2) * KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS)
        )

    def forward(self, x, cos, sin):
        bsz, q_len, _ = x.shape
        outs = []
        for wqkv in self.wqkv:
            qkv_states = wqkv(x).view(bsz, q_len, KV_HEADS, self.groups + 2, HEAD_DIM)  # the rearrange
            key_states = qkv_states[..., -2, :].transpose(1, 2)
            value_states = qkv_states[..., -1, :].transpose(1, 2)
            cos_, sin_ = cos.unsqueeze(1), sin.unsqueeze(1)
            outs += [(key_states * cos_) + (modeling_qwen3.rotate_half(key_states) * sin_), value_states]
        return tuple(outs)


def build_internlm2(dtype):
    torch.manual_seed(0)
    freqs = torch.outer(_positions().float(), _inv_freq(HEAD_DIM))
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(BATCH, -1, -1)
    return _finish(InternLM2Context(), dtype, _hidden(), emb.cos(), emb.sin())


# ----------------------------------------------------------------------------------------------------------
# 22. OpenELM: qkv viewed as [B, T, q + k + v heads, D], transposed, split along the heads; its RMSNorm
# `_norm(x.float()).type_as(x) * weight`, or as re-implementations write it with `x.float()` twice (one
# cast each time in the graph); a float32 RoPE (`k.float() * cos`) with cos/sin sliced from cached
# [1, 1, max_pos, D] tables. apple/OpenELM modeling_openelm.py (OpenELMRMSNorm, OpenELMRotaryEmbedding,
# OpenELMMultiHeadCausalAttention.forward)


class OpenELMRMSNorm(nn.Module):
    def __init__(self, dim: int, double_upcast: bool):
        super().__init__()
        self.weight, self.eps, self.double_upcast = nn.Parameter(torch.rand(dim) + 0.5), EPS, double_upcast

    def forward(self, x):
        if self.double_upcast:
            output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            h = x.float()
            output = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return output.type_as(x) * self.weight


class OpenELMContext(nn.Module):
    def __init__(self, double_upcast: bool):
        super().__init__()
        self.num_q_heads = 2 * KV_HEADS
        self.qkv_proj = nn.ModuleList(
            nn.Linear(HIDDEN, (self.num_q_heads + 2 * KV_HEADS) * HEAD_DIM, bias=False) for _ in range(N_LAYERS)
        )
        self.k_norm = nn.ModuleList(OpenELMRMSNorm(HEAD_DIM, double_upcast) for _ in range(N_LAYERS))

    def forward(self, hidden_states, cos_cached, sin_cached):
        bsz, seq_len, _ = hidden_states.shape
        outs = []
        for qkv_proj, k_norm in zip(self.qkv_proj, self.k_norm):
            qkv = qkv_proj(hidden_states).view(bsz, seq_len, self.num_q_heads + 2 * KV_HEADS, HEAD_DIM)
            _, keys, values = qkv.transpose(1, 2).split([self.num_q_heads, KV_HEADS, KV_HEADS], dim=1)
            keys = k_norm(keys)
            cos, sin = cos_cached[:, :, :seq_len, :], sin_cached[:, :, :seq_len, :]
            x1, x2 = keys.float().chunk(2, dim=-1)
            keys = ((keys.float() * cos) + (torch.cat((-x2, x1), dim=-1) * sin)).type_as(keys)
            outs += [keys, values]
        return tuple(outs)


def build_openelm(dtype, double_upcast):
    torch.manual_seed(0)
    freqs = torch.einsum("i,j->ij", torch.arange(MAX_POS, dtype=torch.float32), _inv_freq(HEAD_DIM))
    emb = torch.cat((freqs, freqs), dim=-1)
    return _finish(OpenELMContext(double_upcast), dtype, _hidden(), emb.cos()[None, None], emb.sin()[None, None])


# ----------------------------------------------------------------------------------------------------------
# 26. lmdeploy's PyTorch backend: a qkv projection unflattened into heads and cut into K and V views, an
# optional K RMSNorm, then the rotation with the rotated half built in `torch.empty_like` by two slice
# assignments (neox halves, or GPT-J pairs with step-2 slices and repeat_interleave'd cos/sin), applied in
# place by default (`k.mul_(cos); k.add_(rotate(k) * sin)`): without a norm, on a view of the qkv output.
# InternLM/lmdeploy lmdeploy/pytorch/backends/default/apply_rotary_emb.py (rotate_half,
# rotate_interleaved, DefaultApplyRotaryEmbImpl.forward)


def _rotated_by_slice_assignment(x, interleaved):
    out = torch.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
    else:
        half = x.shape[-1] // 2
        out[..., :half], out[..., half:] = -x[..., half:], x[..., :half]
    return out


class LmdeployContext(nn.Module):
    def __init__(self, k_norm: bool, interleaved: bool):
        super().__init__()
        self.interleaved, self.q_heads = interleaved, 2 * KV_HEADS
        width = (self.q_heads + 2 * KV_HEADS) * HEAD_DIM
        self.qkv_proj = nn.ModuleList(nn.Linear(HIDDEN, width, bias=False) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(modeling_qwen3.Qwen3RMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS)) if k_norm else None
        _randomize_norm_weights(self)

    def forward(self, hidden_states, cos, sin):  # cos, sin [B, T, HEAD_DIM] (neox halves)
        if self.interleaved:
            cos = cos[..., : HEAD_DIM // 2].repeat_interleave(2, dim=-1)
            sin = sin[..., : HEAD_DIM // 2].repeat_interleave(2, dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        outs = []
        for i, qkv_proj in enumerate(self.qkv_proj):
            qkv = qkv_proj(hidden_states).unflatten(-1, (-1, HEAD_DIM))
            key = qkv[..., self.q_heads : self.q_heads + KV_HEADS, :]
            value = qkv[..., self.q_heads + KV_HEADS :, :]
            if self.k_norm is not None:
                key = self.k_norm[i](key)
            key_sin = _rotated_by_slice_assignment(key, self.interleaved) * sin
            key.mul_(cos)
            key.add_(key_sin)
            outs += [key, value]
        return tuple(outs)


def build_lmdeploy(dtype, k_norm, interleaved):
    torch.manual_seed(0)
    cos, sin = _hf_cos_sin(_positions()[None].expand(BATCH, -1))
    return _finish(LmdeployContext(k_norm, interleaved), dtype, _hidden(), cos, sin)


# ----------------------------------------------------------------------------------------------------------
# 27. HunYuan dense: the q/k RMSNorm comes AFTER the RoPE (`key_layernorm(apply_rotary_pos_emb(...))`),
# with a weight per dim, so it is not the op's norm-then-rotate: the RoPE fuses alone and the norm stays
# as written, reading the op's output (in bfloat16 the norm's float32 upcast ends the rotation, not K).
# huggingface/transformers src/transformers/models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py
# (HunYuanDenseV1Attention.forward, HunYuanDenseV1RMSNorm)


class HunYuanNormAfterRopeContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        norms = [modeling_hunyuan_v1_dense.HunYuanDenseV1RMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS)]
        self.key_layernorm = nn.ModuleList(norms)
        _randomize_norm_weights(self)

    def forward(self, hidden_states, cos, sin):
        hidden_shape = (*hidden_states.shape[:-1], -1, HEAD_DIM)
        outs = []
        for k_proj, v_proj, key_layernorm in zip(self.k_proj, self.v_proj, self.key_layernorm):
            key_states = k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            value_states = v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            _, key_states = modeling_hunyuan_v1_dense.apply_rotary_pos_emb(key_states, key_states, cos, sin)
            outs += [key_layernorm(key_states), value_states]
        return tuple(outs)


def build_hunyuan_norm_after_rope(dtype):
    torch.manual_seed(0)
    cos, sin = _hf_cos_sin(_positions()[None].expand(BATCH, -1))
    return _finish(HunYuanNormAfterRopeContext(), dtype, _hidden(), cos, sin)


# ----------------------------------------------------------------------------------------------------------
# 28. The same math in two more spellings, no public source found: the RoPE's sum as one
# `torch.addcmul(k * cos, rotate_half(k), sin)`, and the RMSNorm's mean without keepdim, restored by
# `.unsqueeze(-1)`.


class AddcmulMeanUnsqueezeContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.k_norm_weight = nn.ParameterList(nn.Parameter(torch.randn(HEAD_DIM) * 0.2 + 1) for _ in range(N_LAYERS))

    def forward(self, x, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        outs = []
        for k_proj, v_proj, weight in zip(self.k_proj, self.v_proj, self.k_norm_weight):
            k = k_proj(x).unflatten(-1, (KV_HEADS, HEAD_DIM)).transpose(1, 2)
            h = k.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1).unsqueeze(-1) + EPS)
            k = weight * h.to(k.dtype)
            k = torch.addcmul(k * cos, modeling_qwen3.rotate_half(k), sin)
            outs += [k, v_proj(x).unflatten(-1, (KV_HEADS, HEAD_DIM)).transpose(1, 2)]
        return tuple(outs)


def build_addcmul_mean_unsqueeze(dtype):
    torch.manual_seed(0)
    cos, sin = _hf_cos_sin(_positions()[None].expand(BATCH, -1))
    return _finish(AddcmulMeanUnsqueezeContext(), dtype, _hidden(), cos, sin)


# ----------------------------------------------------------------------------------------------------------
# 29. torchtune: RoPE on [B, T, H, D] in float32 from a [max_pos, D/2, 2] (cos, sin) cache gathered at
# input_pos, pairs via reshape(..., -1, 2) and stack(...).flatten(3); the KV heads expanded to the query
# heads (view to [B, T, H_kv, 1, D], expand, reshape), transposed, and only then the K norm (torchtune's
# RMSNorm: float32 x * rsqrt(mean(x^2) + eps), type_as, * scale), so after the RoPE: the RoPE fuses alone.
# pytorch/torchtune torchtune/modules/attention.py (MultiHeadAttention.forward),
# torchtune/modules/position_embeddings.py (RotaryPositionalEmbeddings), torchtune/modules/rms_norm.py


class TorchtuneRMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.eps = EPS
        self.scale = nn.Parameter(torch.randn(dim) * 0.2 + 1)

    def forward(self, x):
        x_fp32 = x.float()
        return (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.scale


class TorchtuneContext(nn.Module):
    def __init__(self, num_heads: int = 2 * KV_HEADS):
        super().__init__()
        self.num_heads = num_heads
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(TorchtuneRMSNorm(HEAD_DIM) for _ in range(N_LAYERS))
        idx_theta = torch.einsum("i, j -> ij", torch.arange(MAX_POS).float(), _inv_freq(HEAD_DIM)).float()
        self.register_buffer("cache", torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1), persistent=False)

    def _rope(self, x, input_pos):
        rope_cache = self.cache[input_pos]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        return x_out.flatten(3).type_as(x)

    def forward(self, y, input_pos):
        b, s_y, _ = y.shape
        q_per_kv = self.num_heads // KV_HEADS
        outs = []
        for k_proj, v_proj, k_norm in zip(self.k_proj, self.v_proj, self.k_norm):
            k, v = k_proj(y), v_proj(y)
            k = self._rope(k.view(b, s_y, -1, HEAD_DIM), input_pos)
            k = k.view(b, s_y, KV_HEADS, 1, HEAD_DIM).expand(b, s_y, KV_HEADS, q_per_kv, HEAD_DIM)
            v = v.view(b, s_y, KV_HEADS, 1, HEAD_DIM).expand(b, s_y, KV_HEADS, q_per_kv, HEAD_DIM)
            k = k.reshape(b, s_y, -1, HEAD_DIM).transpose(1, 2)
            v = v.reshape(b, s_y, -1, HEAD_DIM).transpose(1, 2)
            outs += [k_norm(k), v]
        return tuple(outs)


def build_torchtune(dtype):
    torch.manual_seed(0)
    return _finish(TorchtuneContext(), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 30. Cohere: interleaved pairs with rotate_half as stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2),
# the tables' halves duplicated by repeat_interleave(freqs, 2, dim=-1), heads cut by unflatten, K rotated
# in float32 and cast back. No K norm (Cohere's optional one is a LayerNorm: `neg_layer_norm`).
# huggingface/transformers src/transformers/models/cohere/modeling_cohere.py (CohereRotaryEmbedding,
# rotate_half, apply_rotary_pos_emb)


def _cohere_rotate_half(x):
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


class CohereContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.register_buffer("inv_freq", _inv_freq(HEAD_DIM), persistent=False)

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
        cos, sin = emb.cos().to(x.dtype).unsqueeze(1), emb.sin().to(x.dtype).unsqueeze(1)
        outs = []
        for k_proj, v_proj in zip(self.k_proj, self.v_proj):
            k = k_proj(x).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
            v = v_proj(x).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
            k_float = k.float()
            outs += [((k_float * cos) + (_cohere_rotate_half(k_float) * sin)).to(k.dtype), v]
        return tuple(outs)


def build_cohere(dtype):
    torch.manual_seed(0)
    return _finish(CohereContext(), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 31. lucidrains' rotary-embedding-torch: angles einsum("..., f -> ... f", t, freqs), duplicated per pair
# (einops repeat '... n -> ... (n r)', r = 2, here repeat_interleave), rotate_half as reshape to pairs,
# unbind, stack((-x2, x1)) and reshape back (its einops rearranges, here reshapes), applied in float32 with
# an explicit `* scale` of 1.0 on both terms; the K norm before it is torch's nn.RMSNorm.
# lucidrains/rotary-embedding-torch rotary_embedding_torch/rotary_embedding_torch.py (rotate_half,
# apply_rotary_emb, RotaryEmbedding.forward)


def _lucidrains_rotate_half(x):
    x1, x2 = x.reshape(*x.shape[:-1], -1, 2).unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.reshape(*x.shape[:-2], -1)


class LucidrainsContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(nn.RMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS))
        self.register_buffer("freqs", _inv_freq(HEAD_DIM), persistent=False)
        _randomize_norm_weights(self)

    def forward(self, x, t):
        b, n, _ = x.shape
        freqs = torch.einsum("..., f -> ... f", t.type(self.freqs.dtype), self.freqs).repeat_interleave(2, dim=-1)
        scale = 1.0
        outs = []
        for k_proj, v_proj, k_norm in zip(self.k_proj, self.v_proj, self.k_norm):
            k = k_norm(k_proj(x).reshape(b, n, KV_HEADS, HEAD_DIM).permute(0, 2, 1, 3))
            v = v_proj(x).reshape(b, n, KV_HEADS, HEAD_DIM).permute(0, 2, 1, 3)
            dtype, k = k.dtype, k.float()
            k = (k * freqs.cos() * scale) + (_lucidrains_rotate_half(k) * freqs.sin() * scale)
            outs += [k.type(dtype), v]
        return tuple(outs)


def build_lucidrains(dtype):
    torch.manual_seed(0)
    return _finish(LucidrainsContext(), dtype, _hidden(), _positions())


# ----------------------------------------------------------------------------------------------------------
# 32. Megatron-LM's position interpolation: the positions multiplied by 1 / seq_len_interpolation_factor
# before the outer product with inv_freq (torch.outer), tables cat(freqs, freqs), neox rotation by chunk;
# its per-head K norm as torch's F.rms_norm.
# NVIDIA/Megatron-LM megatron/core/models/common/embeddings/rotary_pos_embedding.py (RotaryEmbedding with
# seq_len_interpolation_factor)


class InterpolatedPositionsContext(nn.Module):
    def __init__(self, seq_len_interpolation_factor: float = 4.0):
        super().__init__()
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.k_norm_weight = nn.ParameterList(nn.Parameter(torch.randn(HEAD_DIM) * 0.2 + 1) for _ in range(N_LAYERS))
        self.register_buffer("inv_freq", _inv_freq(HEAD_DIM), persistent=False)

    def forward(self, x, positions):
        b, s, _ = x.shape
        seq = positions.float() * (1 / self.seq_len_interpolation_factor)
        freqs = torch.outer(seq, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        outs = []
        for k_proj, v_proj, weight in zip(self.k_proj, self.v_proj, self.k_norm_weight):
            k = F.rms_norm(k_proj(x).view(b, s, KV_HEADS, HEAD_DIM), (HEAD_DIM,), weight, EPS).transpose(1, 2)
            k1, k2 = torch.chunk(k, 2, dim=-1)
            outs += [k * cos + torch.cat((-k2, k1), dim=-1) * sin, v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)]
        return tuple(outs)


def build_interpolated_positions(dtype):
    torch.manual_seed(0)
    return _finish(InterpolatedPositionsContext(), dtype, _hidden(), _positions())


# ----------------------------------------------------------------------------------------------------------
# 33. Adversarial, no public source: the same math where a look-alike would go wrong. "shifted": the last
# layer's tables come from positions + 1 (per-layer tables, one group); "tied": the last layer re-uses the
# first layer's k_proj and v_proj modules (one weight read by two members of the group).


class AdversarialContext(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(nn.RMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS))
        if variant == "tied":
            self.k_proj[-1], self.v_proj[-1] = self.k_proj[0], self.v_proj[0]
        self.register_buffer("inv_freq", _inv_freq(HEAD_DIM), persistent=False)
        _randomize_norm_weights(self)

    def forward(self, x, positions):
        b, s, _ = x.shape
        outs = []
        for i, (k_proj, v_proj, k_norm) in enumerate(zip(self.k_proj, self.v_proj, self.k_norm)):
            shifted = self.variant == "shifted" and i == N_LAYERS - 1
            freqs = torch.outer((positions + 1 if shifted else positions).float(), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            k = k_norm(k_proj(x).view(b, s, KV_HEADS, HEAD_DIM)).transpose(1, 2)
            k1, k2 = k.chunk(2, dim=-1)
            k = k * emb.cos().to(k.dtype) + torch.cat((-k2, k1), dim=-1) * emb.sin().to(k.dtype)
            outs += [k, v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)]
        return tuple(outs)


def build_adversarial(dtype, variant):
    torch.manual_seed(0)
    return _finish(AdversarialContext(variant), dtype, _hidden(), _positions())


# ----------------------------------------------------------------------------------------------------------
# 34. GPT-NeoX / Pythia: query_key_value laid out per head as [q | k | v] (`view(..., -1, 3 * head_size)`,
# transposed, `chunk(3, dim=-1)`), a bias, and a partial rotary (rotary_pct 0.25) whose pass-through dims
# are joined back by cat; Hugging Face's own apply_rotary_pos_emb.
# huggingface/transformers src/transformers/models/gpt_neox/modeling_gpt_neox.py (GPTNeoXAttention.forward,
# apply_rotary_pos_emb)


def _hf_tables(inv_freq, position_ids, dtype):
    """Hugging Face's rotary embedding forward: cat(freqs, freqs) over the rotary dims, [B, T, rotary_dim]."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class GPTNeoXContext(nn.Module):
    def __init__(self, rotary_pct: float = 0.25):
        super().__init__()
        self.query_key_value = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * 3 * HEAD_DIM) for _ in range(N_LAYERS))
        self.register_buffer("inv_freq", _inv_freq(int(HEAD_DIM * rotary_pct)), persistent=False)

    def forward(self, x, position_ids):
        cos, sin = _hf_tables(self.inv_freq, position_ids, x.dtype)
        outs = []
        for query_key_value in self.query_key_value:
            qkv = query_key_value(x).view(*x.shape[:-1], -1, 3 * HEAD_DIM).transpose(1, 2)
            _, key_states, value_states = qkv.chunk(3, dim=-1)
            _, key_states = modeling_gpt_neox.apply_rotary_pos_emb(key_states, key_states, cos, sin)
            outs += [key_states, value_states]
        return tuple(outs)


def build_gpt_neox(dtype):
    torch.manual_seed(0)
    return _finish(GPTNeoXContext(), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 35. Phi-3 / Phi-4-mini: qkv_proj cut by plain slices at query_pos and query_pos + kv_heads * head_dim,
# a partial rotary (partial_rotary_factor 0.75) through Hugging Face's apply_rotary_pos_emb.
# huggingface/transformers src/transformers/models/phi3/modeling_phi3.py (Phi3Attention.forward,
# apply_rotary_pos_emb)


class Phi3Context(nn.Module):
    def __init__(self, q_heads: int = 2 * KV_HEADS, partial_rotary_factor: float = 0.75):
        super().__init__()
        self.q_heads = q_heads
        width = (q_heads + 2 * KV_HEADS) * HEAD_DIM
        self.qkv_proj = nn.ModuleList(nn.Linear(HIDDEN, width, bias=False) for _ in range(N_LAYERS))
        self.register_buffer("inv_freq", _inv_freq(int(HEAD_DIM * partial_rotary_factor)), persistent=False)

    def forward(self, x, position_ids):
        cos, sin = _hf_tables(self.inv_freq, position_ids, x.dtype)
        hidden_shape = (*x.shape[:-1], -1, HEAD_DIM)
        query_pos = self.q_heads * HEAD_DIM
        outs = []
        for qkv_proj in self.qkv_proj:
            qkv = qkv_proj(x)
            key_states = qkv[..., query_pos : query_pos + KV_HEADS * HEAD_DIM].view(hidden_shape).transpose(1, 2)
            value_states = qkv[..., query_pos + KV_HEADS * HEAD_DIM :].view(hidden_shape).transpose(1, 2)
            _, key_states = modeling_phi3.apply_rotary_pos_emb(key_states, key_states, cos, sin)
            outs += [key_states, value_states]
        return tuple(outs)


def build_phi3(dtype):
    torch.manual_seed(0)
    return _finish(Phi3Context(), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 36. GLM-4 (Hugging Face's Glm): the first half of cos/sin repeat_interleave'd into GPT-J pairs over half
# the head (partial_rotary_factor 0.5), rotate_half as stack((-x[..., 1::2], x[..., 0::2])).flatten(-2),
# the other half passed through by cat; biased K and V projections.
# huggingface/transformers src/transformers/models/glm/modeling_glm.py (GlmAttention.forward,
# apply_rotary_pos_emb, rotate_half)


class GlmContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM) for _ in range(N_LAYERS))
        self.register_buffer("inv_freq", _inv_freq(HEAD_DIM // 2), persistent=False)

    def forward(self, x, position_ids):
        cos, sin = _hf_tables(self.inv_freq, position_ids, x.dtype)
        hidden_shape = (*x.shape[:-1], -1, HEAD_DIM)
        outs = []
        for k_proj, v_proj in zip(self.k_proj, self.v_proj):
            key_states = k_proj(x).view(hidden_shape).transpose(1, 2)
            _, key_states = modeling_glm.apply_rotary_pos_emb(key_states, key_states, cos, sin)
            outs += [key_states, v_proj(x).view(hidden_shape).transpose(1, 2)]
        return tuple(outs)


def build_glm(dtype):
    torch.manual_seed(0)
    return _finish(GlmContext(), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 37. Qwen2-VL's multimodal RoPE: positions [3, B, T] (temporal, height, width), tables over each, then
# `mrope_section * 2` cut of cos/sin whose i-th piece comes from table i % 3, joined by cat. The three
# position rows differ here, as for image tokens, so the tables are no function of one position.
# huggingface/transformers src/transformers/models/qwen2_vl/modeling_qwen2_vl.py (Qwen2VLRotaryEmbedding,
# apply_multimodal_rotary_pos_emb, 4.x); vllm-project/vllm vllm/model_executor/layers/rotary_embedding/mrope.py


class MultimodalRopeContext(nn.Module):
    def __init__(self, mrope_section=(4, 6, 6)):
        super().__init__()
        self.mrope_section = list(mrope_section)
        self.k_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM) for _ in range(N_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM) for _ in range(N_LAYERS))
        self.register_buffer("inv_freq", _inv_freq(HEAD_DIM), persistent=False)

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, None, :, None].float().expand(3, position_ids.shape[1], -1, 1)
        freqs = (inv_freq_expanded @ position_ids[:, :, None, :].float()).transpose(2, 3)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        sections = self.mrope_section * 2
        cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1).unsqueeze(1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1).unsqueeze(1)
        hidden_shape = (*x.shape[:-1], -1, HEAD_DIM)
        outs = []
        for k_proj, v_proj in zip(self.k_proj, self.v_proj):
            key_states = k_proj(x).view(hidden_shape).transpose(1, 2)
            key_states = (key_states * cos) + (modeling_qwen3.rotate_half(key_states) * sin)
            outs += [key_states, v_proj(x).view(hidden_shape).transpose(1, 2)]
        return tuple(outs)


def build_multimodal_rope(dtype):
    torch.manual_seed(0)
    rows = torch.stack([_positions(), _positions(offset=7), 2 * _positions(offset=1)])  # t, h, w differ
    return _finish(MultimodalRopeContext(), dtype, _hidden(), rows[:, None].expand(3, BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 38. Llama 4: RoPE by complex multiplication with freqs_cis = polar(1, freqs) (Hugging Face's
# apply_rotary_emb), then a weightless RMSNorm of K in float32 AFTER the RoPE (the RoPE fuses alone, the
# norm stays after the fused op). "nope": the last layer skips the RoPE (`no_rope_layers`) and must stay out
# of the group. Layers as `self.layers` so that the negative case can name the last one.
# huggingface/transformers src/transformers/models/llama4/modeling_llama4.py (Llama4TextAttention.forward,
# apply_rotary_emb, Llama4TextRotaryEmbedding, Llama4TextWeightlessRMSNorm / Llama4TextL2Norm)


class Llama4Layer(nn.Module):
    def __init__(self, use_rope: bool):
        super().__init__()
        self.use_rope = use_rope
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)

    def forward(self, x, freqs_cis):
        hidden_shape = (*x.shape[:-1], -1, HEAD_DIM)
        key_states, value_states = self.k_proj(x).view(hidden_shape), self.v_proj(x).view(hidden_shape)
        if self.use_rope:
            _, key_states = modeling_llama4.apply_rotary_emb(key_states, key_states, freqs_cis)
        k = key_states.float()
        key_states = (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + EPS)).type_as(key_states)
        return key_states.transpose(1, 2), value_states.transpose(1, 2)


class Llama4Context(nn.Module):
    def __init__(self, nope_last: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Llama4Layer(use_rope=not (nope_last and i == N_LAYERS - 1)) for i in range(N_LAYERS))
        self.register_buffer("inv_freq", _inv_freq(HEAD_DIM), persistent=False)

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
        return tuple(t for layer in self.layers for t in layer(x, freqs_cis))


def build_llama4(dtype, nope_last=False):
    torch.manual_seed(0)
    return _finish(Llama4Context(nope_last), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 39. DBRX's clip_qkv: the fused Wqkv output clamped in place (`qkv.clamp_(min=-clip, max=clip)`) before
# it is cut into q, k, v. K is then no linear function of x: no layer may be fused (the fused op has no
# clamp), and the compile must still give eager's results. Every layer deviates (`offending_layer=None`).
# huggingface/transformers src/transformers/models/dbrx/modeling_dbrx.py (DbrxAttention.forward)


class DbrxLayer(nn.Module):
    def __init__(self, clip_qkv: float):
        super().__init__()
        self.clip_qkv = clip_qkv
        self.Wqkv = nn.Linear(HIDDEN, (2 * KV_HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)

    def forward(self, x, cos, sin):
        qkv = self.Wqkv(x)
        qkv.clamp_(min=-self.clip_qkv, max=self.clip_qkv)
        width = KV_HEADS * HEAD_DIM
        _, key_states, value_states = qkv.split([2 * width, width, width], dim=2)
        hidden_shape = (*x.shape[:-1], -1, HEAD_DIM)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        _, key_states = modeling_qwen3.apply_rotary_pos_emb(key_states, key_states, cos, sin)
        return key_states, value_states.view(hidden_shape).transpose(1, 2)


class DbrxContext(nn.Module):
    def __init__(self, clip_qkv: float = 0.3):  # well inside the projections' spread, so the clamp shows
        super().__init__()
        self.layers = nn.ModuleList(DbrxLayer(clip_qkv) for _ in range(N_LAYERS))
        self.register_buffer("inv_freq", _inv_freq(HEAD_DIM), persistent=False)

    def forward(self, x, position_ids):
        cos, sin = _hf_tables(self.inv_freq, position_ids, x.dtype)
        return tuple(t for layer in self.layers for t in layer(x, cos, sin))


def build_dbrx(dtype):
    torch.manual_seed(0)
    return _finish(DbrxContext(), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# 40. OLMo's clip_qkv: each of q_proj, k_proj and v_proj clamped in place before the head view, with the
# real OlmoAttention modules. As DBRX's: no layer may be fused, and the report says K is clamped.
# huggingface/transformers src/transformers/models/olmo/modeling_olmo.py (OlmoAttention.forward)


class OlmoClipContext(nn.Module):
    def __init__(self, clip_qkv: float = 0.3):
        super().__init__()
        config = modeling_olmo.OlmoConfig(**_HF_SIZES, clip_qkv=clip_qkv)
        self.layers = nn.ModuleList(modeling_olmo.OlmoAttention(config, i) for i in range(N_LAYERS))
        self.rotary_emb = modeling_olmo.OlmoRotaryEmbedding(config)
        self.clip_qkv = clip_qkv

    def forward(self, hidden_states, position_ids):
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        hidden_shape = (*hidden_states.shape[:-1], -1, HEAD_DIM)
        outs = []
        for attn in self.layers:
            q, k, v = attn.q_proj(hidden_states), attn.k_proj(hidden_states), attn.v_proj(hidden_states)
            for states in (q, k, v):
                states.clamp_(min=-self.clip_qkv, max=self.clip_qkv)
            q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in (q, k, v))
            _, k = modeling_olmo.apply_rotary_pos_emb(q, k, cos, sin)
            outs += [k, v]
        return tuple(outs)


def build_olmo_clip(dtype):
    torch.manual_seed(0)
    return _finish(OlmoClipContext(), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 41. Projections written as einsum. Stanford CS336's assignment 1 (stanford-cs336/assignment1-basics, as its
# public solutions write it, cs336_basics/linear.py and rope.py) defines its own Linear: a [d_out, d_in]
# weight applied with einsum("... d_in, d_out d_in -> ... d_out"), and a RoPE over pairs of dims (2i, 2i+1)
# with cos/sin buffers [max_seq_len, d_k / 2] read at token_positions; no K norm. The second spelling keeps
# Qwen3's per-head K norm and rotate_half with einsum projections over a flattened batch ("td,nd->tn"). And
# weights stored [d_in, d_out], applied by einsum "...i,io->...o" or as x @ W.


class EinsumLinear(nn.Module):
    """weight [d_out, d_in] by einsum; hidden_first: [d_in, d_out], by einsum or by `x @ W` (matmul)."""

    def __init__(self, d_in: int, d_out: int, hidden_first: str = ""):
        super().__init__()
        self.hidden_first = hidden_first
        shape = (d_in, d_out) if hidden_first else (d_out, d_in)
        self.weight = nn.Parameter(torch.randn(shape) * d_in**-0.5)

    def forward(self, x):
        if self.hidden_first == "matmul":
            return x @ self.weight
        if self.hidden_first == "einsum":
            return torch.einsum("...i,io->...o", x, self.weight)
        return torch.einsum("...i,oi->...o", x, self.weight)


class PairRope(nn.Module):
    def __init__(self, d_k: int, max_seq_len: int = MAX_POS, theta: float = 10000.0):
        super().__init__()
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), _inv_freq(d_k, theta))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, token_positions):
        cos, sin = self.cos[token_positions], self.sin[token_positions]  # [..., seq, d_k / 2]
        if x.dim() == 4:  # [batch, heads, seq, d_k]: one angle per token, shared by the heads
            cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class EinsumContext(nn.Module):
    def __init__(self, k_norm: bool, hidden_first: str = ""):
        super().__init__()
        self.wk = nn.ModuleList(EinsumLinear(HIDDEN, KV_HEADS * HEAD_DIM, hidden_first) for _ in range(N_LAYERS))
        self.wv = nn.ModuleList(EinsumLinear(HIDDEN, KV_HEADS * HEAD_DIM, hidden_first) for _ in range(N_LAYERS))
        self.k_norm = nn.ModuleList(nn.RMSNorm(HEAD_DIM, eps=EPS) for _ in range(N_LAYERS)) if k_norm else None
        self.rope = PairRope(HEAD_DIM)
        _randomize_norm_weights(self)

    def forward(self, x, token_positions):
        if self.k_norm is None:  # CS336: [batch, seq, d_model] -> heads first, RoPE per head
            batch, seq = x.shape[:2]
            outs = []
            for wk, wv in zip(self.wk, self.wv):
                k = wk(x).view(batch, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
                outs += [self.rope(k, token_positions), wv(x).view(batch, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)]
            return tuple(outs)
        rows = x.flatten(0, 1)  # [tokens, d_model]
        cos, sin = (t.to(x.dtype) for t in _hf_cos_sin(token_positions.flatten()[None]))
        outs = []
        for wk, wv, k_norm in zip(self.wk, self.wv, self.k_norm):
            k = k_norm(torch.einsum("td,nd->tn", rows, wk.weight).view(rows.shape[0], KV_HEADS, HEAD_DIM))
            k = k * cos[0, :, None] + modeling_qwen3.rotate_half(k) * sin[0, :, None]
            outs += [k, torch.einsum("td,nd->tn", rows, wv.weight)]
        return tuple(outs)


def build_einsum(dtype, k_norm=False, hidden_first=""):
    torch.manual_seed(0)
    return _finish(EinsumContext(k_norm, hidden_first), dtype, _hidden(), _positions()[None].expand(BATCH, -1))


# ----------------------------------------------------------------------------------------------------------
# 42. Every layer's weights in one parameter stacked along a leading layer axis, [L, out, hidden] (as vLLM
# stores its MoE experts, [E, N, K], and reads one per expert as w[i] in its torch reference), each layer's
# linear over its entry w_k[i] (or w_k.unbind(0)[i]); the K norm weights likewise [L, head_dim].


class LayerStackedParameters(nn.Module):
    def __init__(self, unbind: bool = False):
        super().__init__()
        self.unbind = unbind  # each layer's entry by unbind(0)[i] rather than [i]
        width = KV_HEADS * HEAD_DIM
        self.w_k = nn.Parameter(torch.randn(N_LAYERS, width, HIDDEN) * HIDDEN**-0.5)
        self.w_v = nn.Parameter(torch.randn(N_LAYERS, width, HIDDEN) * HIDDEN**-0.5)
        self.k_norm_weight = nn.Parameter(torch.randn(N_LAYERS, HEAD_DIM) * 0.2 + 1.0)

    def forward(self, x, cos, sin):
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        stacks = (self.w_k, self.w_v, self.k_norm_weight)
        w_k, w_v, k_norm_weight = (t.unbind(0) for t in stacks) if self.unbind else stacks
        outs = []
        for i in range(N_LAYERS):
            k = F.linear(x, w_k[i]).unflatten(-1, (KV_HEADS, HEAD_DIM))
            k = F.rms_norm(k, (HEAD_DIM,), k_norm_weight[i], EPS)
            outs += [k * cos + modeling_qwen3.rotate_half(k) * sin, F.linear(x, w_v[i])]
        return tuple(outs)


def build_layer_stacked_parameters(dtype, unbind=False):
    torch.manual_seed(0)
    x = _hidden()
    cos, sin = _hf_cos_sin(_positions()[None].expand(BATCH, -1))
    return _finish(LayerStackedParameters(unbind), dtype, x, cos, sin)


# ----------------------------------------------------------------------------------------------------------
# The corpus

_p = functools.partial
_HF = "huggingface/transformers src/transformers/models/qwen3/modeling_qwen3.py"
_LMDEPLOY = "InternLM/lmdeploy lmdeploy/pytorch/backends/default/apply_rotary_emb.py"
_VLLM = (
    "vllm-project/vllm vllm/model_executor/models/qwen3.py, layers/layernorm.py, "
    "layers/rotary_embedding/base.py, layers/rotary_embedding/common.py"
)
_SGL = (
    "sgl-project/sglang python/sglang/srt/models/qwen3.py, layers/layernorm.py, layers/rotary_embedding.py, "
    "models/utils.py"
)
_SGL_DFLASH = "sgl-project/sglang python/sglang/srt/models/dflash.py (kv_proj_only, apply_k_norm, apply_k_rope)"
_SGL_STACKED = "sgl-project/sglang python/sglang/kernels/ops/speculative/fused_kv_materialize.py"
_MEGATRON = (
    "NVIDIA/Megatron-LM megatron/core/transformer/attention.py, "
    "megatron/core/models/common/embeddings/rope_utils.py"
)
_GEMMA3N = "huggingface/transformers src/transformers/models/gemma3n/modeling_gemma3n.py"
_FALCON = "huggingface/transformers src/transformers/models/falcon/modeling_falcon.py"
_VLLM_DFLASH = "vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py (precompute_and_store_context_kv)"
_HF_MODELS = "huggingface/transformers src/transformers/models/"

CASES: list[Case] = [
    Case("hf_qwen3", _HF, _p(build_hf_qwen3)),
    Case("hf_qwen3_bias", _HF + " (attention_bias=True)", _p(build_hf_qwen3, attention_bias=True)),
    Case(
        "hf_qwen3_per_layer_rotary",
        _HF + " (one Qwen3RotaryEmbedding per layer)",
        _p(build_hf_qwen3, per_layer_rotary=True),
    ),
    Case("megatron_chunk_partial", _MEGATRON, _p(build_megatron)),
    Case("megatron_interleaved_partial", _MEGATRON + " (rotary_interleaved)", _p(build_megatron, rotary_interleaved=True)),
    Case("pi0_torch_split", "huggingface/lerobot lerobot/common/policies/pi0/paligemma_with_expert.py", _p(build_pi0)),
    Case("vllm_qwen3_neox", _VLLM, _p(build_vllm)),
    Case("vllm_qwen3_gptj", _VLLM + " (is_neox_style=False)", _p(build_vllm, is_neox_style=False)),
    Case("vllm_qwen3_partial", _VLLM + " (rotary_dim < head_size)", _p(build_vllm, rotary_dim=HEAD_DIM // 2)),
    Case("vllm_dflash_precompute_stacked_norms", _VLLM_DFLASH + " (per-layer K norms joined by torch.stack)", _p(build_vllm_dflash_precompute)),
    Case(
        "vllm_dflash_precompute_norms_into_empty",
        _VLLM_DFLASH + " (each layer's K norm written into torch.empty_like(all_k)[i])",
        _p(build_vllm_dflash_precompute, norms_into_empty=True),
    ),
    Case(
        "vllm_dflash_precompute_one_norm_stacked_weights",
        _VLLM_DFLASH + " (one K norm over all layers, weights stacked [L, 1, 1, D])",
        _p(build_vllm_dflash_precompute, one_norm="stacked"),
    ),
    Case(
        "vllm_dflash_precompute_one_norm_shared_weight",
        _VLLM_DFLASH + " (one K norm over all layers, one weight [D] for every layer)",
        _p(build_vllm_dflash_precompute, one_norm="shared"),
    ),
    Case(
        "vllm_dflash_precompute_one_norm_no_weight",
        _VLLM_DFLASH + " (one K norm over all layers, F.rms_norm without a weight)",
        _p(build_vllm_dflash_precompute, one_norm="none"),
    ),
    Case(
        "vllm_dflash_precompute_chunked_kv",
        _VLLM_DFLASH + " (K and V as all_kv.chunk(2, 0), squeezed, then each layer's [i])",
        _p(build_vllm_dflash_precompute, chunked=True),
    ),
    Case(
        "vllm_dflash_precompute_unbind_expanded_positions",
        _VLLM_DFLASH + " (layers cut by unbind, positions repeated by expand + reshape)",
        _p(build_vllm_dflash_precompute, respelled=True),
    ),
    Case(
        "vllm_qwen2_bias_no_norm",
        "vllm-project/vllm vllm/model_executor/models/qwen2.py (qkv bias, no qk norm)",
        _p(build_vllm, qkv_bias=True, qk_norm=False),
    ),
    Case(
        "nano_vllm_qwen3",
        "GeeeekExplorer/nano-vllm nanovllm/models/qwen3.py, layers/layernorm.py, layers/rotary_embedding.py",
        _p(build_nano_vllm),
    ),
    Case("sglang_qwen3", _SGL, _p(build_sglang)),
    Case("sglang_dflash_kv_proj_only", _SGL_DFLASH, _p(build_sglang, dflash=True)),
    Case("sglang_dflash_kv_proj_only_bias", _SGL_DFLASH + " (bias)", _p(build_sglang, dflash=True, qkv_bias=True)),
    Case("gpt_fast_interleaved", "pytorch-labs/gpt-fast model.py", _p(build_gpt_fast)),
    Case(
        "llama_complex_freqs_cis",
        "meta-llama/llama llama/model.py; pytorch/torchtitan torchtitan/models/llama3/model/model.py",
        _p(build_llama_complex),
    ),
    Case("torchtitan_nn_rmsnorm", "pytorch/torchtitan torchtitan/models/qwen3/model/model.py", _p(build_torch_rmsnorm)),
    Case(
        "torch_f_rms_norm",
        "pytorch/pytorch torch/nn/modules/normalization.py (RMSNorm.forward -> F.rms_norm)",
        _p(build_torch_rmsnorm, functional=True),
    ),
    Case("modded_nanogpt", "KellerJordan/modded-nanogpt train_gpt.py", _p(build_modded_nanogpt)),
    Case(
        "modded_nanogpt_float32_rope",
        "KellerJordan/modded-nanogpt train_gpt.py, as torch 2.11 hands it to the pass on CUDA (no rounding "
        "between the weightless norm and the float32 RoPE)",
        _p(build_modded_nanogpt, float32_rope=True),
    ),
    Case(
        "fused_rms_norm_weightless",
        "pytorch/pytorch torch/_decomp/decompositions.py (_fused_rms_norm, F.rms_norm's CUDA path; transposed K)",
        _p(build_fused_rms_norm),
    ),
    Case("gemma3n_sqrt", _GEMMA3N + " (v4.53: x / torch.sqrt)", _p(build_gemma3n, spelling="sqrt")),
    Case("gemma3n_pow", _GEMMA3N + " (torch.pow(ms + eps, -0.5))", _p(build_gemma3n, spelling="pow")),
    Case(
        "reciprocal_sqrt",
        "no public source found: x * (1 / torch.sqrt(ms + eps)) in the Gemma3n layout",
        _p(build_gemma3n, spelling="reciprocal_sqrt"),
    ),
    Case(
        "gemma3_one_plus_weight",
        "huggingface/transformers src/transformers/models/gemma3/modeling_gemma3.py",
        _p(build_gemma3),
    ),
    Case("no_upcast_rmsnorm", "no canonical source: minimal-Llama RMSNorm without .float()", _p(build_no_upcast)),
    Case("sglang_stacked_kv", _SGL_STACKED, _p(build_sglang_stacked)),
    Case("stack_of_cats", _SGL_STACKED + " layout, per-layer torch.cat([k, v]) stacked", _p(build_sglang_stacked, stack_of_cats=True)),
    Case(
        "sglang_stacked_kv_unbind",
        _SGL_STACKED + " layout viewed [T, L, 2, H, D], K and V cut by unbind(2)",
        _p(build_sglang_stacked, unbind=True),
    ),
    Case(
        "sglang_stacked_kv_norm_weights_stacked_in_forward",
        _SGL_STACKED + " layout, the layers' K norm weights torch.stack'ed in the forward",
        _p(build_sglang_stacked, norm_weights_stacked_in_forward=True),
    ),
    Case(
        "sglang_stacked_kv_shared_norm_weight",
        _SGL_STACKED + " layout, one K norm weight for every layer",
        _p(build_sglang_stacked, shared_norm_weight=True),
    ),
    Case("litgpt_grouped_qkv_partial", "Lightning-AI/litgpt litgpt/model.py", _p(build_litgpt)),
    Case("litgpt_grouped_qkv_gqa", "Lightning-AI/litgpt litgpt/model.py (2 query heads per group)", _p(build_litgpt, n_head=2 * KV_HEADS)),
    # one layer rotating with other cos/sin values: the fused op reads one table per layer
    Case("own_cos_sin_transposed", f"{_HF} (last layer: cos/sin.transpose(0, 1), B == T)", _p(build_deviating, variant="cos_sin_transposed")),
    Case("own_rope_theta", f"{_HF} (last layer: rope_theta=100)", _p(build_deviating, variant="other_rope_theta")),
    Case(
        "falcon_h1_unit_key_multiplier",
        f"{_HF} (last layer: K * 1.0 before RoPE, as huggingface/transformers "
        "src/transformers/models/falcon_h1/modeling_falcon_h1.py scales K by key_multiplier, default 1)",
        _p(build_deviating, variant="k_unit_multiplier"),
    ),
    Case(
        "vllm_qwen3_negative_slices",
        _VLLM + " (q, k, v cut as qkv[..., -2 * kv : -kv] and the like)",
        _p(build_vllm, negative_slices=True),
    ),
    Case("falcon_multi_query_index_cut", _FALCON + " (multi_query: k = qkv[..., [-2], :])", _p(build_falcon, layout="multi_query")),
    Case("falcon_per_head_select", _FALCON + " (multi_query=False: k = qkv[..., 1, :])", _p(build_falcon, layout="per_head")),
    Case(
        "falcon_new_decoder_broadcast_k",
        _FALCON + " (new_decoder_architecture: K heads broadcast to the query heads before RoPE)",
        _p(build_falcon, layout="new_decoder"),
    ),
    Case("timm_eva_unbind", "huggingface/pytorch-image-models timm/models/eva.py (qkv ... permute(2, 0, 3, 1, 4).unbind(0))", _p(build_unbind, style="timm_eva")),
    Case(
        "flash_attn_unbind",
        "Dao-AILab/flash-attention flash_attn/modules/mha.py (qkv.unbind(dim=2)), flash_attn/layers/rotary.py",
        _p(build_unbind, style="flash_attn"),
    ),
    Case("zlab_dflash_ctx_noise_cat", "z-lab/dflash dflash/model.py (Qwen3DFlashAttention.forward)", _p(build_zlab_dflash)),
    Case(
        "zlab_dflash_per_layer_noise",
        "z-lab/dflash dflash/model.py (each layer's noise block its own: only the context rows fuse)",
        _p(build_zlab_dflash, per_layer_noise=True),
    ),
    Case(
        "specforge_dflash_normed_pieces_joined",
        "sgl-project/SpecForge specforge/modeling/draft/dflash.py (K normed per piece, joined before the RoPE)",
        _p(build_joined_dflash, joined_at="normed"),
    ),
    Case(
        "dflash_projection_of_joined_rows",
        "SGLang-style minimal Qwen3 DFlash draft (k_proj(cat([ctx, noise])), k_norm on k.reshape(-1, head_dim))",
        _p(build_joined_dflash, joined_at="inputs"),
    ),
    Case(
        "gpt_oss_dflash_chunk_rope_bias",
        "a GPT-OSS DFlash draft (z-lab's join, bias, no K norm) with " + _HF_MODELS + "gpt_oss/modeling_gpt_oss.py's RoPE",
        _p(build_gpt_oss_dflash),
    ),
    Case(
        "baichuan2_w_pack",
        "baichuan-inc/Baichuan2-7B-Base modeling_baichuan.py (W_pack cut by unflatten/transpose/squeeze, proj[1])",
        _p(build_packed_qkv, style="baichuan2"),
    ),
    Case(
        "torch_mha_in_projection_packed",
        "pytorch/pytorch torch/nn/functional.py (_in_projection_packed's cut, .contiguous(), unpacked)",
        _p(build_packed_qkv, style="torch_mha"),
    ),
    Case("qwen_v1_unbind_rotate_half", "QwenLM/Qwen modeling_qwen.py (c_attn split, rearrange + unbind rotate_half)", _p(build_qwen_v1)),
    Case("chatglm_sequence_first_pairs", "THUDM/ChatGLM3 modeling_chatglm.py (apply_rotary_pos_emb, SelfAttention)", _p(build_chatglm)),
    Case("internlm2_grouped_wqkv", "InternLM/InternLM modeling_internlm2.py (InternLM2Attention.forward)", _p(build_internlm2)),
    Case("openelm_heads_split", "apple/OpenELM modeling_openelm.py (qkv split along heads, float32 RoPE)", _p(build_openelm, double_upcast=False)),
    Case(
        "lmdeploy_slice_assigned_rotate_half_in_place",
        _LMDEPLOY + " (K RMSNorm, rotate_half by slice assignment, in place)",
        _p(build_lmdeploy, k_norm=True, interleaved=False),
    ),
    Case(
        "lmdeploy_interleaved_in_place_on_qkv_view",
        _LMDEPLOY + " (no K norm: rotate_interleaved, in place on a view of the qkv output)",
        _p(build_lmdeploy, k_norm=False, interleaved=True),
    ),
    Case(
        "hunyuan_norm_after_rope",
        "huggingface/transformers src/transformers/models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py "
        "(key_layernorm after the RoPE: the RoPE fuses alone)",
        _p(build_hunyuan_norm_after_rope),
    ),
    Case(
        "addcmul_rope_mean_unsqueeze_norm",
        "no public source found: torch.addcmul for the RoPE's sum, mean(-1).unsqueeze(-1) in the RMSNorm",
        _p(build_addcmul_mean_unsqueeze),
    ),
    Case(
        "openelm_double_upcast_norm",
        "apple/OpenELM modeling_openelm.py, its RMSNorm re-implemented with x.float() twice",
        _p(build_openelm, double_upcast=True),
    ),
    Case(
        "torchtune_gqa_norm_after_rope",
        "pytorch/torchtune torchtune/modules/attention.py, position_embeddings.py, rms_norm.py "
        "(KV heads expanded, K norm after the RoPE: the RoPE fuses alone)",
        _p(build_torchtune),
    ),
    Case("cohere_interleaved_repeat_interleave", "huggingface/transformers src/transformers/models/cohere/modeling_cohere.py", _p(build_cohere)),
    Case(
        "lucidrains_rotary_embedding_torch",
        "lucidrains/rotary-embedding-torch rotary_embedding_torch/rotary_embedding_torch.py (einops as reshapes)",
        _p(build_lucidrains),
    ),
    Case(
        "megatron_position_interpolation",
        "NVIDIA/Megatron-LM megatron/core/models/common/embeddings/rotary_pos_embedding.py (seq_len_interpolation_factor)",
        _p(build_interpolated_positions),
    ),
    Case("adversarial_last_layer_shifted_positions", "no public source: adversarial", _p(build_adversarial, variant="shifted")),
    Case("adversarial_tied_projections", "no public source: adversarial", _p(build_adversarial, variant="tied")),
    Case("gpt_neox_per_head_qkv_chunk_partial", _HF_MODELS + "gpt_neox/modeling_gpt_neox.py", _p(build_gpt_neox)),
    Case("phi3_sliced_qkv_partial", _HF_MODELS + "phi3/modeling_phi3.py", _p(build_phi3)),
    Case("glm_partial_interleaved_repeat_interleave", _HF_MODELS + "glm/modeling_glm.py", _p(build_glm)),
    Case(
        "qwen2_vl_multimodal_rope_sections",
        _HF_MODELS + "qwen2_vl/modeling_qwen2_vl.py (apply_multimodal_rotary_pos_emb, 4.x)",
        _p(build_multimodal_rope),
    ),
    Case(
        "cs336_einsum_linear_pair_rope",
        "stanford-cs336/assignment1-basics cs336_basics/linear.py, rope.py (einsum Linear, RoPE on pairs)",
        _p(build_einsum),
    ),
    Case("einsum_projections_qwen3_k_norm", _HF + " math, projections as torch.einsum over flattened tokens", _p(build_einsum, k_norm=True)),
    Case(
        "einsum_hidden_first_weights",
        "no public source found: the CS336 layers with each weight stored [d_in, d_out], applied by einsum '...i,io->...o'",
        _p(build_einsum, hidden_first="einsum"),
    ),
    Case(
        "matmul_hidden_first_weights",
        "no public source found: the CS336 layers with each weight stored [d_in, d_out], applied as x @ W",
        _p(build_einsum, hidden_first="matmul"),
    ),
    Case(
        "layer_stacked_parameters",
        "vllm-project/vllm's stacked-expert layout ([E, N, K] parameters, w[i] per expert in its torch "
        "reference), one entry per layer",
        _p(build_layer_stacked_parameters),
    ),
    Case("layer_stacked_parameters_unbind", "the same, each entry taken by unbind(0)[i]", _p(build_layer_stacked_parameters, unbind=True)),
    Case(
        "llama4_complex_rope_weightless_norm_after",
        _HF_MODELS + "llama4/modeling_llama4.py (the K norm after the RoPE: the RoPE fuses alone)",
        _p(build_llama4),
    ),
]


def _negative(name: str, variant: str, what: str, expect: str, reason: Optional[str] = None) -> Case:
    return Case(
        name,
        f"{_HF} (last layer: {what})",
        _p(build_deviating, variant=variant),
        expect=expect,
        offending_layer=N_LAYERS - 1,
        reason=reason,
    )


NEGATIVE_CASES: list[Case] = [
    _negative("neg_layer_norm", "layer_norm", "nn.LayerNorm", "LayerNorm subtracts the mean", "subtracts the mean"),
    _negative("neg_l2_norm", "l2_norm", "x * rsqrt(sum(x^2) + eps), Dory's K norm", "an L2 norm", "an L2 norm, not an RMSNorm"),
    _negative("neg_eps_outside_rsqrt", "eps_outside_rsqrt", "x * rsqrt(ms) + eps", "eps outside the rsqrt", "eps sits elsewhere"),
    _negative("neg_transposed_x", "transposed_x", "reads x.transpose(0, 1), B == T", "reads a different input"),
    _negative("neg_channel_shuffled_x", "channel_shuffled_x", "reads x[..., perm]", "reads a different input"),
    _negative("neg_k_multiplier", "k_multiplier", "K * 0.5 before RoPE, Falcon-H1's key_multiplier", "K scaled before its RoPE",
              r"multiplied by a constant \(0\.5\) before its RoPE"),
    Case("llama4_no_rope_last_layer", _HF_MODELS + "llama4/modeling_llama4.py (last layer: no_rope_layers)",
         _p(build_llama4, nope_last=True), expect="the last layer has no RoPE", offending_layer=N_LAYERS - 1),
    Case("dbrx_clip_qkv", _HF_MODELS + "dbrx/modeling_dbrx.py (Wqkv clamped before the cut)", _p(build_dbrx),
         expect="K is clamped: no linear function of x", reason=r"K is clamped \(clip_qkv\) between its projection and its RoPE"),
    Case("olmo_clip_qkv", _HF_MODELS + "olmo/modeling_olmo.py (q, k and v clamped in place)", _p(build_olmo_clip),
         expect="K is clamped: no linear function of x", reason=r"K is clamped \(clip_qkv\) between its projection and its RoPE"),
]

# The supported math in spellings the pass does not fuse yet, and the reason it reports (a regex). They
# must still compile to eager's results, and never without a reason. README "Not fused yet" lists them.
NOT_YET: dict[str, str] = {
}
ALL_CASES: list[Case] = CASES + NEGATIVE_CASES
