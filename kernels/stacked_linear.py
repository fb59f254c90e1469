"""`fx_fusion::stacked_linear`: one GEMM over the weights of several linears that read the same input.

    out[n, :] = cat(x[n] @ W_0.T + b_0, x[n] @ W_1.T + b_1, ...)        out: [N, sum(W_i.shape[0])]

The weights are stacked once (see `stacked_params.concatenated_view`), so steady-state calls launch a
single mm/addmm and copy nothing. The output is a fresh tensor: the stacked weights never enter the
compiled graph, so Inductor cannot reuse or overwrite them.

Defined with the low-level `torch.library.Library` API (schema + per-device implementation + fake): it
sits on the hot path of every compiled call, and this API dispatches straight to the implementation.
"""

from __future__ import annotations

import torch

from .stacked_params import concatenated_view

_library = torch.library.Library("fx_fusion", "FRAGMENT")
_library.define("stacked_linear(Tensor x, Tensor[] weights, Tensor[] biases) -> Tensor")


def stacked_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """x: [N, hidden]; weights: W_i [rows_i, hidden]; biases: [] or b_i [rows_i] for every weight."""
    weight = concatenated_view(weights)
    if biases:
        return torch.addmm(concatenated_view(biases), x, weight.t())
    return torch.mm(x, weight.t())


_library.impl("stacked_linear", stacked_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("fx_fusion::stacked_linear")
def _(x, weights, biases):
    return x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))
