"""fx_fusion.cuda_graphs.capture: a replay reads what the captured call read, for as long as it lives."""

import gc

import pytest
import torch

from fx_fusion import cuda_graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_replay_keeps_the_captured_callables_inputs_alive():
    """The callable's inputs go out of scope after capture (a benchmark loop rebinding them): the replay
    must still read them, not memory the caching allocator has handed to a new tensor of the same size."""

    def captured_doubling(seed: int):
        weights = torch.randn(1 << 20, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        return cuda_graphs.capture(lambda: weights * 2), weights.double() * 2

    replay, expected = captured_doubling(seed=7)
    gc.collect()
    reuse = [torch.full((1 << 20,), 3.0, device="cuda") for _ in range(4)]  # what a freed block would become
    torch.testing.assert_close(replay().double(), expected, rtol=0, atol=0)
    assert all(bool((r == 3.0).all()) for r in reuse)
