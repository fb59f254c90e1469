"""Rotary angles as a broadcast multiply instead of an inner-dimension-1 matmul.

Hugging Face's rotary embeddings form their angles as an outer product,

    freqs = inv_freq[None, :, None].float() @ position_ids[:, None, :].float()    # bmm, inner dim 1

which Inductor on a GPU sends to cuBLAS as a kernel of its own, after a kernel that materializes its
inputs and before the pointwise cos/sin kernel. With an inner dimension of 1 every output element is one
product, so the matmul equals the broadcast multiply `a * b` exactly: one IEEE multiply, scaled by
alpha = 1 with nothing added, provided float32 matmuls may not use TF32 or bf16 (torch's default
precision, "highest"; checked when the pass runs). The multiply changes no value and lets Inductor fuse the
angles into its pointwise cos/sin kernel instead of launching the bmm and the kernels around it.

Only ancestors of a fused group's cos/sin tables are rewritten, and only matmuls of that exact form.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

# How far up from the cos/sin tables to look (the HF rotary embedding sits within ~10 nodes).
MAX_ANCESTORS = 64


def _exact_float32_matmul(device: torch.device) -> bool:
    """True when a float32 matmul on `device` computes in IEEE float32 (no TF32 or bf16 shortcuts)."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    if device.type == "cuda":
        return not torch.backends.cuda.matmul.allow_tf32
    if device.type == "cpu":
        return getattr(torch.backends.mkldnn.matmul, "fp32_precision", "none") in ("none", "ieee")
    return False


def is_outer_product(node: torch.fx.Node) -> bool:
    """mm [M, 1] x [1, N] or bmm [B, M, 1] x [B, 1, N] in float32/float64 whose result a multiply equals."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.bmm.default):
        return False
    a, b = (arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None for arg in node.args[:2])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype not in (torch.float32, torch.float64) or b.dtype != a.dtype:
        return False
    if not (statically_known_true(a.shape[-1] == 1) and statically_known_true(b.shape[-2] == 1)):
        return False
    return a.dtype == torch.float64 or _exact_float32_matmul(a.device)


def outer_products_to_mul(
    graph: torch.fx.Graph, fake_mode: Optional[FakeTensorMode], roots: list[torch.fx.Node]
) -> list[torch.fx.Node]:
    """Replace the outer-product matmuls among the ancestors of `roots` by multiplies; return the new nodes."""
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    found = []
    while stack and len(seen) < MAX_ANCESTORS:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_outer_product(node):
            found.append(node)
        stack.extend(node.all_input_nodes)
    created = []
    for matmul in found:
        a, b = matmul.args[:2]
        with graph.inserting_before(matmul):
            product = graph.call_function(aten.mul.Tensor, (a, b))
        product.meta.update({k: v for k, v in matmul.meta.items() if k not in ("val", "tensor_meta")})
        if fake_mode is not None:
            with fake_mode:
                product.meta["val"] = aten.mul.Tensor(a.meta["val"], b.meta["val"])
        matmul.replace_all_uses_with(product)
        graph.erase_node(matmul)
        created.append(product)
    return created
