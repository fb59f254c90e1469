"""Whole Hugging Face causal LMs (small random configs, fp32, CPU) compiled with backend="fx_fusion".

For each family: the compiled forward's logits equal eager, the pass reported on every graph it saw, and
every projection that shares its input with another projection of the same width is accounted for: in a
fused group, a view of a fused group's grouped GEMM (V), or left alone with a reason; each layer's Q and
K (MHA and GQA, with and without q/k norms) are one fused group with V a view. Greedy `generate`
on a compiled forward (static cache; DynamicCache for one family) gives eager's tokens.

Compile time dominates (about 5-15 s a model on 2 cores), so each family runs at one batch size; Llama
(GQA) runs at two.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._inductor.utils

transformers = pytest.importorskip("transformers")

import fx_fusion  # noqa: F401  (registers backend="fx_fusion")
from fx_fusion.diagnostics import RecordSink

pytestmark = pytest.mark.usefixtures("fresh_compile")

SEQ_LEN = 7
VOCAB = 128
TOLERANCE = dict(rtol=1e-4, atol=1e-4)

# The shared tiny sizes; every family below gets these (families without a head_dim argument derive
# hidden / heads = 16).
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    intermediate_size=128,
    max_position_embeddings=64,
    pad_token_id=0,  # token ids inside the tiny vocabulary (Phi-3's default pad id 32000 breaks nn.Embedding)
    bos_token_id=1,
    eos_token_id=2,
)


@dataclasses.dataclass(frozen=True)
class Family:
    config_class: str
    model_class: str
    extra: tuple = ()  # (name, value) pairs added to COMMON
    attn: str = "sdpa"

    def kwargs(self) -> dict[str, Any]:
        return {**COMMON, **dict(self.extra)}



HEAD_DIM = (("head_dim", 16),)
FAMILIES = {
    "llama-gqa": Family("LlamaConfig", "LlamaForCausalLM", HEAD_DIM),
    "llama-mha": Family("LlamaConfig", "LlamaForCausalLM", HEAD_DIM + (("num_key_value_heads", 4),)),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", HEAD_DIM),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM"),  # q/k/v with bias
    "mistral": Family("MistralConfig", "MistralForCausalLM", HEAD_DIM),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", HEAD_DIM),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM"),  # one fused qkv_proj, one fused gate_up_proj
    "olmo": Family("OlmoConfig", "OlmoForCausalLM"),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM"),  # q/k norm over the whole projection
    "qwen3-moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        HEAD_DIM + (("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32)),
    ),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    family = FAMILIES[name]
    config_class = getattr(transformers, family.config_class, None)
    model_class = getattr(transformers, family.model_class, None)
    if config_class is None or model_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family.config_class}/{family.model_class}")
    config = config_class(**family.kwargs())
    config._attn_implementation = family.attn
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # Non-trivial norm weights, so that a wrongly applied (or dropped) norm weight shows in the logits.
    low, high = (-0.5, 0.5) if _zero_centred(config) else (0.5, 1.5)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name and param.dim() == 1:
                param.uniform_(low, high)
    return model


def _zero_centred(config) -> bool:
    """Gemma's RMSNorm scales by (1 + weight)."""
    return "gemma" in type(config).__name__.lower()


def input_ids(batch: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=generator)


# ----------------------------------------------------------------------------------------------------------
# What the pass reported


def describe(records: list) -> str:
    """Every record's summary, then each fused group and each rejection on a line of its own."""
    lines = [f"{len(records)} record(s)"]
    for i, record in enumerate(records):
        lines.append(f"[{i}] {record.stage}: {record.summary()}")
        for group in record.fused_groups:
            lines.append(
                f"    fused: {group.n_layers} x {group.num_kv_heads} heads x {group.head_dim}, "
                f"v_as_view={group.v_as_view}: {[module_of(loc) for loc in group.layers]}"
            )
        for rejection in record.rejected:
            lines.append(f"    left alone: {module_of(rejection.location)}: {rejection.reason}")
    return "\n".join(lines)


def module_of(location: str) -> str:
    """'[0].model.layers.0.self_attn.k_proj ("file", line 3, in forward)' -> 'model.layers.0.self_attn.k_proj'."""
    head = location.split(" ", 1)[0]
    return re.sub(r"^(\[\d+\]\.)+", "", head)


def names_module(location: str, name: str) -> bool:
    path = module_of(location)
    return path == name or path.endswith("." + name)


def sibling_projections(model: torch.nn.Module, ids: torch.Tensor) -> list[list[tuple[str, int]]]:
    """Sets of nn.Linear modules that read the same input tensor in one eager forward, each member with
    its output width; only sets where some width occurs at least twice."""
    readers: dict[int, list[tuple[str, int]]] = {}
    keep_alive: list[torch.Tensor] = []
    handles = []

    def hook_for(name: str, width: int) -> Callable:
        def hook(_module, args):
            keep_alive.append(args[0])  # so that no later tensor reuses the id
            readers.setdefault(id(args[0]), []).append((name, width))

        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(hook_for(name, module.out_features)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    sets = []
    for members in readers.values():
        widths = [w for _, w in members]
        if any(widths.count(w) > 1 for w in widths):
            sets.append(members)
    return sets


def check_accounted(model, ids, records: list) -> None:
    """Every projection with a same-width sibling on its input is fused, a view of a fused GEMM, or left
    alone with a non-empty reason."""
    text = describe(records)
    assert records, "the pass emitted no record (did it run?)"
    fused = [loc for r in records for g in r.fused_groups for loc in g.layers]
    rejected = [(j.location, j.reason) for r in records for j in r.rejected]
    views = sum(g.v_as_view for r in records for g in r.fused_groups)
    for location, reason in rejected:
        assert reason and reason.strip(), f"empty reason for {location}\n{text}"
    unaccounted = []
    sets = sibling_projections(model, ids)
    fused_qkv = any(name.endswith("qkv_proj") for name, _ in model.named_modules())
    # (one fused qkv linear has no sibling linears; check_attention_projections covers it)
    assert sets or fused_qkv, "expected projections that share their input (q/k/v, gate/up)"
    for members in sets:
        widths = [w for _, w in members]
        for name, width in members:
            if widths.count(width) < 2:
                continue
            if any(names_module(loc, name) for loc in fused):
                continue
            if any(names_module(loc, name) and reason for loc, reason in rejected):
                continue
            # A projection that joined a group's grouped GEMM without being its K (a V) is not named in
            # the record, only counted: it must read the same input as a fused projection.
            beside_fused = any(any(names_module(loc, other) for loc in fused) for other, _ in members)
            assert beside_fused, f"{name}: neither fused nor rejected with a reason, and no fused sibling\n{text}"
            unaccounted.append(name)
    assert len(unaccounted) <= views, (
        f"{len(unaccounted)} projection(s) neither fused nor rejected, but only {views} V-as-view slot(s) to "
        f"explain them: {unaccounted}\n{text}"
    )


# Families whose layers keep Q and K apart, and why (the reason the pass must give)
QK_APART = {"olmo2": "over the whole projection"}  # q_norm/k_norm over all heads at once, not per head


def check_attention_projections(family_name: str, model, records: list) -> None:
    """Each layer's Q and K projections (or its fused qkv) are fused into one group of their own: Q's
    num_attention_heads and K's num_key_value_heads in blocks of their gcd, V a view of the same GEMM;
    or, in the QK_APART families, left alone with the expected reason."""
    text = describe(records)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = [config.num_attention_heads, config.num_key_value_heads]
    groups = [g for r in records for g in r.fused_groups]
    rejected = [(j.location, j.reason) for r in records for j in r.rejected]
    for layer in range(config.num_hidden_layers):
        attn = model.model.layers[layer].self_attn
        prefix = f"model.layers.{layer}.self_attn."
        fused_qkv = hasattr(attn, "qkv_proj")
        wanted = ["qkv_proj"] if fused_qkv else ["q_proj", "k_proj"]
        in_group = [g for g in groups if any(names_module(loc, prefix + wanted[0]) for loc in g.layers)]
        if family_name in QK_APART:
            reasons = [reason for loc, reason in rejected if any(names_module(loc, prefix + p) for p in wanted)]
            assert not in_group and any(QK_APART[family_name] in r for r in reasons), text
            continue
        assert len(in_group) == 1, f"{prefix}: Q and K not in one fused group\n{text}"
        (group,) = in_group
        members = [module_of(loc) for loc in group.layers]
        expected = [prefix + "qkv_proj"] * 2 if fused_qkv else [prefix + "q_proj", prefix + "k_proj"]
        assert [m[m.index("model.layers."):] for m in members] == expected, text
        assert group.layer_heads == heads and group.num_kv_heads == math.gcd(*heads), text
        assert group.head_dim == head_dim and group.v_as_view == (0 if fused_qkv else 1), text
        reasons = [reason for loc, reason in rejected if any(names_module(loc, prefix + p) for p in wanted)]
        assert not reasons, f"{prefix}: fused and also left alone\n{text}"


# ----------------------------------------------------------------------------------------------------------
# Tests

CASES = [
    ("llama-gqa", 1),
    ("llama-gqa", 2),
    ("llama-mha", 1),
    ("qwen3", 1),
    ("qwen2", 2),
    ("mistral", 2),
    ("gemma3", 1),
    ("phi3", 1),
    ("olmo", 2),
    ("olmo2", 1),
    ("qwen3-moe", 1),
]


@pytest.mark.parametrize("name,batch", CASES, ids=[f"{n}-b{b}" for n, b in CASES])
def test_compiled_logits_match_eager_and_projections_accounted(name, batch):
    model = build(name)
    ids = input_ids(batch)
    with torch.no_grad():
        expected = model(ids).logits
        records: list = []
        with RecordSink.collect(records):
            compiled = torch.compile(model, backend="fx_fusion")
            actual = compiled(ids).logits
    text = describe(records)
    torch.testing.assert_close(actual, expected, **TOLERANCE, msg=lambda m: f"{m}\n{text}")
    check_accounted(model, ids, records)
    check_attention_projections(name, model, records)
    check_mlp_reasons(records)
    check_strided_views(records)


def check_strided_views(records: list) -> None:
    """A GQA layer's Q and K (heads in several blocks) are handed to attention as strided views of the
    token-major output, at any batch, so that Inductor does not copy Q in front of attention."""
    for group in (g for r in records for g in r.fused_groups if len(set(g.layer_heads)) > 1):
        assert group.strided_views == len(group.layer_heads), describe(records)


def check_mlp_reasons(records: list) -> None:
    """An MLP's linears are never rotated: the report says so, not that their activation (Gemma's gelu-tanh
    cubes its input, a MoE router's softmax subtracts the max) is a K norm that failed to match."""
    text = describe(records)
    for record in records:
        for rejection in record.rejected:
            if ".mlp." in module_of(rejection.location):
                assert rejection.reason.startswith("left as a plain linear: no rotary embedding"), text


def test_gated_attention_of_a_hybrid_model_fuses_q_and_k():
    """Qwen3.5 (Qwen3-Next's successor): linear-attention layers beside gated full attention, whose q_proj
    yields each head's query and its output gate side by side ([H, 2 * D], cut with chunk), a (1 + w)
    norm on Q and K and a RoPE over a quarter of each head. Logits match eager; the full-attention
    layer's Q and K are each fused (Q's heads lie 2 * D apart, so Q does not join K as blocks of heads)."""
    family = Family(
        "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", HEAD_DIM + (("layer_types", ["linear_attention", "full_attention"]),)
    )
    FAMILIES["qwen3.5"] = family
    try:
        model = build("qwen3.5")
    finally:
        del FAMILIES["qwen3.5"]
    ids = input_ids(1)
    with torch.no_grad():
        expected = model(ids).logits
        records: list = []
        with RecordSink.collect(records):
            actual = torch.compile(model, backend="fx_fusion")(ids).logits
    text = describe(records)
    torch.testing.assert_close(actual, expected, **TOLERANCE, msg=lambda m: f"{m}\n{text}")
    check_accounted(model, ids, records)
    check_mlp_reasons(records)
    fused = [module_of(loc) for r in records for g in r.fused_groups for loc in g.layers]
    for projection in ("q_proj", "k_proj"):
        assert any(m.endswith(f"layers.1.self_attn.{projection}") for m in fused), text


def _generate(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=False,
            disable_compile=True,  # no automatic compile of the eager reference on an accelerator
            pad_token_id=0,
            **kwargs,
        )


# Llama MHA with the default DynamicCache: the fused Q+K groups through prefill, decode and the
# dynamic-length recompile.
GENERATE_CASES = [("llama-gqa", "static"), ("qwen3", "static"), ("llama-mha", None)]


@pytest.mark.parametrize(
    "name,cache", GENERATE_CASES, ids=[f"{n}-{c or 'dynamic'}" for n, c in GENERATE_CASES]
)
def test_generate_with_compiled_forward_matches_eager(name, cache):
    model = build(name)
    ids = input_ids(1, seed=2)
    kwargs = {"cache_implementation": cache} if cache else {}
    expected = _generate(model, ids, **kwargs)
    records: list = []
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, backend="fx_fusion")
    try:
        with RecordSink.collect(records):
            actual = _generate(model, ids, **kwargs)
    finally:
        model.forward = eager_forward
    text = describe(records)
    assert expected.shape[1] > SEQ_LEN, expected.shape
    assert torch.equal(actual, expected), f"compiled {actual.tolist()} != eager {expected.tolist()}\n{text}"
    assert records, "the pass emitted no record during generate"
    # prefill and decode graphs each go through the pass, and each accounts for every layer's Q and K
    for record in records:
        check_attention_projections(name, model, [record])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seq_len", [5, 200])
def test_whole_model_fused_work_is_inductor_code_on_cuda(seq_len):
    """A whole Llama (GQA) model on CUDA: each layer's Q+K group reaches Inductor as kernel launches in its
    generated code, at few tokens (the grouped GEMM with the K epilogue) and at many (cuBLAS GEMMs and the
    materialization kernel): no fused op is left as an op call dispatched from Python, and attention reads
    each layer's Q straight from that kernel's output (no copy of Q in between)."""
    # head_dim 64: Q's 256 and K's 128 rows are blocks of 128 rows, wide enough for the grouped kernel
    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 256, "head_dim": 64, "intermediate_size": 512})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to("cuda", torch.bfloat16)
    ids = torch.randint(3, VOCAB, (1, seq_len), device="cuda")
    with torch.no_grad():
        expected = model(ids).logits.float()
        records: list = []
        with RecordSink.collect(records):
            compiled = torch.compile(model, backend="fx_fusion")
            actual, codes = torch._inductor.utils.run_and_get_code(compiled, ids)
    text = describe(records)
    torch.testing.assert_close(actual.logits.float(), expected, rtol=2e-2, atol=2e-2, msg=lambda m: f"{m}\n{text}")
    code = "\n".join(codes)
    assert len([g for r in records for g in r.fused_groups]) == model.config.num_hidden_layers, text
    assert all(not r.ops_kept for r in records), [r.ops_kept for r in records]
    assert "torch.ops.fx_fusion" not in code, "a fused op is still called from Python"
    kernel = "_grouped_gemv_kernel" if seq_len <= 32 else "_fused_kv_materialize_kernel"
    assert kernel in code, text
    launches = "\n".join(line for line in code.splitlines() if kernel in line and ".run(" in line)
    queries = re.findall(r"= torch\.ops\.aten\._scaled_dot_product_\w+\.default\((?:reinterpret_tensor\()?(buf\d+)\b", code)
    assert len(queries) == model.config.num_hidden_layers, code
    for query in queries:
        assert re.search(rf"\b{query}\b", launches), f"attention reads Q from {query}, not written by {kernel}:\n{code}"


def outputs_match_eager(config, model_class, batch: int = 2) -> tuple[list, str]:
    """A sdpa model of `config` compiled with the backend: its logits (a bare decoder's last hidden states)
    against eager's; returns the pass's records and their description."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_class(config).eval()
    ids = input_ids(batch)
    first = lambda out: out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state  # noqa: E731
    with torch.no_grad():
        expected = first(model(ids))
        records: list = []
        with RecordSink.collect(records):
            actual = first(torch.compile(model, backend="fx_fusion")(ids))
    text = describe(records)
    torch.testing.assert_close(actual, expected, **TOLERANCE, msg=lambda m: f"{m}\n{text}")
    return records, text


@pytest.mark.parametrize("name", ["Qwen2VLText", "Qwen2_5_VLText", "Qwen3VLText"])
def test_multimodal_rope_text_models_fuse_each_layers_q_and_k(name):
    """The text decoders of Qwen2-VL, Qwen2.5-VL and Qwen3-VL build cos/sin from three position streams
    cut into sections (M-RoPE); per token and frequency it is still one cos/sin table, so each layer's Q
    and K fuse as with a plain RoPE, and the hidden states equal eager."""
    config_class, model_class = getattr(transformers, f"{name}Config", None), getattr(transformers, f"{name}Model", None)
    if config_class is None or model_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}Model")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # head_dim 16: 8 frequencies
    sizes = {k: v for k, v in COMMON.items() if k not in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = config_class(**sizes, head_dim=16, rope_parameters=rope)
    records, text = outputs_match_eager(config, model_class, batch=1)
    groups = [g for r in records for g in r.fused_groups]
    assert [(g.n_layers, g.layer_heads) for g in groups] == [(2, [4, 2])] * config.num_hidden_layers, text


FALCON_LAYOUTS = {
    # layout: (config extra, fused groups per layer as (n_layers, unit heads, layer_heads), Q's reason or None)
    "multi_query": ({}, (2, 1, [4, 1]), None),  # Falcon-7B: Q's 4 heads and the one K head, blocks of 1
    "per_head": ({"multi_query": False}, (1, 4, [4]), "not evenly spaced"),  # Q and K heads interleave
    "new_decoder_kv1": ({"new_decoder_architecture": True, "num_kv_heads": 1}, (2, 1, [4, 1]), None),
    "new_decoder_kv2": ({"new_decoder_architecture": True, "num_kv_heads": 2}, (1, 2, [2]), None),
}


@pytest.mark.parametrize("layout", list(FALCON_LAYOUTS))
def test_falcon_qkv_cuts_fuse_each_layers_k(layout):
    """Falcon cuts its fused query_key_value with index lists (`qkv[..., [-2], :]`), a select
    (`qkv[..., 1, :]`) or, in the new decoder architecture, index lists per KV group with K broadcast to
    every query head before RoPE: each layer's K is fused (with Q where Q's heads are evenly spaced
    blocks beside it), the broadcast replayed on the fused K, and the logits equal eager."""
    extra, (n_layers, unit, layer_heads), q_reason = FALCON_LAYOUTS[layout]
    config = transformers.FalconConfig(**{**COMMON, "num_attention_heads": 4, **extra})
    records, text = outputs_match_eager(config, transformers.FalconForCausalLM)
    groups = [g for r in records for g in r.fused_groups]
    head_dim = config.hidden_size // config.num_attention_heads
    assert [(g.n_layers, g.num_kv_heads, g.head_dim, g.layer_heads) for g in groups] == [
        (n_layers, unit, head_dim, layer_heads)
    ] * config.num_hidden_layers, text
    for layer, group in enumerate(groups):
        assert all(names_module(loc, f"transformer.h.{layer}.self_attention.query_key_value") for loc in group.layers), text
    reasons = [j.reason for r in records for j in r.rejected if "query_key_value" in j.location]
    if q_reason is None:
        assert not reasons, text
    else:
        assert len(reasons) == config.num_hidden_layers and all(q_reason in r for r in reasons), text


def test_gpt_neox_per_head_qkv_fuses_each_layers_k():
    """GPT-NeoX (Pythia) lays its fused qkv out per head, `qkv.view(B, T, H, 3 * D).transpose(1, 2)` cut
    with `chunk(3, dim=-1)`, and rotates a quarter of each head: each layer's K is fused (K heads 3 * D
    columns apart, 4 rotary dims), its Q stays apart (Q and K heads interleave, so they are not evenly
    spaced blocks: the reason says so), and the logits equal eager."""
    config = transformers.GPTNeoXConfig(**{**COMMON, "num_attention_heads": 4, "num_key_value_heads": None})
    records, text = outputs_match_eager(config, transformers.GPTNeoXForCausalLM)
    groups = [g for r in records for g in r.fused_groups]
    head_dim = config.hidden_size // config.num_attention_heads
    rotary_fraction = getattr(config, "rotary_pct", None) or config.rope_parameters["partial_rotary_factor"]
    assert [(g.n_layers, g.num_kv_heads, g.head_dim, g.rotary_dim) for g in groups] == [
        (1, 4, head_dim, int(head_dim * rotary_fraction))
    ] * config.num_hidden_layers, text
    for layer, group in enumerate(groups):
        assert names_module(group.layers[0], f"gpt_neox.layers.{layer}.attention.query_key_value"), text
    reasons = [j.reason for r in records for j in r.rejected]
    assert len(reasons) == config.num_hidden_layers and all("not evenly spaced" in r for r in reasons), text
