"""DFlash-style draft context-K/V modules, built from Hugging Face transformers' own modules.

A speculative-decoding draft (DFlash style) has several small attention layers whose *context* K/V all come
from the same hidden states `x`. Materializing that context K/V is, per layer::

    k = k_proj(x).view(B, T, H, D)      # [B, T, H, D]
    k = k_norm(k)                       # per-head RMSNorm (Qwen3; Llama has none)
    k = k.transpose(1, 2)               # [B, H, T, D]
    k = apply_rotary_pos_emb(k, cos, sin)
    v = v_proj(x).view(B, T, H, D).transpose(1, 2)

`ContextKV` is that computation written plainly, one layer after another, with the modules' own
`k_proj`/`v_proj`/`k_norm` and the modeling file's own `apply_rotary_pos_emb`: it is what the fx_fusion pass
sees and rewrites. `HandFusedContextKV` is what a user would write by hand without the pass (SGLang's
algorithm): the K/V weights of all layers stacked once into one weight, one GEMM, and one fused
norm + RoPE op (`torch.ops.fx_fusion.materialize_kv`).

Nothing is downloaded: the factories build the HF modules from small or realistic random configs and
initialise their weights randomly (deterministically, from `seed`).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ContextKV",
    "HandFusedContextKV",
    "PRESETS",
    "WORKLOADS",
    "build_workload",
    "example_inputs",
    "llama_context_kv",
    "qwen3_context_kv",
]

# Model shapes. "realistic" is Qwen3-8B / Llama3-8B-like (the same attention shapes; Llama has no K norm).
PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096),
    "realistic": dict(
        hidden_size=4096, num_attention_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960
    ),
}

# Named workloads: (factory, preset, n_layers, extra factory kwargs).
WORKLOADS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "qwen3-8b-dflash": ("qwen3", "realistic", 5, dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    "llama3-8b-ctx": ("llama", "realistic", 5, dict(rope_theta=500_000.0)),
    "qwen3-1layer": ("qwen3", "realistic", 1, dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    "qwen3-small": ("qwen3", "small", 3, dict()),
    "llama-small": ("llama", "small", 3, dict()),
}


class ContextKV(nn.Module):
    """Context K/V of several draft attention layers that all read the same hidden states.

    layers: HF attention modules (`Qwen3Attention`, `LlamaAttention`, ...) with `k_proj`, `v_proj`,
        `head_dim` and optionally `k_norm`; only those are used (q_proj/o_proj are carried along unused).
    rotary_emb: the model's rotary embedding module (`Qwen3RotaryEmbedding(config)`, ...), shared by all.

    forward(hidden_states [B, T, hidden], position_ids [B, T]) -> (k_0, v_0, k_1, v_1, ...), each
    [B, H_kv, T, D]; k is post-norm (if the layer has k_norm) and post-RoPE.
    """

    def __init__(self, layers: list[nn.Module] | nn.ModuleList, rotary_emb: nn.Module) -> None:
        super().__init__()
        if len(layers) == 0:
            raise ValueError("ContextKV needs at least one attention layer")
        self.layers = layers if isinstance(layers, nn.ModuleList) else nn.ModuleList(layers)
        self.rotary_emb = rotary_emb
        # The modeling file's own RoPE function (e.g. transformers.models.qwen3.modeling_qwen3).
        modeling = importlib.import_module(type(self.layers[0]).__module__)
        self.apply_rotary_pos_emb = modeling.apply_rotary_pos_emb

    # Shape helpers (read off the modules; all layers must agree).
    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def head_dim(self) -> int:
        return int(self.layers[0].head_dim)

    @property
    def num_kv_heads(self) -> int:
        return int(self.layers[0].k_proj.out_features) // self.head_dim

    @property
    def hidden_size(self) -> int:
        return int(self.layers[0].k_proj.in_features)

    @property
    def has_k_norm(self) -> bool:
        return getattr(self.layers[0], "k_norm", None) is not None

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        input_shape = hidden_states.shape[:-1]
        outputs = []
        for layer in self.layers:
            hidden_shape = (*input_shape, -1, layer.head_dim)
            key_states = layer.k_proj(hidden_states).view(hidden_shape)
            if getattr(layer, "k_norm", None) is not None:
                key_states = layer.k_norm(key_states)
            key_states = key_states.transpose(1, 2)
            value_states = layer.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            # k passed as both q and k: the q output is the same computation, unused (dead code).
            _, key_states = self.apply_rotary_pos_emb(key_states, key_states, cos, sin)
            outputs.append(key_states)
            outputs.append(value_states)
        return tuple(outputs)


# ----------------------------------------------------------------------------------------------------------
# Factories


def qwen3_style_config(
    config_class, shape: dict, n_layers: int, intermediate_size: int, rms_norm_eps: float, rope_theta: float,
    attention_bias: bool = False,
):  # fmt: skip
    """A Hugging Face config (`config_class`: Qwen3Config, LlamaConfig) of `shape` (a PRESETS entry)."""
    return config_class(
        hidden_size=shape["hidden_size"],
        intermediate_size=intermediate_size,
        num_hidden_layers=n_layers,
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_position_embeddings"],
        rms_norm_eps=rms_norm_eps,
        attention_bias=attention_bias,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        vocab_size=128,
    )


def _init_weights_(module: nn.Module, seed: int, device: torch.device, dtype: torch.dtype) -> None:
    """Random, non-trivial, deterministic init of every parameter (generated in fp32, then cast)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            values = torch.empty(param.shape, dtype=torch.float32, device=device)
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:  # RMSNorm weights ~ 1 + 0.1 * randn
                values.normal_(0.0, 1.0, generator=gen).mul_(0.1).add_(1.0)
            elif leaf == "bias":
                values.normal_(0.0, 0.1, generator=gen)
            else:  # Linear weights: unit-variance outputs for unit-variance inputs
                values.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
            param.copy_(values.to(dtype))


def _build(
    family: str,
    n_layers: int,
    *,
    preset: str | None,
    hidden_size: int | None,
    num_kv_heads: int | None,
    head_dim: int | None,
    num_attention_heads: int | None,
    max_position_embeddings: int | None,
    rope_theta: float,
    rms_norm_eps: float,
    dtype: torch.dtype,
    device: torch.device | str,
    attention_bias: bool,
    seed: int,
) -> ContextKV:
    if family == "qwen3":
        from transformers import Qwen3Config as Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as Attention
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rotary
    elif family == "llama":
        from transformers import LlamaConfig as Config
        from transformers.models.llama.modeling_llama import LlamaAttention as Attention
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
    else:
        raise ValueError(f"unknown family {family!r}")

    shape = dict(PRESETS[preset or "small"])
    for key, value in (
        ("hidden_size", hidden_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("num_attention_heads", num_attention_heads),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if value is not None:
            shape[key] = value
    if num_attention_heads is None and shape["num_attention_heads"] % shape["num_kv_heads"]:
        shape["num_attention_heads"] = shape["num_kv_heads"]
    if shape["num_attention_heads"] % shape["num_kv_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_kv_heads")

    config = qwen3_style_config(
        Config, shape, n_layers, intermediate_size=4 * shape["hidden_size"], rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta, attention_bias=attention_bias,
    )  # fmt: skip
    device = torch.device(device)
    # Build on the meta device (no wasted CPU init of realistic weights), then allocate on `device`.
    with torch.device("meta"):
        layers = nn.ModuleList([Attention(config, layer_idx=i) for i in range(n_layers)])
    layers = layers.to_empty(device=device).to(dtype)
    _init_weights_(layers, seed, device, dtype)
    # The rotary embedding computes inv_freq at init: build it for real; keep its buffers fp32, as HF does.
    rotary = Rotary(config).to(device)
    return ContextKV(layers, rotary).eval()


def qwen3_context_kv(
    n_layers: int = 5,
    hidden_size: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    num_attention_heads: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_bias: bool = False,
    seed: int = 0,
    *,
    preset: str | None = "small",
    max_position_embeddings: int | None = None,
    rope_theta: float = 1_000_000.0,
    rms_norm_eps: float = 1e-6,
) -> ContextKV:
    """ContextKV over `n_layers` `Qwen3Attention` layers (per-head K RMSNorm) + `Qwen3RotaryEmbedding`.

    Shapes come from `PRESETS[preset]` ("small" or "realistic"), overridden by any size given explicitly.
    The same arguments give the same weights (on the same device).
    """
    return _build(
        "qwen3",
        n_layers,
        preset=preset,
        hidden_size=hidden_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_attention_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
        dtype=dtype,
        device=device,
        attention_bias=attention_bias,
        seed=seed,
    )


def llama_context_kv(
    n_layers: int = 5,
    hidden_size: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    num_attention_heads: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_bias: bool = False,
    seed: int = 0,
    *,
    preset: str | None = "small",
    max_position_embeddings: int | None = None,
    rope_theta: float = 500_000.0,
) -> ContextKV:
    """ContextKV over `n_layers` `LlamaAttention` layers (no K norm) + `LlamaRotaryEmbedding`."""
    return _build(
        "llama",
        n_layers,
        preset=preset,
        hidden_size=hidden_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_attention_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=1e-6,
        dtype=dtype,
        device=device,
        attention_bias=attention_bias,
        seed=seed,
    )


def build_workload(
    name: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", seed: int = 0
) -> ContextKV:
    """A named workload from `WORKLOADS` ("qwen3-8b-dflash", "llama3-8b-ctx", "qwen3-1layer", ...)."""
    try:
        family, preset, n_layers, extra = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}") from None
    factory = qwen3_context_kv if family == "qwen3" else llama_context_kv
    return factory(n_layers, dtype=dtype, device=device, seed=seed, preset=preset, **extra)


def example_inputs(
    module: ContextKV,
    batch: int = 1,
    seq_len: int = 16,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_states [batch, seq_len, hidden], position_ids [batch, seq_len] int64) for `module`.

    hidden_states ~ randn; each row's positions are consecutive from a random, non-zero offset (distinct
    rows get distinct offsets), staying below the model's max_position_embeddings where it allows.
    """
    param = module.layers[0].k_proj.weight
    device = torch.device(device) if device is not None else param.device
    dtype = dtype if dtype is not None else param.dtype
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    hidden = torch.randn(batch, seq_len, module.hidden_size, generator=gen, dtype=torch.float32)
    max_pos = int(getattr(module.rotary_emb, "max_seq_len_cached", 0) or 0)
    span = max(max_pos - seq_len, 0)
    high = max(span, 2 * seq_len + 8)
    offsets = torch.randint(1, high, (batch, 1), generator=gen)
    positions = offsets + torch.arange(seq_len).unsqueeze(0)
    return hidden.to(device=device, dtype=dtype), positions.to(device)


# ----------------------------------------------------------------------------------------------------------
# Hand-fused path (what a user writes without the pass)


class HandFusedContextKV(nn.Module):
    """The same outputs as `ContextKV`, computed the hand-fused way (SGLang's algorithm).

    At init the K/V weights of all layers are stacked ONCE (copied) into one `[L * 2 * kv, hidden]` weight,
    rows `[k_0; v_0; k_1; v_1; ...]` (and the biases likewise), and the K-norm weights into `[L, D]`.
    forward does one GEMM, views the result as `[B*T, L, 2*kv]` and calls the project's fused op:

    - rope="per_token" (default): cos/sin per token from the module's own rotary embedding (HF layout,
      exactly the values `ContextKV` uses);
    - rope="cache": SGLang's form, a `[max_pos, D]` cos|sin cache (cos half, then sin half) built once at
      init in fp32 from the same rotary embedding, indexed by the positions inside the op (close to, not
      bit-equal with, the HF path in bf16, whose cos/sin are rounded to bf16).

    Both call `torch.ops.fx_fusion.materialize_kv` (K and V halves of the GEMM output as strided views).
    Returns the same tuple layout as `ContextKV`: (k_0, v_0, ...), each [B, H, T, D] (views of the op's
    [L, B*T, H, D] outputs).

    Later changes to the source module's weights are not seen (the stack is a copy).
    """

    def __init__(self, source: ContextKV, rope: str = "per_token") -> None:
        super().__init__()
        if rope not in ("per_token", "cache"):
            raise ValueError(f"rope must be 'per_token' or 'cache', got {rope!r}")
        import fx_fusion.kernels.ops  # noqa: F401  (registers torch.ops.fx_fusion.materialize_kv)

        self.rope = rope
        self.n_layers = source.n_layers
        self.num_kv_heads = source.num_kv_heads
        self.head_dim = source.head_dim
        self.hidden_size = source.hidden_size
        self.rotary_emb = source.rotary_emb
        layers = source.layers
        with torch.no_grad():
            weight = torch.cat([torch.cat([l.k_proj.weight, l.v_proj.weight], 0) for l in layers], 0)
            self.register_buffer("kv_weight", weight.contiguous())
            if layers[0].k_proj.bias is not None:
                bias = torch.cat([torch.cat([l.k_proj.bias, l.v_proj.bias], 0) for l in layers], 0)
                self.register_buffer("kv_bias", bias.contiguous())
            else:
                self.kv_bias = None
            if source.has_k_norm:
                self.register_buffer("k_norm_weight", torch.stack([l.k_norm.weight for l in layers], 0))
                eps = [float(l.k_norm.variance_epsilon) for l in layers]
                self.register_buffer("k_norm_eps", torch.tensor(eps, dtype=torch.float32, device=weight.device))
                self.eps_value = eps[0]
                self.uniform_eps = all(e == eps[0] for e in eps)
            else:
                self.k_norm_weight = None
                self.k_norm_eps = None
                self.eps_value = 1e-6
                self.uniform_eps = True
            if rope == "cache":
                max_pos = int(getattr(self.rotary_emb, "max_seq_len_cached"))
                positions = torch.arange(max_pos, device=weight.device).unsqueeze(0)
                probe = torch.empty(0, device=weight.device, dtype=torch.float32)
                cos, sin = self.rotary_emb(probe, positions)  # [1, max_pos, D] fp32, HF layout
                half = self.head_dim // 2
                cache = torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).contiguous()
                self.register_buffer("cos_sin_cache", cache)  # [max_pos, D]: cos half | sin half

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, T, hidden = hidden_states.shape
        L, H, D = self.n_layers, self.num_kv_heads, self.head_dim
        kv_size = H * D
        x = hidden_states.reshape(B * T, hidden)
        kv = F.linear(x, self.kv_weight, self.kv_bias).view(B * T, L, 2 * kv_size)  # one GEMM
        if self.rope == "per_token":
            cos, sin = self.rotary_emb(hidden_states, position_ids)  # [B, T, D] each, in x's dtype
            cos, sin, positions = cos.reshape(B * T, D), sin.reshape(B * T, D), None
        else:
            cos, sin, positions = self.cos_sin_cache, None, position_ids.reshape(B * T)
        norm_w = [] if self.k_norm_weight is None else [self.k_norm_weight]
        eps = None if self.uniform_eps else self.k_norm_eps
        k, v = torch.ops.fx_fusion.materialize_kv(
            kv[..., :kv_size],  # K part, a strided view of the stacked projection
            norm_w,
            eps,
            self.eps_value,
            cos,
            sin,
            positions,
            H,
            D,
            D,
            False,  # neox rotary
            0.0,  # norm weight offset
            False,  # Hugging Face rounding: normalise, round, then the weight
            True,  # round the normalised K before RoPE
            kv[..., kv_size:],  # V part
        )  # k, v: [L, B*T, H, D]
        outputs = []
        for i in range(L):
            outputs.append(k[i].view(B, T, H, D).transpose(1, 2))
            outputs.append(v[i].view(B, T, H, D).transpose(1, 2))
        return tuple(outputs)
