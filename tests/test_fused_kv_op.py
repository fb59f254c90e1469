"""Tests of the stacked K/V materialization ops (`fx_fusion::materialize_k/_kv/_kv_out`) and the drop-in
`fused_norm_rope_stacked`.

Every numeric case runs on each backend: the PyTorch implementation (CPU), the Triton kernel through the
interpreter (CPU, TRITON_INTERPRET=1 read at call time) and the compiled Triton kernel (CUDA, skipped
without a GPU). Results are compared with an independent float64 reference written here from the spec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fx_fusion.kernels.fused_kv_materialize import norm_weight_pointers
from fx_fusion.kernels.ops import fused_norm_rope_stacked
from fx_fusion.strided_outputs import is_token_major

OPS = torch.ops.fx_fusion
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BACKENDS = [
    pytest.param("torch", id="cpu-torch"),
    pytest.param("interpret", id="cpu-triton-interpret"),
    pytest.param("cuda", id="cuda", marks=[CUDA, pytest.mark.gpu]),
]


@pytest.fixture(params=BACKENDS)
def device(request, monkeypatch) -> str:
    """The device to build inputs on; selects the CPU backend through TRITON_INTERPRET."""
    if request.param == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return "cuda" if request.param == "cuda" else "cpu"


# --------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    total_ctx: int = 7
    n_layers: int = 3
    num_kv_heads: int = 2
    head_dim: int = 64
    rotary_dim: int | None = None  # None: head_dim
    dtype: torch.dtype = torch.bfloat16
    norm: str | None = "stacked"  # "stacked" [L, D], "per_layer" L x [D], None
    eps_tensor: bool = True  # per-layer eps tensor, else eps_value
    # "cache" (cos_sin_cache + positions), "per_token" (cos, sin [T, r] shared by every layer), "per_layer"
    # (cos, sin [L, T, r], one table per layer) or "per_layer_strided" (the same, non-contiguous views)
    rope: str = "cache"
    positions_dtype: torch.dtype = torch.int64
    interleaved: bool = False
    kv_layout: str = "contiguous"  # "contiguous", "wide" (view of a wider buffer), "token_stride", "elem_stride"
    # k_proj / v_proj given to the ops as: "flat" [T, L, H*D] views of kv, "heads" [T, L, H, D] views of kv
    # (head stride = head_dim element strides) or "grouped" [T, L, H, D] views of a per-query-group QKV buffer
    # [T, L, H, q_per_group + 2, D] (head stride (q_per_group + 2) * head_dim); the drop-in always gets kv
    proj: str = "flat"
    max_pos: int = 64
    edge_positions: bool = False  # positions alternate 0 and max_pos - 1
    norm_weight_offset: float = 0.0  # 1.0: Gemma's (1 + weight)
    norm_weight_in_float32: bool = False  # True: one rounding (SGLang native, Gemma); False: two (Llama, Qwen3)
    norm_round_before_rope: bool = True  # False (with norm_weight_in_float32): float32 through RoPE, one rounding

    @property
    def rot(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclasses.dataclass
class Inputs:
    kv: torch.Tensor  # [T, L, 2*kv_size], laid out as the case says
    k_norm_weight: list[torch.Tensor]
    eps: torch.Tensor | None
    eps_value: float
    cos: torch.Tensor
    sin: torch.Tensor | None
    positions: torch.Tensor | None
    grouped: tuple[torch.Tensor, torch.Tensor] | None = None  # (k, v) [T, L, H, D] views, proj="grouped"

    def k_proj(self, case: Case) -> torch.Tensor:
        if case.proj == "grouped":
            return self.grouped[0]
        k_proj = self.kv[..., : case.kv_size]
        return k_proj.unflatten(-1, (case.num_kv_heads, case.head_dim)) if case.proj == "heads" else k_proj

    def v_proj(self, case: Case) -> torch.Tensor:
        if case.proj == "grouped":
            return self.grouped[1]
        v_proj = self.kv[..., case.kv_size :]
        return v_proj.unflatten(-1, (case.num_kv_heads, case.head_dim)) if case.proj == "heads" else v_proj

    def common(self, case: Case) -> tuple:
        return (
            self.k_proj(case), self.k_norm_weight, self.eps, self.eps_value, self.cos, self.sin, self.positions,
            case.num_kv_heads, case.head_dim, case.rot, case.interleaved, case.norm_weight_offset,
            case.norm_weight_in_float32, case.norm_round_before_rope,
        )


def _strided_kv(values: torch.Tensor, layout: str) -> torch.Tensor:
    """Place `values` [T, L, W] into a buffer so that the returned view has the requested strides."""
    total_ctx, n_layers, width = values.shape
    if layout == "contiguous":
        return values.contiguous()
    if layout == "wide":  # e.g. the K/V columns of a fused QKV GEMM output
        buffer = torch.randn(total_ctx, n_layers, width + 24, dtype=values.dtype, device=values.device)
        view = buffer[..., 16 : 16 + width]
    elif layout == "token_stride":
        buffer = torch.randn(2 * total_ctx, n_layers, width, dtype=values.dtype, device=values.device)
        view = buffer[1::2]
    elif layout == "elem_stride":
        buffer = torch.randn(total_ctx, n_layers, width, 2, dtype=values.dtype, device=values.device)
        view = buffer[..., 1]
    else:
        raise AssertionError(layout)
    view.copy_(values)
    return view


def grouped_heads(kv: torch.Tensor, num_kv_heads: int, head_dim: int, q_per_group: int = 2) -> tuple:
    """(k, v) [T, L, H, D] views of a QKV buffer laid out per query group, [T, L, H, q_per_group + 2, D]
    (q heads of the group, then its K head, then its V head), holding kv's K and V values: the head stride
    is (q_per_group + 2) * head_dim, not head_dim. The query slots hold random decoys."""
    total_ctx, n_layers, _ = kv.shape
    shape = (total_ctx, n_layers, num_kv_heads, q_per_group + 2, head_dim)
    qkv = torch.randn(shape, dtype=kv.dtype, device=kv.device)
    qkv[..., q_per_group, :] = kv[..., : num_kv_heads * head_dim].unflatten(-1, (num_kv_heads, head_dim))
    qkv[..., q_per_group + 1, :] = kv[..., num_kv_heads * head_dim :].unflatten(-1, (num_kv_heads, head_dim))
    return qkv[..., q_per_group, :], qkv[..., q_per_group + 1, :]


def make_inputs(case: Case, device: str = "cpu", seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=case.dtype):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    T, L, D = case.total_ctx, case.n_layers, case.head_dim
    kv = _strided_kv(randn(T, L, 2 * case.kv_size) * 3, case.kv_layout)
    weight_mean = 1 - case.norm_weight_offset  # effective weights (offset + weight) around 1
    if case.norm == "stacked":
        k_norm_weight = [weight_mean + 0.5 * randn(L, D)]
    elif case.norm == "per_layer":
        k_norm_weight = [weight_mean + 0.5 * randn(D) for _ in range(L)]
    else:
        k_norm_weight = []
    eps = (torch.rand(L, generator=gen) * 1e-2 + 1e-6).to(device) if case.eps_tensor else None
    if case.rope == "cache":
        angles = randn(case.max_pos, case.rot // 2, dtype=torch.float32) * 3
        cos = torch.cat([angles.cos(), angles.sin()], dim=-1)
        sin = None
        if case.edge_positions:
            positions = torch.tensor([0, case.max_pos - 1] * T)[:T]
        else:
            positions = torch.randint(0, case.max_pos, (T,), generator=gen)
        positions = positions.to(device=device, dtype=case.positions_dtype)
    elif case.rope == "per_token":
        angles = randn(T, case.rot, dtype=torch.float32) * 3  # no assumption that the halves repeat
        cos, sin, positions = angles.cos().to(case.dtype), angles.sin().to(case.dtype), None
    elif case.rope == "per_layer":  # a different table for every layer
        angles = randn(L, T, case.rot, dtype=torch.float32) * 3
        cos, sin, positions = angles.cos().to(case.dtype), angles.sin().to(case.dtype), None
    elif case.rope == "per_layer_strided":  # [L, T, r] views: of a [T, L, r] buffer, of a [T, L, r, 2] one
        angles = randn(T, L, case.rot, dtype=torch.float32) * 3
        cos = angles.cos().to(case.dtype).transpose(0, 1)
        decoys = randn(T, L, case.rot, dtype=torch.float32)
        sin = torch.stack([angles.sin(), decoys], dim=-1).to(case.dtype)[..., 0].transpose(0, 1)
        positions = None
    else:
        raise AssertionError(case.rope)
    grouped = grouped_heads(kv, case.num_kv_heads, D) if case.proj == "grouped" else None
    return Inputs(kv, k_norm_weight, eps, 1e-5, cos, sin, positions, grouped)


# --------------------------------------------------------------------------------------------------------
# Independent float64 reference, written from the spec
# --------------------------------------------------------------------------------------------------------


def reference(case: Case, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_out, v_out) [L, T, H, D] in float64 (rounded to the case dtype where the spec rounds)."""
    T, L, H, D, r = case.total_ctx, case.n_layers, case.num_kv_heads, case.head_dim, case.rot
    half = r // 2
    idx = torch.arange(r)
    if case.interleaved:
        partner, sign, freq = idx ^ 1, torch.where(idx % 2 == 0, -1.0, 1.0), idx // 2
    else:
        partner = torch.where(idx < half, idx + half, idx - half)
        sign, freq = torch.where(idx < half, -1.0, 1.0), idx % half

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(case.dtype).double()

    if inputs.positions is None:  # [T, r] shared by every layer, or [L, T, r]
        cos, sin = inputs.cos.double().cpu(), inputs.sin.double().cpu()
        if cos.dim() == 2:
            cos, sin = cos.expand(L, T, r), sin.expand(L, T, r)
    else:
        pos = inputs.positions.long().cpu().clamp(0, inputs.cos.shape[0] - 1)
        cache = inputs.cos.double().cpu()
        cos, sin = cache[pos][:, freq].expand(L, T, r), cache[pos][:, half + freq].expand(L, T, r)

    weights = [w.double().cpu() for w in inputs.k_norm_weight]
    if len(weights) == 1 and weights[0].dim() == 2:
        weights = list(weights[0])
    k_proj = inputs.k_proj(case).double().cpu().reshape(T, L, H, D)
    k_out = torch.empty(L, T, H, D, dtype=torch.float64)
    for layer in range(L):
        k = k_proj[:, layer]  # [T, H, D]
        if weights:
            eps = float(inputs.eps[layer]) if inputs.eps is not None else inputs.eps_value
            normed = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + eps)
            if not case.norm_weight_in_float32:
                normed = rounded(normed)
            k = normed * (weights[layer] + case.norm_weight_offset)
            if case.norm_round_before_rope:
                k = rounded(k)
        rot = k[..., :r] * cos[layer][:, None, :] + sign * k[..., partner] * sin[layer][:, None, :]
        k_out[layer] = rounded(torch.cat([rot, k[..., r:]], dim=-1))
    v_out = inputs.v_proj(case).double().cpu().reshape(T, L, H, D).transpose(0, 1)
    return k_out, v_out


def _interpreter_truncates(actual: torch.Tensor) -> bool:
    """Triton's interpreter converts float32 to bfloat16 by truncation (GPUs and PyTorch round to nearest)."""
    interpreted = actual.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return interpreted and actual.dtype == torch.bfloat16


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: within 1e-5. fp16/bf16: the reference rounds where the spec rounds, so all but a rare element
    (a float32 intermediate landing on the other side of a rounding boundary) match it exactly; rounding
    at a wrong point changes about a quarter of them. Truncating bf16 conversions get 3 ulps per head."""
    truncates = _interpreter_truncates(actual)
    actual = actual.double().cpu()
    assert torch.isfinite(actual).all(), "output has NaN/inf (unwritten or poisoned elements)"
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    error = (actual - expected).abs()
    head_scale = expected.abs().amax(dim=-1, keepdim=True) * torch.finfo(dtype).eps
    max_ulps = (error / head_scale.clamp_min(1e-30)).max().item() if error.numel() else 0.0
    if truncates:
        assert max_ulps <= 3, f"error of {max_ulps:.2f} ulps of the head's largest element"
        return
    mismatches = int((error > 0).sum())
    assert mismatches <= max(2, error.numel() // 100), f"{mismatches} of {error.numel()} elements differ"
    assert max_ulps <= 1, f"error of {max_ulps:.2f} ulps of the head's largest element"


def poisoned(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


@contextlib.contextmanager
def poisoned_allocations():
    """New tensors (torch.empty and friends) come filled with NaN, so unwritten output elements show."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def check_all_variants(case: Case, inputs: Inputs) -> None:
    """materialize_k, materialize_kv, materialize_kv_out (and the drop-in in cache mode) vs the reference."""
    ref_k, ref_v = reference(case, inputs)
    common = inputs.common(case)
    v_proj = inputs.v_proj(case)

    with poisoned_allocations():
        k_only = OPS.materialize_k(*common)
        k_out, v_out = OPS.materialize_kv(*common, v_proj)
    assert k_out.shape == (case.n_layers, case.total_ctx, case.num_kv_heads, case.head_dim)
    assert k_out.dtype == v_out.dtype == case.dtype
    assert_close_to_reference(k_out, ref_k, case.dtype)
    assert torch.equal(v_out.double().cpu(), ref_v)
    # A separate kernel specialization (no V): the compiler may contract multiply-adds differently.
    torch.testing.assert_close(k_only, k_out)

    k_into, v_into = poisoned(k_out.shape, k_out), poisoned(v_out.shape, v_out)
    assert OPS.materialize_kv_out(*common, v_proj, k_into, v_into) is None
    torch.testing.assert_close(k_into, k_out, rtol=0, atol=0)
    assert torch.equal(v_into, v_out)

    if case.rope == "cache":
        norm_weight = None
        if case.norm is not None:
            norm_weight = torch.stack(inputs.k_norm_weight) if case.norm == "per_layer" else inputs.k_norm_weight[0]
        eps_kwargs = {} if inputs.eps is not None else {"eps_value": inputs.eps_value}
        drop_k, drop_v = fused_norm_rope_stacked(
            inputs.kv, norm_weight, inputs.eps, inputs.cos, inputs.positions,
            case.num_kv_heads, case.head_dim, case.rot, interleaved=case.interleaved, **eps_kwargs,
            norm_weight_offset=case.norm_weight_offset, norm_weight_in_float32=case.norm_weight_in_float32,
            norm_round_before_rope=case.norm_round_before_rope,
        )
        torch.testing.assert_close(drop_k, k_out, rtol=0, atol=0)
        assert torch.equal(drop_v, v_out)


# --------------------------------------------------------------------------------------------------------
# Numerics on every backend
# --------------------------------------------------------------------------------------------------------

CASES = {
    "bf16-neox-cache": Case(),
    "fp16-neox-cache-int32": Case(dtype=torch.float16, positions_dtype=torch.int32),
    "fp32-neox-cache": Case(dtype=torch.float32),
    "bf16-interleaved-cache": Case(interleaved=True),
    "fp32-interleaved-per-token": Case(dtype=torch.float32, interleaved=True, rope="per_token"),
    "bf16-neox-per-token": Case(rope="per_token"),
    "fp32-partial-rotary": Case(dtype=torch.float32, head_dim=128, rotary_dim=64, num_kv_heads=1),
    "fp32-partial-rotary-interleaved": Case(dtype=torch.float32, head_dim=80, rotary_dim=32, interleaved=True),
    "bf16-head80-padded": Case(head_dim=80, num_kv_heads=3),
    "bf16-head256": Case(head_dim=256, n_layers=2, total_ctx=3),
    "fp32-rotary2": Case(dtype=torch.float32, rotary_dim=2),
    "fp32-no-norm": Case(dtype=torch.float32, norm=None),
    "bf16-no-norm-per-token": Case(norm=None, rope="per_token"),
    "fp32-per-layer-norm": Case(dtype=torch.float32, norm="per_layer"),
    "fp32-eps-value": Case(dtype=torch.float32, eps_tensor=False),
    "bf16-kv-wide-buffer": Case(kv_layout="wide"),
    "fp32-kv-token-stride": Case(dtype=torch.float32, kv_layout="token_stride"),
    "fp32-kv-elem-stride": Case(dtype=torch.float32, kv_layout="elem_stride", interleaved=True),
    "fp32-edge-positions": Case(dtype=torch.float32, edge_positions=True, max_pos=5),
    "bf16-single-token-layer-head": Case(total_ctx=1, n_layers=1, num_kv_heads=1),
    "fp32-many-rows": Case(dtype=torch.float32, total_ctx=37, num_kv_heads=4, n_layers=2),
    # K-norm options: Gemma ((1 + w), one rounding), each option alone, across dtypes and RoPE layouts
    "bf16-gemma-norm": Case(norm_weight_offset=1.0, norm_weight_in_float32=True),
    "fp16-gemma-norm-interleaved": Case(dtype=torch.float16, norm_weight_offset=1.0, norm_weight_in_float32=True,
                                        interleaved=True),
    "fp32-gemma-norm-partial-rotary": Case(dtype=torch.float32, head_dim=80, rotary_dim=32,
                                           norm_weight_offset=1.0, norm_weight_in_float32=True),
    "bf16-weight-in-float32-per-token": Case(norm_weight_in_float32=True, rope="per_token"),
    "fp16-weight-in-float32-partial-rotary": Case(dtype=torch.float16, head_dim=80, rotary_dim=48,
                                                  norm_weight_in_float32=True, norm="per_layer"),
    "fp16-offset-two-roundings": Case(dtype=torch.float16, norm_weight_offset=1.0, eps_tensor=False),
    "bf16-offset-interleaved-partial-rotary": Case(norm_weight_offset=0.5, interleaved=True, rotary_dim=32),
    "bf16-no-norm-options-unused": Case(norm=None, norm_weight_offset=1.0, norm_weight_in_float32=True),
    # norm_round_before_rope=False: float32 through RoPE, one rounding at the end (SGLang's stacked reference)
    "bf16-round-once-neox-cache": Case(norm_weight_in_float32=True, norm_round_before_rope=False),
    "fp16-round-once-interleaved-gemma": Case(dtype=torch.float16, interleaved=True, norm_weight_offset=1.0,
                                              norm_weight_in_float32=True, norm_round_before_rope=False),
    "fp32-round-once-partial-rotary": Case(dtype=torch.float32, head_dim=80, rotary_dim=32,
                                           norm_weight_in_float32=True, norm_round_before_rope=False),
    "bf16-round-once-partial-rotary-interleaved-per-token": Case(head_dim=80, rotary_dim=48, interleaved=True,
                                                                 rope="per_token", norm="per_layer",
                                                                 norm_weight_in_float32=True,
                                                                 norm_round_before_rope=False),
    "fp16-round-once-partial-rotary-neox": Case(dtype=torch.float16, head_dim=128, rotary_dim=64, num_kv_heads=1,
                                                eps_tensor=False, norm_weight_in_float32=True,
                                                norm_round_before_rope=False),
    "bf16-no-norm-round-once-unused": Case(norm=None, norm_weight_in_float32=True, norm_round_before_rope=False),
    # Per-layer cos/sin tables [L, T, r] (a different table for every layer)
    "bf16-per-layer-tables-neox": Case(rope="per_layer"),
    "fp32-per-layer-tables-interleaved": Case(dtype=torch.float32, rope="per_layer", interleaved=True),
    "fp16-per-layer-tables-strided": Case(dtype=torch.float16, rope="per_layer_strided"),
    "fp32-per-layer-tables-partial-rotary": Case(dtype=torch.float32, rope="per_layer_strided", head_dim=80,
                                                 rotary_dim=32, num_kv_heads=3),
    "bf16-per-layer-tables-partial-rotary-interleaved": Case(rope="per_layer", head_dim=80, rotary_dim=48,
                                                             interleaved=True, norm=None),
    # 4-D k_proj / v_proj [T, L, H, D]: views of kv, and heads cut from a per-query-group QKV buffer
    "bf16-heads-4d-neox-cache": Case(proj="heads"),
    "fp32-heads-4d-token-stride-per-token": Case(dtype=torch.float32, proj="heads", kv_layout="token_stride",
                                                 rope="per_token"),
    "fp32-heads-4d-elem-stride-interleaved": Case(dtype=torch.float32, proj="heads", kv_layout="elem_stride",
                                                  interleaved=True),
    "bf16-grouped-heads-neox-cache": Case(proj="grouped"),
    "fp32-grouped-heads-interleaved-partial-rotary": Case(dtype=torch.float32, proj="grouped", interleaved=True,
                                                          head_dim=80, rotary_dim=48, num_kv_heads=3),
    "fp16-grouped-heads-gemma-norm": Case(dtype=torch.float16, proj="grouped", norm_weight_offset=1.0,
                                          norm_weight_in_float32=True),
    "bf16-grouped-heads-per-layer-tables-round-once": Case(proj="grouped", rope="per_layer_strided",
                                                           norm_weight_in_float32=True, norm_round_before_rope=False),
    "fp32-grouped-heads-per-layer-tables-partial-rotary": Case(dtype=torch.float32, proj="grouped",
                                                               rope="per_layer", head_dim=128, rotary_dim=64,
                                                               num_kv_heads=1, norm="per_layer"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str, device: str) -> None:
    case = CASES[name]
    check_all_variants(case, make_inputs(case, device))


def test_cpu_backend_follows_triton_interpret_at_call_time(monkeypatch) -> None:
    """On CPU, TRITON_INTERPRET=1 (read per call) picks the interpreted Triton kernel, else PyTorch."""
    import fx_fusion.kernels.ops as ops_module

    case = Case(dtype=torch.float32)
    inputs = make_inputs(case)
    calls = []
    for name in ("launch_fused_kv_materialize", "fused_kv_materialize_torch"):
        real = getattr(ops_module, name)
        recording = lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))  # noqa: E731
        monkeypatch.setattr(ops_module, name, recording)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = OPS.materialize_k(*inputs.common(case))
    monkeypatch.delenv("TRITON_INTERPRET")
    plain = OPS.materialize_k(*inputs.common(case))
    assert calls == ["launch_fused_kv_materialize", "fused_kv_materialize_torch"]
    torch.testing.assert_close(interpreted, plain, rtol=1e-5, atol=1e-5)


def test_per_layer_weights_match_stacked(device: str) -> None:
    case = Case(dtype=torch.float32)
    inputs = make_inputs(case, device)
    stacked = OPS.materialize_kv(*inputs.common(case), inputs.v_proj(case))
    per_layer = dataclasses.replace(inputs, k_norm_weight=[w.clone() for w in inputs.k_norm_weight[0]])
    k_out, v_out = OPS.materialize_kv(*per_layer.common(case), inputs.v_proj(case))
    torch.testing.assert_close(k_out, stacked[0], rtol=0, atol=0)
    assert torch.equal(v_out, stacked[1])


@pytest.mark.parametrize("form", ["strided", "repeated", "many", "mixed_strides"])
def test_per_layer_norm_weights_read_in_place(form: str, device: str) -> None:
    """Per-layer K-norm weights are read where they are, as the kernel's pointer arguments (up to
    MAX_NORM_WEIGHTS_PER_LAUNCH of one element stride: views with stride 2, one weight for several layers as
    Q's blocks have), else gathered into a table (more layers, mixed strides); each matches the reference."""
    case = Case(dtype=torch.float32, n_layers=18 if form == "many" else 5, norm="per_layer", rope="per_token")
    inputs = make_inputs(case, device)
    weights = inputs.k_norm_weight
    if form == "strided":
        weights = [torch.stack([torch.randn_like(w), w], dim=-1)[..., 1] for w in weights]
    elif form == "repeated":
        weights = [weights[0], weights[0], weights[1], weights[1], weights[2]]
    elif form == "mixed_strides":
        weights = [w if i % 2 else torch.stack([w, -w], dim=-1)[..., 0] for i, w in enumerate(weights)]
    in_place = norm_weight_pointers(weights) is not None
    assert in_place == (form in ("strided", "repeated"))
    check_all_variants(case, dataclasses.replace(inputs, k_norm_weight=weights))


def test_cache_and_per_token_rope_agree(device: str) -> None:
    """Per-token cos/sin built from the cache rows (neox layout) give the same result as cache + positions."""
    case = Case(dtype=torch.float32)
    inputs = make_inputs(case, device)
    half = case.rot // 2
    rows = inputs.cos[inputs.positions.long()]
    cos = torch.cat([rows[:, :half], rows[:, :half]], dim=-1)
    sin = torch.cat([rows[:, half:], rows[:, half:]], dim=-1)
    per_token = dataclasses.replace(inputs, cos=cos, sin=sin, positions=None)
    expected = OPS.materialize_k(*inputs.common(case))
    torch.testing.assert_close(OPS.materialize_k(*per_token.common(case)), expected, rtol=1e-6, atol=1e-6)


def test_out_variant_with_strided_outputs(device: str) -> None:
    case = Case(dtype=torch.float32)
    inputs = make_inputs(case, device)
    expected_k, expected_v = OPS.materialize_kv(*inputs.common(case), inputs.v_proj(case))
    shape = (case.total_ctx, case.n_layers, case.num_kv_heads, case.head_dim)
    k_into = poisoned(shape, expected_k).transpose(0, 1)  # [L, T, H, D] view of a [T, L, H, D] buffer
    v_into = poisoned((*shape[:3], 2 * case.head_dim), expected_v)[..., ::2].transpose(0, 1)
    OPS.materialize_kv_out(*inputs.common(case), inputs.v_proj(case), k_into, v_into)
    torch.testing.assert_close(k_into, expected_k, rtol=0, atol=0)
    assert torch.equal(v_into, expected_v)


def test_token_major_output_is_the_same_values_laid_out_token_first(device: str) -> None:
    case = Case(dtype=torch.float32)
    inputs = make_inputs(case, device)
    expected = OPS.materialize_k(*inputs.common(case))
    with poisoned_allocations():
        token_major = OPS.materialize_k(*inputs.common(case), token_major=True)
    assert token_major.shape == expected.shape and token_major.transpose(0, 1).is_contiguous()
    assert is_token_major(token_major)  # the layout the pass's strided views of Q and K assume
    assert not is_token_major(expected) and not is_token_major(token_major[:, 1:])
    torch.testing.assert_close(token_major, expected, rtol=0, atol=0)
    mode = torch._subclasses.fake_tensor.FakeTensorMode()  # the fake kernel promises the same strides
    fake_args = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, inputs.common(case))
    with mode:
        fake = OPS.materialize_k(*fake_args, token_major=True)
    assert fake.stride() == token_major.stride()


def test_drop_in_writes_given_outputs(device: str) -> None:
    case = Case()
    inputs = make_inputs(case, device)
    args = (inputs.kv, inputs.k_norm_weight[0], inputs.eps, inputs.cos, inputs.positions, 2, 64, 64)
    expected_k, expected_v = fused_norm_rope_stacked(*args)
    k_into = poisoned(expected_k.shape, expected_k)
    v_into = poisoned(expected_v.shape, expected_v)
    k_ret, v_ret = fused_norm_rope_stacked(*args, k_out=k_into, v_out=v_into)
    assert k_ret is k_into and v_ret is v_into
    torch.testing.assert_close(k_into, expected_k, rtol=0, atol=0)
    assert torch.equal(v_into, expected_v)
    only_v = poisoned(expected_v.shape, expected_v)
    k_new, v_ret = fused_norm_rope_stacked(*args, v_out=only_v)
    assert v_ret is only_v
    torch.testing.assert_close(k_new, expected_k, rtol=0, atol=0)


def test_out_of_range_positions_are_clamped_without_check(device: str) -> None:
    case = Case(dtype=torch.float32, max_pos=6)
    inputs = make_inputs(case, device)
    wild = torch.tensor([-3, 0, 5, 6, 1000, 2, -1], device=device)
    clamped = dataclasses.replace(inputs, positions=wild.clamp(0, 5))
    expected = OPS.materialize_k(*clamped.common(case))
    k_out, _ = fused_norm_rope_stacked(
        inputs.kv, inputs.k_norm_weight[0], inputs.eps, inputs.cos, wild, 2, 64, 64, check_positions=False
    )
    torch.testing.assert_close(k_out, expected, rtol=0, atol=0)
    wild_inputs = dataclasses.replace(inputs, positions=wild)
    torch.testing.assert_close(OPS.materialize_k(*wild_inputs.common(case)), expected, rtol=0, atol=0)


def test_non_contiguous_positions(device: str) -> None:
    """positions = buffer[:, 0] (stride 2), other positions in between: the kernel follows the stride."""
    case = Case(dtype=torch.float32)
    inputs = make_inputs(case, device)
    decoys = (inputs.positions + 1 + torch.arange(case.total_ctx, device=device)) % case.max_pos
    strided = torch.stack([inputs.positions, decoys], dim=1)[:, 0]
    assert strided.stride() == (2,) and not torch.equal(strided, decoys)
    expected = OPS.materialize_k(*inputs.common(case))
    strided_inputs = dataclasses.replace(inputs, positions=strided)
    with poisoned_allocations():
        k_out = OPS.materialize_k(*strided_inputs.common(case))
    torch.testing.assert_close(k_out, expected, rtol=0, atol=0)
    assert_close_to_reference(k_out, reference(case, inputs)[0], case.dtype)
    drop_k, _ = fused_norm_rope_stacked(
        inputs.kv, inputs.k_norm_weight[0], inputs.eps, inputs.cos, strided, 2, 64, 64
    )
    torch.testing.assert_close(drop_k, expected, rtol=0, atol=0)


def test_empty_context(device: str) -> None:
    case = Case(total_ctx=0)
    inputs = make_inputs(case, device)
    shape = (case.n_layers, 0, case.num_kv_heads, case.head_dim)
    args = (inputs.kv, inputs.k_norm_weight[0], inputs.eps, inputs.cos, inputs.positions, 2, 64, 64)
    k_out, v_out = fused_norm_rope_stacked(*args)
    assert k_out.shape == v_out.shape == shape and k_out.dtype == case.dtype
    given_k, given_v = torch.empty_like(k_out), torch.empty_like(v_out)
    k_ret, v_ret = fused_norm_rope_stacked(*args, k_out=given_k, v_out=given_v)
    assert k_ret is given_k and v_ret is given_v
    # SGLang order: an empty context returns before the trailing-dim check.
    k_out, _ = fused_norm_rope_stacked(inputs.kv[..., :-2], None, None, inputs.cos, inputs.positions, 2, 64, 64)
    assert k_out.shape == shape
    assert OPS.materialize_k(*inputs.common(case)).shape == shape
    k_out, v_out = OPS.materialize_kv(*inputs.common(case), inputs.v_proj(case))
    assert k_out.shape == v_out.shape == shape


# --------------------------------------------------------------------------------------------------------
# Per-layer cos/sin tables [L, T, r]; 4-D projections [T, L, H, D] with any head stride
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_per_layer_tables_give_each_layer_its_table(interleaved: bool, device: str) -> None:
    """Layer l of the per-layer result is, bit for bit, layer l of the result with table l shared by every
    layer; the layers' tables differ, so a kernel reading one table for all would fail."""
    case = Case(dtype=torch.float32, rope="per_layer_strided", interleaved=interleaved, head_dim=80, rotary_dim=48)
    inputs = make_inputs(case, device)
    v_proj = inputs.v_proj(case)
    assert not torch.equal(inputs.cos[0], inputs.cos[1]) and not torch.equal(inputs.sin[1], inputs.sin[2])
    with poisoned_allocations():
        k_out, v_out = OPS.materialize_kv(*inputs.common(case), v_proj)
    assert_close_to_reference(k_out, reference(case, inputs)[0], case.dtype)
    shared_case = dataclasses.replace(case, rope="per_token")
    for layer in range(case.n_layers):
        shared = dataclasses.replace(inputs, cos=inputs.cos[layer], sin=inputs.sin[layer])
        torch.testing.assert_close(k_out[layer], OPS.materialize_k(*shared.common(shared_case))[layer], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expanded_per_layer_table_equals_shared(dtype: torch.dtype, device: str) -> None:
    """A [1, T, r] table expanded to [L, T, r] (layer stride 0) gives the 2-D shared result bit for bit."""
    case = Case(dtype=dtype, rope="per_token", head_dim=80, rotary_dim=48)
    inputs = make_inputs(case, device)
    expanded = dataclasses.replace(
        inputs,
        cos=inputs.cos[None].expand(case.n_layers, -1, -1),
        sin=inputs.sin.unsqueeze(0).expand(case.n_layers, -1, -1),
    )
    assert expanded.cos.stride(0) == 0 and expanded.cos.dim() == 3
    v_proj = inputs.v_proj(case)
    expected_k, expected_v = OPS.materialize_kv(*inputs.common(case), v_proj)
    k_into, v_into = poisoned(expected_k.shape, expected_k), poisoned(expected_v.shape, expected_v)
    OPS.materialize_kv_out(*expanded.common(case), v_proj, k_into, v_into)
    torch.testing.assert_close(k_into, expected_k, rtol=0, atol=0)
    assert torch.equal(v_into, expected_v)
    torch.testing.assert_close(OPS.materialize_k(*expanded.common(case)), expected_k, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_heads_equal_contiguous(dtype: torch.dtype, interleaved: bool, device: str) -> None:
    """4-D k_proj / v_proj whose heads sit (q_per_group + 2) * head_dim apart in a per-group QKV buffer give,
    bit for bit, what the same data gives made contiguous (4-D) or flattened to [T, L, H*D]."""
    case = Case(dtype=dtype, proj="grouped", interleaved=interleaved, head_dim=80, rotary_dim=48, num_kv_heads=3)
    inputs = make_inputs(case, device)
    k_proj, v_proj = inputs.k_proj(case), inputs.v_proj(case)
    assert k_proj.dim() == 4 and k_proj.stride(2) == 4 * case.head_dim and not k_proj.is_contiguous()
    with poisoned_allocations():
        k_out, v_out = OPS.materialize_kv(*inputs.common(case), v_proj)
    assert_close_to_reference(k_out, reference(case, inputs)[0], case.dtype)
    args = list(inputs.common(case))
    for k_same, v_same in ((k_proj.contiguous(), v_proj.contiguous()), (k_proj.flatten(2), v_proj.flatten(2))):
        args[0] = k_same
        expected_k, expected_v = OPS.materialize_kv(*args, v_same)
        torch.testing.assert_close(k_out, expected_k, rtol=0, atol=0)
        assert torch.equal(v_out, expected_v)
    k_into, v_into = poisoned(k_out.shape, k_out), poisoned(v_out.shape, v_out)
    OPS.materialize_kv_out(*inputs.common(case), v_proj, k_into, v_into)
    torch.testing.assert_close(k_into, k_out, rtol=0, atol=0)
    assert torch.equal(v_into, v_out)


def test_grouped_heads_per_layer_tables_under_compile(device: str) -> None:
    """Both generalisations at once through torch.compile (fake kernel shapes, then the real kernel)."""
    torch._dynamo.reset()
    case = Case(dtype=torch.float32, proj="grouped", rope="per_layer_strided")
    inputs = make_inputs(case, device)

    def draft(k_proj, v_proj, weight, eps, cos, sin):
        return OPS.materialize_kv(
            k_proj, [weight], eps, 1e-6, cos, sin, None, case.num_kv_heads, case.head_dim, case.rot, False, 0.0,
            False, True, v_proj,
        )

    args = (inputs.k_proj(case), inputs.v_proj(case), inputs.k_norm_weight[0], inputs.eps, inputs.cos, inputs.sin)
    expected_k, expected_v = draft(*args)
    k_out, v_out = torch.compile(draft, fullgraph=True)(*args)
    torch.testing.assert_close(k_out, expected_k, rtol=0, atol=0)
    assert torch.equal(v_out, expected_v)
    assert_close_to_reference(k_out, reference(case, inputs)[0], case.dtype)


# --------------------------------------------------------------------------------------------------------
# K-norm options: norm_weight_offset, norm_weight_in_float32 and norm_round_before_rope
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_float32", [False, True])
def test_weight_offset_is_added_to_the_weight_in_float32(in_float32: bool, device: str) -> None:
    """Offset 1 with bf16 weights w gives exactly what offset 0 with float32 weights (w + 1) gives."""
    case = Case(norm_weight_offset=1.0, norm_weight_in_float32=in_float32)
    inputs = make_inputs(case, device)
    folded_case = dataclasses.replace(case, norm_weight_offset=0.0)
    folded = dataclasses.replace(inputs, k_norm_weight=[inputs.k_norm_weight[0].float() + 1.0])
    expected = OPS.materialize_k(*folded.common(folded_case))
    torch.testing.assert_close(OPS.materialize_k(*inputs.common(case)), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rounding_point(dtype: torch.dtype, device: str) -> None:
    """float32 outputs: rounding x * inv_rms to float32 first changes nothing. bf16/fp16: it does."""
    one, two = (Case(dtype=dtype, norm_weight_in_float32=flag) for flag in (True, False))
    inputs = make_inputs(one, device)  # the same tensors for both cases
    once, twice = (OPS.materialize_k(*inputs.common(case)) for case in (one, two))
    if dtype == torch.float32:
        torch.testing.assert_close(once, twice, rtol=0, atol=0)
    else:
        assert (once != twice).float().mean() > 0.05


def test_norm_options_unused_without_norm(device: str) -> None:
    case = Case(norm=None)
    inputs = make_inputs(case, device)
    plain = OPS.materialize_k(*inputs.common(case))
    with_options = dataclasses.replace(case, norm_weight_offset=1.0, norm_weight_in_float32=True)
    torch.testing.assert_close(OPS.materialize_k(*inputs.common(with_options)), plain, rtol=0, atol=0)
    round_once = dataclasses.replace(with_options, norm_round_before_rope=False)
    torch.testing.assert_close(OPS.materialize_k(*inputs.common(round_once)), plain, rtol=0, atol=0)


# norm_round_before_rope=False: k_out = round(rope(x * inv_rms * w)), float32 throughout


def _round_point_cases(dtype: torch.dtype, **kwargs) -> tuple[Case, Case]:
    """(rounds before RoPE, rounds once at the end), both with the weight applied in float32."""
    before = Case(dtype=dtype, norm_weight_in_float32=True, **kwargs)
    return before, dataclasses.replace(before, norm_round_before_rope=False)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_before_rope_point(dtype: torch.dtype, interleaved: bool, device: str) -> None:
    """float32 outputs: rounding the normalised K to float32 is a no-op, so the option changes nothing
    (bit-exact). bf16/fp16: it changes many rotated elements on random inputs, and never a dim past
    rotary_dim (not rotated: rounded once either way)."""
    before, once = _round_point_cases(dtype, head_dim=80, rotary_dim=48, interleaved=interleaved)
    inputs = make_inputs(before, device)  # the same tensors for both cases
    with poisoned_allocations():
        k_before, k_once = (OPS.materialize_k(*inputs.common(case)) for case in (before, once))
    assert torch.isfinite(k_before).all() and torch.isfinite(k_once).all()
    torch.testing.assert_close(k_once[..., 48:], k_before[..., 48:], rtol=0, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(k_once, k_before, rtol=0, atol=0)
    else:
        assert (k_once[..., :48] != k_before[..., :48]).float().mean() > 0.05


def test_round_before_rope_unchanged_by_identity_rotation(device: str) -> None:
    """cos = 1, sin = 0 (angle 0): x * 1 + partner * 0 == x in float32, so rounding before or after RoPE
    gives the same bits, whatever the dtype."""
    before, once = _round_point_cases(torch.bfloat16)
    inputs = make_inputs(before, device)
    half = before.rot // 2
    identity = torch.cat([torch.ones(4, half), torch.zeros(4, half)], dim=-1).to(device)
    inputs = dataclasses.replace(inputs, cos=identity, positions=inputs.positions % 4)
    k_before, k_once = (OPS.materialize_k(*inputs.common(case)) for case in (before, once))
    torch.testing.assert_close(k_once, k_before, rtol=0, atol=0)
    assert_close_to_reference(k_once, reference(once, inputs)[0], once.dtype)


def _to_dtype_as_backend(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) converted to `dtype` the way the running backend converts (the interpreter truncates bf16)."""
    if _interpreter_truncates(x.to(dtype)):
        x = (x.view(torch.int32) & -65536).view(torch.float32)  # drop the low 16 bits: exact in bf16
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_once_equals_float32_result_rounded(dtype: torch.dtype, device: str) -> None:
    """Rounding once at the end is the float32 op on the same (upcast) inputs, rounded: bit-exact on CPU
    (on CUDA the float32 specialization may contract multiply-adds differently: within an ulp)."""
    _, once = _round_point_cases(dtype, rotary_dim=32, interleaved=True)
    inputs = make_inputs(once, device)
    with poisoned_allocations():
        k_once = OPS.materialize_k(*inputs.common(once))
    fp32_case = dataclasses.replace(once, dtype=torch.float32)
    fp32_inputs = dataclasses.replace(inputs, kv=inputs.kv.float())  # same weights, eps and tables
    expected = _to_dtype_as_backend(OPS.materialize_k(*fp32_inputs.common(fp32_case)), dtype)
    if device == "cuda":
        assert_close_to_reference(k_once, expected.double().cpu(), dtype)
    else:
        torch.testing.assert_close(k_once, expected, rtol=0, atol=0)


def test_round_once_needs_weight_in_float32() -> None:
    message = (
        "Invalid K-norm rounding options for fused KV materialization: norm_round_before_rope=False (keep "
        "the normalised K in float32 through RoPE) needs norm_weight_in_float32=True, got "
        "norm_weight_in_float32=False."
    )
    case = Case(norm_round_before_rope=False)
    inputs = make_inputs(case)
    for op, extra in ((OPS.materialize_k, ()), (OPS.materialize_kv, (inputs.v_proj(case),))):
        with pytest.raises(ValueError, match=re.escape(message)):
            op(*inputs.common(case), *extra)
    with pytest.raises(ValueError, match=re.escape(message)):
        fused_norm_rope_stacked(**drop_in_args(norm_round_before_rope=False))
    with pytest.raises(ValueError, match=re.escape(message)):  # also without a norm: the flags alone decide
        fused_norm_rope_stacked(**drop_in_args(k_norm_weight=None, norm_round_before_rope=False))


# --------------------------------------------------------------------------------------------------------
# Property test (PyTorch path; a few examples through the interpreter)
# --------------------------------------------------------------------------------------------------------


@st.composite
def cases(draw, max_layers=8, max_heads=16, max_ctx=4):
    head_dim = draw(st.sampled_from([64, 80, 128, 256]))
    return Case(
        total_ctx=draw(st.integers(1, max_ctx)),
        n_layers=draw(st.integers(1, max_layers)),
        num_kv_heads=draw(st.integers(1, max_heads)),
        head_dim=head_dim,
        rotary_dim=2 * draw(st.integers(1, head_dim // 2)),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        norm=draw(st.sampled_from(["stacked", "per_layer", None])),
        eps_tensor=draw(st.booleans()),
        rope=draw(st.sampled_from(["cache", "per_token", "per_layer", "per_layer_strided"])),
        positions_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        interleaved=draw(st.booleans()),
        kv_layout=draw(st.sampled_from(["contiguous", "wide", "token_stride", "elem_stride"])),
        proj=draw(st.sampled_from(["flat", "heads", "grouped"])),
        max_pos=draw(st.integers(1, 16)),
        norm_weight_offset=draw(st.sampled_from([0.0, 1.0])),
        norm_weight_in_float32=(in_float32 := draw(st.booleans())),
        norm_round_before_rope=draw(st.booleans()) if in_float32 else True,
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(), seed=st.integers(0, 2**16))
def test_property_torch_path(case: Case, seed: int, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check_all_variants(case, make_inputs(case, seed=seed))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(max_layers=3, max_heads=4, max_ctx=3), seed=st.integers(0, 2**16))
def test_property_interpreter(case: Case, seed: int, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_all_variants(case, make_inputs(case, seed=seed))


# --------------------------------------------------------------------------------------------------------
# Validation: SGLang's messages in SGLang's order, then the extra checks
# --------------------------------------------------------------------------------------------------------


def drop_in_args(case: Case = Case(), **overrides) -> dict:
    inputs = make_inputs(case)
    args = dict(
        kv=inputs.kv, k_norm_weight=inputs.k_norm_weight[0], eps=inputs.eps, cos_sin_cache=inputs.cos,
        positions=inputs.positions, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, rotary_dim=case.rot,
    )
    args.update(overrides)
    return args


def _kv_2d():
    return torch.randn(7, 256, dtype=torch.bfloat16)


SEED_ERRORS = {
    "kv-2d": (
        dict(kv=_kv_2d()),
        "Invalid stacked fused KV projection shape: got (7, 256), expected 3D [total_ctx, n_layers, kv_size*2].",
    ),
    "kv-trailing-dim": (
        dict(kv=torch.randn(7, 3, 250, dtype=torch.bfloat16)),
        "Invalid fused KV projection shape: got (7, 3, 250), expected trailing dim 256.",
    ),
    "rotary-odd": (dict(rotary_dim=63), "Invalid fused KV rotary/head dim pair: rotary_dim=63, head_dim=64."),
    "rotary-too-big": (dict(rotary_dim=66), "Invalid fused KV rotary/head dim pair: rotary_dim=66, head_dim=64."),
    "rotary-zero": (dict(rotary_dim=0), "Invalid fused KV rotary/head dim pair: rotary_dim=0, head_dim=64."),
    "norm-weight": (
        dict(k_norm_weight=torch.ones(2, 64, dtype=torch.bfloat16)),
        "Invalid stacked k_norm_weight shape for fused KV materialization: got (2, 64), expected (3, 64).",
    ),
    "norm-weight-1d": (
        dict(k_norm_weight=torch.ones(64, dtype=torch.bfloat16)),
        "Invalid stacked k_norm_weight shape for fused KV materialization: got (1, 64), expected (3, 64).",
    ),
    "eps": (
        dict(eps=torch.ones(3, 1)),
        "Invalid stacked eps shape for fused KV materialization: got (3, 1), expected (3,).",
    ),
    "k_out-shape": (
        dict(k_out=torch.empty(3, 7, 2, 32, dtype=torch.bfloat16), v_out=torch.empty(3, 7, 2, 64).bfloat16()),
        "Invalid k_out shape for fused KV materialization: got (3, 7, 2, 32), expected (3, 7, 2, 64).",
    ),
    "k_out-dtype": (
        dict(k_out=torch.empty(3, 7, 2, 64), v_out=torch.empty(3, 7, 2, 64, dtype=torch.bfloat16)),
        "Invalid k_out device/dtype for fused KV materialization: got device=cpu, dtype=torch.float32, "
        "expected device=cpu, dtype=torch.bfloat16.",
    ),
    "v_out-shape": (
        dict(v_out=torch.empty(3, 6, 2, 64, dtype=torch.bfloat16)),
        "Invalid v_out shape for fused KV materialization: got (3, 6, 2, 64), expected (3, 7, 2, 64).",
    ),
    "v_out-dtype": (
        dict(v_out=torch.empty(3, 7, 2, 64, dtype=torch.float16)),
        "Invalid v_out device/dtype for fused KV materialization: got device=cpu, dtype=torch.float16, "
        "expected device=cpu, dtype=torch.bfloat16.",
    ),
}

EXTRA_ERRORS = {
    "kv-dtype": (
        dict(kv=torch.randn(7, 3, 256, dtype=torch.float64)),
        "Unsupported KV projection dtype for fused KV materialization: got torch.float64, "
        "expected torch.bfloat16, torch.float16 or torch.float32.",
    ),
    "positions-dtype": (
        dict(positions=torch.zeros(7, dtype=torch.int16)),
        "Unsupported positions dtype for fused KV materialization: got torch.int16, "
        "expected torch.int32 or torch.int64.",
    ),
    "positions-float": (
        dict(positions=torch.zeros(7)),
        "Unsupported positions dtype for fused KV materialization: got torch.float32, "
        "expected torch.int32 or torch.int64.",
    ),
    "positions-length": (
        dict(positions=torch.zeros(6, dtype=torch.int64)),
        "Invalid positions shape for fused KV materialization: got (6,), expected (7,).",
    ),
    "cache-dtype": (
        dict(cos_sin_cache=torch.zeros(64, 64, dtype=torch.int32)),
        "Unsupported cos dtype for fused KV materialization: got torch.int32, expected a floating dtype.",
    ),
    "cache-width": (
        dict(cos_sin_cache=torch.zeros(64, 32)),
        "Invalid cos_sin_cache shape for fused KV materialization: got (64, 32), expected (max_pos >= 1, 64).",
    ),
    "cache-empty": (
        dict(cos_sin_cache=torch.zeros(0, 64)),
        "Invalid cos_sin_cache shape for fused KV materialization: got (0, 64), expected (max_pos >= 1, 64).",
    ),
    "norm-weight-dtype": (
        dict(k_norm_weight=torch.ones(3, 64, dtype=torch.int64)),
        "Unsupported k_norm_weight[0] dtype for fused KV materialization: got torch.int64, expected a floating dtype.",
    ),
    "eps-dtype": (
        dict(eps=torch.ones(3, dtype=torch.int64)),
        "Unsupported eps dtype for fused KV materialization: got torch.int64, expected a floating dtype.",
    ),
    "positions-device": (
        dict(positions=torch.zeros(7, dtype=torch.int64, device="meta")),
        "Device mismatch for fused KV materialization: positions is on meta, expected cpu (the projection's device).",
    ),
    "positions-out-of-range": (
        dict(positions=torch.tensor([0, 1, 2, 64, 3, 4, 5])),
        "Positions out of range of the cos_sin_cache for fused KV materialization: "
        "got min=0, max=64, expected 0 <= position < 64.",
    ),
    "positions-negative": (
        dict(positions=torch.tensor([0, 1, -1, 2, 3, 4, 5], dtype=torch.int32)),
        "Positions out of range of the cos_sin_cache for fused KV materialization: "
        "got min=-1, max=5, expected 0 <= position < 64.",
    ),
    "kv-4d": (  # the drop-in keeps SGLang's 3-D kv; 4-D projections are for the ops
        dict(kv=torch.randn(7, 3, 4, 64, dtype=torch.bfloat16)),
        "Invalid stacked fused KV projection shape: got (7, 3, 4, 64), expected 3D [total_ctx, n_layers, kv_size*2].",
    ),
    "head-layout": (
        dict(num_kv_heads=0, kv=torch.randn(7, 3, 0)),
        "Invalid fused KV head layout: num_kv_heads=0, head_dim=64; both must be positive.",
    ),
}


@pytest.mark.parametrize("name", list(SEED_ERRORS) + list(EXTRA_ERRORS))
def test_drop_in_errors(name: str) -> None:
    overrides, message = {**SEED_ERRORS, **EXTRA_ERRORS}[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        fused_norm_rope_stacked(**drop_in_args(**overrides))


def test_sglang_check_order() -> None:
    """With several problems at once, the first in SGLang's order is reported."""
    bad_everything = dict(
        rotary_dim=63,
        k_norm_weight=torch.ones(2, 64),
        eps=torch.ones(2),
        k_out=torch.empty(1),
        kv=torch.randn(7, 3, 250, dtype=torch.bfloat16),
    )
    order = ["kv", "rotary_dim", "k_norm_weight", "eps", "k_out"]
    messages = [
        "Invalid fused KV projection shape",
        "Invalid fused KV rotary/head dim pair",
        "Invalid stacked k_norm_weight shape",
        "Invalid stacked eps shape",
        "Invalid k_out shape",
    ]
    for dropped, message in enumerate(messages):
        overrides = {key: bad_everything[key] for key in order[dropped:]}
        with pytest.raises(ValueError, match=re.escape(message)):
            fused_norm_rope_stacked(**drop_in_args(**overrides))


def _numel_view(buffer: torch.Tensor, start: int) -> torch.Tensor:
    """A dense [3, 7, 2, 64] view of `buffer` (flattened) from element `start`."""
    return buffer.view(-1)[start : start + 3 * 7 * 2 * 64].view(3, 7, 2, 64)


TYPE_ERRORS = {
    "eps-float": (
        dict(eps=1e-6),
        "eps must be a [n_layers] tensor or None, got float 1e-06; pass a scalar eps as eps_value=1e-06.",
    ),
    "positions-list": (dict(positions=list(range(7))), "positions must be a torch.Tensor, got list."),
    "kv-list": (dict(kv=[[0.0]]), "kv must be a torch.Tensor, got list."),
    "cache-none": (dict(cos_sin_cache=None), "cos_sin_cache must be a torch.Tensor, got NoneType."),
    "norm-weight-list": (
        dict(k_norm_weight=[torch.ones(64)] * 3), "k_norm_weight must be a torch.Tensor or None, got list."
    ),
    "k_out-tuple": (dict(k_out=()), "k_out must be a torch.Tensor or None, got tuple."),
    "num_kv_heads-float": (dict(num_kv_heads=2.0), "num_kv_heads must be an int, got float 2.0."),
    "head_dim-bool": (dict(head_dim=True), "head_dim must be an int, got bool True."),
    "rotary_dim-float": (dict(rotary_dim=64.0), "rotary_dim must be an int, got float 64.0."),
    "interleaved-int": (dict(interleaved=1), "interleaved must be a bool, got int 1."),
    "eps_value-str": (dict(eps_value="1e-6"), "eps_value must be a float, got str '1e-6'."),
    "offset-bool": (dict(norm_weight_offset=True), "norm_weight_offset must be a float, got bool True."),
    "in-float32-none": (dict(norm_weight_in_float32=None), "norm_weight_in_float32 must be a bool, got NoneType None."),
    "round-before-rope-int": (dict(norm_round_before_rope=0), "norm_round_before_rope must be a bool, got int 0."),
    "check_positions-int": (dict(check_positions=0), "check_positions must be a bool, got int 0."),
}


@pytest.mark.parametrize("name", list(TYPE_ERRORS))
def test_drop_in_type_errors(name: str) -> None:
    overrides, message = TYPE_ERRORS[name]
    with pytest.raises(TypeError, match=re.escape(message)):
        fused_norm_rope_stacked(**drop_in_args(**overrides))


EMPTY_CONTEXT_ERRORS = {
    "num_kv_heads-zero": (
        dict(num_kv_heads=0), "Invalid fused KV head layout: num_kv_heads=0, head_dim=64; both must be positive."
    ),
    "head_dim-negative": (
        dict(head_dim=-64), "Invalid fused KV head layout: num_kv_heads=2, head_dim=-64; both must be positive."
    ),
    "k_out-shape": (
        dict(k_out=torch.empty(3, 1, 2, 64, dtype=torch.bfloat16)),
        "Invalid k_out shape for fused KV materialization: got (3, 1, 2, 64), expected (3, 0, 2, 64).",
    ),
    "v_out-dtype": (
        dict(v_out=torch.empty(3, 0, 2, 64)),
        "Invalid v_out device/dtype for fused KV materialization: got device=cpu, dtype=torch.float32, "
        "expected device=cpu, dtype=torch.bfloat16.",
    ),
    "norm-weight": (
        dict(k_norm_weight=torch.ones(2, 64)),
        "Invalid stacked k_norm_weight shape for fused KV materialization: got (2, 64), expected (3, 64).",
    ),
}


@pytest.mark.parametrize("name", list(EMPTY_CONTEXT_ERRORS))
def test_empty_context_is_validated(name: str) -> None:
    overrides, message = EMPTY_CONTEXT_ERRORS[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        fused_norm_rope_stacked(**drop_in_args(Case(total_ctx=0), **overrides))


def test_drop_in_rejects_overlapping_outputs() -> None:
    args = drop_in_args()
    buffer = torch.empty(2 * 3 * 7 * 2 * 64, dtype=torch.bfloat16)
    same = _numel_view(buffer, 0)
    cases = {
        "Overlapping outputs for fused KV materialization: k_out and v_out share memory.": [
            dict(k_out=same, v_out=same),
            dict(k_out=_numel_view(buffer, 0), v_out=_numel_view(buffer, 0)),
            dict(k_out=_numel_view(buffer, 64), v_out=_numel_view(buffer, 0)),
        ],
        "Overlapping k_out for fused KV materialization: it shares memory with the input k_proj.": [
            dict(k_out=_numel_view(args["kv"], 0)),
        ],
        "Overlapping v_out for fused KV materialization: it shares memory with the input k_proj.": [
            dict(v_out=_numel_view(args["kv"], args["kv"].numel() - 3 * 7 * 2 * 64)),
        ],
    }
    for message, outputs in cases.items():
        for given in outputs:
            with pytest.raises(ValueError, match=re.escape(message)):
                fused_norm_rope_stacked(**{**args, **given})


def test_drop_in_accepts_interleaved_outputs_of_one_buffer() -> None:
    """K and V halves of one [L, T, H, 2, D] cache buffer interleave without sharing an element."""
    args = drop_in_args()
    expected_k, expected_v = fused_norm_rope_stacked(**args)
    cache = torch.full((3, 7, 2, 2, 64), float("nan"), dtype=torch.bfloat16)
    k_out, v_out = fused_norm_rope_stacked(**args, k_out=cache[..., 0, :], v_out=cache[..., 1, :])
    torch.testing.assert_close(cache[..., 0, :], expected_k, rtol=0, atol=0)
    assert torch.equal(cache[..., 1, :], expected_v)


def test_drop_in_meta_tensors() -> None:
    """Meta inputs give meta outputs of the right shape and dtype; positions are never read."""
    args = drop_in_args()
    meta = {name: value.to("meta") if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    k_out, v_out = fused_norm_rope_stacked(**meta)
    for out in (k_out, v_out):
        assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == (3, 7, 2, 64)
    k_into = torch.empty(3, 7, 2, 64, dtype=torch.bfloat16, device="meta")
    assert fused_norm_rope_stacked(**meta, k_out=k_into)[0] is k_into


OP_ERRORS = {
    "k_proj-2d": (
        lambda inputs, case: {"k_proj": inputs.kv[0, :, :128]},
        "Invalid stacked fused KV projection shape: got (3, 128), expected 3D [total_ctx, n_layers, kv_size] "
        "or 4D [total_ctx, n_layers, num_kv_heads, head_dim] for k_proj.",
    ),
    "k_proj-5d": (
        lambda inputs, case: {"k_proj": inputs.kv[..., :128].reshape(7, 3, 2, 1, 64)},
        "Invalid stacked fused KV projection shape: got (7, 3, 2, 1, 64), expected 3D [total_ctx, n_layers, "
        "kv_size] or 4D [total_ctx, n_layers, num_kv_heads, head_dim] for k_proj.",
    ),
    "k_proj-4d-heads": (
        lambda inputs, case: {"k_proj": inputs.kv.unflatten(-1, (4, 64)), "v_proj": inputs.kv.unflatten(-1, (4, 64))},
        "Invalid fused KV projection shape: got (7, 3, 4, 64), expected trailing dims (num_kv_heads, head_dim) = "
        "(2, 64) for a 4D k_proj.",
    ),
    "k_proj-4d-head-dim": (
        lambda inputs, case: {"k_proj": inputs.kv[..., :128].unflatten(-1, (4, 32))},
        "Invalid fused KV projection shape: got (7, 3, 4, 32), expected trailing dims (num_kv_heads, head_dim) = "
        "(2, 64) for a 4D k_proj.",
    ),
    "v_proj-3d-with-4d-k_proj": (
        lambda inputs, case: {"k_proj": inputs.kv[..., :128].unflatten(-1, (2, 64))},
        "Invalid fused KV projection shape: got v_proj (7, 3, 128), expected (7, 3, 2, 64) (the k_proj shape).",
    ),
    "v_proj-4d-with-3d-k_proj": (
        lambda inputs, case: {"v_proj": inputs.kv[..., 128:].unflatten(-1, (2, 64))},
        "Invalid fused KV projection shape: got v_proj (7, 3, 2, 64), expected (7, 3, 128) (the k_proj shape).",
    ),
    "v_proj-shape": (
        lambda inputs, case: {"v_proj": inputs.kv[:-1, :, 128:]},
        "Invalid fused KV projection shape: got v_proj (6, 3, 128), expected (7, 3, 128) (the k_proj shape).",
    ),
    "per-layer-norm-count": (
        lambda inputs, case: {"k_norm_weight": [torch.ones(64, dtype=torch.bfloat16)] * 2},
        "Invalid stacked k_norm_weight shape for fused KV materialization: got (2, 64), expected (3, 64).",
    ),
    "per-layer-norm-mixed": (
        lambda inputs, case: {"k_norm_weight": [torch.ones(64), torch.ones(64), torch.ones(32)]},
        "Invalid stacked k_norm_weight shape for fused KV materialization: "
        "got ((64,), (64,), (32,)), expected (3, 64).",
    ),
    "per-layer-norm-dtypes": (
        lambda inputs, case: {"k_norm_weight": [torch.ones(64), torch.ones(64), torch.ones(64, dtype=torch.bfloat16)]},
        "Mismatched k_norm_weight dtypes for fused KV materialization: "
        "got [torch.float32, torch.float32, torch.bfloat16], expected one dtype.",
    ),
    "missing-sin": (
        lambda inputs, case: {"positions": None},
        "Missing sin for fused KV materialization: per-token cos/sin (positions=None) need both tables.",
    ),
    "unexpected-sin": (
        lambda inputs, case: {"sin": inputs.cos},
        "Unexpected sin for fused KV materialization: with positions, cos is the cos_sin_cache "
        "[max_pos, rotary_dim] and sin must be None.",
    ),
    "per-token-cos-shape": (
        lambda inputs, case: {"positions": None, "cos": torch.ones(6, 64), "sin": torch.ones(7, 64)},
        "Invalid per-token cos shape for fused KV materialization: got (6, 64), "
        "expected (7, 64) (shared by every layer) or (3, 7, 64) (one table per layer).",
    ),
    "per-token-sin-shape": (
        lambda inputs, case: {"positions": None, "cos": torch.ones(7, 64), "sin": torch.ones(7, 32)},
        "Invalid per-token sin shape for fused KV materialization: got (7, 32), "
        "expected (7, 64) (shared by every layer) or (3, 7, 64) (one table per layer).",
    ),
    "per-layer-cos-layers": (
        lambda inputs, case: {"positions": None, "cos": torch.ones(2, 7, 64), "sin": torch.ones(3, 7, 64)},
        "Invalid per-token cos shape for fused KV materialization: got (2, 7, 64), "
        "expected (7, 64) (shared by every layer) or (3, 7, 64) (one table per layer).",
    ),
    "per-layer-sin-width": (
        lambda inputs, case: {"positions": None, "cos": torch.ones(3, 7, 64), "sin": torch.ones(3, 7, 32)},
        "Invalid per-token sin shape for fused KV materialization: got (3, 7, 32), "
        "expected (7, 64) (shared by every layer) or (3, 7, 64) (one table per layer).",
    ),
    "per-token-cos-1d": (
        lambda inputs, case: {"positions": None, "cos": torch.ones(64), "sin": torch.ones(7, 64)},
        "Invalid per-token cos shape for fused KV materialization: got (64,), "
        "expected (7, 64) (shared by every layer) or (3, 7, 64) (one table per layer).",
    ),
    "per-token-cos-4d": (
        lambda inputs, case: {"positions": None, "cos": torch.ones(1, 3, 7, 64), "sin": torch.ones(1, 3, 7, 64)},
        "Invalid per-token cos shape for fused KV materialization: got (1, 3, 7, 64), "
        "expected (7, 64) (shared by every layer) or (3, 7, 64) (one table per layer).",
    ),
    "per-token-cos-sin-ranks": (
        lambda inputs, case: {"positions": None, "cos": torch.ones(7, 64), "sin": torch.ones(3, 7, 64)},
        "Mismatched per-token cos/sin shapes for fused KV materialization: got cos (7, 64) and sin (3, 7, 64), "
        "expected both (7, 64) (shared by every layer) or both (3, 7, 64) (one table per layer).",
    ),
    "per-layer-cache-with-positions": (
        lambda inputs, case: {"cos": inputs.cos.expand(3, -1, -1)},
        "Invalid cos_sin_cache shape for fused KV materialization: got (3, 64, 64), expected (max_pos >= 1, 64).",
    ),
    "v_proj-dtype": (
        lambda inputs, case: {"v_proj": inputs.v_proj(case).half()},
        "Mismatched v_proj dtype for fused KV materialization: got torch.float16, expected torch.bfloat16.",
    ),
    "cos-device": (
        lambda inputs, case: {"cos": inputs.cos.to("meta")},
        "Device mismatch for fused KV materialization: cos is on meta, expected cpu (the projection's device).",
    ),
    "eps_value-nan": (
        lambda inputs, case: {"eps_value": math.nan},
        "Invalid eps_value for fused KV materialization: got nan, expected a finite float >= 0.",
    ),
    "eps_value-negative": (
        lambda inputs, case: {"eps_value": -1e-6},
        "Invalid eps_value for fused KV materialization: got -1e-06, expected a finite float >= 0.",
    ),
    "norm-weight-offset-inf": (
        lambda inputs, case: {"norm_weight_offset": math.inf},
        "Invalid norm_weight_offset for fused KV materialization: got inf, expected a finite float.",
    ),
    "round-once-without-weight-in-float32": (
        lambda inputs, case: {"norm_round_before_rope": False},
        "Invalid K-norm rounding options for fused KV materialization: norm_round_before_rope=False",
    ),
}


def _op_call_args(inputs: Inputs, case: Case, change) -> tuple:
    names = ["k_proj", "k_norm_weight", "eps", "eps_value", "cos", "sin", "positions", "num_kv_heads",
             "head_dim", "rotary_dim", "interleaved", "norm_weight_offset", "norm_weight_in_float32",
             "norm_round_before_rope", "v_proj"]
    args = dict(zip(names, (*inputs.common(case), inputs.v_proj(case))))
    args.update(change(inputs, case))
    return tuple(args[name] for name in names)


@pytest.mark.parametrize("name", list(OP_ERRORS))
def test_op_errors(name: str) -> None:
    change, message = OP_ERRORS[name]
    case = Case()
    args = _op_call_args(make_inputs(case), case, change)
    with pytest.raises(ValueError, match=re.escape(message)):
        OPS.materialize_kv(*args)


@pytest.mark.parametrize(
    "name",
    [
        "v_proj-shape", "per-layer-norm-count", "missing-sin", "eps_value-nan", "round-once-without-weight-in-float32",
        "k_proj-4d-heads", "v_proj-3d-with-4d-k_proj", "per-layer-cos-layers", "per-token-cos-sin-ranks",
    ],
)
def test_op_errors_at_trace_time(name: str) -> None:
    """The fake kernel validates like the real one, so torch.compile fails with the same message."""
    torch._dynamo.reset()
    change, message = OP_ERRORS[name]
    case = Case()
    args = _op_call_args(make_inputs(case), case, change)
    with pytest.raises(Exception, match=re.escape(message)):
        torch.compile(lambda *a: OPS.materialize_kv(*a), fullgraph=True, backend="eager")(*args)


def test_out_op_rejects_overlapping_outputs() -> None:
    case = Case(dtype=torch.float32)  # the cos_sin_cache's dtype, so an output may be a view of it
    inputs = make_inputs(case)
    k_out = poisoned((case.n_layers, case.total_ctx, case.num_kv_heads, case.head_dim), inputs.kv)
    with pytest.raises(ValueError, match=re.escape("Overlapping outputs for fused KV materialization")):
        OPS.materialize_kv_out(*inputs.common(case), inputs.v_proj(case), k_out, k_out)
    with pytest.raises(ValueError, match=re.escape("it shares memory with the input cos.")):
        OPS.materialize_kv_out(*inputs.common(case), inputs.v_proj(case), k_out, _numel_view(inputs.cos, 0))


# --------------------------------------------------------------------------------------------------------
# torch.compile, dynamic shapes, export, opcheck
# --------------------------------------------------------------------------------------------------------


def _drop_in_call(kv, weight, eps, cache, positions):
    return fused_norm_rope_stacked(kv, weight, eps, cache, positions, 2, 64, 64)


_EVERY_LAUNCH_READS = {"k_proj_ptr", "k_out_ptr", "cos_ptr", "num_rows"} | {
    f"stride_{group}_{axis}"
    for group, axes in (("k", ("token", "layer", "head", "elem")), ("ko", ("layer", "token", "head", "dim")))
    for axis in axes
} | {"stride_cos_row", "stride_cos_dim"}
_PER_TOKEN_TABLES = {"stride_cos_layer", "sin_ptr", "stride_sin_layer", "stride_sin_row", "stride_sin_dim"}
_V_COPY = {"v_proj_ptr", "v_out_ptr"} | {f"stride_v_{a}" for a in ("token", "layer", "head", "elem")} | {
    f"stride_vo_{a}" for a in ("layer", "token", "head", "dim")
}


@pytest.mark.parametrize(
    "case, with_v, expected",
    [
        (Case(norm=None, rope="per_token"), False, _EVERY_LAUNCH_READS | _PER_TOKEN_TABLES),
        (
            Case(norm="stacked", eps_tensor=False, rope="per_token"),
            False,
            _EVERY_LAUNCH_READS | _PER_TOKEN_TABLES | {"norm_weight_ptr", "stride_weight_layer", "stride_weight_dim"},
        ),
        (
            Case(norm="stacked", eps_tensor=True, rope="cache"),
            True,
            _EVERY_LAUNCH_READS | _V_COPY | {"norm_weight_ptr", "stride_weight_layer", "stride_weight_dim"}
            | {"eps_ptr", "stride_eps", "positions_ptr", "stride_positions", "cache_rows"},
        ),
    ],
    ids=["llama-k", "qwen3-k", "cache-kv"],
)
def test_launch_passes_only_what_it_reads(case: Case, with_v: bool, expected: set, monkeypatch) -> None:
    """Each launch passes the kernel only the runtime arguments its constexpr flags read; every other one is
    None (a constexpr the launchers skip: each argument costs host time on every call). The kernel's results
    with those Nones are checked by every numeric test here."""
    from fx_fusion.kernels import fused_kv_materialize as materialize

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append(args)

    monkeypatch.setattr(materialize, "fused_kv_materialize_kernel_interpreted", Recorder())
    inputs = make_inputs(case)
    norm_weight = inputs.k_norm_weight[0] if inputs.k_norm_weight else None
    L, T, H, D = case.n_layers, case.total_ctx, case.num_kv_heads, case.head_dim
    k_out, v_out = torch.empty(L, T, H, D, dtype=case.dtype), torch.empty(L, T, H, D, dtype=case.dtype)
    materialize.launch_fused_kv_materialize(
        inputs.k_proj(case), inputs.v_proj(case) if with_v else None, norm_weight, inputs.eps, inputs.eps_value,
        inputs.cos, inputs.sin, inputs.positions, k_out, v_out if with_v else None, H, D, case.rot,
        case.interleaved, case.norm_weight_offset, case.norm_weight_in_float32, case.norm_round_before_rope,
        interpret=True,
    )  # fmt: skip
    (args,) = launches
    passed = {name for name, value in zip(materialize._KERNEL_ARG_NAMES, args, strict=True) if value is not None}
    assert passed == expected


def test_compile_fullgraph_matches_eager(device: str) -> None:
    """fullgraph=True also proves the eager-only positions check (a host sync) is skipped while tracing."""
    torch._dynamo.reset()
    inputs = make_inputs(Case(), device)
    args = (inputs.kv, inputs.k_norm_weight[0], inputs.eps, inputs.cos, inputs.positions)
    expected_k, expected_v = _drop_in_call(*args)
    k_out, v_out = torch.compile(_drop_in_call, fullgraph=True)(*args)
    torch.testing.assert_close(k_out, expected_k, rtol=0, atol=0)
    assert torch.equal(v_out, expected_v)


def test_compile_shape_guard_at_trace_time() -> None:
    torch._dynamo.reset()
    inputs = make_inputs(Case())
    message = "Invalid stacked fused KV projection shape: got (7, 256), expected 3D [total_ctx, n_layers, kv_size*2]."
    with pytest.raises(Exception, match=re.escape(message)):
        torch.compile(_drop_in_call, fullgraph=True, backend="eager")(
            inputs.kv.flatten(1)[:, :256], inputs.k_norm_weight[0], inputs.eps, inputs.cos, inputs.positions
        )
    # Calling the op directly, the fake kernel raises the same kind of message while tracing.
    def k_only(k_proj):
        return OPS.materialize_k(
            k_proj, [], None, 1e-6, inputs.cos, None, inputs.positions, 2, 64, 64, False, 0.0, False, True
        )

    op_message = "Invalid stacked fused KV projection shape: got (7, 128), expected 3D"
    with pytest.raises(Exception, match=re.escape(op_message)):
        torch.compile(k_only, fullgraph=True, backend="eager")(inputs.kv[:, 0, :128])


def test_dynamic_total_ctx_grouped_heads_per_layer_tables() -> None:
    """4-D strided k_proj / v_proj and per-layer tables with a dynamic total_ctx: one graph for T = 5, 7, 9."""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def draft(k_proj, v_proj, weight, eps, cos, sin):
        return OPS.materialize_kv(
            k_proj, [weight], eps, 1e-6, cos, sin, None, 2, 64, 64, False, 0.0, False, True, v_proj
        )

    compiled = torch.compile(draft, backend=counting_backend, fullgraph=True, dynamic=True)
    for total_ctx in (5, 7, 9):
        case = Case(total_ctx=total_ctx, dtype=torch.float32, proj="grouped", rope="per_layer_strided")
        inputs = make_inputs(case, seed=total_ctx)
        k_proj, v_proj = inputs.k_proj(case), inputs.v_proj(case)
        k_out, v_out = compiled(k_proj, v_proj, inputs.k_norm_weight[0], inputs.eps, inputs.cos, inputs.sin)
        ref_k, ref_v = reference(case, inputs)
        assert_close_to_reference(k_out, ref_k, case.dtype)
        assert torch.equal(v_out.double(), ref_v)
    assert len(graphs) == 1


def test_dynamic_total_ctx_does_not_recompile() -> None:
    """T = 5, 7, 9 share one graph. (Dynamo specializes sizes 0 and 1, so T=1 would get its own graph.)"""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(_drop_in_call, backend=counting_backend, fullgraph=True, dynamic=True)
    for total_ctx in (5, 7, 9):
        case = Case(total_ctx=total_ctx, dtype=torch.float32)
        inputs = make_inputs(case, seed=total_ctx)
        args = (inputs.kv, inputs.k_norm_weight[0], inputs.eps, inputs.cos, inputs.positions)
        k_out, _ = compiled(*args)
        assert_close_to_reference(k_out, reference(case, inputs)[0], case.dtype)
    assert len(graphs) == 1


class _DraftKV(torch.nn.Module):
    def __init__(self, n_layers: int, head_dim: int) -> None:
        super().__init__()
        self.k_norm = torch.nn.ParameterList(torch.nn.Parameter(torch.rand(head_dim) + 0.5) for _ in range(n_layers))

    def forward(self, kv, eps, cache, positions):
        kv_size = kv.shape[-1] // 2
        return OPS.materialize_kv(
            kv[..., :kv_size], list(self.k_norm), eps, 1e-6, cache, None, positions, 2, 64, 64, False, 0.0, False,
            True, kv[..., kv_size:],
        )


def test_export_module_calling_op() -> None:
    case = Case(dtype=torch.float32)
    inputs = make_inputs(case)
    module = _DraftKV(case.n_layers, case.head_dim)
    args = (inputs.kv, inputs.eps, inputs.cos, inputs.positions)
    exported = torch.export.export(module, args)
    assert any(node.target == OPS.materialize_kv.default for node in exported.graph.nodes)
    expected = module(*args)
    actual = exported.module()(*args)
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(actual[1], expected[1], rtol=0, atol=0)


OPCHECK_LAYOUTS = {
    "cache": dict(rope="cache"),
    "per_token": dict(rope="per_token"),
    # per-layer cos/sin [L, T, r] (strided views) and 4-D k_proj / v_proj with a head stride != head_dim
    "per_layer_tables-grouped_heads": dict(rope="per_layer_strided", proj="grouped"),
}


@pytest.mark.parametrize("op_name", ["materialize_k", "materialize_kv", "materialize_kv_out"])
@pytest.mark.parametrize("layout", list(OPCHECK_LAYOUTS))
@pytest.mark.parametrize("norm", ["stacked", "per_layer"])
def test_opcheck(op_name: str, layout: str, norm: str, device: str) -> None:
    case = Case(dtype=torch.float32, norm=norm, **OPCHECK_LAYOUTS[layout])
    inputs = make_inputs(case, device)
    args = (*inputs.common(case),)
    if op_name != "materialize_k":
        args += (inputs.v_proj(case),)
    if op_name == "materialize_kv_out":
        shape = (case.n_layers, case.total_ctx, case.num_kv_heads, case.head_dim)
        args += (poisoned(shape, inputs.kv), poisoned(shape, inputs.kv))
    torch.library.opcheck(getattr(OPS, op_name).default, args)


# --------------------------------------------------------------------------------------------------------
# CUDA only
# --------------------------------------------------------------------------------------------------------


@CUDA
@pytest.mark.gpu
def test_cuda_graph_capture_replays() -> None:
    """The drop-in (positions check on) is capturable: nothing syncs while the stream captures."""
    case = Case()
    inputs = make_inputs(case, "cuda")
    args = (inputs.kv, inputs.k_norm_weight[0], inputs.eps, inputs.cos, inputs.positions)
    expected_k, expected_v = _drop_in_call(*args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _drop_in_call(*args)  # warm up (compiles the kernel) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k_out, v_out = _drop_in_call(*args)
    inputs.kv.copy_(inputs.kv * 0.5)
    expected_k, expected_v = _drop_in_call(*args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(k_out, expected_k, rtol=0, atol=0)
    assert torch.equal(v_out, expected_v)
