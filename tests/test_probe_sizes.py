"""probe_sizes: the pass's probes run over a few tokens, prove the same as at full size, and cost the same
whatever the token count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fx_fusion
from fx_fusion import kv_patterns, probe_sizes, rotary_action
from fx_fusion.drafts import example_inputs, qwen3_context_kv
from fx_fusion.probe_sizes import SMALL_TOKENS, ProbeMismatch, ProbeSizes, probe_call

T, F = 1024, 2048  # tokens, features


def test_token_sizes_map_by_their_ratio_and_small_sizes_stay():
    sizes = ProbeSizes([2 * T, T, 64, 8])
    assert sizes([2 * T, T, 64, 8, -1]) == [2 * SMALL_TOKENS, SMALL_TOKENS, 64, 8, -1]
    assert not ProbeSizes([600, 1000])  # no common token count >= LARGE: run at full size
    assert not ProbeSizes([64, 2**63 - 1])  # a slice's "to the end" is no size


def _run_probe(fn, full_shape: list, sizes: ProbeSizes) -> torch.Tensor:
    """fn's ATen graph at `full_shape`, run node by node through probe_call on an index tensor of the
    probe's size (its values: flat positions in the full-size input)."""
    graph = make_fx(fn, tracing_mode="fake")(torch.empty(full_shape, dtype=torch.int64)).graph
    rows = sizes(full_shape[0])
    value = torch.arange(rows * full_shape[1]).view(rows, full_shape[1])
    for node in graph.nodes:
        if node.op == "call_function":
            value = probe_call(node, node.target, [value, *node.args[1:]], dict(node.kwargs), sizes)
    return value


def _full(fn, full_shape: list) -> torch.Tensor:
    return fn(torch.arange(full_shape[0] * full_shape[1]).view(full_shape))


def test_a_feature_cut_equal_to_the_token_count_keeps_its_meaning():
    fn = lambda x: x[:, :T]  # noqa: E731  (F columns cut to T: a feature cut that equals the token count)
    got = _run_probe(fn, [T, F], ProbeSizes([T]))
    assert torch.equal(got, _full(fn, [T, F])[:SMALL_TOKENS])


def test_a_reshape_whose_feature_size_equals_the_token_count_is_the_full_reshape_on_fewer_tokens():
    fn = lambda x: x.view(1, T, -1, 128).transpose(1, 2)  # noqa: E731  (T == hidden width below)
    got = _run_probe(fn, [T, T], ProbeSizes([T]))
    assert torch.equal(got, _full(fn, [T, T])[:, :, :SMALL_TOKENS])
    fn = lambda x: x.view(-1, T)  # noqa: E731  ([T, 2T] -> [2T, T]: each row in two)
    got = _run_probe(fn, [T, F], ProbeSizes([T]))
    assert torch.equal(got, _full(fn, [T, F])[: 2 * SMALL_TOKENS])


def test_a_reshape_mixing_tokens_into_features_is_refused():
    fn = lambda x: x.t().reshape(T, F)  # noqa: E731  (features outermost: few tokens are not a prefix)
    with pytest.raises(ProbeMismatch):
        _run_probe(fn, [T, F], ProbeSizes([T]))
    fn = lambda x: x[:, :1].expand(T, T)  # noqa: E731  (broadcast to a size that equals T)
    with pytest.raises(ProbeMismatch):
        _run_probe(fn, [T, F], ProbeSizes([T]))


def _largest_probes(tokens: int) -> tuple[int, int, int]:
    """(fused groups, largest index simulation, largest rotary probe) in elements, compiling a 3-layer
    Qwen3 context K/V at `tokens` tokens."""
    largest = {"layout": 0, "rotary": 0}
    head_layout, probe_init = kv_patterns.head_layout, rotary_action._Probe.__init__

    def recording_head_layout(index, *args):
        largest["layout"] = max(largest["layout"], index.numel())
        return head_layout(index, *args)

    def recording_probe_init(self, *args):
        probe_init(self, *args)
        largest["rotary"] = max(largest["rotary"], torch.Size(self.shape).numel())

    module = qwen3_context_kv(n_layers=3).eval()
    fused_kv_pass = fx_fusion.FusedKVPass()
    try:
        kv_patterns.head_layout, rotary_action._Probe.__init__ = recording_head_layout, recording_probe_init
        with torch.no_grad():
            torch.compile(module, options={"post_grad_custom_post_pass": fused_kv_pass})(*example_inputs(module, seq_len=tokens))
    finally:
        kv_patterns.head_layout, rotary_action._Probe.__init__ = head_layout, probe_init
    groups = sum(len(record.fused_groups) for record in fused_kv_pass.records)
    return groups, largest["layout"], largest["rotary"]


@pytest.mark.usefixtures("fresh_compile")
def test_the_pass_probes_the_same_sizes_whatever_the_token_count():
    at_1k, at_4k = _largest_probes(1024), _largest_probes(4096)
    assert at_1k[0] == at_4k[0] == 1
    assert at_1k == at_4k
    assert 0 < at_4k[1] < 64 * 1024 and 0 < at_4k[2] < 64 * 1024


def test_spellings_fuse_and_match_eager_past_the_probe_threshold():
    """A cross-section of the spelling corpus at 600 tokens per sequence (1200 rows): every probe runs
    over a few tokens, and each spelling still fuses and matches eager."""
    cases = "hf_qwen3 or vllm_qwen3_gptj or megatron_chunk_partial or sglang_stacked_kv or pi0_torch_split"
    env = dict(os.environ, SPELLING_CORPUS_TOKENS=str(probe_sizes.LARGE + 88))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_spelling_corpus.py"]
    command += ["-k", f"fuses_and_matches and fp32 and ({cases})"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
