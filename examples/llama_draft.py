"""A Llama-style draft's context K/V (no K norm), compiled with the fx_fusion backend.

Llama attention has no per-head K norm, so each layer's context K is `k_proj -> RoPE` and V is `v_proj`:

    k = layer.k_proj(hidden_states).view(B, T, H, D).transpose(1, 2)
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    v = layer.v_proj(hidden_states).view(B, T, H, D).transpose(1, 2)

The pass fuses that too: one stacked GEMM over all K and V projection weights (biases included, with
--bias), one fused RoPE op over all layers' K (reported with `k_norm: no`), V as views.

    python examples/llama_draft.py                     # small random config, fp32, CPU
    python examples/llama_draft.py --bias              # with attention biases (addmm projections)
    python examples/llama_draft.py --device cuda       # Llama-3-8B-sized layers, bf16
"""

import argparse

import torch

import fx_fusion
from fx_fusion.drafts import example_inputs, llama_context_kv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--bias", action="store_true", help="attention_bias=True (K/V projections with bias)")
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")

    model = llama_context_kv(
        args.layers,
        preset="realistic" if on_gpu else "small",
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        device=args.device,
        attention_bias=args.bias,
    )
    hidden_states, position_ids = example_inputs(model, batch=1, seq_len=args.seq_len)

    with torch.no_grad():
        expected = model(hidden_states, position_ids)
        compiled = torch.compile(model, backend="fx_fusion")
        outputs = compiled(hidden_states, position_ids)

    report = fx_fusion.explain(model, hidden_states, position_ids)
    print(report)
    for group in report.fused_groups:
        print(f"\nfused: {group.describe()}; {group.v_as_view} projection(s) read as views of the stacked GEMM")

    tolerance = 2e-2 if on_gpu else 1e-4
    worst = max(((o.float() - e.float()).norm() / e.float().norm()).item() for o, e in zip(outputs, expected))
    ok = worst <= tolerance and len(report.fused_groups) == 1 and not report.fused_groups[0].k_norm
    print(f"compiled vs eager: max relative error {worst:.2e} (tolerance {tolerance:g}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
