"""A DFlash-style speculative-decoding draft (Qwen3), its context K/V compiled with the fx_fusion backend.

A DFlash draft has a few attention layers whose context K/V all come from the same hidden states (those of
the target model). Written plainly, with Hugging Face's own Qwen3 modules, each layer does

    k = layer.k_proj(hidden_states).view(B, T, H, D)
    k = layer.k_norm(k).transpose(1, 2)              # per-head RMSNorm
    _, k = apply_rotary_pos_emb(k, k, cos, sin)      # RoPE
    v = layer.v_proj(hidden_states).view(B, T, H, D).transpose(1, 2)

which is 2L small GEMMs and L norm/RoPE kernels (`fx_fusion.drafts.ContextKV` is exactly this code). With
`torch.compile(model, backend="fx_fusion")` the compiled graph has one stacked GEMM for all layers' K and V
projections, one fused RMSNorm + RoPE op for all layers' K, and every V is a view of the GEMM output.

    python examples/qwen3_dflash_draft.py                   # small random config, fp32, CPU
    python examples/qwen3_dflash_draft.py --device cuda     # Qwen3-8B-sized layers, bf16
"""

import argparse

import torch

import fx_fusion
from fx_fusion.drafts import example_inputs, qwen3_context_kv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=16)
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")

    # The draft: `layers` Qwen3Attention modules and a Qwen3RotaryEmbedding, random weights, nothing downloaded.
    model = qwen3_context_kv(
        args.layers,
        preset="realistic" if on_gpu else "small",  # realistic: hidden 4096, 8 KV heads x 128
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        device=args.device,
    )
    hidden_states, position_ids = example_inputs(model, batch=1, seq_len=args.seq_len)

    with torch.no_grad():
        expected = model(hidden_states, position_ids)  # eager: (k_0, v_0, k_1, v_1, ...)

        # Enabling the pass is all a user does:
        compiled = torch.compile(model, backend="fx_fusion")
        outputs = compiled(hidden_states, position_ids)

    # What the pass did (compiles once more, with the graph caches off so the pass surely runs):
    report = fx_fusion.explain(model, hidden_states, position_ids)
    print(report)

    tolerance = 2e-2 if on_gpu else 1e-4
    worst = max(((o.float() - e.float()).norm() / e.float().norm()).item() for o, e in zip(outputs, expected))
    ok = worst <= tolerance and len(report.fused_groups) == 1
    print(f"\ncompiled vs eager: max relative error {worst:.2e} (tolerance {tolerance:g}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
