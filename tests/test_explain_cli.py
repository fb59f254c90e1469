"""fx_fusion.explain, the fx-fusion command line and the examples (CPU).

Compiles are slow on small machines: each report is computed once per module (module-scoped fixtures) and
the command-line / example runs use the smallest sizes.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

import fx_fusion  # noqa: E402
from fx_fusion import cli  # noqa: E402
from fx_fusion.diagnostics import RecordSink  # noqa: E402
from fx_fusion.drafts import ContextKV, example_inputs, llama_context_kv, qwen3_context_kv  # noqa: E402
from fx_fusion.explain import FusionReport, _svg_problem  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBPROCESS_TIMEOUT = 300


def _rel_err(out, ref) -> float:
    return max(((o.float() - r.float()).norm() / r.float().norm()).item() for o, r in zip(out, ref))


def _run(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT
    )


def _explain_entry_codes_with_cache_entries() -> list[str]:
    """Names of explain's wrapper code objects that still hold dynamo cache entries."""
    from torch._dynamo import convert_frame

    names = []
    for ref in convert_frame.input_codes.seen:
        code = ref()
        if code is not None and code.co_name.startswith("fx_fusion_explain_"):
            if torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code):
                names.append(code.co_name)
    return names


# ----------------------------------------------------------------------------------------------------------
# Modules and their reports (one compile each)


class MixedContextKV(ContextKV):
    """Draft context K/V where layer 2 normalises K with a LayerNorm and layer 3 uses its own cos/sin."""

    def __init__(self, base: ContextKV, layer_norm_layer: int = 2, own_rotary_layer: int = 3) -> None:
        super().__init__(base.layers, base.rotary_emb)
        self.layers[layer_norm_layer].k_norm = torch.nn.LayerNorm(base.head_dim)
        self.other_rotary = copy.deepcopy(base.rotary_emb)
        with torch.no_grad():
            self.other_rotary.inv_freq.mul_(0.5)
        self.own_rotary_layer = own_rotary_layer

    def forward(self, hidden_states, position_ids):
        tables = [self.rotary_emb(hidden_states, position_ids), self.other_rotary(hidden_states, position_ids)]
        shape = hidden_states.shape[:-1]
        outputs = []
        for i, layer in enumerate(self.layers):
            cos, sin = tables[i == self.own_rotary_layer]
            k = layer.k_proj(hidden_states).view(*shape, -1, layer.head_dim)
            k = layer.k_norm(k).transpose(1, 2)
            v = layer.v_proj(hidden_states).view(*shape, -1, layer.head_dim).transpose(1, 2)
            _, k = self.apply_rotary_pos_emb(k, k, cos, sin)
            outputs += [k, v]
        return tuple(outputs)


@pytest.fixture(scope="module")
def qwen3_case(tmp_path_factory):
    model = qwen3_context_kv(3)
    x, pos = example_inputs(model, batch=1, seq_len=8)
    with torch.no_grad():
        ref = model(x, pos)
    svg_dir = str(tmp_path_factory.mktemp("svg"))
    report = fx_fusion.explain(model, x, pos, svg_dir=svg_dir)
    return model, ref, report, svg_dir


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory):
    """Llama (no K norm) with biases; explained with dump_dir while depyf cannot be imported."""
    model = llama_context_kv(2, attention_bias=True)
    x, pos = example_inputs(model, batch=2, seq_len=4)
    with torch.no_grad():
        ref = model(x, pos)
    dump_dir = str(tmp_path_factory.mktemp("dump_without_depyf"))
    with mock.patch.dict(sys.modules, {"depyf": None}):  # `import depyf` raises ImportError
        report = fx_fusion.explain(model, x, pos, dump_dir=dump_dir)
    return model, ref, report, dump_dir


@pytest.fixture(scope="module")
def mixed_case():
    model = MixedContextKV(qwen3_context_kv(4))
    x, pos = example_inputs(model, batch=1, seq_len=8)
    with torch.no_grad():
        ref = model(x, pos)
    return model, ref, fx_fusion.explain(model, x, pos)


# ----------------------------------------------------------------------------------------------------------
# explain


def test_explain_qwen3_fused_group(qwen3_case):
    model, ref, report, _ = qwen3_case
    assert isinstance(report, FusionReport)
    assert report.graphs == 1
    assert len(report.fused_groups) == 1 and not report.rejected
    group = report.fused_groups[0]
    assert (group.n_layers, group.num_kv_heads, group.head_dim) == (3, model.num_kv_heads, model.head_dim)
    assert (group.rotary_dim, group.rotary_style) == (model.head_dim, "neox")
    assert group.k_norm and not group.bias
    assert group.v_as_view == 3
    assert [loc.split()[0] for loc in group.layers] == ["layers.0.k_proj", "layers.1.k_proj", "layers.2.k_proj"]
    # the readable regions: per-layer mm + norm before, one stacked GEMM + one fused op after
    assert report.graph_before.count("torch.ops.aten.mm.default(") == 6
    assert "rsqrt" in report.graph_before
    assert report.graph_after.count("torch.ops.fx_fusion.grouped_linear.default(") == 1
    assert report.graph_after.count("torch.ops.fx_fusion.materialize_k.default(") == 1
    assert "aten.mm" not in report.graph_after
    assert _rel_err(report.output, ref) < 1e-5


def test_explain_llama_no_norm_with_bias(llama_case):
    model, ref, report, _ = llama_case
    assert len(report.fused_groups) == 1
    group = report.fused_groups[0]
    assert group.n_layers == 2 and not group.k_norm and group.bias
    assert group.v_as_view == 2
    assert "rsqrt" not in report.graph_after
    assert _rel_err(report.output, ref) < 1e-5


def test_explain_reports_rejected_candidates(mixed_case):
    model, ref, report = mixed_case
    # layer 3 rotates with its own cos/sin: it joins the group, which reads one table per layer
    assert [g.n_layers for g in report.fused_groups] == [3]
    group = report.fused_groups[0]
    assert [loc.split()[0] for loc in group.layers] == ["layers.0.k_proj", "layers.1.k_proj", "layers.3.k_proj"]
    assert group.rotary_tables == "per-layer cos/sin"
    reasons = {r.location.split()[0]: r.reason for r in report.rejected}
    assert set(reasons) == {"layers.2.k_proj"}
    assert "LayerNorm" in reasons["layers.2.k_proj"]
    text = str(report)
    assert "Rejected candidates:" in text and "LayerNorm" in text and "layers.2.k_proj" in text
    assert _rel_err(report.output, ref) < 1e-5


def test_report_text_and_json_round_trip(qwen3_case):
    model, _, report, _ = qwen3_case
    text = str(report)
    assert text.splitlines()[0] == report.summary()
    assert "fused 1 K/V group(s) (3 layers)" in text
    assert "Fused groups:" in text and "absorbed layers" in text
    assert f"{model.num_kv_heads} x {model.head_dim}" in text and "neox" in text
    for i in range(3):
        assert f"layers.{i}.k_proj (drafts.py:" in text
    data = json.loads(report.to_json())
    assert data == report.to_dict()
    assert data["fused_groups"][0]["n_layers"] == 3 and data["rejected"] == []
    again = FusionReport.from_json(report.to_json())
    assert again.to_dict() == report.to_dict()
    assert again.fused_groups == report.fused_groups


def test_explain_svg_or_clear_message(qwen3_case):
    _, _, report, svg_dir = qwen3_case
    problem = _svg_problem()
    svgs = sorted(f for f in report.files if f.endswith(".svg"))
    if problem is not None:
        assert not svgs
        assert any("pip install pydot" in n and "graphviz" in n for n in report.notes), report.notes
        pytest.skip(f"drawing not checked: {problem}")
    assert [os.path.basename(f) for f in svgs] == ["fx_fusion_region0_after.svg", "fx_fusion_region0_before.svg"]
    for path in svgs:
        assert os.path.dirname(path) == svg_dir
        with open(path) as f:
            assert "<svg" in f.read()


def test_explain_dump_without_depyf_writes_own_files(llama_case):
    _, _, report, dump_dir = llama_case
    assert any("depyf is not installed" in n and "pip install depyf" in n for n in report.notes)
    names = sorted(os.listdir(dump_dir))
    assert names == sorted(
        [
            "fx_fusion_graph_before.txt",
            "fx_fusion_graph_after.txt",
            "fx_fusion_full_graph0_before.py",
            "fx_fusion_full_graph0_after.py",
            "fx_fusion_report.txt",
            "fx_fusion_report.json",
        ]
    )
    with open(os.path.join(dump_dir, "fx_fusion_graph_after.txt")) as f:
        assert "fx_fusion.grouped_linear" in f.read()
    with open(os.path.join(dump_dir, "fx_fusion_full_graph0_after.py")) as f:
        assert "fx_fusion.materialize_k" in f.read()
    with open(os.path.join(dump_dir, "fx_fusion_report.json")) as f:
        assert json.load(f)["fused_groups"] == report.to_dict()["fused_groups"]


def test_explain_leaves_no_global_state():
    model = qwen3_context_kv(2, seed=3)
    x, pos = example_inputs(model, batch=1, seq_len=8)
    with torch.no_grad():
        ref = model(x, pos)

    early_calls, late_calls = [], []

    def early_backend(gm, example_inputs):
        early_calls.append(gm)
        return gm.forward

    def late_backend(gm, example_inputs):
        late_calls.append(gm)
        return gm.forward

    # The caller compiled the module before explain...
    early = torch.compile(model, backend=early_backend)
    with torch.no_grad():
        early(x, pos)
    assert len(early_calls) == 1

    configs = {
        "inductor": torch._inductor.config,
        "functorch": torch._functorch.config,
        "dynamo": torch._dynamo.config,
        "compiler": torch.compiler.config,
    }
    before = {name: cfg.get_config_copy() for name, cfg in configs.items()}
    sink_before = RecordSink._active
    report = fx_fusion.explain(model, x, pos)
    # ...explain compiled on its own (the caller's compiled entry did not serve it)...
    assert report.graphs == 1 and report.fused_groups[0].n_layers == 2
    assert {name: cfg.get_config_copy() for name, cfg in configs.items()} == before
    assert RecordSink._active is sink_before
    assert _explain_entry_codes_with_cache_entries() == []

    # ...and the caller's compiled module still runs its own compile, without recompiling.
    with torch.no_grad():
        out = early(x, pos)
    assert len(early_calls) == 1
    assert _rel_err(out, ref) < 1e-6

    # A later compile of the same module uses its own backend, not explain's compiled code.
    late = torch.compile(model, backend=late_backend)
    with torch.no_grad():
        out = late(x, pos)
    assert len(late_calls) == 1
    assert not any("fx_fusion" in str(n.target) for n in late_calls[0].graph.nodes)
    assert _rel_err(out, ref) < 1e-6


# ----------------------------------------------------------------------------------------------------------
# Command line

FACTORY_FILE = textwrap.dedent(
    """
    from fx_fusion.drafts import example_inputs, llama_context_kv


    def make():
        model = llama_context_kv(2)
        return model, example_inputs(model, batch=1, seq_len=4)


    def make_with_kwargs():
        model = llama_context_kv(2, seed=5)
        hidden_states, position_ids = example_inputs(model, batch=1, seq_len=4)
        return model, (hidden_states,), {"position_ids": position_ids}


    def not_a_pair():
        return 3
    """
)


@pytest.fixture(scope="module")
def factory_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_draft.py"
    path.write_text(FACTORY_FILE)
    return path


def test_cli_demo_small_cpu():
    result = _run("-m", "fx_fusion", "demo", "--layers", "2", "--seq-len", "8", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Fused groups:" in result.stdout
    # the context K/V of both layers: one group, its cache writes absorbed (each layer's Q and K: a group too)
    assert "K and V of 2 layers written straight into their caches: 4 cache writes absorbed" in result.stdout
    # the MLPs' gate and up projections are plain linears (no rotary embedding), never a "K not rotated"
    assert "not rotated" not in result.stdout and "left as a plain linear: no rotary embedding" in result.stdout
    assert "PASS" in result.stdout and "FAIL" not in result.stdout


def test_cli_explain_factory_file(factory_file, capsys):
    assert cli.main(["explain", f"{factory_file}:make", "--graphs"]) == 0
    out = capsys.readouterr().out
    assert "fused 1 K/V group(s) (2 layers)" in out
    assert "Region after the pass:" in out and "fx_fusion.materialize_k" in out


def test_cli_explain_json_dump_svg(factory_file, tmp_path):
    dump_dir, svg_dir = tmp_path / "dump", tmp_path / "svg"
    result = _run(
        "-m", "fx_fusion", "explain", f"{factory_file}:make_with_kwargs", "--json", "--min-layers", "2",
        "--dump", str(dump_dir), "--svg", str(svg_dir),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)  # stdout is JSON alone; the file guide goes to stderr
    assert [g["n_layers"] for g in data["fused_groups"]] == [2]
    assert data["backend_options"] == {"min_layers": 2}
    names = set(os.listdir(dump_dir))
    assert {"fx_fusion_graph_before.txt", "fx_fusion_graph_after.txt", "fx_fusion_report.json"} <= names
    assert "fx_fusion_graph_after.txt" in result.stderr
    try:
        import depyf  # noqa: F401
    except ImportError:
        assert any("depyf is not installed" in n for n in data["notes"])
    else:  # depyf's own dumps: decompiled code, graphs around the post-grad passes, generated kernels
        assert any(n.startswith("full_code_for_fx_fusion_explain_") for n in names), names
        assert any("AFTER_POST_GRAD" in n for n in names), names
        assert any(".kernel_" in n for n in names), names
        assert all(os.path.join(str(dump_dir), n) in data["files"] for n in names)
    if _svg_problem() is None:
        assert sorted(os.listdir(svg_dir)) == ["fx_fusion_region0_after.svg", "fx_fusion_region0_before.svg"]
    else:
        assert any("pip install pydot" in n for n in data["notes"])


def test_cli_explain_errors(factory_file, capsys):
    assert cli.main(["explain", "no/such/file.py:make"]) == cli.EXIT_USAGE
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["explain", f"{factory_file}:missing"]) == cli.EXIT_USAGE
    assert "has no attribute 'missing'" in capsys.readouterr().err
    assert cli.main(["explain", f"{factory_file}:not_a_pair"]) == cli.EXIT_USAGE
    assert "must return (module, example_args)" in capsys.readouterr().err
    assert cli.main(["explain", "make"]) == cli.EXIT_USAGE
    assert "expected PATH.py:FACTORY" in capsys.readouterr().err


def test_cli_load_factory_from_module(factory_file, monkeypatch):
    monkeypatch.syspath_prepend(str(factory_file.parent))
    factory = cli.load_factory("my_draft:make_with_kwargs")
    assert factory.__name__ == "make_with_kwargs"
    module, args, kwargs = cli.call_factory(factory)
    assert isinstance(module, ContextKV) and len(args) == 1 and set(kwargs) == {"position_ids"}


# ----------------------------------------------------------------------------------------------------------
# Examples


@pytest.mark.parametrize(
    "script, args, expected",
    [
        ("qwen3_dflash_draft.py", ["--layers", "2", "--seq-len", "8"], "fused 1 K/V group(s) (2 layers)"),
        ("llama_draft.py", ["--layers", "2", "--seq-len", "8", "--bias"], "no k_norm, bias"),
        ("dump_rewritten_graph.py", ["--layers", "2", "--seq-len", "4"], "fx_fusion.materialize_k"),
    ],
)
def test_examples_run(script, args, expected, tmp_path):
    if script == "dump_rewritten_graph.py":
        args = [*args, "--out", str(tmp_path / "dump")]
    result = _run(os.path.join(REPO, "examples", script), *args, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert expected in result.stdout
    if script == "dump_rewritten_graph.py":
        assert os.path.exists(tmp_path / "dump" / "fx_fusion_graph_after.txt")
