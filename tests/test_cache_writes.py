"""K/V straight into the KV cache: the op `materialize_kv_to_cache` against a float64 reference, and the pass
absorbing the cache writes that a graph spells (StaticCache's index_copy_, paged pools, a slice copy, FP8)."""

from __future__ import annotations

import pytest
import torch
from test_fused_kv_op import Case, assert_close_to_reference, device, make_inputs, reference  # noqa: F401

import fx_fusion  # noqa: F401  (registers backend="fx_fusion")
from fx_fusion.diagnostics import RecordSink
from fx_fusion.drafts import example_inputs, qwen3_context_kv
from fx_fusion.kernels.ops import cache_view

OPS = torch.ops.fx_fusion
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# name: (buffer shape for (batches, slots per batch, H, D), cache_dims: the buffer's (batch, slot, head, dim))
LAYOUTS = {
    "static": (lambda b, s, h, d: (b, h, s, d), [0, 2, 1, 3]),  # Hugging Face StaticCache [B, H, max_len, D]
    "flat_pool": (lambda b, s, h, d: (b * s, h, d), [-1, 0, 1, 2]),  # [num_slots, H, D]
    "paged": (lambda b, s, h, d: (b, s, h, d), [0, 1, 2, 3]),  # [num_blocks, block_size, H, D]
    "head_major_pool": (lambda b, s, h, d: (h, b * s, d), [-1, 1, 0, 2]),  # [H, num_slots, D]
}


def _caches(layout: str, n: int, batches: int, per_batch: int, case: Case, dtype: torch.dtype, device: str):
    """n caches, each a view into the middle of a NaN-filled buffer (guards on both sides show stray writes)."""
    shape_of, dims = LAYOUTS[layout]
    shape = shape_of(batches, per_batch, case.num_kv_heads, case.head_dim)
    numel = torch.Size(shape).numel()
    buffers = [torch.full((3 * numel,), float("nan"), device=device).to(dtype) for _ in range(n)]
    return buffers, [b[numel : 2 * numel].view(shape) for b in buffers], dims


def _expected_rows(values: torch.Tensor, slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the slots written, values [L, written, H, D]) for tokens whose slot is in [0, num_slots)."""
    valid = (slots >= 0) & (slots < num_slots)
    return slots[valid].long().cpu(), values[:, valid.cpu()]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_op_writes_every_layer_at_its_slots(layout: str, cache_dtype: torch.dtype, device: str) -> None:
    check_cache_write(layout, cache_dtype, device)


@pytest.mark.parametrize("norm", ["stacked", "per_layer"])
def test_op_writes_more_layers_than_one_launch_takes(norm: str, device: str) -> None:
    """Launched 8 layers at a time; per-layer norm weights go to each launch as its layers' pointers."""
    check_cache_write("static", torch.bfloat16, device, n_layers=11, norm=norm)


def check_cache_write(
    layout: str, cache_dtype: torch.dtype, device: str, n_layers: int = 3, norm: str = "stacked"
) -> None:
    """Poisoned caches (inside guard regions) written by the op, against the float64 reference: every
    named slot holds its token's K/V, every other slot and the guards stay NaN."""
    case = Case(
        total_ctx=9, n_layers=n_layers, num_kv_heads=2, head_dim=64, rope="per_token", dtype=torch.bfloat16, norm=norm
    )
    inputs = make_inputs(case, device)
    k_ref, v_ref = reference(case, inputs)  # [L, T, H, D] float64
    batches, per_batch = 2, 8
    num_slots = batches * per_batch
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(num_slots, generator=gen)[: case.total_ctx]
    slots[2], slots[5] = -1, num_slots + 3  # padding and out of range: skipped
    slots = slots.to(device)
    n = case.n_layers
    k_buffers, k_caches, dims = _caches(layout, n, batches, per_batch, case, cache_dtype, device)
    v_buffers, v_caches, _ = _caches(layout, n, batches, per_batch, case, cache_dtype, device)
    scaled = cache_dtype in FP8
    k_scale = torch.tensor(0.37, device=device) if scaled else None
    v_scale = torch.tensor([1.9], device=device) if scaled else None

    OPS.materialize_kv_to_cache(*inputs.common(case), inputs.v_proj(case), k_caches, v_caches, slots, dims, k_scale, v_scale)

    for caches, buffers, ref, scale in ((k_caches, k_buffers, k_ref, k_scale), (v_caches, v_buffers, v_ref, v_scale)):
        written, values = _expected_rows(ref, slots, num_slots)
        for layer, (cache, buffer) in enumerate(zip(caches, buffers)):
            rows = cache_view(cache, dims).reshape(num_slots, case.num_kv_heads, case.head_dim)
            unwritten = torch.ones(num_slots, dtype=torch.bool)
            unwritten[written] = False
            assert rows[unwritten.to(device)].float().isnan().all(), "a slot that no token names was written"
            third = buffer.numel() // 3
            assert buffer[:third].float().isnan().all() and buffer[2 * third :].float().isnan().all(), "write outside the cache"
            actual = rows[written.to(device)]
            if scaled:  # within one FP8 step of the exact quotient
                expected = values[layer] / float(scale)
                step = 2.0 ** -(3 if cache_dtype == torch.float8_e4m3fn else 2)
                tiny = torch.finfo(cache_dtype).smallest_normal
                torch.testing.assert_close(actual.double().cpu(), expected, rtol=step, atol=tiny)
            else:
                assert_close_to_reference(actual, values[layer], case.dtype)


def test_op_fp8_is_the_float32_quotient_converted_once(device: str) -> None:
    """FP8: k / scale from K in float32 (not rounded to bf16 first) and V as projected, converted once."""
    case = Case(total_ctx=16, n_layers=2, num_kv_heads=2, head_dim=64, rope="per_token", dtype=torch.float32)
    inputs = make_inputs(case, device)
    k32, _ = OPS.materialize_kv(*inputs.common(case), inputs.v_proj(case))
    _, k_caches, dims = _caches("flat_pool", 2, 1, 16, case, torch.float8_e4m3fn, device)
    _, v_caches, _ = _caches("flat_pool", 2, 1, 16, case, torch.float8_e4m3fn, device)
    scale = torch.tensor(0.05, device=device)
    slots = torch.arange(16, device=device).flip(0)
    OPS.materialize_kv_to_cache(*inputs.common(case), inputs.v_proj(case), k_caches, v_caches, slots, dims, scale, scale)
    v = inputs.v_proj(case).unflatten(-1, (2, 64)).transpose(0, 1)
    for layer in range(2):
        expected_k = (k32[layer] / scale).to(torch.float8_e4m3fn)
        expected_v = (v[layer] / scale).to(torch.float8_e4m3fn)
        assert torch.equal(k_caches[layer][slots].view(torch.uint8), expected_k.view(torch.uint8))
        assert torch.equal(v_caches[layer][slots].view(torch.uint8), expected_v.view(torch.uint8))


def test_op_with_only_padding_slots_writes_nothing(device: str) -> None:
    """Every slot -1 or past the cache, or no token at all: no slot is written (the PyTorch math's stand-in
    write, which keeps the shapes static, puts back what slot 0 holds)."""
    case = Case(total_ctx=4, n_layers=2, num_kv_heads=2, head_dim=64, rope="per_token", dtype=torch.float32)
    inputs = make_inputs(case, device)
    caches = [torch.randn(8, 2, 64, device=device) for _ in range(4)]
    before = [c.clone() for c in caches]
    slots = torch.tensor([-1, 8, -1, 100], device=device)
    OPS.materialize_kv_to_cache(*inputs.common(case), inputs.v_proj(case), caches[:2], caches[2:], slots, [-1, 0, 1, 2], None, None)
    for cache, held in zip(caches, before):
        assert torch.equal(cache, held)
    empty = Case(total_ctx=0, n_layers=2, num_kv_heads=2, head_dim=64, rope="per_token", dtype=torch.float32)
    inputs = make_inputs(empty, device)
    no_slots = torch.zeros(0, dtype=torch.int64, device=device)
    OPS.materialize_kv_to_cache(*inputs.common(empty), inputs.v_proj(empty), caches[:2], caches[2:], no_slots, [-1, 0, 1, 2], None, None)
    for cache, held in zip(caches, before):
        assert torch.equal(cache, held)


def _op_args(**change):
    case = Case(total_ctx=4, n_layers=2, num_kv_heads=2, head_dim=64, rope="per_token")
    inputs = make_inputs(case)
    _, k_caches, dims = _caches("flat_pool", 2, 1, 8, case, torch.bfloat16, "cpu")
    _, v_caches, _ = _caches("flat_pool", 2, 1, 8, case, torch.bfloat16, "cpu")
    args = dict(v_proj=inputs.v_proj(case), k_caches=k_caches, v_caches=v_caches, slots=torch.arange(4),
                cache_dims=dims, k_scale=None, v_scale=None)  # fmt: skip
    args.update(change)
    return inputs.common(case), args


BAD_CACHE_ARGS = {
    "one cache short": (dict(k_caches="short"), "got 1 caches, expected 2"),
    "strides differ": (dict(k_caches="transposed"), "every layer's cache needs the shape, strides"),
    "fp8 without a scale": (dict(k_caches="fp8"), "FP8 k_caches need a per-tensor scale"),
    "cache_dims not a permutation": (dict(cache_dims=[0, 0, 1, 2]), "Invalid cache_dims"),
    "heads do not match": (dict(cache_dims=[-1, 0, 2, 1]), "heads and head_dim"),
    "slots of the wrong length": (dict(slots=torch.arange(3)), "Invalid slots"),
    "float slots": (dict(slots=torch.arange(4.0)), "Invalid slots"),
    "a scale of two elements": (dict(k_scale=torch.ones(2)), "Invalid scale"),
    "K and V in one cache": (dict(v_caches="same"), "share memory"),
}


@pytest.mark.parametrize("name", sorted(BAD_CACHE_ARGS))
def test_op_rejects_bad_caches_by_name(name: str) -> None:
    change, message = BAD_CACHE_ARGS[name]
    common, args = _op_args()
    if change.get("k_caches") == "short":
        change = dict(k_caches=args["k_caches"][:1])
    elif change.get("k_caches") == "transposed":
        change = dict(k_caches=[args["k_caches"][0], args["k_caches"][1].transpose(0, 1).contiguous().transpose(0, 1)])
    elif change.get("k_caches") == "fp8":
        change = dict(k_caches=[c.to(torch.float8_e4m3fn) for c in args["k_caches"]])
    elif change.get("v_caches") == "same":
        change = dict(v_caches=args["k_caches"])
    args.update(change)
    with pytest.raises(ValueError, match=message):
        OPS.materialize_kv_to_cache(*common, *args.values())


# --------------------------------------------------------------------------------------------------------
# The pass: cache writes spelled in the graph
# --------------------------------------------------------------------------------------------------------

MAX_LEN, BLOCK = 32, 8
SENTINEL = 256.0  # what unwritten cache rows hold (exact in every cache dtype)


def _write(spelling: str, cache: torch.Tensor, value: torch.Tensor, cache_position, slots) -> None:
    """One layer's cache write, `value` [B, H, T, D] as Hugging Face's attention has it."""
    H, D = value.shape[1], value.shape[3]
    if spelling == "static":  # StaticCache.update
        cache.index_copy_(2, cache_position, value)
    elif spelling == "static_setitem":
        cache[:, :, cache_position] = value
    elif spelling == "slice_copy":
        cache[:, :, 3 : 3 + value.shape[2]].copy_(value)
    elif spelling == "flat_pool":  # SGLang / vLLM native: k_cache[slot_mapping] = k
        cache[slots] = value[0].transpose(0, 1)
    elif spelling == "paged_flat_view":
        cache.view(-1, H, D)[slots] = value[0].transpose(0, 1)
    elif spelling == "paged_block_offset":
        cache[slots // BLOCK, slots % BLOCK] = value[0].transpose(0, 1)
    elif spelling == "index_put_":
        cache.index_put_((slots,), value[0].transpose(0, 1))
    else:
        raise ValueError(spelling)


def _cache_shape(spelling: str, batch: int, H: int, D: int) -> tuple:
    if spelling in ("flat_pool", "index_put_"):
        return (MAX_LEN, H, D)
    if spelling.startswith("paged"):
        return (MAX_LEN // BLOCK, BLOCK, H, D)
    return (batch, H, MAX_LEN, D)  # StaticCache's layout


class CachedContext(torch.nn.Module):
    """Context K/V of a draft (drafts.ContextKV) written into per-layer caches (buffers), as `spelling` says;
    with a `scale`, quantised the way peers spell it, `(k / k_scale).to(cache dtype)`."""

    def __init__(
        self, spelling: str, dtype: torch.dtype, cache_dtype: torch.dtype, batch: int = 1, scale: bool = False,
        device: str = "cpu",
    ):  # fmt: skip
        super().__init__()
        self.context = qwen3_context_kv(3, dtype=dtype, device=device)
        self.spelling = spelling
        shape = _cache_shape(spelling, batch, self.context.num_kv_heads, self.context.head_dim)
        for i in range(2 * self.context.n_layers):
            self.register_buffer(f"cache{i}", torch.full(shape, SENTINEL, device=device).to(cache_dtype), persistent=False)
        self.register_buffer("k_scale", torch.tensor(0.37, device=device) if scale else None, persistent=False)
        self.register_buffer("v_scale", torch.tensor(1.9, device=device) if scale else None, persistent=False)

    def caches(self) -> list[torch.Tensor]:
        return [getattr(self, f"cache{i}") for i in range(2 * self.context.n_layers)]

    def forward(self, hidden, position_ids, cache_position, slots):
        outputs = self.context(hidden, position_ids)
        caches = self.caches()
        for i, value in enumerate(outputs):
            if self.k_scale is not None:
                value = (value / (self.k_scale if i % 2 == 0 else self.v_scale)).to(caches[i].dtype)
            _write(self.spelling, caches[i], value, cache_position, slots)
        return caches[0].float().sum()


def _run(module: CachedContext, backend: str, inputs: tuple, options: dict | None = None):
    """The caches after one call (fresh copies of the module's), and the pass's records."""
    for cache in module.caches():
        cache.fill_(SENTINEL)
    records: list = []
    fn = module if backend == "eager" else torch.compile(module, backend=backend, options=options, fullgraph=True)
    with torch.no_grad(), RecordSink.collect(records, keep_graphs=True):
        fn(*inputs)
    return [c.clone() for c in module.caches()], records


def _inputs(module: CachedContext, tokens: int, batch: int = 1, slots=None):
    hidden, positions = example_inputs(module.context, batch=batch, seq_len=tokens)
    cache_position = torch.arange(tokens) + 5
    if slots is None:
        slots = torch.randperm(MAX_LEN, generator=torch.Generator().manual_seed(0))[:tokens]
    return hidden, positions, cache_position.to(hidden.device), slots.to(hidden.device)


def _count(graph: torch.fx.Graph, target) -> int:
    return sum(1 for n in graph.nodes if n.target is target)


SPELLINGS = ["static", "static_setitem", "slice_copy", "flat_pool", "paged_flat_view", "paged_block_offset", "index_put_"]
CUDA = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), pytest.mark.gpu]
ON_CUDA = [pytest.param(s, "cuda", id=f"cuda-{s}", marks=CUDA) for s in ("static", "paged_flat_view", "slice_copy")]


@pytest.mark.parametrize("spelling, device", [(s, "cpu") for s in SPELLINGS] + ON_CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pass_absorbs_cache_writes(spelling: str, device: str, dtype: torch.dtype, fresh_compile) -> None:
    batch = 2 if spelling.startswith("static") else 1
    module = CachedContext(spelling, dtype, dtype, batch=batch, device=device)
    inputs = _inputs(module, tokens=5, batch=batch)
    expected, _ = _run(module, "inductor", inputs)
    eager, _ = _run(module, "eager", inputs)
    actual, records = _run(module, "fx_fusion", inputs)
    (record,) = records
    (group,) = record.fused_groups
    assert group.cache_writes.startswith("K and V of 3 layers written straight into their caches"), group.cache_writes
    after = record.full_graph_after
    assert _count(after, torch.ops.aten.index_put.default) + _count(after, torch.ops.aten.slice_scatter.default) == 0
    assert _count(after, torch.ops.higher_order.auto_functionalized_v2) == 1
    for i, (a, e, ref) in enumerate(zip(actual, expected, eager)):
        assert torch.equal(a == SENTINEL, e == SENTINEL), f"cache {i}: other rows written than the plain graph writes"
        if i % 2 and device == "cpu":  # V: the same projection GEMM, bit for bit
            assert torch.equal(a, e)
        else:  # K: the op's rounding (fused_kv_pass's docstring), within an ulp of the head's largest element;
            # V on CUDA: the grouped GEMM sums in another order than cuBLAS
            written = e != SENTINEL
            ulp = 1e-6 if dtype == torch.float32 else 2**-8
            atol = 4 * ulp * e[written].abs().max().item()
            torch.testing.assert_close(a[written].float(), e[written].float(), rtol=0, atol=atol)
            torch.testing.assert_close(a[written].float(), ref[written].float(), rtol=0, atol=atol)


@pytest.mark.parametrize(
    "spelling, device", [(s, "cpu") for s in ("flat_pool", "paged_flat_view", "slice_copy")] + ON_CUDA[1:]
)
@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_pass_absorbs_fp8_cache_writes(spelling: str, device: str, cache_dtype: torch.dtype, fresh_compile) -> None:
    """float32 K and V: the fused FP8 caches equal stock Inductor's bit for bit."""
    module = CachedContext(spelling, torch.float32, cache_dtype, scale=True, device=device)
    inputs = _inputs(module, tokens=6)
    expected, _ = _run(module, "inductor", inputs)
    actual, records = _run(module, "fx_fusion", inputs)
    (group,) = records[0].fused_groups
    assert group.cache_writes.startswith("K and V of 3 layers written straight into their caches (FP8, scaled)")
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8)), f"cache {i} differs"


@pytest.mark.parametrize("spelling, cache_dtype", [("static", torch.float32), ("paged_block_offset", torch.float32), ("flat_pool", torch.float8_e4m3fn)])
def test_cpu_code_writes_the_caches_itself(spelling: str, cache_dtype: torch.dtype, fresh_compile) -> None:
    """On a CPU the absorbed write is the op's math compiled by Inductor: no op call is left in the generated
    code, and no cache is copied whole (the writes go in place)."""
    from torch._inductor.utils import run_and_get_code

    module = CachedContext(spelling, torch.float32, cache_dtype, scale=cache_dtype in FP8)
    inputs = _inputs(module, tokens=5, slots=torch.tensor([3, -1, 7, 30, 12]))
    expected, _ = _run(module, "inductor", inputs)
    for cache in module.caches():
        cache.fill_(SENTINEL)
    compiled = torch.compile(module, backend="fx_fusion", fullgraph=True)
    records: list = []
    with torch.no_grad(), RecordSink.collect(records):
        _, (code,) = run_and_get_code(compiled, *inputs)
    assert records[0].fused_groups[0].cache_writes.startswith("K and V of 3 layers")
    assert "torch.ops.fx_fusion" not in code and "aten.copy_" not in code
    if spelling == "flat_pool":  # the plain index_put writes the padded token at the last slot: fused skips it
        for a, e in zip(module.caches(), expected):
            rows = torch.tensor([3, 7, 30, 12])
            assert torch.equal(a[rows].view(torch.uint8), e[rows].view(torch.uint8))  # FP8: bit for bit
            assert (a[-1].float() == SENTINEL).all()


def test_pass_skips_padding_slots(fresh_compile) -> None:
    """A slot of -1 (vLLM's padding) is skipped: the pool's last slot keeps its value (the plain index_put
    would write the padded token there)."""
    module = CachedContext("flat_pool", torch.float32, torch.float32)
    slots = torch.tensor([4, -1, 9, 30, -1])
    inputs = _inputs(module, tokens=5, slots=slots)
    actual, records = _run(module, "fx_fusion", inputs)
    assert records[0].fused_groups[0].cache_writes.startswith("K and V of 3 layers")
    valid = torch.tensor([4, 9, 30])
    plain = CachedContext("flat_pool", torch.float32, torch.float32)  # the same weights (seeded)
    expected, _ = _run(plain, "eager", (*inputs[:3], slots.clamp(min=0)))  # padded tokens into slot 0
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a[valid], e[valid], rtol=1e-5, atol=1e-5)
        assert (a[-1] == SENTINEL).all() and (a[0] == SENTINEL).all(), "a padded token was written"


def test_pass_leaves_writes_when_k_is_also_read(fresh_compile) -> None:
    class AlsoReturned(CachedContext):
        def forward(self, hidden, position_ids, cache_position, slots):
            outputs = self.context(hidden, position_ids)
            for cache, value in zip(self.caches(), outputs):
                _write(self.spelling, cache, value, cache_position, slots)
            return outputs[0]

    module = AlsoReturned("static", torch.float32, torch.float32)
    inputs = _inputs(module, tokens=4)
    expected, _ = _run(module, "eager", inputs)
    actual, records = _run(module, "fx_fusion", inputs)
    (group,) = records[0].fused_groups
    assert group.cache_writes.startswith("cache writes left as written: a layer's K is also read by")
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_pass_leaves_writes_at_different_indices(fresh_compile) -> None:
    class Shifted(CachedContext):
        def forward(self, hidden, position_ids, cache_position, slots):
            outputs = self.context(hidden, position_ids)
            for i, (cache, value) in enumerate(zip(self.caches(), outputs)):
                _write(self.spelling, cache, value, cache_position + (i // 2), slots)
            return self.caches()[0].sum()

    module = Shifted("static", torch.float32, torch.float32)
    inputs = _inputs(module, tokens=4)
    expected, _ = _run(module, "eager", inputs)
    actual, records = _run(module, "fx_fusion", inputs)
    (group,) = records[0].fused_groups
    assert group.cache_writes == "cache writes left as written: the K cache writes do not share one index"
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_pass_leaves_scaled_writes_under_emulated_casts(fresh_compile) -> None:
    module = CachedContext("flat_pool", torch.bfloat16, torch.float8_e4m3fn, scale=True)
    inputs = _inputs(module, tokens=4)
    _, records = _run(module, "fx_fusion", inputs, options={"emulate_precision_casts": True})
    assert "emulate_precision_casts" in records[0].fused_groups[0].cache_writes


def test_compiled_generate_with_a_static_cache_matches_eager(fresh_compile) -> None:
    """Hugging Face's own StaticCache: compiled `generate` gives eager's tokens (Q and K of a decoder layer
    form one group, so its cache writes stay as written, with the reason)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=97, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    prompt = torch.randint(0, 97, (1, 6))
    settings = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        expected = model.generate(prompt, **settings)
        model.forward = torch.compile(model.forward, backend="fx_fusion", fullgraph=True)
        records: list = []
        with RecordSink.collect(records):
            actual = model.generate(prompt, **settings)
    assert torch.equal(actual, expected)
    notes = [g.cache_writes for r in records for g in r.fused_groups]
    assert notes and all("query heads" in n for n in notes), notes


@pytest.mark.parametrize("spelling", ["static", "flat_pool", "slice_copy"])
def test_pass_with_dynamic_token_counts(spelling: str, fresh_compile) -> None:
    """dynamic=True: every T gives eager's caches; a slice whose bounds follow T stays as written."""
    module = CachedContext(spelling, torch.float32, torch.float32)
    compiled = torch.compile(module, backend="fx_fusion", dynamic=True, fullgraph=True)
    records: list = []
    for tokens in (3, 6):
        inputs = _inputs(module, tokens=tokens)
        expected, _ = _run(module, "eager", inputs)
        for cache in module.caches():
            cache.fill_(SENTINEL)
        with torch.no_grad(), RecordSink.collect(records):
            compiled(*inputs)
        for a, e in zip(module.caches(), expected):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    notes = [g.cache_writes for r in records for g in r.fused_groups]
    if spelling != "slice_copy":
        assert notes and all(n.startswith("K and V of 3 layers written straight") for n in notes), notes
    else:
        assert notes and all("bounds are not fixed numbers" in n for n in notes), notes


class Adversarial(CachedContext):
    """Writes that look like the plain ones but put values elsewhere: the caches must still equal eager's."""

    def forward(self, hidden, position_ids, cache_position, slots):
        outputs = self.context(hidden, position_ids)
        caches = self.caches()
        n = len(caches)
        if self.spelling == "swapped":  # layer l's K into the last layer's V cache, and so on
            for i, value in enumerate(outputs):
                caches[n - 1 - i].index_copy_(2, cache_position, value)
        elif self.spelling == "int32_index":
            for cache, value in zip(caches, outputs):
                cache[:, :, cache_position.to(torch.int32)] = value
        elif self.spelling == "heads_swapped":  # a cache laid out [B, max_len, H, D], heads written reversed
            for cache, value in zip(caches, outputs):
                cache.transpose(1, 2)[:, cache_position] = value.flip(1).transpose(1, 2)
        elif self.spelling == "tokens_reversed":
            for cache, value in zip(caches, outputs):
                cache.index_copy_(2, cache_position, value.flip(2))
        elif self.spelling == "one_buffer":  # K and V of a layer in one [2, B, H, max_len, D] buffer
            for i in range(0, n, 2):
                both = torch.stack([caches[i], caches[i + 1]])
                both[0].index_copy_(2, cache_position, outputs[i])
                both[1].index_copy_(2, cache_position, outputs[i + 1])
                caches[i].copy_(both[0])
                caches[i + 1].copy_(both[1])
        return caches[0].sum()


ADVERSARIAL = {  # spelling: absorbed?
    "swapped": True,
    "int32_index": True,
    "heads_swapped": False,
    "tokens_reversed": False,
    "one_buffer": False,
}


@pytest.mark.parametrize("spelling", sorted(ADVERSARIAL))
def test_pass_never_misplaces_a_cache_write(spelling: str, fresh_compile) -> None:
    module = Adversarial(spelling, torch.float32, torch.float32)
    inputs = _inputs(module, tokens=4)
    expected, _ = _run(module, "eager", inputs)
    actual, records = _run(module, "fx_fusion", inputs)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    notes = [g.cache_writes for r in records for g in r.fused_groups]
    absorbed = any(n.startswith("K and V of 3 layers written straight") for n in notes)
    assert absorbed == ADVERSARIAL[spelling], notes
