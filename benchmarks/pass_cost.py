"""The fused-K/V pass's share of a whole-model compile (CPU is enough: the pass runs on graphs).

    python benchmarks/pass_cost.py [--layers 32] [--seq-len 4096] [--profile]

Compiles a Hugging Face `Qwen3ForCausalLM` with random weights (hidden 256, 8 heads of 32, 4 KV heads) with
`backend="fx_fusion"` and the FX graph cache off, runs it once on T tokens, and prints the wall time of that
first call (the compile) and the time spent inside `FusedKVPass.__call__`. `--profile` adds cProfile's
table of the pass (which slows it, so the share printed with it is not the pass's real cost).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch._inductor.config
import transformers

import fx_fusion  # noqa: F401  (registers backend="fx_fusion")
from fx_fusion.fused_kv_pass import FusedKVPass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    config = transformers.Qwen3Config(
        hidden_size=256, intermediate_size=768, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, vocab_size=1000,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len))

    spent = 0.0
    profiler = cProfile.Profile()
    original = FusedKVPass.__call__

    def timed(self, graph):
        nonlocal spent
        start = time.perf_counter()
        if args.profile:
            profiler.enable()
        try:
            return original(self, graph)
        finally:
            if args.profile:
                profiler.disable()
            spent += time.perf_counter() - start

    FusedKVPass.__call__ = timed
    try:
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            compiled = torch.compile(model, backend="fx_fusion", dynamic=False)
            start = time.perf_counter()
            compiled(ids, logits_to_keep=1)
            total = time.perf_counter() - start
    finally:
        FusedKVPass.__call__ = original
    print(f"{args.layers} layers, T={args.seq_len}: compile {total:.1f} s, pass {spent:.2f} s ({100 * spent / total:.1f}%)")
    if args.profile:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
