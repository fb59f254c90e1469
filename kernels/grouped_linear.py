"""`fx_fusion::grouped_linear`: several linears over one input, written side by side into one output.

    x: [N, hidden]; weights: W_i [rows_i, hidden]; biases: [] or b_i [rows_i] for every weight
    out: [N, sum(rows_i)],   out[:, c_i : c_i + rows_i] = x @ W_i.T + b_i   (c_i: rows of the weights before i)

Every weight is read where it lives: nothing is stacked, copied or re-homed, so a module's parameters, their
storage, `state_dict()`, pickles and in-place updates stay exactly the user's. For a few tokens on CUDA
(`grouped_gemv.max_tokens` or fewer), one Triton launch computes every linear (weights of different row
counts as row blocks of their gcd), so that all SMs stream weights at once; for a few hundred to a
thousand tokens on Hopper (`grouped_gemm_tma.token_range`), weights of one shape go through one persistent
TMA launch whose tiles cover all SMs; otherwise each linear is one GEMM writing straight into its column
slice of `out` (a row-major slice is a valid GEMM output with the full row as leading dimension, so
nothing is copied).

Defined with the low-level `torch.library.Library` API (schema + implementation + fake): it sits on the hot
path of every compiled call, and this API dispatches straight to the implementation.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from . import grouped_gemm_tma, ops
from .fused_kv_materialize import norm_weight_pointers, norm_weight_table
from .grouped_gemv import (
    MAX_EPILOGUE_TOKENS,
    KEpilogue,
    RotaryAngles,
    grouped_gemv_supported,
    grouped_gemv_unsupported_reason,
    k_epilogue_unsupported_reason,
    launch_grouped_gemv,
    token_positions,
)

_library = torch.library.Library("fx_fusion", "FRAGMENT")
_library.define("grouped_linear(Tensor x, Tensor[] weights, Tensor[] biases) -> Tensor")


SYMBOLIC_TOKENS = "a symbolic token count on CUDA: the op call picks the grouped kernel for each call's count"
# From this many weights a symbolic token count keeps the op call. Measured on an H200 (dynamic=True, bf16;
# benchmarks/RESULTS.md): a 5-layer draft (10 weights) CUDA-graphed 38.8 / 48.1 / 96.4 us at 16 / 128 / 512
# tokens against 92.6 / 99.4 / 115.8 with a GEMM per weight; uncaptured, against torch.compile, 0.99 / 0.93 /
# 1.07 / 1.00 at 16 / 128 / 512 / 1024 (1.29x at 512 before the op's host path was trimmed); one layer
# (2 weights) graphed 19.2 against 24.8 but uncaptured 1.7x at 16.
MIN_WEIGHTS_FOR_SYMBOLIC_CALL = 6

MIN_BLOCK_ROWS = 64  # row blocks narrower than this would leave the grouped kernel's tiles mostly empty


def equal_row_blocks(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> tuple[list, list]:
    """Weights (and biases) of different row counts as row blocks of their gcd, in order: views, nothing
    copied, the same output columns. The grouped kernel reads weights of one shape (a layer's Q [4096, K]
    beside its K and V [1024, K] are 4 + 1 + 1 blocks of [1024, K])."""
    rows = [w.shape[0] for w in weights]
    if len(set(rows)) < 2:
        return list(weights), list(biases)
    unit = math.gcd(*rows)
    if unit < MIN_BLOCK_ROWS:
        return list(weights), list(biases)
    blocks = lambda t: [t[i : i + unit] for i in range(0, t.shape[0], unit)]  # noqa: E731
    return [b for w in weights for b in blocks(w)], [b for bias in biases for b in blocks(bias)]


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    out = x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))
    blocks, bias_blocks = equal_row_blocks(weights, biases)
    # CUDA (or CPU with TRITON_INTERPRET=1); the token limit counts the weights as given (a Q weight of 4
    # blocks is one larger GEMM)
    if grouped_gemv_supported(x, blocks, bias_blocks, out, gemms=len(weights)):
        launch_grouped_gemv(x, blocks, bias_blocks, out)
        return out
    if grouped_gemm_tma.unsupported_reason(x, weights, biases, out) is None:
        grouped_gemm_tma.launch(x, weights, biases, out)
        return out
    column = 0
    for i, weight in enumerate(weights):
        columns = out[:, column : column + weight.shape[0]]
        if biases:
            torch.addmm(biases[i], x, weight.t(), out=columns)
        else:
            torch.mm(x, weight.t(), out=columns)
        column += weight.shape[0]
    return out


_library.impl("grouped_linear", grouped_linear, "CompositeExplicitAutograd")


def grouped_linear_body(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """What `fx_fusion.op_lowering` traces in place of a grouped_linear call: on CUDA, for a known token
    count the grouped kernel (or the TMA kernel) serves, that kernel launched through
    `torch.library.wrap_triton` (Inductor launches it from its generated code); otherwise the linears as
    ATen mm/addmm and a cat over columns, which Inductor compiles with the graph (no Python-level op per
    call; on CUDA each cuBLAS GEMM writes straight into its column slice of the cat's output).

    Raises NotImplementedError for a symbolic token count on CUDA over MIN_WEIGHTS_FOR_SYMBOLIC_CALL or more
    weights (a multi-layer draft): which kernel serves a call depends on its count, so the op call stays
    and picks one per call (one op dispatch, where GEMMs per weight would give up the grouped kernels at
    every count). Fewer weights (one layer's projections) keep GEMMs per weight, launched by Inductor."""
    symbolic = isinstance(x.shape[0], torch.SymInt)
    if x.is_cuda and symbolic and len(weights) >= MIN_WEIGHTS_FOR_SYMBOLIC_CALL:
        raise NotImplementedError(SYMBOLIC_TOKENS)
    if x.is_cuda and not symbolic:
        out = x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))
        blocks, bias_blocks = equal_row_blocks(weights, biases)
        if grouped_gemv_supported(x, blocks, bias_blocks, out, gemms=len(weights)):
            launch_grouped_gemv(x, blocks, bias_blocks, out, traceable=True)
            return out
        if grouped_gemm_tma.unsupported_reason(x, weights, biases, out) is None:
            grouped_gemm_tma.launch(x, weights, biases, out, traceable=True)
            return out
    linears = [torch.addmm(biases[i], x, w.t()) if biases else torch.mm(x, w.t()) for i, w in enumerate(weights)]
    return torch.cat(linears, dim=1)


@torch.library.register_fake("fx_fusion::grouped_linear")
def _(x, weights, biases):
    return x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))


def grouped_linear_k_epilogue_body(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor],
    k_columns: tuple[int, int, int],
    *materialize_args,
    rotary_angles: Optional[tuple] = None,
    **materialize_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `fx_fusion.op_lowering` traces in place of a grouped_linear call and the materialize_k call
    that reads its K heads: one launch of the grouped kernel whose tiles of K heads also go through the K
    norm and RoPE (`grouped_gemv.KEpilogue`), so K is not read back from memory by a second kernel.

    k_columns = (column, block_stride, head_stride): where materialize_k's k_proj, a view of the grouped
    output [N, columns], finds head h of block b (column + b * block_stride + h * head_stride). The other
    arguments are the two calls' own. `rotary_angles` = (inv_freq, positions, scale, rounded, first, step):
    the launch computes cos / sin from these (`grouped_gemv.RotaryAngles`, inv_freq flattened, token t at
    position positions.reshape(-1)[first + t * step]) instead of reading materialize_k's tables, which must
    hold the same values (`fx_fusion.rotary_angles`).
    Returns (the grouped output, materialize_k's output). Raises
    NotImplementedError where the fused launch does not serve the call (not CUDA, a symbolic or too large
    token count, heads not tile-aligned): the two calls are then lowered one by one.
    """
    common, token_major = ops._common_and_token_major(materialize_args, materialize_kwargs)
    ops._validate(common)
    c = ops.CommonArgs(*common)
    if not x.is_cuda or isinstance(x.shape[0], torch.SymInt) or x.shape[0] > MAX_EPILOGUE_TOKENS:
        raise NotImplementedError(f"the fused launch serves CUDA tensors with up to {MAX_EPILOGUE_TOKENS} tokens")
    n_tokens, n_blocks = c.k_proj.shape[:2]
    out = x.new_empty((n_tokens, sum(w.shape[0] for w in weights)))
    # Allocated from x: k_proj, a view of the grouped output this launch replaces, is only described.
    if token_major:
        k_out = x.new_empty((n_tokens, n_blocks, c.num_kv_heads, c.head_dim)).transpose(0, 1)
    else:
        k_out = x.new_empty((n_blocks, n_tokens, c.num_kv_heads, c.head_dim))
    blocks, bias_blocks = equal_row_blocks(weights, biases)
    norm_weight = ops._norm_weight(c.k_norm_weight)
    norm_weights = norm_weight_pointers(norm_weight)
    if norm_weights is None:  # one table (or no norm)
        table = norm_weight_table(norm_weight, n_blocks, c.head_dim)
        norm_weights = [] if table is None else [table]
    angles = None
    if rotary_angles is not None:
        inv_freq, positions, scale, rounded, first, step = rotary_angles
        angles = RotaryAngles(inv_freq.reshape(-1), token_positions(positions, first, step, n_tokens), scale, rounded)
    epilogue = KEpilogue(
        k_out, *k_columns, norm_weights, c.eps, c.eps_value, c.cos, c.sin, c.positions, c.rotary_dim,
        c.interleaved, c.norm_weight_offset, c.norm_weight_in_float32, c.norm_round_before_rope, angles,
    )  # fmt: skip
    reason = grouped_gemv_unsupported_reason(x, blocks, bias_blocks, out)
    reason = reason or k_epilogue_unsupported_reason(blocks[0].shape[0], out.shape[1], epilogue, out)
    if reason is not None:
        raise NotImplementedError(reason)
    launch_grouped_gemv(x, blocks, bias_blocks, out, k_epilogue=epilogue, traceable=True)
    return out, k_out
