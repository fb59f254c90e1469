"""Integer helpers for launch configurations, which run on the host for every uncaptured op call.

`triton.cdiv` and `triton.next_power_of_2` are Triton constexpr functions: called from Python, each call
goes through Triton's JIT wrapper (about 3 us on a 2-core host, several per launch). These are plain
Python with the same results; `ceil_div` also takes symbolic sizes (torch.SymInt) while tracing."""


def ceil_div(a, b):
    """ceil(a / b) for integers a >= 0, b > 0."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n for n >= 1 (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
