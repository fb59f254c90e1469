"""The `fx_fusion` torch.compile backend: Inductor with FusedKVPass installed.

    torch.compile(model, backend="fx_fusion")
    torch.compile(model, backend="fx_fusion", options={"min_layers": 2, "freezing": True})
    torch.compile(model, backend="fx_fusion", mode="reduce-overhead")

Options of the pass: `min_layers` (default 1: a single layer is fused too), `disable` (compile without the
pass), `gemm_epilogue` (default True; False keeps the K norm/RoPE a kernel of its own after the grouped
GEMM), `rotary_angles_in_kernel` (default True; False has that GEMM read RoPE's cos/sin from the tables
the graph computes rather than computing them itself). Every other option is an Inductor config option,
passed through as `torch.compile(options=...)` would. With Inductor freezing on, the pass runs on the
joint graph, before freezing folds and merges the projection weights.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch._dynamo import list_backends, register_backend

from .fused_kv_pass import FusedKVPass

PASS_OPTIONS = ("min_layers", "disable", "gemm_epilogue", "rotary_angles_in_kernel")


def fx_fusion_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    options: Optional[dict[str, Any]] = None,
    mode: Optional[str] = None,
):
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    inductor_options = dict(list_mode_options(mode)) if mode else {}
    inductor_options.update(options or {})
    min_layers = inductor_options.pop("min_layers", 1)
    disable = inductor_options.pop("disable", False)
    gemm_epilogue = inductor_options.pop("gemm_epilogue", True)
    angles_in_kernel = inductor_options.pop("rotary_angles_in_kernel", True)
    freezing = inductor_options.get("freezing", torch._inductor.config.freezing)
    stage = "joint" if freezing and not torch.is_grad_enabled() else "post_grad"
    slot = f"{stage}_custom_post_pass"
    kv_pass = FusedKVPass(
        min_layers=min_layers, enabled=not disable, stage=stage, gemm_epilogue=gemm_epilogue,
        rotary_angles_in_kernel=angles_in_kernel,
    )  # fmt: skip
    if inductor_options.get(slot) is not None:
        raise ValueError(f"fx_fusion installs its own {slot}; remove it from options")
    inductor_options[slot] = kv_pass
    return compile_fx(gm, example_inputs, config_patches=inductor_options)


# An installed package also declares the backend through the `torch_dynamo_backends` entry point, which
# dynamo registers itself when it looks the name up; register here only where no entry point exists
# (a source checkout on PYTHONPATH), since registering one name twice is an error.
if "fx_fusion" not in list_backends(exclude_tags=()):
    register_backend(name="fx_fusion", compiler_fn=fx_fusion_backend)
