"""Show the graph the fx_fusion pass rewrote: the region before and after, and depyf's dump files.

    python examples/dump_rewritten_graph.py                  # dumps into ./fx_fusion_dump
    python examples/dump_rewritten_graph.py --out /tmp/dump  # elsewhere
    python examples/dump_rewritten_graph.py --device cuda

`fx_fusion.explain(..., dump_dir=DIR)` compiles under `depyf.prepare_debug(DIR)` (decompiled bytecode, each
graph, Inductor's generated code) and adds the pass's own files:

    fx_fusion_graph_before.txt / fx_fusion_graph_after.txt   the rewritten region(s), before / after the pass
    fx_fusion_full_graph0_before.py / ..._after.py           the whole post-grad graph right before / after it
    fx_fusion_report.txt / .json                             the report

Without depyf installed (`pip install depyf`), only the fx_fusion_* files are written.
"""

import argparse
import os

import torch

import fx_fusion
from fx_fusion.drafts import example_inputs, qwen3_context_kv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fx_fusion_dump", help="dump directory (default ./fx_fusion_dump)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8)
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")

    model = qwen3_context_kv(
        args.layers,
        preset="realistic" if on_gpu else "small",
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        device=args.device,
    )
    hidden_states, position_ids = example_inputs(model, batch=1, seq_len=args.seq_len)

    report = fx_fusion.explain(model, hidden_states, position_ids, dump_dir=args.out)
    print(report.summary())
    print("\n=== the region the pass rewrote, before (post-grad ATen graph) ===")
    print(report.graph_before)
    print("=== the same region after: one stacked GEMM, one fused K op, V as views ===")
    print(report.graph_after)

    print(f"=== files in {args.out} ===")
    ours = [f for f in report.files if os.path.basename(f).startswith("fx_fusion_")]
    depyf = [f for f in report.files if f not in ours]
    for path in ours:
        print(f"  {path}")
    if depyf:
        print("  depyf (open full_code_for_*.py, then __compiled_fn_*.AFTER_POST_GRAD.*.py and *.kernel_*.py):")
        for path in depyf:
            print(f"    {path}")
    for note in report.notes:
        print(f"note: {note}")
    return 0 if report.fused_groups else 1


if __name__ == "__main__":
    raise SystemExit(main())
