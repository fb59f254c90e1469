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
