"""The host-side launch helpers agree with Triton's own constexpr functions."""

import triton

from fx_fusion.kernels.launch_math import ceil_div, next_power_of_2


def test_ceil_div_and_next_power_of_2_match_triton() -> None:
    for n in range(0, 2100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 132, 1000):
            assert ceil_div(n, d) == triton.cdiv(n, d), (n, d)
    for n in (2**31 - 1, 2**31, 2**31 + 1, 3 * 2**40 + 5):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        assert ceil_div(n, 7) == triton.cdiv(n, 7)

