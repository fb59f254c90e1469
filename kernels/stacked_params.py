"""Present several same-shaped weight tensors as one stacked tensor without a per-call copy.

A fused multi-layer path wants the per-layer weights of a model (K/V projection weights, K-norm weights)
as one stacked tensor, but a compiled graph receives them as separate inputs on every call. Stacking them
inside the graph (`cat`) would copy every weight on every call. Instead, `concatenated_view` stacks them
once and re-homes each input onto its slot of the stacked buffer (`tensor.data = buffer[slot]`): the
module's parameters then *are* views of the buffer, so

- later calls find the inputs already laid out back to back and return a view, with no copy;
- in-place updates of a parameter (`load_state_dict`, `param.copy_`) write into the buffer and are seen
  by the next call, also by a replayed CUDA graph, since the buffer's address does not change;
- a parameter replaced by a new tensor is re-homed on the next call, with the others, onto a new buffer.

Memory: the stacked buffer replaces the parameters' own storage, so steady state costs nothing extra; the
first call holds both copies for a moment. Inputs that cannot be re-homed without changing what other
tensors see (views of another tensor, the same tensor twice, shared storage) are concatenated on every
call instead, which is correct but not free; a warning says so once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import torch

logger = logging.getLogger("fx_fusion")

_warned_copy_fallback = False
# Set on every re-homed tensor: the address of the stacked buffer's storage it was given.
_STACKED_STORAGE_ATTR = "_fx_fusion_stacked_storage"


def _already_concatenated(parts: Sequence[torch.Tensor]) -> bool:
    """True when the parts lie back to back, in order, inside the first part's storage.

    Every part's data must start where the previous one ends and stay within the first part's storage;
    a live storage's memory belongs to it alone, so the parts are then views of that one storage.
    """
    first = parts[0]
    storage = first.untyped_storage()
    storage_end = storage.data_ptr() + storage.nbytes()
    item_size = first.element_size()
    expected_ptr = first.data_ptr()
    for part in parts:
        if part.data_ptr() != expected_ptr or not part.is_contiguous() or part.dtype != first.dtype:
            return False
        expected_ptr += part.numel() * item_size
    return expected_ptr <= storage_end


def _can_rehome(parts: Sequence[torch.Tensor]) -> bool:
    """True when giving every part a new storage changes what no other tensor sees.

    Parts must be distinct tensors with their own storage, or still sit on a buffer stacked here earlier
    (replacing one stacked parameter leaves the others on the old buffer, which only they use).
    """
    seen = set()
    for part in parts:
        if part.is_inference() != parts[0].is_inference():
            return False
        storage_ptr = part.untyped_storage().data_ptr()
        if getattr(part, _STACKED_STORAGE_ATTR, None) == storage_ptr:
            key = ("slot", part.data_ptr())
        elif part._base is None:
            key = ("storage", storage_ptr)
        else:
            return False
        if key in seen:
            return False
        seen.add(key)
    return True


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
            setattr(part, _STACKED_STORAGE_ATTR, buffer.untyped_storage().data_ptr())
            row += n
    return buffer
