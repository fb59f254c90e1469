"""Every causal LM in the installed transformers, compiled with backend="fx_fusion" on a tiny config (CPU).

    python tests/sweep_causal_lms.py [--only NAME,...] [--out sweep.jsonl]     # about an hour for all
    python tests/sweep_causal_lms.py --summary sweep.jsonl

Each model runs in a subprocess of its own (a crash or a hang ends that model only): one generic tiny
config (families that need more than that fail to build and are listed as such), random weights with
non-trivial norm weights, 7 tokens, fp32; eager, fx_fusion and stock Inductor logits. A model is a
MISMATCH when fx_fusion's error against eager exceeds ten times stock Inductor's (and 1e-4), fx_crash when
only the fx_fusion compile fails. One JSON line per model: the status, both errors, the fused groups and
the distinct reasons the pass gave. Not part of the test run: the families that matter are covered by
tests/test_whole_models.py; this is the wide net for spellings nobody listed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import traceback

# Families without a RoPE'd attention (encoders, state-space and recurrent models, audio).
SKIPPED_PREFIXES = (
    "AutoModel Bart BigBird BioGpt Blenderbot Bloom Camembert Clvp CpmAnt Csm Data2Vec Electra FalconMamba Git "
    "GPTBigCode GPTNeoFor MBart Mamba2 MambaFor Marian MegatronBert Moshi Mpt Musicgen Mvp OPT PLBart Pegasus "
    "ProphetNet RemBert RoCBert Roberta Rwkv TrOCR Whisper XGLM XLMRoberta Xmod xLSTM"
).split()

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=128, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
    n_routed_experts=4, shared_expert_intermediate_size=32, first_k_dense_replace=1,
)  # fmt: skip


def run_one(name: str) -> dict:
    import torch
    import transformers

    import fx_fusion  # noqa: F401  (registers backend="fx_fusion")
    from fx_fusion.diagnostics import RecordSink

    model_class = getattr(transformers, name)
    try:
        config = model_class.config_class(**TINY)
    except Exception as error:
        return dict(status="config", error=repr(error)[:300])
    torch.manual_seed(0)
    model = None
    for attention in ("sdpa", "eager"):
        config._attn_implementation = attention
        try:
            model = model_class(config).eval()
            break
        except Exception as error:
            failure = repr(error)[:300]
    if model is None:
        return dict(status="build", error=failure)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name and param.dim() == 1:
                param.uniform_(0.5, 1.5)
    ids = torch.randint(3, TINY["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(1))

    def logits(module):
        with torch.no_grad():
            return module(input_ids=ids, use_cache=False).logits

    try:
        expected = logits(model)
    except Exception as error:
        return dict(status="eager", error=repr(error)[:300])
    records: list = []
    torch._dynamo.reset()
    try:
        with RecordSink.collect(records):
            fused = logits(torch.compile(model, backend="fx_fusion"))
    except Exception:
        fx_error = traceback.format_exc()[-1500:]
        torch._dynamo.reset()
        try:
            logits(torch.compile(model))
        except Exception as error:
            return dict(status="both_crash", error=fx_error, inductor=repr(error)[:300])
        return dict(status="fx_crash", error=fx_error)
    torch._dynamo.reset()
    try:
        inductor_error = (logits(torch.compile(model)) - expected).abs().max().item()
    except Exception:
        inductor_error = float("nan")
    fx_error = (fused - expected).abs().max().item()
    groups = [g.describe() for r in records for g in r.fused_groups]
    reasons = sorted({j.reason[:200] for r in records for j in r.rejected})
    mismatch = not fx_error <= max(10 * inductor_error, 1e-4)
    return dict(
        status="MISMATCH" if mismatch else "ok", fx_error=fx_error, inductor_error=inductor_error,
        records=len(records), groups=groups, reasons=reasons,
    )  # fmt: skip


def summary(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    print(dict(collections.Counter(row["status"] for row in rows)))
    for row in rows:
        if row["status"] in ("ok",):
            print(f"{row['name']}: {len(row['groups'])} group(s); {row['reasons'][:4]}")
        else:
            print(f"{row['name']}: {row['status']} {row.get('error', '')[-200:]!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated class names (default: every *ForCausalLM)")
    parser.add_argument("--out", default="sweep.jsonl")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per model")
    parser.add_argument("--summary", default=None, help="print a summary of a sweep's JSON lines")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the subprocess' entry
    args = parser.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return 0
    if args.one:
        try:
            result = run_one(args.one)
        except Exception:
            result = dict(status="harness", error=traceback.format_exc()[-800:])
        print("RESULT " + json.dumps(result))
        return 0
    import transformers

    names = sorted(n for n in dir(transformers) if n.endswith("ForCausalLM") and not n.startswith("TF"))
    names = [n for n in names if not n.startswith(tuple(SKIPPED_PREFIXES))]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    # compile caches off, so that the pass runs (and reports) for every model
    env = dict(os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    with open(args.out, "a") as out:
        for name in names:
            try:
                done = subprocess.run(
                    [sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=args.timeout, env=env
                )
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                result = json.loads(lines[-1][len("RESULT ") :]) if lines else dict(status="died", error=done.stderr[-800:])
            except subprocess.TimeoutExpired:
                result = dict(status="timeout")
            result["name"] = name
            out.write(json.dumps(result) + "\n")
            out.flush()
            print(name, result["status"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
