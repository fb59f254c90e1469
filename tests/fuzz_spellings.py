"""Random context-K/V drafts: each axis of the spelling corpus drawn at random, with one layer deviating.

A draft is 1-3 layers over one hidden state; each layer projects K and V (separate linears, a kv linear
split in two, or K and V cut from a qkv linear by slices), lays K out as [B, T, H, D] or [B, H, T, D]
(before or after the norm), normalises it (none, Hugging Face's RMSNorm, F.rms_norm, Gemma's 1 + weight,
no upcast) and rotates it (rotate_half by slices or chunk, vLLM's native halves, GPT-J pairs; full or
partial) with cos/sin computed from the positions or gathered from a cat(cos, sin) cache. Optional: bias,
every linear applied by `torch.einsum` or over weights stored [hidden, out] (`x @ W`),
V transposed, the raw K returned too, one norm weight shared by every layer, a dynamic token count, and
a DFlash token concatenation: each layer's context rows joined with a noise block's along tokens, at its
projections (z-lab), after the K norm of each piece, or at the projections' input rows. `--stacked` draws
vLLM's DFlash precompute form instead (StackedDraft: one linear over all layers' weights, layer-major K,
one rotation over all layers' rows). One layer may deviate in eps, rope base, the rotary style or width, the norm, or read
the hidden states flipped: grouping must tell those apart by value. `check(seed)` compiles a draft with FusedKVPass and
with stock Inductor and compares both with eager.

    python tests/fuzz_spellings.py [--first 0] [--count 200] [--stacked]     # a long run, one line per draft
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Optional

import torch
import torch._functorch.config
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

import fx_fusion

HIDDEN, HEADS, HEAD_DIM, MAX_POS = 64, 2, 16, 64
NOISE_TOKENS = 2  # a token-cat draft's noise block
ROPES = ("slices", "chunk", "vllm", "gptj")
NORMS = ("none", "hf", "f_rms_norm", "gemma", "no_upcast")
TOKEN_CAT_PLACES = ("projections", "normed", "inputs")  # where a token-cat draft joins context and noise rows


def _inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def _norm(kind: str, eps: float, w, k):
    """K normalised per head in one of NORMS' spellings (w: the norm weight, None for "none")."""
    if kind == "none":
        return k
    if kind == "f_rms_norm":
        return F.rms_norm(k, (HEAD_DIM,), w, eps)
    if kind == "no_upcast":
        return k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * w
    h = k.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(k.dtype) if kind == "hf" else (h * (1.0 + w.float())).type_as(k)


def _rotate(style: str, k, cos, sin):
    """K rotated in one of ROPES' spellings; cos/sin [..., rotary_dim], neox halves repeated."""
    rot = cos.shape[-1]
    kr, k_pass = k[..., :rot], k[..., rot:]
    half = rot // 2
    if style == "slices":
        out = kr * cos + torch.cat((-kr[..., half:], kr[..., :half]), dim=-1) * sin
    elif style == "chunk":
        x1, x2 = kr.chunk(2, dim=-1)
        out = kr * cos + torch.cat((-x2, x1), dim=-1) * sin
    elif style == "vllm":
        c, s, x1, x2 = cos[..., :half], sin[..., :half], kr[..., :half], kr[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:  # GPT-J pairs
        c, s, x1, x2 = cos[..., :half], sin[..., :half], kr[..., ::2], kr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return torch.cat((out, k_pass), dim=-1) if k_pass.shape[-1] else out


def _tables(spec: dict, positions, dtype):
    """cos/sin of `positions` for the spec's rotary width and base, computed or gathered from a cache."""
    rot = HEAD_DIM // 2 if spec["partial"] else HEAD_DIM
    if spec["tables"] == "cache":  # vLLM/SGLang: a [max_pos, rot] cat(cos, sin) cache, gathered
        freqs = torch.outer(torch.arange(MAX_POS).float(), _inv_freq(rot, spec["base"]))
        cos, sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype).index_select(0, positions).chunk(2, dim=-1)
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    freqs = torch.outer(positions.float(), _inv_freq(rot, spec["base"]))
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class FuzzLayer(nn.Module):
    def __init__(self, spec: dict):
        super().__init__()
        self.spec, width, bias = spec, HEADS * HEAD_DIM, spec["bias"]
        if spec["projection"] == "separate":
            self.k_proj, self.v_proj = nn.Linear(HIDDEN, width, bias=bias), nn.Linear(HIDDEN, width, bias=bias)
        else:  # kv: [k | v]; qkv: [q (2H heads) | k | v]
            self.fused = nn.Linear(HIDDEN, (2 if spec["projection"] == "kv" else 4) * width, bias=bias)
        self.norm_weight = nn.Parameter(torch.rand(HEAD_DIM) + 0.5) if spec["norm"] != "none" else None
        for name, module in list(self.named_children()) if spec["hidden_first"] else []:
            self.register_parameter(name + "_hidden_first", nn.Parameter(module.weight.detach().t().contiguous()))

    def linear(self, name: str, x):
        """The linear `name`, as drawn: the module itself, an einsum (CS336's Linear), or over its weight
        stored [hidden, out] (`hidden_first`: a parameter of its own) by `x @ W` or einsum."""
        module = getattr(self, name)
        if self.spec["hidden_first"]:
            weight = getattr(self, name + "_hidden_first")
            y = torch.einsum("...i,io->...o", x, weight) if self.spec["einsum"] else x @ weight
        elif self.spec["einsum"]:
            y = torch.einsum("...i,oi->...o", x, module.weight)
        else:
            return module(x)
        return y if module.bias is None else y + module.bias

    def project(self, x):
        width = HEADS * HEAD_DIM
        if self.spec["projection"] == "separate":
            return self.linear("k_proj", x), self.linear("v_proj", x)
        if self.spec["projection"] == "kv":
            k, v = self.linear("fused", x).split(width, dim=-1)
            return k, v
        qkv = self.linear("fused", x)
        return qkv[..., 2 * width : 3 * width], qkv[..., 3 * width :]

    def norm(self, k):
        return _norm(self.spec["norm"], self.spec["eps"], self.norm_weight, k)

    def rotate(self, k, cos, sin):
        return _rotate(self.spec["rope"], k, cos, sin)

    def tables(self, positions, dtype):
        return _tables(self.spec, positions, dtype)

    def forward(self, x, positions, noise=None, joined_at=None):
        """`noise` and `joined_at` (a TOKEN_CAT_PLACES entry): a token-cat draft's noise rows and where they
        join the context's."""
        spec = self.spec
        x = x.flip(0) if spec["flip_x"] else x
        if joined_at == "inputs":  # one projection of the context and noise rows joined
            x = torch.cat([x, noise], dim=1)
        k, v = self.project(x)
        heads = lambda t: t.view(*t.shape[:2], HEADS, HEAD_DIM)  # noqa: E731
        if joined_at in ("projections", "normed"):
            k_noise, v_noise = self.project(noise)
            v = torch.cat([v, v_noise], dim=1)
            if joined_at == "projections":  # z-lab DFlash: joined before the norm
                k = torch.cat([k, k_noise], dim=1)
            else:  # each piece normed on its own, joined before the RoPE
                raw = torch.cat([heads(k), heads(k_noise)], dim=1)
                k = torch.cat([self.norm(heads(k)), self.norm(heads(k_noise))], dim=1)
        v = heads(v)
        if joined_at != "normed":
            k = raw = heads(k)
        cos, sin = self.tables(positions, x.dtype)
        norm = (lambda t: t) if joined_at == "normed" else self.norm
        if spec["layout"] == "bthd":
            k = self.rotate(norm(k), cos[None, :, None], sin[None, :, None])
        else:
            k = norm(k.transpose(1, 2)) if spec["layout"] == "bhtd" else norm(k).transpose(1, 2)
            k = self.rotate(k, cos[None, None], sin[None, None])
        v = v.transpose(1, 2) if spec["v_transposed"] else v
        return (k, v, raw) if spec["raw_k"] else (k, v)


class FuzzDraft(nn.Module):
    def __init__(self, specs: list[dict], shared_norm: bool, token_cat_at: Optional[str] = None):
        super().__init__()
        self.token_cat_at = token_cat_at
        self.layers = nn.ModuleList(FuzzLayer(spec) for spec in specs)
        self.noise = nn.Buffer(torch.randn(1, NOISE_TOKENS, HIDDEN)) if token_cat_at else None
        weighted = [layer for layer in self.layers if layer.norm_weight is not None]
        for layer in weighted[1:] if shared_norm else []:
            layer.norm_weight = weighted[0].norm_weight

    def forward(self, x, positions):
        noise = None
        if self.noise is not None:  # the noise block's positions follow the context's
            noise = self.noise.expand(x.shape[0], -1, -1)
            positions = torch.cat([positions, positions[-1] + 1 + torch.arange(NOISE_TOKENS)])
        return tuple(out for layer in self.layers for out in layer(x, positions, noise, self.token_cat_at))


# how a stacked draft norms each layer's K and puts them back together ("one_norm": one norm over all layers'
# K at once, with ONE_NORM_WEIGHTS)
STACKED_JOINS = ("stack", "unbind", "into_empty", "one_norm")
# the one norm's weights: stacked in the forward ([L, 1, 1, D]); one parameter shaped so ([L, 1, 1, D], or
# [L, 1, D] token-major); one [D] for every layer; no weight
ONE_NORM_WEIGHTS = ("stacked", "parameter", "shared", "none")
ONE_NORM_NORMS = ("hf", "gemma", "no_upcast")  # the spellings whose weight may be a stacked tensor
REPEATS = ("repeat", "cat", "expand")  # how it repeats the positions for every layer's rows
# the seed's token-major [T, L, 2, H, D] layout, K and V cut by select, unbind or slices of [T, L, 2 * kv]
TOKEN_MAJOR_CUTS = ("select", "unbind", "slices")


class StackedDraft(nn.Module):
    """vLLM's DFlash context precompute in plain PyTorch: one linear over every layer's K and V weights
    stacked, viewed [T, L, 2, H, D] and made layer-major, each layer's K normed on its own (its spec's norm
    and eps), joined back (STACKED_JOINS), viewed [L * T, H, D] and rotated once with the cos/sin of the
    positions repeated for every layer (REPEATS; `shift_last`: the last layer's rows read the next
    positions, so its cos/sin differ; `chunked`: K and V taken by `chunk(2, 0)` and squeezed). With a `cut`,
    the seed's token-major layout instead (`token_major`)."""

    def __init__(self, specs, heads, join, repeat, shift_last, one_norm_weights=None, cut=None, chunked=False):
        super().__init__()
        self.specs, self.heads, self.join, self.repeat, self.shift_last = specs, heads, join, repeat, shift_last
        self.one_norm_weights, self.cut, self.chunked = one_norm_weights, cut, chunked
        self.kv = nn.Linear(HIDDEN, len(specs) * 2 * heads * HEAD_DIM, bias=specs[0]["bias"])
        self.norm_weights = nn.ParameterList(nn.Parameter(torch.rand(HEAD_DIM) + 0.5) for _ in specs)
        if one_norm_weights == "parameter":  # the same values, as one parameter shaped to broadcast
            shape = (len(specs), 1, HEAD_DIM) if cut else (len(specs), 1, 1, HEAD_DIM)
            self.stacked_norm_weight = nn.Parameter(torch.stack([w.detach() for w in self.norm_weights]).view(shape))

    def forward(self, x, positions):  # [T, hidden], [T]: one sequence's context rows
        if self.cut is not None:
            return self.token_major(x, positions)
        layers, tokens = len(self.specs), x.shape[0]
        kv = self.kv(x).view(tokens, layers, 2, self.heads, HEAD_DIM).permute(2, 1, 0, 3, 4).contiguous()
        if self.chunked:  # K and V as `kv.chunk(2, 0)`, each squeezed: the same [L, T, H, D] values
            kv = [half.squeeze(0) for half in kv.chunk(2, dim=0)]

        def norm(i, k):
            return _norm(self.specs[i]["norm"], self.specs[i]["eps"], self.norm_weights[i], k)

        if self.join == "one_norm":
            weights = {
                "stacked": lambda: torch.stack(list(self.norm_weights)).view(layers, 1, 1, HEAD_DIM),
                "parameter": lambda: self.stacked_norm_weight,
                "shared": lambda: self.norm_weights[0],
                "none": lambda: None,
            }[self.one_norm_weights]()
            k = _norm(self.specs[0]["norm"], self.specs[0]["eps"], weights, kv[0])
        elif self.join == "into_empty":
            k = torch.empty_like(kv[0])
            for i in range(layers):
                k[i] = norm(i, kv[0][i])
        else:
            pieces = kv[0].unbind(0) if self.join == "unbind" else [kv[0][i] for i in range(layers)]
            k = torch.stack([norm(i, piece) for i, piece in enumerate(pieces)])
        rows = k.view(layers * tokens, self.heads * HEAD_DIM).view(layers * tokens, self.heads, HEAD_DIM)
        if self.shift_last:
            repeated = torch.cat([positions] * (layers - 1) + [positions + 1])
        elif self.repeat == "repeat":
            repeated = positions.repeat(layers)
        elif self.repeat == "cat":
            repeated = torch.cat([positions] * layers)
        else:
            repeated = positions.expand(layers, tokens).reshape(-1)
        cos, sin = _tables(self.specs[0], repeated, x.dtype)
        k = _rotate(self.specs[0]["rope"], rows, cos[:, None], sin[:, None])
        return k.view(layers, tokens, self.heads, HEAD_DIM), kv[1]

    def token_major(self, x, positions):
        """The seed's own layout, [T, L, 2, H, D] kept token-major (TOKEN_MAJOR_CUTS), all layers' K normed
        in one expression and rotated with one cos/sin per token."""
        layers, tokens, width = len(self.specs), x.shape[0], self.heads * HEAD_DIM
        kv = self.kv(x)
        if self.cut == "slices":
            kv = kv.view(tokens, layers, 2 * width)
            k, v = (part.reshape(tokens, layers, self.heads, HEAD_DIM) for part in (kv[..., :width], kv[..., width:]))
        else:
            kv = kv.view(tokens, layers, 2, self.heads, HEAD_DIM)
            k, v = kv.unbind(2) if self.cut == "unbind" else (kv[:, :, 0], kv[:, :, 1])
        weights = {
            "stacked": lambda: torch.stack(list(self.norm_weights)).view(layers, 1, HEAD_DIM),
            "parameter": lambda: self.stacked_norm_weight,
            "shared": lambda: self.norm_weights[0],
            "none": lambda: None,
        }[self.one_norm_weights]()
        k = _norm(self.specs[0]["norm"], self.specs[0]["eps"], weights, k)
        cos, sin = _tables(self.specs[0], positions, x.dtype)
        k = _rotate(self.specs[0]["rope"], k, cos[:, None, None], sin[:, None, None])
        return k.transpose(0, 1), v.transpose(0, 1)


def draw_stacked(seed: int) -> dict:
    """A stacked draft's description (plain data), drawn from `seed`: one rotation for all layers, so only
    a layer's eps or norm may deviate (or, `shift_last`, its positions)."""
    rng = random.Random(seed)
    spec = dict(
        bias=rng.random() < 0.3, norm=rng.choice(NORMS), rope=rng.choice(ROPES), partial=rng.random() < 0.25,
        tables=rng.choice(["computed", "cache"]), eps=1e-6, base=10000.0,
    )  # fmt: skip
    cut = rng.choice(TOKEN_MAJOR_CUTS) if rng.random() < 0.3 else None
    join = "one_norm" if cut else rng.choice(STACKED_JOINS)
    one_norm_weights = rng.choice(ONE_NORM_WEIGHTS)
    if join == "one_norm":  # one expression: one norm and eps for all layers
        stacked = rng.choice(ONE_NORM_NORMS)
        spec["norm"] = {"stacked": stacked, "parameter": stacked, "shared": rng.choice(NORMS[1:]), "none": "f_rms_norm"}[
            one_norm_weights
        ]
    specs = [dict(spec) for _ in range(rng.choice([1, 2, 3, 4]))]
    deviations = [None, None, "shift_last"] if join == "one_norm" else [None, None, "eps", "norm", "shift_last"]
    deviation = rng.choice(deviations) if len(specs) > 1 and not cut else None
    if deviation in ("eps", "norm"):
        specs[-1][deviation] = 1e-5 if deviation == "eps" else rng.choice([n for n in NORMS if n != spec["norm"]])
    return dict(
        specs=specs, heads=rng.choice([1, 2]), join=join, repeat=rng.choice(REPEATS),
        shift_last=deviation == "shift_last", tokens=rng.choice([1, 3, 5]), dtype=rng.choice(["float32", "bfloat16"]),
        dynamic=rng.random() < 0.2, one_norm_weights=one_norm_weights if join == "one_norm" else None, cut=cut,
        chunked=not cut and rng.random() < 0.3,
    )  # fmt: skip


def draw(seed: int) -> dict:
    """One draft's description (plain data), drawn from `seed`."""
    rng = random.Random(seed)
    spec = dict(
        projection=rng.choice(["separate", "kv", "qkv"]), bias=rng.random() < 0.3,
        layout=rng.choice(["bthd", "bhtd", "bhtd_after_norm"]), norm=rng.choice(NORMS), rope=rng.choice(ROPES),
        partial=rng.random() < 0.25, tables=rng.choice(["computed", "cache"]), eps=1e-6, base=10000.0,
        flip_x=False, raw_k=rng.random() < 0.15, v_transposed=rng.random() < 0.3,
    )  # fmt: skip
    specs = [dict(spec) for _ in range(rng.choice([1, 2, 3]))]
    if len(specs) > 1 and rng.random() < 0.5:
        deviant = specs[rng.randrange(len(specs))]
        field = rng.choice(["eps", "base", "flip_x", "rope", "norm", "partial"])
        deviant[field] = {
            "eps": 1e-5, "base": 500.0, "flip_x": True, "rope": rng.choice(ROPES), "norm": rng.choice(NORMS),
            "partial": not spec["partial"],
        }[field]  # fmt: skip
    drawn = dict(
        specs=specs, shared_norm=rng.random() < 0.3, tokens=rng.choice([1, 3, 5]), batch=rng.choice([1, 2]),
        dtype=rng.choice(["float32", "bfloat16"]), dynamic=rng.random() < 0.2, token_cat=rng.random() < 0.2,
        token_cat_at=rng.choice(TOKEN_CAT_PLACES),
    )  # fmt: skip
    einsum, hidden_first = rng.random() < 0.25, rng.random() < 0.2  # drawn last: earlier seeds keep their drafts
    for spec in specs:
        spec.update(einsum=einsum, hidden_first=hidden_first)
    return drawn


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check(seed: int) -> tuple[dict, fx_fusion.FusedKVPass, float, float]:
    """Compile the draft of `seed` with FusedKVPass and with stock Inductor; returns (its description, the
    pass, fx_fusion's worst relative error against eager, stock Inductor's). Shapes and dtypes must match."""
    drawn = draw(seed)
    dtype = getattr(torch, drawn["dtype"])
    torch.manual_seed(seed)
    draft = FuzzDraft(drawn["specs"], drawn["shared_norm"], drawn["token_cat_at"] if drawn["token_cat"] else None).to(dtype).eval()
    x = torch.randn(drawn["batch"], drawn["tokens"], HIDDEN, dtype=dtype)
    positions = torch.arange(drawn["tokens"]) + 3
    return drawn, *_compare(draft, x, positions, drawn["dynamic"])


def check_stacked(seed: int) -> tuple[dict, fx_fusion.FusedKVPass, float, float]:
    """`check` for the stacked draft of `seed` (draw_stacked)."""
    drawn = draw_stacked(seed)
    dtype = getattr(torch, drawn["dtype"])
    torch.manual_seed(seed)
    draft = StackedDraft(
        drawn["specs"], drawn["heads"], drawn["join"], drawn["repeat"], drawn["shift_last"], drawn["one_norm_weights"],
        drawn["cut"], drawn["chunked"],
    )
    draft = draft.to(dtype).eval()
    x = torch.randn(drawn["tokens"], HIDDEN, dtype=dtype)
    positions = torch.randperm(MAX_POS - 1)[: drawn["tokens"]]
    return drawn, *_compare(draft, x, positions, drawn["dynamic"])


def _compare(draft: nn.Module, x: torch.Tensor, positions: torch.Tensor, dynamic: bool) -> tuple[fx_fusion.FusedKVPass, float, float]:
    """(the pass, fx_fusion's worst relative error against eager, stock Inductor's) for one draft."""
    fused_kv_pass = fx_fusion.FusedKVPass()
    errors = []
    # no compile cache: a hit skips the pass, whose record says what fused
    no_cache = torch._inductor.config.patch(fx_graph_cache=False)
    with torch.no_grad(), no_cache, torch._functorch.config.patch(enable_autograd_cache=False):
        ref = draft(x, positions)
        for options in ({"post_grad_custom_post_pass": fused_kv_pass}, {}):
            torch._dynamo.reset()
            if dynamic:
                torch._dynamo.maybe_mark_dynamic(x, x.dim() - 2)
                torch._dynamo.maybe_mark_dynamic(positions, 0)
            got = torch.compile(draft, options=options)(x, positions)
            assert [(g.shape, g.dtype) for g in got] == [(r.shape, r.dtype) for r in ref]
            errors.append(max(_relative_error(g, r) for g, r in zip(got, ref)))
    return fused_kv_pass, errors[0], errors[1]


def within_tolerance(drawn: dict, error: float, stock_error: float) -> bool:
    """fx_fusion's error no worse than float32 round-off or bfloat16 rounding, or twice stock Inductor's."""
    tolerance = 2e-5 if drawn["dtype"] == "float32" else 1e-2
    return error <= max(tolerance, 2 * stock_error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--stacked", action="store_true", help="stacked drafts (StackedDraft) instead")
    args = parser.parse_args(argv)
    bad = 0
    for seed in range(args.first, args.first + args.count):
        drawn, fused_kv_pass, error, stock_error = (check_stacked if args.stacked else check)(seed)
        ok = within_tolerance(drawn, error, stock_error)
        groups = [g.describe() for r in fused_kv_pass.records for g in r.fused_groups]
        print(f"seed {seed}: {'ok' if ok else 'MISMATCH'} error {error:.1e} (stock {stock_error:.1e}) groups {groups} {drawn}", flush=True)
        bad += not ok
    print(f"{bad} of {args.count} drafts outside the tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
