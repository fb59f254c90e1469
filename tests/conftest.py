"""Shared fixtures."""

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

# The tests compile many tiny graphs. On CPU much of each compile is Inductor's vectorisation analysis
# and the C++ build of vectorised kernels, neither of which the pass changes; scalar C++ runs the same
# graphs (the pass, the lowering and the numerics checks are unchanged) in less time: the whole suite with
# empty caches on 2 cores took 27.9 min against 33.6 min vectorised.
torch._inductor.config.cpp.simdlen = 1

MAX_TEST_WORKERS = 8  # each worker imports torch and compiles on its own: beyond this, memory, not speed


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (`-n auto`); absent without the plugin
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most MAX_TEST_WORKERS."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_TEST_WORKERS))


@pytest.fixture
def fresh_compile():
    """A fresh dynamo, and the compile caches off so that the pass really runs (and records)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


@pytest.fixture(
    params=[
        pytest.param("interpret", id="cpu-triton-interpret"),
        pytest.param(
            "cuda", id="cuda",
            marks=[pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), pytest.mark.gpu],
        ),
    ]
)
def triton_device(request, monkeypatch) -> str:
    """A Triton kernel's two front ends: "cpu" through the interpreter (TRITON_INTERPRET=1, read at call
    time), or "cuda" compiled (skipped without a GPU)."""
    if request.param == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        return "cpu"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return "cuda"


def _stand_in_k_epilogue_body(x, weights, biases, k_columns, *materialize_args, rotary_angles=None, **materialize_kwargs):
    """The fused launch's contract in ATen ops: the grouped output, and materialize_k over the K heads that
    `k_columns` names in it (so a wrong column mapping gives wrong numbers), with cos / sin computed from
    `rotary_angles` when given (so wrong positions or frequencies give wrong numbers)."""
    from fx_fusion.kernels import grouped_gemv, grouped_linear, ops

    out = grouped_linear.grouped_linear_body(x, weights, biases)
    k_proj = materialize_args[0]
    if rotary_angles is not None:
        inv_freq, positions, scale, rounded, first, step = rotary_angles
        c = ops.CommonArgs(*ops._common_and_token_major(materialize_args, materialize_kwargs)[0])
        freq = torch.arange(c.rotary_dim, device=x.device)
        freq = freq // 2 if c.interleaved else freq % (c.rotary_dim // 2)
        positions = grouped_gemv.token_positions(positions, first, step, k_proj.shape[0])
        angle = positions.float()[:, None] * inv_freq.reshape(-1).float()[freq][None, :]
        tables = [trig(angle) * scale for trig in (torch.cos, torch.sin)]
        tables = [t.to(k_proj.dtype) if rounded else t for t in tables]
        materialize_args = (*materialize_args[:4], *tables, *materialize_args[6:])
    column, block_stride, head_stride = k_columns
    if k_proj.dim() == 3:
        strides = (out.stride(0), block_stride, 1)
    else:
        strides = (out.stride(0), block_stride, head_stride, 1)
    heads = out.as_strided(k_proj.shape, strides, out.storage_offset() + column)
    return out, ops.materialize_k_body(heads, *materialize_args[1:], **materialize_kwargs)


@pytest.fixture
def k_epilogue_on_cpu(monkeypatch):
    """The K-epilogue lowering on CPU, the fused launch replaced by `_stand_in_k_epilogue_body`."""
    from fx_fusion import op_lowering
    from fx_fusion.kernels import grouped_linear

    monkeypatch.setattr(op_lowering, "K_EPILOGUE_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(grouped_linear, "grouped_linear_k_epilogue_body", _stand_in_k_epilogue_body)


@pytest.fixture
def refuse_add_call(monkeypatch):
    """`refuse_add_call(module, target)`: the module's `add_call` raises for `target`, as fake tensors that
    refuse an op would; other calls go through."""

    def refuse(module, target):
        real = module.add_call

        def add_call(graph, called, args, kwargs=None):
            if called is target:
                raise RuntimeError("refused")
            return real(graph, called, args, kwargs)

        monkeypatch.setattr(module, "add_call", add_call)

    return refuse
