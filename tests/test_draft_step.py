"""fx_fusion.draft_step: a whole DFlash-style draft step, eager and compiled (CPU, small sizes)."""

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache

import fx_fusion  # noqa: F401  (registers backend="fx_fusion")
from fx_fusion.diagnostics import RecordSink
from fx_fusion.draft_step import draft_step_inputs, qwen3_draft_step
from fx_fusion.drafts import ContextKV

N_LAYERS, BATCH, CTX_TOKENS, BLOCK_SIZE, MAX_LEN = 3, 2, 5, 4, 32
# Unwritten cache rows hold this. Finite: masked rows still enter the attention matmuls (weight 0), and a
# visible sentinel row would swamp the attention, so a wrong mask shows in the output too.
SENTINEL = 1000.0


def step_inputs(module, n_steps):
    """Inputs of consecutive steps: each step's context is the T tokens after the previous one's."""
    return [
        draft_step_inputs(module, BATCH, CTX_TOKENS, BLOCK_SIZE, start=i * CTX_TOKENS, seed=10 + i)
        for i in range(n_steps)
    ]


def run_steps(step, module, steps):
    """[(output, [k cache per layer], [v cache per layer]) after each step], from sentinel-filled caches."""
    module.reset_caches(fill_value=SENTINEL)
    results = []
    with torch.no_grad():
        for inputs in steps:
            out = step(*inputs)
            results.append((out, [c.k.clone() for c in module.caches], [c.v.clone() for c in module.caches]))
    return results


def assert_close(got, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        err = (got.double() - ref.double()).norm() / ref.double().norm()
        assert err < 1e-2, err


def hf_reference(module, steps):
    """The last step's output from HF's own `Qwen3DecoderLayer.forward`: its attention over a DynamicCache
    holding every step's context K/V so far, with an all-visible mask (non-causal over the block)."""
    target_hidden = torch.cat([s[0] for s in steps], dim=1)
    ctx_positions = torch.cat([s[1] for s in steps], dim=1)
    _, _, noise, block_positions = steps[-1]
    context_kv = ContextKV([layer.self_attn for layer in module.layers], module.rotary_emb)
    kv = context_kv(target_hidden, ctx_positions)
    cache = DynamicCache()
    for i in range(N_LAYERS):
        cache.update(kv[2 * i], kv[2 * i + 1], i)
    mask = torch.zeros(BATCH, 1, BLOCK_SIZE, target_hidden.shape[1] + BLOCK_SIZE, dtype=noise.dtype)
    cos_sin = module.rotary_emb(noise, block_positions)
    hidden = noise
    for layer in module.layers:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=cos_sin, cache=cache, use_cache=True)
    return module.norm(hidden), kv


def test_eager_step_matches_hf_decoder_layers():
    module = qwen3_draft_step(N_LAYERS, max_len=MAX_LEN, batch_size=BATCH)
    steps = step_inputs(module, 2)
    results = run_steps(module, module, steps)
    with torch.no_grad():
        ref, kv = hf_reference(module, steps)
    out, k_caches, v_caches = results[-1]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ctx_end = 2 * CTX_TOKENS
    for i in range(N_LAYERS):
        # one projection over both steps' tokens vs one per step: BLAS may round them differently
        torch.testing.assert_close(k_caches[i][:, :, :ctx_end], kv[2 * i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_caches[i][:, :, :ctx_end], kv[2 * i + 1], rtol=1e-5, atol=1e-5)
        assert (k_caches[i][:, :, ctx_end:] == SENTINEL).all() and (v_caches[i][:, :, ctx_end:] == SENTINEL).all()


def test_reset_caches_fills_in_place_and_reallocates_for_a_new_batch():
    module = qwen3_draft_step(2, max_len=MAX_LEN, batch_size=1)
    k = module.caches[0].k
    assert k.shape == (1, 2, MAX_LEN, 32) and (k == 0).all()
    module.reset_caches(fill_value=SENTINEL)
    assert module.caches[0].k is k and (k == SENTINEL).all()
    module.reset_caches(batch_size=3)
    assert module.caches[1].v.shape == (3, 2, MAX_LEN, 32) and (module.caches[1].v == 0).all()
    assert not any(key.startswith("caches.") for key in module.state_dict())  # not persistent


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.parametrize(
    "backend, dtype",
    [("inductor", torch.float32), ("fx_fusion", torch.float32), ("fx_fusion", torch.bfloat16)],
    ids=["inductor-float32", "fx_fusion-float32", "fx_fusion-bfloat16"],
)
def test_compiled_steps_match_eager(backend, dtype):
    """Two consecutive steps (the context grows), compiled with fullgraph=True: each step's output and
    every cache equal eager's; rows written so far hold eager's K/V, the rest still hold the sentinel."""
    module = qwen3_draft_step(N_LAYERS, max_len=MAX_LEN, dtype=dtype, batch_size=BATCH)
    steps = step_inputs(module, 2)
    expected = run_steps(module, module, steps)
    records = []
    with RecordSink.collect(records):
        got = run_steps(torch.compile(module, backend=backend, fullgraph=True), module, steps)
    for n_steps, ((out, k_caches, v_caches), (ref, ref_k, ref_v)) in enumerate(zip(got, expected), start=1):
        assert_close(out, ref, dtype)
        ctx_end = n_steps * CTX_TOKENS
        for cache, ref_cache in zip(k_caches + v_caches, ref_k + ref_v):
            assert_close(cache[:, :, :ctx_end], ref_cache[:, :, :ctx_end], dtype)
            assert (cache[:, :, ctx_end:] == SENTINEL).all()
    if backend == "fx_fusion":
        (record,) = records  # one graph: the step compiled once, no graph break, no recompile
        context_groups = [g for g in record.fused_groups if any("in write_context" in loc for loc in g.layers)]
        assert len(context_groups) == 1, record.summary()
        (group,) = context_groups
        assert all("in write_context" in loc for loc in group.layers), group.layers
        assert [loc.split()[0] for loc in group.layers] == [f"layers.{i}.self_attn.k_proj" for i in range(N_LAYERS)]
        assert group.n_layers == N_LAYERS and group.k_norm and group.v_as_view == N_LAYERS
        assert group.cache_writes.startswith(f"K and V of {N_LAYERS} layers written straight into their caches")
