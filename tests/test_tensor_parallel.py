"""The fx_fusion backend on tensor-parallel drafts: 2 CPU processes, gloo.

Under tensor parallelism every rank holds a slice of the KV heads and projects the same replicated hidden
states onto them. A 3-layer Qwen3 draft (small preset, fp32) is sharded over the 2 ranks in these ways and
compiled with `backend="fx_fusion"` on each rank:

- dtensor_colwise: `parallelize_module` with `ColwiseParallel()` on every layer's k_proj and v_proj over a
  1-D DeviceMesh of the 2 ranks (q_proj is left alone: the draft's forward reads only K and V);
- local_shards: each rank builds a plain draft with half the KV heads, its K/V weights being the full
  draft's rows for its heads;
- uneven_shards: 3 KV heads over 2 ranks as plain local shards (rank 0 heads 0-1, rank 1 head 2);
- sequence_gathered: local shards fed sequence-sharded hidden states that the module all-gathers first,
  so that the graph holds a collective (upstream of the projections): the positive control of the check
  that no collective sits inside the fused region.

One spawn of 2 worker processes runs the scenarios the selected tests need, in order; each worker saves,
per scenario, the gathered outputs, the unsharded eager reference, what the pass recorded and (for
dtensor_colwise and sequence_gathered) what the post-grad graph holds. The tests below assert on those in
this process. A worker that raises ends the spawn; the tests of that scenario and of the ones after it fail
with its traceback.
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import time
import traceback

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
import torch.multiprocessing
from torch.multiprocessing.spawn import ProcessException

WORLD_SIZE = 2
N_LAYERS = 3
SEQ_LEN = 5
SPAWN_TIMEOUT_S = 300
COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d", "_dtensor")
SCENARIOS = ("dtensor_colwise", "local_shards", "uneven_shards", "sequence_gathered")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
)


# ----------------------------------------------------------------------------------------------------------
# Worker side (runs in the spawned processes; top-level so that spawn can find it)


def head_split(num_heads: int, world_size: int) -> list[tuple[int, int]]:
    """[start, stop) KV heads of each rank: contiguous blocks, the first ranks one head larger when uneven."""
    base, extra = divmod(num_heads, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def local_shard(full, start: int, stop: int):
    """A draft of the same shape as `full` holding only KV heads [start, stop): built by the factory with
    that many heads, its K/V projection rows (and biases) copied from `full`'s rows for those heads."""
    from fx_fusion import drafts

    head_dim = full.head_dim
    local = drafts.qwen3_context_kv(
        full.n_layers,
        hidden_size=full.hidden_size,
        num_kv_heads=stop - start,
        head_dim=head_dim,
        dtype=full.layers[0].k_proj.weight.dtype,
        device=full.layers[0].k_proj.weight.device,
        attention_bias=full.layers[0].k_proj.bias is not None,
        seed=123,  # deliberately not `full`'s seed: every parameter that matters is copied below
    )
    rows = slice(start * head_dim, stop * head_dim)
    with torch.no_grad():
        for src, dst in zip(full.layers, local.layers):
            for name in ("k_proj", "v_proj"):
                getattr(dst, name).weight.copy_(getattr(src, name).weight[rows])
                if getattr(src, name).bias is not None:
                    getattr(dst, name).bias.copy_(getattr(src, name).bias[rows])
            dst.k_norm.weight.copy_(src.k_norm.weight)  # per head_dim, shared by the heads
    return local


def gather_heads(local_outputs, counts: list[int]) -> list[torch.Tensor]:
    """all_gather each rank's [B, h_rank, T, D] outputs (padded to the largest h) and concatenate heads."""
    gathered = []
    widest = max(counts)
    for out in local_outputs:
        padded = out.new_zeros(out.shape[0], widest, *out.shape[2:])
        padded[:, : out.shape[1]] = out
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded)
        gathered.append(torch.cat([part[:, :count] for part, count in zip(parts, counts)], dim=1))
    return gathered


def record_data(records) -> list[dict]:
    return [
        {
            "summary": record.summary(),
            "groups": [(g.n_layers, g.num_kv_heads, g.head_dim) for g in record.fused_groups],
            "rejected": [r.reason for r in record.rejected],
        }
        for record in records
    ]


def is_collective(node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) in COLLECTIVE_NAMESPACES


def graph_data(records) -> dict:
    """Op counts of the whole post-grad graph before / after the pass, and the collectives in it: all of
    them, those upstream of the grouped GEMM (its inputs' producers) and those downstream of it (the fused
    region: the inlined norm + RoPE and the V views, up to the outputs)."""
    grouped = torch.ops.fx_fusion.grouped_linear.default
    data = {"before": {}, "after": {}, "collectives": [], "upstream": [], "region": [], "grouped_gemms": 0}
    for record in records:
        for key, graph in (("before", record.full_graph_before), ("after", record.full_graph_after)):
            for node in graph.nodes:
                if node.op == "call_function":
                    data[key][str(node.target)] = data[key].get(str(node.target), 0) + 1
        graph = record.full_graph_after
        data["collectives"] += [str(n.target) for n in graph.nodes if is_collective(n)]
        roots = [n for n in graph.nodes if n.op == "call_function" and n.target is grouped]
        data["grouped_gemms"] += len(roots)
        for direction, key in (("all_input_nodes", "upstream"), ("users", "region")):
            seen, stack = set(), list(roots)
            while stack:
                node = stack.pop()
                for other in getattr(node, direction):
                    if other not in seen:
                        seen.add(other)
                        stack.append(other)
            data[key] += sorted(str(n.target) for n in seen if is_collective(n))
    return data


def compile_and_run(module, inputs, keep_graphs: bool = False):
    """`module` compiled with backend="fx_fusion" and run under no_grad; (outputs, records)."""
    import fx_fusion  # noqa: F401  (registers the backend)
    from fx_fusion.diagnostics import RecordSink

    records = []
    with torch.no_grad(), RecordSink.collect(records, keep_graphs=keep_graphs):
        outputs = torch.compile(module, backend="fx_fusion")(*inputs)
    return outputs, records


def run_dtensor_colwise(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from fx_fusion import drafts

    full = drafts.qwen3_context_kv(N_LAYERS, num_kv_heads=4, num_attention_heads=4)
    inputs = drafts.example_inputs(full, seq_len=SEQ_LEN)
    with torch.no_grad():
        reference = full(*inputs)
    sharded = drafts.qwen3_context_kv(N_LAYERS, num_kv_heads=4, num_attention_heads=4)  # same seed: same weights
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    plan = {}
    for i in range(N_LAYERS):
        plan[f"layers.{i}.k_proj"] = ColwiseParallel()
        plan[f"layers.{i}.v_proj"] = ColwiseParallel()
    parallelize_module(sharded, mesh, plan)
    weight = sharded.layers[0].k_proj.weight
    with torch.no_grad():
        eager_local = sharded(*inputs)
    outputs, records = compile_and_run(sharded, inputs, keep_graphs=True)
    counts = [2] * WORLD_SIZE
    return {
        "reference": reference,
        "gathered": gather_heads(outputs, counts),
        "eager_gathered": gather_heads(eager_local, counts),
        "output_types": sorted({type(o).__name__ for o in outputs}),
        "local_shapes": [tuple(o.shape) for o in outputs],
        "weight_is_dtensor": isinstance(weight, DTensor),
        "weight_local_shape": tuple(weight.to_local().shape) if isinstance(weight, DTensor) else None,
        "records": record_data(records),
        "graph": graph_data(records),
    }


def run_local_shards(rank: int, num_kv_heads: int) -> dict:
    from fx_fusion import drafts

    full = drafts.qwen3_context_kv(N_LAYERS, num_kv_heads=num_kv_heads)
    inputs = drafts.example_inputs(full, seq_len=SEQ_LEN)
    with torch.no_grad():
        reference = full(*inputs)
    bounds = head_split(num_kv_heads, WORLD_SIZE)
    local = local_shard(full, *bounds[rank])
    outputs, records = compile_and_run(local, inputs)
    counts = [stop - start for start, stop in bounds]
    return {
        "reference": reference,
        "gathered": gather_heads(outputs, counts),
        "bounds": bounds,
        "local_heads": local.num_kv_heads,
        "local_shapes": [tuple(o.shape) for o in outputs],
        "records": record_data(records),
    }


class GatherSequenceThen(torch.nn.Module):
    """Hidden states arrive sharded along the sequence (sequence parallelism); the draft gathers them once
    (a functional all_gather, traced into the graph) and then projects them onto its own heads."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, hidden_shard, position_ids):
        from torch.distributed import _functional_collectives as funcol

        hidden = funcol.all_gather_tensor(hidden_shard, gather_dim=1, group=dist.group.WORLD)
        return self.draft(hidden, position_ids)


def run_sequence_gathered(rank: int) -> dict:
    from fx_fusion import drafts

    full = drafts.qwen3_context_kv(N_LAYERS, num_kv_heads=4)
    hidden, positions = drafts.example_inputs(full, seq_len=2 * SEQ_LEN)
    with torch.no_grad():
        reference = full(hidden, positions)
    bounds = head_split(4, WORLD_SIZE)
    module = GatherSequenceThen(local_shard(full, *bounds[rank]))
    hidden_shard = hidden.chunk(WORLD_SIZE, dim=1)[rank].contiguous()
    outputs, records = compile_and_run(module, (hidden_shard, positions), keep_graphs=True)
    return {
        "reference": reference,
        "gathered": gather_heads(outputs, [stop - start for start, stop in bounds]),
        "local_shapes": [tuple(o.shape) for o in outputs],
        "records": record_data(records),
        "graph": graph_data(records),
    }


SCENARIO_RUNNERS = {
    "sequence_gathered": run_sequence_gathered,
    "dtensor_colwise": run_dtensor_colwise,
    "local_shards": functools.partial(run_local_shards, num_kv_heads=4),
    "uneven_shards": functools.partial(run_local_shards, num_kv_heads=3),
}


def tp_worker(rank: int, world_size: int, store_path: str, out_dir: str, scenarios: list[str]) -> None:
    """One rank: run each scenario, save its data to out_dir/<scenario>.rank<r>.pkl. Raises on failure
    (torch.multiprocessing then ends the other rank and hands the traceback to the parent)."""
    torch.set_num_threads(1)
    # a fresh process, but the on-disk caches would skip the pass (and its records) on a rerun
    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.compile_threads = 1
    torch._functorch.config.enable_autograd_cache = False
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    try:
        for scenario in scenarios:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            data = SCENARIO_RUNNERS[scenario](rank)
            data["seconds"] = time.perf_counter() - t0
            with open(os.path.join(out_dir, f"{scenario}.rank{rank}.pkl"), "wb") as f:
                pickle.dump(data, f)
            dist.barrier()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------
# Parent side


def spawn(fn, world_size: int, args: tuple, timeout_s: float) -> None:
    """Run fn(rank, *args) in `world_size` spawned processes; raise if one fails (with its traceback) or
    if they run past `timeout_s`."""
    context = torch.multiprocessing.start_processes(fn, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"tensor-parallel workers still running after {timeout_s}s")


class SpawnResults:
    def __init__(self, out_dir, error: str | None, seconds: float):
        self.out_dir = out_dir
        self.error = error
        self.seconds = seconds

    def load(self, scenario: str) -> list[dict]:
        """Each rank's data for `scenario`; fails the test with the workers' error if it is missing."""
        paths = [self.out_dir / f"{scenario}.rank{rank}.pkl" for rank in range(WORLD_SIZE)]
        if not all(path.exists() for path in paths):
            pytest.fail(f"scenario {scenario!r} did not complete in the workers:\n{self.error or 'no error raised'}")
        per_rank = []
        for path in paths:
            with open(path, "rb") as f:
                per_rank.append(pickle.load(f))
        return per_rank


def scenario(name: str):
    """Mark a test as needing the workers' data for scenario `name`."""
    assert name in SCENARIOS

    def mark(fn):
        fn.tp_scenario = name
        return fn

    return mark


@pytest.fixture(scope="module")
def tp_results(request, tmp_path_factory) -> SpawnResults:
    """Spawn the 2 ranks once for every scenario the selected tests of this module need."""
    wanted = {
        getattr(getattr(item, "function", None), "tp_scenario", None)
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    }
    scenarios = [name for name in SCENARIOS if name in wanted]
    out_dir = tmp_path_factory.mktemp("tensor_parallel")
    error = None
    t0 = time.perf_counter()
    try:
        args = (WORLD_SIZE, str(out_dir / "store"), str(out_dir), scenarios)
        spawn(tp_worker, WORLD_SIZE, args, SPAWN_TIMEOUT_S)
    except (ProcessException, TimeoutError):  # a worker raised, died or hung: its tests say so
        error = traceback.format_exc()
    return SpawnResults(out_dir, error, time.perf_counter() - t0)


def assert_matches_reference(data: dict) -> None:
    """The ranks' gathered outputs equal the unsharded eager draft's (fp32, the repo's tight tolerance)."""
    assert len(data["gathered"]) == len(data["reference"]) == 2 * N_LAYERS
    for got, ref in zip(data["gathered"], data["reference"]):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def fused_groups(records: list[dict]) -> list[tuple]:
    return [group for record in records for group in record["groups"]]


def describe(records: list[dict]) -> str:
    return " | ".join(record["summary"] for record in records) or "no pass record"


@scenario("dtensor_colwise")
def test_tensor_parallel_dtensor_colwise_matches_eager(tp_results):
    for rank, data in enumerate(tp_results.load("dtensor_colwise")):
        assert data["weight_is_dtensor"] and data["weight_local_shape"] == (2 * 32, 64), rank
        assert data["output_types"] == ["Tensor"]  # ColwiseParallel hands back local tensors
        assert all(shape == (1, 2, SEQ_LEN, 32) for shape in data["local_shapes"]), data["local_shapes"]
        assert_matches_reference(data)
        for got, ref in zip(data["eager_gathered"], data["reference"]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@scenario("dtensor_colwise")
def test_tensor_parallel_dtensor_colwise_fuses_per_rank(tp_results):
    for rank, data in enumerate(tp_results.load("dtensor_colwise")):
        records = data["records"]
        assert len(records) == 1, f"rank {rank}: {describe(records)}"
        assert fused_groups(records) == [(N_LAYERS, 4 // WORLD_SIZE, 32)], f"rank {rank}: {describe(records)}"
        assert records[0]["rejected"] == [], f"rank {rank}: {describe(records)}"


@scenario("dtensor_colwise")
def test_tensor_parallel_dtensor_colwise_no_collective_in_fused_region(tp_results):
    for rank, data in enumerate(tp_results.load("dtensor_colwise")):
        graph = data["graph"]
        # the pass saw the 2 * L projections as plain mm's of local weight shards and replaced them
        assert graph["before"].get("aten.mm.default", 0) == 2 * N_LAYERS, graph["before"]
        assert graph["after"].get("aten.mm.default", 0) == 0, graph["after"]
        assert graph["grouped_gemms"] == 1, graph["after"]
        # replicated hidden states: nothing to communicate anywhere, least of all around the fused ops
        assert graph["region"] == [], f"rank {rank}: collectives fed by the grouped GEMM: {graph['region']}"
        assert graph["upstream"] == [], f"rank {rank}: collectives feeding the grouped GEMM: {graph['upstream']}"
        assert graph["collectives"] == [], f"rank {rank}: collectives in the graph: {graph['collectives']}"


@scenario("local_shards")
def test_tensor_parallel_local_shards_match_eager_and_fuse(tp_results):
    for rank, data in enumerate(tp_results.load("local_shards")):
        assert data["bounds"] == [(0, 2), (2, 4)] and data["local_heads"] == 2
        assert all(shape == (1, 2, SEQ_LEN, 32) for shape in data["local_shapes"]), data["local_shapes"]
        assert_matches_reference(data)
        records = data["records"]
        assert len(records) == 1, f"rank {rank}: {describe(records)}"
        assert fused_groups(records) == [(N_LAYERS, 2, 32)], f"rank {rank}: {describe(records)}"
        assert records[0]["rejected"] == [], f"rank {rank}: {describe(records)}"


@scenario("uneven_shards")
def test_tensor_parallel_uneven_shards_match_eager(tp_results):
    per_rank = tp_results.load("uneven_shards")
    for rank, data in enumerate(per_rank):
        assert data["bounds"] == [(0, 2), (2, 3)]
        assert data["local_heads"] == (2, 1)[rank]
        assert all(shape == (1, data["local_heads"], SEQ_LEN, 32) for shape in data["local_shapes"])
        assert_matches_reference(data)
        records = data["records"]
        assert records, f"rank {rank}: the pass did not run"
        # whatever the pass decided on a rank, it fused whole layers of that rank's own heads or said why not
        for n_layers, heads, head_dim in fused_groups(records):
            assert (n_layers, heads, head_dim) == (N_LAYERS, data["local_heads"], 32), describe(records)
        assert fused_groups(records) or any(r["rejected"] for r in records), describe(records)


@scenario("sequence_gathered")
def test_tensor_parallel_sequence_gathered_collective_stays_upstream(tp_results):
    """Positive control of the graph check: a collective that produces the hidden states (before the
    projections) is in the graph, upstream of the grouped GEMM, and the layers are still fused."""
    for rank, data in enumerate(tp_results.load("sequence_gathered")):
        assert all(shape == (1, 2, 2 * SEQ_LEN, 32) for shape in data["local_shapes"]), data["local_shapes"]
        assert_matches_reference(data)
        records = data["records"]
        assert fused_groups(records) == [(N_LAYERS, 2, 32)], f"rank {rank}: {describe(records)}"
        graph = data["graph"]
        assert graph["grouped_gemms"] == 1
        assert "_c10d_functional.all_gather_into_tensor.default" in graph["upstream"], graph["collectives"]
        assert sorted(graph["upstream"]) == sorted(graph["collectives"]), graph
        assert graph["region"] == [], f"rank {rank}: collectives fed by the grouped GEMM: {graph['region']}"
