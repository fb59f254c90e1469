"""The spelling corpus (tests/spelling_corpus.py) through FusedKVPass: the same context K/V math as public
codebases spell it must fuse (all 3 layers in one group) and match eager; layers whose math truly differs
must stay out of the group and still match eager.

    pytest tests/test_spelling_corpus.py -q                     # the corpus
    python tests/test_spelling_corpus.py                        # a case x dtype table of what the pass did
"""

from __future__ import annotations

import functools
import os
import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch._functorch.config
import torch._inductor.config

import fx_fusion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spelling_corpus  # noqa: E402
from spelling_corpus import CASES, NEGATIVE_CASES, NOT_YET, N_LAYERS, Case  # noqa: E402

FUSING = [c for c in CASES if c.name not in NOT_YET]
PENDING = [c for c in CASES if c.name in NOT_YET]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_TOL = 2e-5  # a few spellings (sqrt vs rsqrt, float32 RoPE of a float32 norm) differ by an ulp or two
BF16_REL_TOL = 1e-2  # bfloat16 and float16: relative Frobenius error


pytestmark = pytest.mark.usefixtures("fresh_compile")


def compile_and_run(case, dtype, device="cpu"):
    """(compiled outputs, eager outputs, the pass) for `case` in `dtype` on `device`, under torch.no_grad()."""
    module, inputs = case.build(dtype)
    module, inputs = module.to(device), tuple(t.to(device) for t in inputs)
    fused_kv_pass = fx_fusion.FusedKVPass()
    with torch.no_grad():
        # The reference is eager's second call: in a fresh process the first call of Hugging Face's rotary on
        # CPU (torch 2.13, two threads) can give the cos of its second sequence's 600 positions off by up to
        # 1.5e-4 (4 processes of 30, none of 30 on one thread; the second call stays within float32's 1.4e-5
        # of float64's), and a test may be the first in its process.
        module(*inputs)
        ref = module(*inputs)
        compiled = torch.compile(module, options={"post_grad_custom_post_pass": fused_kv_pass})
        got = compiled(*inputs)
    return got, ref, fused_kv_pass


def assert_matches_eager(got, ref, dtype):
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, r.shape, g.dtype, r.dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(g, r, rtol=FP32_TOL, atol=FP32_TOL)
        else:
            err = ((g.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item()
            assert err < BF16_REL_TOL, err


def groups_and_rejections(fused_kv_pass):
    groups = [g for record in fused_kv_pass.records for g in record.fused_groups]
    rejected = [r for record in fused_kv_pass.records for r in record.rejected]
    return groups, rejected


def describe(fused_kv_pass) -> str:
    groups, rejected = groups_and_rejections(fused_kv_pass)
    parts = [f"{len(fused_kv_pass.records)} graph(s)"]
    parts += [f"group: {g.describe()}" for g in groups]
    parts += [f"rejected {r.location}: {r.reason}" for r in rejected]
    return "; ".join(parts)


# Spellings that round K to its dtype right after the RoPE and widen it again for a norm after the RoPE (Llama
# 4's weightless norm): where Inductor folds that round trip away (torch 2.11 does, as it folds AMP's casts),
# the RoPE's float32 result reaches the norm unrounded, which no fused op gives, so the pass must refuse with
# this reason instead.
ROUND_TRIP_AFTER_ROPE = {"llama4_complex_rope_weightless_norm_after": r"K output is torch\.float32, the projection"}


@functools.cache
def inductor_keeps_round_trips(dtype: torch.dtype, device: str) -> bool:
    """Whether the post-grad graph that the pass sees still rounds a float32 value to `dtype` before
    widening it again."""
    casts = []

    def record_casts(graph: torch.fx.Graph) -> None:
        casts.extend(n.args[1] for n in graph.find_nodes(op="call_function", target=torch.ops.prims.convert_element_type.default))

    with torch.no_grad():
        round_trip = torch.compile(lambda t: (t * 2).to(dtype).float() * 3, options={"post_grad_custom_post_pass": record_casts})
        round_trip(torch.ones(4, device=device))
    return dtype in casts


def assert_fused(case, fused_kv_pass, dtype, device) -> None:
    """All N_LAYERS layers in one group, or the round trip's reason where Inductor folds it."""
    groups, rejected = groups_and_rejections(fused_kv_pass)
    if any(g.n_layers >= N_LAYERS for g in groups):
        return
    pattern = ROUND_TRIP_AFTER_ROPE.get(case.name)
    if pattern and dtype != torch.float32 and not inductor_keeps_round_trips(dtype, device):
        assert any(re.search(pattern, r.reason) for r in rejected), describe(fused_kv_pass)
        return
    raise AssertionError(
        f"{case.name} ({case.source}): expected all {N_LAYERS} layers in one fused group; {describe(fused_kv_pass)}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", FUSING, ids=[c.name for c in FUSING])
def test_spelling_fuses_and_matches_eager(case, dtype):
    got, ref, fused_kv_pass = compile_and_run(case, dtype)
    assert_matches_eager(got, ref, dtype)
    assert fused_kv_pass.records, "the pass did not run"
    assert_fused(case, fused_kv_pass, dtype, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", FUSING, ids=[c.name for c in FUSING])
def test_spelling_fuses_and_matches_eager_on_cuda(case):
    """Each spelling in bfloat16 on CUDA, where the fused work runs as our Triton kernels."""
    got, ref, fused_kv_pass = compile_and_run(case, torch.bfloat16, "cuda")
    assert_matches_eager(got, ref, torch.bfloat16)
    assert_fused(case, fused_kv_pass, torch.bfloat16, "cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", PENDING, ids=[c.name for c in PENDING])
def test_spelling_not_fused_yet_is_explained_and_matches_eager(case, dtype):
    """Spellings of the supported math that do not fuse yet: eager's results, and a reason in the report."""
    got, ref, fused_kv_pass = compile_and_run(case, dtype)
    assert_matches_eager(got, ref, dtype)
    groups, rejected = groups_and_rejections(fused_kv_pass)
    if any(g.n_layers >= N_LAYERS for g in groups):
        return  # fused in this dtype
    assert any(re.search(NOT_YET[case.name], r.reason) for r in rejected), describe(fused_kv_pass)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", NEGATIVE_CASES, ids=[c.name for c in NEGATIVE_CASES])
def test_deviating_layer_not_grouped_and_matches_eager(case, dtype):
    got, ref, fused_kv_pass = compile_and_run(case, dtype)
    assert_matches_eager(got, ref, dtype)
    groups, rejected = groups_and_rejections(fused_kv_pass)
    if case.reason is not None:  # rejected, for the reason the case names
        assert any(re.search(case.reason, r.reason) for r in rejected), describe(fused_kv_pass)
    assert all(g.n_layers < N_LAYERS for g in groups), (
        f"{case.name}: {case.expect}, yet all {N_LAYERS} layers were fused together; {describe(fused_kv_pass)}"
    )
    if case.offending_layer is None:  # every layer deviates
        assert not groups, f"{case.name}: {case.expect}, yet fused: {describe(fused_kv_pass)}"
        return
    offending = re.compile(rf"layers\.{case.offending_layer}\b")
    for group in groups:  # the deviating layer may be fused, but only on its own
        assert group.n_layers == 1 or not any(offending.search(location) for location in group.layers), (
            f"{case.name}: layer {case.offending_layer} ({case.expect}) was fused into {group.layers}"
        )


# The spellings whose cos / sin tables read back to positions and frequencies (rotary_angles.find_angle_source),
# so that the fused launch computes cos / sin itself; every other spelling keeps its tables and says why.
ANGLES_IN_LAUNCH = {
    "hf_qwen3", "hf_qwen3_bias", "gemma3_one_plus_weight", "falcon_h1_unit_key_multiplier", "cohere_interleaved_repeat_interleave",
    "gpt_neox_per_head_qkv_chunk_partial", "phi3_sliced_qkv_partial", "glm_partial_interleaved_repeat_interleave",
    "einsum_projections_qwen3_k_norm",
}
# The deviating-layer cases built on Hugging Face's rotary (the others fuse with that rotary's tables read back)
HF_ROTARY_NEGATIVES = {c.name for c in NEGATIVE_CASES if c.build.func is spelling_corpus.build_deviating}
FUSING_NEGATIVES = [c for c in NEGATIVE_CASES if c.offending_layer is not None]  # some layers still fuse
ANGLE_CASES = [pytest.param(c, torch.float32, id=f"{c.name}-fp32") for c in FUSING + FUSING_NEGATIVES] + [
    pytest.param(c, torch.bfloat16, id=f"{c.name}-bf16") for c in FUSING if c.name in ANGLES_IN_LAUNCH
]


@pytest.fixture
def angles_at_any_token_count(k_epilogue_on_cpu, monkeypatch):
    """conftest's `k_epilogue_on_cpu` (its stand-in launch computes cos / sin from the positions and
    frequencies the lowering read back, so a wrong read-back gives wrong numbers), the angles allowed at any
    token count."""
    from fx_fusion.kernels import grouped_gemv

    monkeypatch.setattr(grouped_gemv, "MAX_ANGLE_TOKENS", 10**6)
    monkeypatch.setattr(grouped_gemv, "MAX_ANGLE_TILE_TOKENS", 10**6)


def epilogues_and_angles(fused_kv_pass) -> tuple[int, int, list[str]]:
    """(grouped GEMMs with the K epilogue, those computing cos / sin themselves, why the others read tables)."""
    records = fused_kv_pass.records
    epilogues = sum(r.gemm_epilogues for r in records)
    assert epilogues >= 1, [note for r in records for note in r.gemm_epilogue_notes]
    notes = [note for r in records for note in r.rotary_angle_notes]
    return epilogues, sum(r.rotary_angles_in_kernel for r in records), notes


@pytest.mark.usefixtures("angles_at_any_token_count")
@pytest.mark.parametrize("case, dtype", ANGLE_CASES)
def test_spelling_through_the_k_epilogue_with_angles_in_the_launch_matches_eager(case, dtype):
    """Every spelling through the K-epilogue lowering (`angles_at_any_token_count`): eager's results; the tables of
    the spellings in ANGLES_IN_LAUNCH (and of the deviating-layer cases, Hugging Face's rotary) are dropped,
    the others keep theirs with a reason."""
    got, ref, fused_kv_pass = compile_and_run(case, dtype)
    assert_matches_eager(got, ref, dtype)
    epilogues, in_launch, notes = epilogues_and_angles(fused_kv_pass)
    if case.name in ANGLES_IN_LAUNCH | HF_ROTARY_NEGATIVES:
        assert in_launch == epilogues and not notes, notes
    else:
        assert in_launch == 0 and len(notes) == epilogues, notes


@pytest.mark.usefixtures("angles_at_any_token_count")
@pytest.mark.parametrize("per_layer_noise", [False, True])
def test_zlab_draft_of_one_sequence_computes_cos_sin_for_context_and_noise_rows(per_layer_noise):
    """z-lab DFlash's draft for one sequence (2 context tokens, 2 noise tokens): both cut their rows from one
    table over all four positions, and every launch, context and noise rows alike, computes its cos / sin
    from the position ids (the noise rows' from the third on); eager's results."""
    case = Case("zlab", "", functools.partial(spelling_corpus.build_zlab_dflash, per_layer_noise=per_layer_noise,
                                              batch=1, tokens=2, q_len=2))  # fmt: skip
    got, ref, fused_kv_pass = compile_and_run(case, torch.float32)
    assert_matches_eager(got, ref, torch.float32)
    epilogues, in_launch, notes = epilogues_and_angles(fused_kv_pass)
    assert epilogues == (4 if per_layer_noise else 2) and in_launch == epilogues, notes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_zlab_draft_of_one_sequence_on_cuda_computes_the_tables_bits():
    """The same draft in bfloat16 on CUDA, through the real launch: its own cos / sin give K and V equal, bit
    for bit, to those of the compile whose launches read the tables."""
    module, inputs = spelling_corpus.build_zlab_dflash(torch.bfloat16, batch=1, tokens=2, q_len=2)
    module, inputs = module.cuda(), tuple(t.cuda() for t in inputs)
    outputs = {}
    with torch.no_grad():
        for in_kernel in (True, False):
            torch._dynamo.reset()
            fused_kv_pass = fx_fusion.FusedKVPass(rotary_angles_in_kernel=in_kernel)
            compiled = torch.compile(module, options={"post_grad_custom_post_pass": fused_kv_pass})
            outputs[in_kernel] = compiled(*inputs)
            epilogues, in_launch, notes = epilogues_and_angles(fused_kv_pass)
            assert in_launch == (epilogues if in_kernel else 0), notes
        ref = module(*inputs)
    assert_matches_eager(outputs[True], ref, torch.bfloat16)
    for got, from_tables in zip(outputs[True], outputs[False]):
        assert torch.equal(got, from_tables)


def test_float32_weights_under_autocast_are_named_as_casts(fresh_compile):
    """Under torch.autocast each linear reads a bfloat16 copy of its float32 weight, made in the graph: the
    K projections are reported as such (the V and other plain linears are not), and the compiled module
    gives autocast eager's results."""
    case = next(c for c in CASES if c.name == "hf_qwen3")
    module, inputs = case.build(torch.float32)
    fused_kv_pass = fx_fusion.FusedKVPass()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = module(*inputs)
        got = torch.compile(module, options={"post_grad_custom_post_pass": fused_kv_pass})(*inputs)
    assert_matches_eager(got, ref, torch.bfloat16)
    groups, rejected = groups_and_rejections(fused_kv_pass)
    assert not groups
    cast = "projection weight is a parameter cast to torch.bfloat16 in the graph"
    assert sorted(r.location.split()[0] for r in rejected if cast in r.reason) == [
        f"layers.{i}.k_proj" for i in range(N_LAYERS)
    ], describe(fused_kv_pass)
    assert not any("v_proj" in r.location for r in rejected), describe(fused_kv_pass)


class _NearlyRotated(torch.nn.Module):
    """K times cos plus a buffer times sin, the buffer built like lmdeploy's rotate_half but not into a
    rotation: half left as zeros, half left uninitialised, or an addcmul that scales the rotated half; and
    one that is a rotation, the rotated half multiplied by 1."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        width = spelling_corpus.KV_HEADS * spelling_corpus.HEAD_DIM
        self.k_proj = torch.nn.ModuleList(torch.nn.Linear(spelling_corpus.HIDDEN, width) for _ in range(N_LAYERS))

    def forward(self, x, cos, sin):
        outs = []
        for k_proj in self.k_proj:
            k = k_proj(x).unflatten(-1, (spelling_corpus.KV_HEADS, spelling_corpus.HEAD_DIM))
            half = k.shape[-1] // 2
            if self.variant in ("addcmul_scaled", "unit_factor"):
                rotated = torch.cat((-k[..., half:], k[..., :half]), -1)
                if self.variant == "unit_factor":
                    outs.append(k * cos + 1 * rotated * sin)
                else:
                    outs.append(torch.addcmul(k * cos, rotated, sin, value=2.0))
                continue
            rotated = torch.zeros_like(k) if self.variant == "zeros_half" else torch.empty_like(k)
            rotated[..., :half] = -k[..., half:]
            outs.append(k * cos + rotated * sin)
        return tuple(outs)


@pytest.mark.parametrize("variant", ["zeros_half", "empty_half", "addcmul_scaled"])
def test_slice_assignments_and_addcmul_that_do_not_rotate_stay_as_written(variant):
    """The slice-assigned buffer and addcmul spellings are read as a rotation only when they are one: a
    buffer written in part (zeros, or garbage where uninitialised) or a rotated half scaled by 2 is not."""
    module = _NearlyRotated(variant).eval()
    x = torch.randn(spelling_corpus.BATCH, spelling_corpus.TOKENS, spelling_corpus.HIDDEN)
    angles = torch.rand(spelling_corpus.TOKENS, spelling_corpus.HEAD_DIM // 2) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1)[:, None] for f in (torch.cos, torch.sin))
    fused_kv_pass = fx_fusion.FusedKVPass()
    compiled = torch.compile(module, options={"post_grad_custom_post_pass": fused_kv_pass})
    got = compiled(x, cos, sin)
    if variant != "empty_half":  # garbage in both: nothing to compare
        assert_matches_eager(got, module(x, cos, sin), torch.float32)
    groups, rejected = groups_and_rejections(fused_kv_pass)
    assert not groups, describe(fused_kv_pass)
    assert any(r.reason.startswith("K is not rotated") for r in rejected), describe(fused_kv_pass)


def test_a_rotation_through_a_multiply_by_one_fuses():
    """`self + value * t1 * t2`, addcmul as torch 2.11 decomposes it on CUDA: the rotated half times 1
    (an exact identity) before sin. Fuses, with eager's results."""
    module = _NearlyRotated("unit_factor").eval()
    x = torch.randn(spelling_corpus.BATCH, spelling_corpus.TOKENS, spelling_corpus.HIDDEN)
    angles = torch.rand(spelling_corpus.TOKENS, spelling_corpus.HEAD_DIM // 2) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1)[:, None] for f in (torch.cos, torch.sin))
    fused_kv_pass = fx_fusion.FusedKVPass()
    got = torch.compile(module, options={"post_grad_custom_post_pass": fused_kv_pass})(x, cos, sin)
    assert_matches_eager(got, module(x, cos, sin), torch.float32)
    groups, _ = groups_and_rejections(fused_kv_pass)
    assert [g.n_layers for g in groups] == [N_LAYERS], describe(fused_kv_pass)


def test_zlab_context_rows_fuse_and_noise_rows_keep_their_own_path():
    """z-lab's DFlash draft concatenates context and noise K along tokens before the norm: with a noise
    block of its own per layer, the context projections of all layers form one group and each layer's
    noise projection a group of its own (one input each)."""
    case = next(c for c in CASES if c.name == "zlab_dflash_per_layer_noise")
    got, ref, fused_kv_pass = compile_and_run(case, torch.float32)
    assert_matches_eager(got, ref, torch.float32)
    groups, _ = groups_and_rejections(fused_kv_pass)
    (context,) = [g for g in groups if g.n_layers == N_LAYERS]
    noise = [g for g in groups if g is not context]
    assert len(noise) == N_LAYERS and all(g.n_layers == 1 for g in noise), describe(fused_kv_pass)
    context_line = {location.split("line ")[1] for location in context.layers}
    assert not {g.layers[0].split("line ")[1] for g in noise} & context_line, describe(fused_kv_pass)


def test_explain_vllm_model_factory():
    """The factory `python -m fx_fusion explain tests/spelling_corpus.py:explain_vllm_model` imports."""
    from fx_fusion.cli import call_factory, load_factory

    factory = load_factory(os.path.join(os.path.dirname(os.path.abspath(__file__)), "spelling_corpus.py:explain_vllm_model"))
    module, args, kwargs = call_factory(factory)
    # load_factory imports the file under its own module name: compare the class by name
    assert type(module).__name__ == spelling_corpus.VllmContext.__name__ and len(args) == 2 and kwargs == {}
    with torch.no_grad():
        assert len(module(*args)) == 2 * N_LAYERS


def corpus_table() -> list[tuple[str, str, str]]:
    """(case, dtype, outcome) for every case: 'fused (...)', 'not fused (...)' or 'error: ...'."""
    rows = []
    for case in CASES + NEGATIVE_CASES:
        for dtype in DTYPES:
            torch._dynamo.reset()
            label = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
            try:
                with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
                    enable_autograd_cache=False
                ):
                    got, ref, fused_kv_pass = compile_and_run(case, dtype)
                try:
                    assert_matches_eager(got, ref, dtype)
                    numerics = "matches eager"
                except AssertionError as exc:
                    numerics = f"MISMATCH vs eager ({str(exc).splitlines()[0][:80]})"
                groups, rejected = groups_and_rejections(fused_kv_pass)
                sizes = [g.n_layers for g in groups]
                reasons = "; ".join(sorted({r.reason for r in rejected}))[:300]
                if any(n >= N_LAYERS for n in sizes):
                    outcome = f"fused {sizes}"
                else:
                    outcome = f"not fused {sizes or ''}".rstrip() + (f" ({reasons})" if reasons else " (no candidate)")
                rows.append((case.name, label, f"{outcome}; {numerics}"))
            except Exception as exc:  # report, do not stop the table
                rows.append((case.name, label, f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
    torch._dynamo.reset()
    return rows


if __name__ == "__main__":
    for name, label, outcome in corpus_table():
        print(f"{name:<34} {label}  {outcome}")


# ----------------------------------------------------------------------------------------------------------
# Random compositions of equivalent spellings, one per piece (projection cut, norm form, rotary form, dtype)

def _norm(form, k, weight, eps=1e-6):
    x = k if form == "no_upcast" else k.float()
    if form == "sqrt_divide":
        normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    elif form == "rms_norm":
        normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)
    else:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if form == "in_place":  # nano-vllm: in float32, x is k itself, so this updates the projection output
        x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        return x.to(k.dtype).mul_(weight)
    if form in ("weight_in_float32", "one_plus_weight"):
        scale = weight.float() + (1.0 if form == "one_plus_weight" else 0.0)
        return (normed * scale).to(k.dtype)
    return weight * normed.to(k.dtype)


def _rotate(form, k, cos, sin):
    """k [T, H, D]; cos, sin [T, D // 2] (one value per frequency)."""
    cos, sin = cos.unsqueeze(1).to(k.dtype), sin.unsqueeze(1).to(k.dtype)
    if form in ("halves_slices", "halves_chunk"):
        half = k.shape[-1] // 2
        x1, x2 = k.chunk(2, dim=-1) if form == "halves_chunk" else (k[..., :half], k[..., half:])
        return k * torch.cat((cos, cos), -1) + torch.cat((-x2, x1), -1) * torch.cat((sin, sin), -1)
    if form == "cos_sin_halves":
        x1, x2 = torch.chunk(k, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if form == "negated_sin_table":  # modded-nanogpt: a rotation by -angle, its -sin a table of its own
        x1, x2 = torch.chunk(k, 2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos), dim=-1)
    if form == "complex":  # Meta Llama: pairs as complex numbers times cos + i sin
        freqs = torch.complex(cos.float(), sin.float())
        pairs = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs).flatten(-2).to(k.dtype)
    x1, x2 = k[..., ::2], k[..., 1::2]  # GPT-J pairs
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class _Composed(torch.nn.Module):
    def __init__(self, projection, norm, rotary, heads=2, head_dim=16, hidden=48):
        super().__init__()
        self.projection, self.norm, self.rotary, self.heads, self.head_dim = projection, norm, rotary, heads, head_dim
        kv = heads * head_dim
        width = 3 * kv if projection in ("qkv_split", "head_chunk", "permuted_groups") else kv
        self.k = torch.nn.ModuleList(torch.nn.Linear(hidden, width) for _ in range(N_LAYERS))
        self.v = torch.nn.ModuleList(torch.nn.Linear(hidden, kv) for _ in range(N_LAYERS))
        self.w = torch.nn.ParameterList(torch.nn.Parameter(1 + 0.2 * torch.randn(head_dim)) for _ in range(N_LAYERS))

    def forward(self, x, cos, sin):
        outs, kv = [], self.heads * self.head_dim
        for k_proj, v_proj, weight in zip(self.k, self.v, self.w):
            tokens = x.shape[0]
            if self.projection == "qkv_split":
                _, k, v = k_proj(x).split([kv, kv, kv], dim=-1)
            elif self.projection == "head_chunk":  # modded-nanogpt: view as heads, cut along them
                _, k, v = k_proj(x).view(tokens, 3 * self.heads, self.head_dim).chunk(3, dim=-2)
            elif self.projection == "permuted_groups":  # litgpt: per-head groups, permuted, then cut
                qkv = k_proj(x).view(tokens, self.heads, 3, self.head_dim).permute(1, 2, 0, 3)
                _, k, v = qkv.split((1, 1, 1), dim=1)
                k, v = k.squeeze(1).transpose(0, 1), v.squeeze(1).transpose(0, 1)
            else:
                k, v = k_proj(x), v_proj(x)
            k = k.reshape(tokens, self.heads, self.head_dim)
            if self.norm != "none":
                k = _norm(self.norm, k, weight)
            outs += [_rotate(self.rotary, k, cos, sin), v]
        return outs


@settings(max_examples=int(os.environ.get("FX_FUSION_SPELLING_EXAMPLES", "6")), deadline=None, derandomize=True)
@given(
    projection=st.sampled_from(["separate", "qkv_split", "head_chunk", "permuted_groups"]),
    norm=st.sampled_from(
        ["hf", "no_upcast", "sqrt_divide", "rms_norm", "weight_in_float32", "one_plus_weight", "in_place", "none"]
    ),
    rotary=st.sampled_from(["halves_slices", "halves_chunk", "cos_sin_halves", "negated_sin_table", "complex", "pairs"]),
    dtype=st.sampled_from(DTYPES),
)
def test_random_spelling_compositions_fuse_and_match_eager(projection, norm, rotary, dtype):
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = _Composed(projection, norm, rotary).to(dtype)
    angles = torch.randn(5, module.head_dim // 2)
    inputs = (torch.randn(5, 48, dtype=dtype), angles.cos().to(dtype), angles.sin().to(dtype))
    fused_kv_pass = fx_fusion.FusedKVPass()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        ref = module(*inputs)
        got = torch.compile(module, options={"post_grad_custom_post_pass": fused_kv_pass})(*inputs)
    assert_matches_eager(got, ref, dtype)
    groups, rejected = groups_and_rejections(fused_kv_pass)
    if projection == "permuted_groups" and norm == "in_place" and dtype == torch.float32:
        # Known limit: an in-place update through a permuted view is functionalised into scatters that
        # scatter_forwarding does not read back yet; the layers stay unfused, each with a reason.
        assert not groups and len(rejected) >= N_LAYERS, describe(fused_kv_pass)
        return
    assert [g.n_layers for g in groups] == [N_LAYERS], describe(fused_kv_pass)
    assert groups[0].k_norm == (norm != "none")
    assert groups[0].rotary_style == ("interleaved" if rotary in ("pairs", "complex") else "neox")


@pytest.mark.parametrize("dynamic_piece", ["context", "noise"])
def test_zlab_token_cat_fuses_with_one_piece_of_dynamic_length(dynamic_piece):
    """The z-lab DFlash concatenation with one dynamic piece (a varying context beside a fixed noise block,
    or the reverse): the other piece's length is a plain number in the graph, the dynamic one's a symbol,
    and each piece's cos/sin rows start where the earlier pieces end. Both layers' context and noise rows
    fuse, as at static sizes."""
    (case,) = [c for c in CASES if c.name == "zlab_dflash_ctx_noise_cat"]
    module, (noise, target, positions) = case.build(torch.float32)
    torch._dynamo.mark_dynamic(target if dynamic_piece == "context" else noise, 1)
    torch._dynamo.mark_dynamic(positions, 1)
    fused_kv_pass = fx_fusion.FusedKVPass()
    with torch.no_grad():
        compiled = torch.compile(module, options={"post_grad_custom_post_pass": fused_kv_pass})
        assert_matches_eager(compiled(noise, target, positions), module(noise, target, positions), torch.float32)
    groups, rejected = groups_and_rejections(fused_kv_pass)
    assert [g.n_layers for g in groups] == [N_LAYERS, N_LAYERS] and not rejected, describe(fused_kv_pass)


@pytest.mark.parametrize("case", FUSING, ids=[c.name for c in FUSING])
def test_spelling_fuses_with_dynamic_shapes(case):
    """Each spelling compiled with dynamic=True (every size symbolic: views of symbolic shapes in the rotary
    region, symbolic split sizes, strided pieces of symbolic token axes, token concatenations of symbolic
    length) matches eager and fuses."""
    module, inputs = case.build(torch.float32)
    fused_kv_pass = fx_fusion.FusedKVPass()
    with torch.no_grad():
        compiled = torch.compile(module, dynamic=True, options={"post_grad_custom_post_pass": fused_kv_pass})
        assert_matches_eager(compiled(*inputs), module(*inputs), torch.float32)
    groups, _ = groups_and_rejections(fused_kv_pass)
    assert any(g.n_layers >= N_LAYERS for g in groups), f"{case.name}: {describe(fused_kv_pass)}"
