"""Random drafts (tests/fuzz_spellings.py) through FusedKVPass: never a result other than eager's, never a
crash, and a draft whose layers all spell one supported form fuses into one group.

    pytest tests/test_fuzz_spellings.py -q          # a few drafts (derandomized)
    python tests/fuzz_spellings.py --count 500      # a long run
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_spellings  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_compile")


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**20))
def test_random_draft_matches_eager(seed):
    drawn, fused_kv_pass, error, stock_error = fuzz_spellings.check(seed)
    assert fused_kv_pass.records, "the pass did not run"
    assert fuzz_spellings.within_tolerance(drawn, error, stock_error), (error, stock_error, drawn)
    groups = [g for record in fused_kv_pass.records for g in record.fused_groups]
    specs = drawn["specs"]
    if all(spec == specs[0] for spec in specs):  # one group; with a token cat, one more for the noise rows
        # (but one layer's projection of joined rows, shared with no other layer, fuses whole)
        split = drawn["token_cat"] and not (drawn["token_cat_at"] == "inputs" and len(specs) == 1)
        expected = [len(specs)] * (2 if split else 1)
        assert [g.n_layers for g in groups] == expected, (drawn, [g.describe() for g in groups])


@pytest.mark.parametrize("seed", [65, 67])
def test_gptj_pairs_with_a_dynamic_token_count_fuse(seed):
    """Found by the fuzzer: GPT-J pairs flattened back by a view of symbolic size (`stack(...).flatten(-2)`
    with a dynamic token count) were not read as a rotation (the view's size argument was taken for a
    table); they are now."""
    drawn, fused_kv_pass, error, stock_error = fuzz_spellings.check(seed)
    assert drawn["dynamic"] and any(spec["rope"] == "gptj" for spec in drawn["specs"]), drawn
    assert fuzz_spellings.within_tolerance(drawn, error, stock_error)
    assert any(record.fused_groups for record in fused_kv_pass.records), drawn


def test_cuts_of_a_projection_whose_size_a_later_view_reads_fuse():
    """Found by the fuzzer (seed 44007, dynamic, GPT-J pairs, a qkv linear over joined rows): the view that
    flattens the pairs back reads the token count as `sym_size` of the qkv output, a reader of no values
    that kept its K and V column cuts from being read (nothing fused, nothing said); it fuses now."""
    drawn, fused_kv_pass, error, stock_error = fuzz_spellings.check(44007)
    assert drawn["dynamic"] and drawn["specs"][0]["rope"] == "gptj", drawn
    assert fuzz_spellings.within_tolerance(drawn, error, stock_error)
    assert [g.n_layers for record in fused_kv_pass.records for g in record.fused_groups] == [1], drawn


@pytest.mark.parametrize("seed", [3008, 3013, 3019])
def test_drafts_that_also_return_the_raw_k_fuse(seed):
    """Found by the fuzzer: a layer whose raw K (the projection viewed as heads) is also returned was left
    alone ("K norm input has other users", or "no rotary embedding" without a norm). The raw K's readers
    now read it from the grouped projection, and the norm/RoPE fuses: a Gemma norm in bfloat16 with a
    dynamic token count, no norm with a [B, H, T, D] layout, a norm without upcast in float32."""
    drawn, fused_kv_pass, error, stock_error = fuzz_spellings.check(seed)
    assert all(spec["raw_k"] for spec in drawn["specs"]), drawn
    assert fuzz_spellings.within_tolerance(drawn, error, stock_error)
    groups = [g for record in fused_kv_pass.records for g in record.fused_groups]
    assert sum(g.n_layers for g in groups) == len(drawn["specs"]), [g.describe() for g in groups]


@pytest.mark.parametrize("seed", [5023, 5062])
def test_token_cats_of_cut_projections_fuse(seed):
    """Found by the fuzzer: z-lab's token concatenation of K and V cut from a fused kv/qkv linear (the
    pieces are column cuts of the projection, not the projection itself) was not pushed down, and no layer
    fused. Now the context rows of every layer fuse, and the noise rows too: a qkv linear with GPT-J pairs
    and a dynamic token count, a kv linear whose raw K is also returned."""
    drawn, fused_kv_pass, error, stock_error = fuzz_spellings.check(seed)
    assert drawn["token_cat"] and drawn["specs"][0]["projection"] in ("kv", "qkv"), drawn
    assert fuzz_spellings.within_tolerance(drawn, error, stock_error)
    groups = [g for record in fused_kv_pass.records for g in record.fused_groups]
    assert [g.n_layers for g in groups] == [len(drawn["specs"])] * 2, [g.describe() for g in groups]


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**20))
def test_random_stacked_draft_matches_eager(seed):
    """vLLM's DFlash precompute form (fuzz_spellings.StackedDraft): eager's results, and every layer in one
    group when no layer deviates."""
    drawn, fused_kv_pass, error, stock_error = fuzz_spellings.check_stacked(seed)
    assert fuzz_spellings.within_tolerance(drawn, error, stock_error), (error, stock_error, drawn)
    specs = drawn["specs"]
    if all(spec == specs[0] for spec in specs) and not drawn["shift_last"]:
        groups = [g for record in fused_kv_pass.records for g in record.fused_groups]
        assert [g.n_layers for g in groups] == [len(specs)], (drawn, [g.describe() for g in groups])
