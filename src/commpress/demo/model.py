"""A tiny GPT (decoder-only transformer) for byte-level language modelling.

The model is the workload behind commpress's demos, benchmarks and integration tests: small
enough to train for a few hundred steps on a laptop CPU, yet with the tensors that matter for
communication compression in real training (attention and MLP weight matrices whose gradients
are all-reduced under data parallelism, and block outputs that cross pipeline-stage boundaries).

Architecture (pre-LayerNorm, as in GPT-2): token + learned position embedding, ``n_layers``
blocks of ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))`` with causal multi-head attention and a
GELU MLP, then a final LayerNorm and a linear projection to the vocabulary. There is no dropout
and no weight tying, so every stage of a pipeline split owns its own parameters and a forward
pass is a pure function of the weights and the tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from commpress.errors import CommpressError


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`TinyGPT`. All fields are positive ints.

    Args:
        vocab_size: number of token ids (256 for bytes).
        context: the longest sequence the model accepts (size of the position table).
        d_model: width of the residual stream. Must be divisible by ``n_heads``. Parameters
            grow like ``12 * n_layers * d_model**2``.
        n_layers: number of transformer blocks; also the most pipeline stages you can split
            the model into.
        n_heads: attention heads; ``d_model // n_heads`` is the head width (32 by default).
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
    """

    vocab_size: int = 256
    context: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CommpressError(f"GPTConfig.{f.name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise CommpressError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); e.g. d_model=128 with n_heads in 1, 2, 4, 8, ..."
            )

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise CommpressError(f"unknown GPTConfig fields {unknown}; accepted: {sorted(names)}")
        return cls(**data)


#: Named model sizes for the CLI and benchmarks. "tiny" (the default, ~0.86M parameters) trains
#: at tens of steps per second on 2 CPU cores; "small" (~4.9M) and "medium" (~25M) are for
#: GPUs or patient CPUs.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "small": GPTConfig(context=128, d_model=256, n_layers=6, n_heads=8),
    "medium": GPTConfig(context=256, d_model=512, n_layers=8, n_heads=8),
}


def preset(name: str) -> GPTConfig:
    """The :data:`PRESETS` entry called ``name``."""
    if name not in PRESETS:
        raise CommpressError(f"unknown model preset {name!r}; accepted: {sorted(PRESETS)}")
    return PRESETS[name]


class Embedding(nn.Module):
    """Token embedding plus learned absolute position embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.context = config.context
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.context, config.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise CommpressError(
                f"tokens must be a 2-d (batch, time) int64/int32 tensor, got shape "
                f"{tuple(tokens.shape)} dtype {tokens.dtype}"
            )
        if tokens.shape[1] > self.context:
            raise CommpressError(
                f"sequence length {tokens.shape[1]} exceeds the model context {self.context}"
            )
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and projection to vocabulary logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.proj = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(h))


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``(B, T, V)`` logits against ``(B, T)`` ids.

    Computed in fp32 whatever the logits' dtype, so mixed-precision runs report comparable
    losses.
    """
    if logits.shape[:-1] != targets.shape:
        raise CommpressError(
            f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}: "
            "expected logits (B, T, V) and targets (B, T)"
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class TinyGPT(nn.Module):
    """Decoder-only transformer over bytes. Build it with :func:`build_model`.

    Submodules (their names are the parameter-name prefixes, e.g. ``blocks.0.attn.qkv.weight``):
    ``embedding`` (:class:`Embedding`), ``blocks`` (``nn.ModuleList`` of :class:`Block`),
    ``final`` (:class:`Head`). ``forward(tokens) == head(blocks(...embed(tokens)))``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final = Head(config)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` token ids -> ``(B, T, d_model)`` residual stream."""
        return self.embedding(tokens)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """``(B, T, d_model)`` residual stream -> ``(B, T, vocab_size)`` logits."""
        return self.final(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    loss = staticmethod(loss)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def _init_weights(model: TinyGPT, generator: torch.Generator) -> None:
    """GPT-2 style: N(0, 0.02) for matrices and embeddings, zero biases, unit LayerNorm gains,
    and residual output projections scaled by ``1 / sqrt(2 * n_layers)`` so the residual
    stream's variance does not grow with depth."""
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    for name, p in model.named_parameters():  # registration order: deterministic
        if name.endswith("bias"):
            p.zero_()
        elif ".ln" in name or name.startswith("final.ln"):
            p.fill_(1.0)
        else:
            std = residual_std if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=generator) * std)


def build_model(
    config: GPTConfig | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> TinyGPT:
    """A :class:`TinyGPT` whose weights depend only on ``config`` and ``seed``.

    Weights are drawn on CPU from a private generator (the global RNG is untouched: modules are
    created on the meta device, so PyTorch's default initialisation never runs) and then
    moved to ``device``, so every rank and every device type starts from bit-identical
    weights, which is what data-parallel training requires.
    """
    config = config if config is not None else GPTConfig()
    if not isinstance(config, GPTConfig):
        raise CommpressError(f"config must be a GPTConfig, got {type(config).__name__}")
    with torch.device("meta"):  # no default init: it would consume the global RNG
        model = TinyGPT(config)
    model = model.to_empty(device="cpu")
    _init_weights(model, torch.Generator().manual_seed(int(seed)))
    if device is not None:
        model = model.to(device)
    return model


class Stage(nn.Module):
    """One pipeline stage of a :class:`TinyGPT`: optional embedding, some blocks, optional head.

    It holds the *same* module objects as the model it came from (parameters are shared, not
    copied); ``copy.deepcopy`` a stage to give it its own weights.
    """

    def __init__(
        self,
        index: int,
        blocks: list[nn.Module],
        embedding: nn.Module | None,
        final: nn.Module | None,
    ) -> None:
        super().__init__()
        self.index = index
        self.embedding = embedding
        self.blocks = nn.ModuleList(blocks)
        self.final = final

    @property
    def is_first(self) -> bool:
        return self.embedding is not None

    @property
    def is_last(self) -> bool:
        return self.final is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> hidden (first stage), hidden -> hidden, or hidden -> logits (last)."""
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks:
            x = block(x)
        if self.final is not None:
            x = self.final(x)
        return x


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Which blocks each of ``n_stages`` stages gets: contiguous, sizes differing by at most
    one, the earlier stages taking the extra blocks."""
    if not isinstance(n_stages, int) or not 1 <= n_stages <= n_layers:
        raise CommpressError(
            f"n_stages must be an int in [1, n_layers={n_layers}] (every stage needs at least "
            f"one block), got {n_stages!r}"
        )
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for i in range(n_stages):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def split_stages(model: TinyGPT, n_stages: int) -> list[Stage]:
    """Cut ``model`` into ``n_stages`` consecutive :class:`Stage` modules for pipelining.

    Stage 0 starts with the embedding, the last stage ends with the head, and blocks are
    spread as in :func:`stage_layers`. Running the stages in order on the same tokens gives
    exactly (bit for bit) ``model(tokens)``, since the very same modules run in the same order.
    """
    if not isinstance(model, TinyGPT):
        raise CommpressError(f"split_stages needs a TinyGPT, got {type(model).__name__}")
    ranges = stage_layers(len(model.blocks), n_stages)
    return [
        Stage(
            i,
            [model.blocks[j] for j in r],
            model.embedding if i == 0 else None,
            model.final if i == n_stages - 1 else None,
        )
        for i, r in enumerate(ranges)
    ]
