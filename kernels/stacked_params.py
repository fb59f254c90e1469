"""Present several same-shaped weight tensors as one stacked tensor without a per-call copy.

A fused multi-layer path wants the per-layer weights of a model (K/V projection weights, K-norm weights)
as one stacked tensor, but a compiled graph receives them as separate inputs on every call. Stacking them
inside the graph (`cat`) would copy every weight on every call. Instead, `concatenated_view` stacks them
once and re-homes each input onto its slot of the stacked buffer (`tensor.data = buffer[slot]`): the
module's parameters then *are* views of the buffer, so

- later calls find the inputs already laid out back to back and return a view, with no copy;
- in-place updates of a parameter (`load_state_dict`, `param.copy_`) write into the buffer and are seen
  by the next call, also by a replayed CUDA graph, since the buffer's address does not change;
- a parameter replaced by a new tensor is simply re-homed again on the next call.

Memory: the stacked buffer replaces the parameters' own storage, so steady state costs nothing extra; the
first call holds both copies for a moment. Inputs that cannot be re-homed without changing what other
tensors see (views of another tensor, the same tensor twice, overlapping storage) are concatenated on every
call instead, which is correct but not free; a warning says so once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import torch

logger = logging.getLogger("fx_fusion")

_warned_copy_fallback = False


def _already_concatenated(parts: Sequence[torch.Tensor]) -> bool:
    first = parts[0]
    storage_ptr = first.untyped_storage().data_ptr()
    expected_offset = first.storage_offset()
    for part in parts:
        if not part.is_contiguous() or part.untyped_storage().data_ptr() != storage_ptr:
            return False
        if part.storage_offset() != expected_offset:
            return False
        expected_offset += part.numel()
    return True


def _can_rehome(parts: Sequence[torch.Tensor]) -> bool:
    storages = set()
    for part in parts:
        if part._base is not None or part.is_inference() != parts[0].is_inference():
            return False
        storages.add(part.untyped_storage().data_ptr())
    return len(storages) == len(parts)


def _warn_copy_fallback(count: int, why: str) -> None:
    global _warned_copy_fallback
    if not _warned_copy_fallback:
        _warned_copy_fallback = True
        logger.warning(
            "fx_fusion: %d weight tensors could not be stacked in place (%s); they are concatenated on every "
            "call instead",
            count,
            why,
        )


def _outside_graph_pools(make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """Run `make` on a helper thread and wait for it.

    CUDA graph trees route every allocation of the warming-up thread into their private memory pool, where
    a tensor that outlives the graph is an error; the stacked buffer must live in the ordinary pool.
    """
    result: dict = {}

    def run() -> None:
        try:
            with torch.cuda.device(device):
                result["tensor"] = make()
                torch.cuda.current_stream().synchronize()
        except BaseException as error:  # re-raised on the calling thread
            result["error"] = error

    worker = threading.Thread(target=run, name="fx_fusion-stack-weights")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["tensor"]


def concatenated_view(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate `parts` along dim 0 (1-D parts end to end), copying at most once per parameter set.

    All parts must share dtype, device and trailing shape. Returns a tensor
    `[sum(p.shape[0] for p in parts), *parts[0].shape[1:]]` whose rows are the parts in order.
    """
    if len(parts) == 0:
        raise ValueError("concatenated_view needs at least one tensor")
    first = parts[0]
    rows = sum(int(p.shape[0]) for p in parts)
    shape = (rows, *first.shape[1:])
    if len(parts) == 1 and first.is_contiguous():
        return first
    if _already_concatenated(parts):
        return torch.as_strided(first, shape, first.stride(), first.storage_offset())
    capturing = first.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or not _can_rehome(parts):
        _warn_copy_fallback(len(parts), "inside a CUDA graph capture" if capturing else "views or shared storage")
        with torch.no_grad():
            return torch.cat([p.detach() for p in parts], dim=0)

    def stack() -> torch.Tensor:
        with torch.no_grad(), torch.inference_mode(first.is_inference()):
            return torch.cat([p.detach() for p in parts], dim=0)

    buffer = _outside_graph_pools(stack, first.device) if first.is_cuda else stack()
    with torch.no_grad():
        row = 0
        for part in parts:
            n = int(part.shape[0])
            part.data = buffer[row : row + n]
            row += n
    return buffer
