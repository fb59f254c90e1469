"""Symbolic token counts on CUDA (dynamic=True): the grouped GEMM as one op call that picks its kernel per
call, against GEMMs per weight traced into the graph (an ablation: a backend of its own whose lowering
traces the per-weight body), and torch.compile; uncaptured back to back (columns interleaved) and graphed.

    python benchmarks/dynamic_tradeoff.py OUT_DIR WORKLOADS SEQ_LENS     # e.g. out qwen3-8b-dflash 16,128,512

Writes OUT_DIR/dyn_tradeoff.json after every row. Outputs are checked against eager first.
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_module  # noqa: E402
import bench_whole_model  # noqa: E402
import fx_fusion.backend  # noqa: E402
from fx_fusion.drafts import build_workload, example_inputs  # noqa: E402
from fx_fusion.kernels import grouped_linear  # noqa: E402

OP_CALL_BODY = grouped_linear.grouped_linear_body


def per_weight_body(x, weights, biases):
    """The lowering's body with symbolic counts traced as one GEMM per weight."""
    if x.is_cuda and isinstance(x.shape[0], torch.SymInt):
        linears = [torch.addmm(biases[i], x, w.t()) if biases else torch.mm(x, w.t()) for i, w in enumerate(weights)]
        return torch.cat(linears, dim=1)
    return OP_CALL_BODY(x, weights, biases)


def per_weight_backend(gm, example_inputs):
    """fx_fusion with the per-weight body; a distinct backend, so dynamo keeps its compiled code apart."""
    grouped_linear.grouped_linear_body = per_weight_body
    try:
        return fx_fusion.backend.fx_fusion_backend(gm, example_inputs)
    finally:
        grouped_linear.grouped_linear_body = OP_CALL_BODY


def compiled_call(model, inputs, backend, reference):
    with bench_whole_model.caches_off():
        compiled = torch.compile(model, backend=backend, dynamic=True)
        error = bench_module.rel_error(compiled(*inputs), reference)
    assert error < 2e-2, error
    return lambda: compiled(*inputs)


def main(out_dir: str, workloads: str, seq_lens: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    args = types.SimpleNamespace(repeats=10, block_ms=30.0, min_calls=10)
    torch.set_grad_enabled(False)
    rows = []
    for workload in workloads.split(","):
        for seq_len in map(int, seq_lens.split(",")):
            model = build_workload(workload, dtype=torch.bfloat16, device="cuda")
            inputs = example_inputs(model, seq_len=seq_len, device="cuda")
            reference = model(*inputs)
            torch._dynamo.reset()
            calls = {
                "inductor": compiled_call(model, inputs, "inductor", reference),
                "fxf_op_call": compiled_call(model, inputs, "fx_fusion", reference),
                "fxf_per_weight": compiled_call(model, inputs, per_weight_backend, reference),
            }
            times = bench_whole_model.block_times_interleaved(calls, args, torch.cuda.synchronize)
            row = {
                "workload": workload, "T": seq_len,
                "uncaptured_median_us": {k: v["median_us"] for k, v in times.items()},
                "uncaptured_p10_p90": {k: (v["p10_us"], v["p90_us"]) for k, v in times.items()},
                "graphed_us": {
                    k: do_bench(bench_module.capture_graph(fn, torch.device("cuda")), warmup=25, rep=100, return_mode="median") * 1e3
                    for k, fn in calls.items()
                },
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(out_dir, "dyn_tradeoff.json"), "w") as f:
                json.dump(rows, f, indent=1)
            del model, calls
            torch._dynamo.reset()


if __name__ == "__main__":
    main(*sys.argv[1:4])
