"""Entropy analysis of floating-point tensors: how compressible are they losslessly, and why.

For every tensor this computes, from its bit patterns:

* the entropy of every bit position (``H(bit k)`` in bits; 1 for a fair coin), which shows
  the low-entropy exponent bits next to the near-random mantissa bits (NetZIP's Figure 5);
* the order-0 entropy of every byte plane (byte ``k`` of every element, in bits per byte);
* the order-0 entropy of the exponent field;
* entropy *bounds* on the lossless compression ratio:

  - ``order0``: the elements' top 16 bits taken as one symbol (for bf16/fp16 that is the
    whole value) plus each lower byte plane as its own symbol stream, each coded with the
    tensor's own histogram. No coder that treats the elements as independent draws from
    one per-tensor distribution over these symbols can beat it (up to the cost of sending
    its table, which the bound leaves out). This is "the order-0 per-tensor bound".
  - ``row``: the exponent coded with one histogram per row of the tensor's matrix view
    (``H(exponent | row)``) plus the rest order-0. Coders that model per-row statistics can
    approach it; it is optimistic for short rows (a per-row table is not free).

All entropies are plug-in estimates (empirical frequencies), which slightly underestimate the
true entropy on small tensors. Bounds of a set of tensors add the bits of each tensor (each
tensor has its own statistics): ``ratio = sum(bits of the raw tensors) / sum(bound bits)``.

:func:`plot` draws the per-bit entropy of each group of tensors and their exponent
histograms into a PNG (matplotlib, Agg backend).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from commpress.codecs.netzip.grouping import Layout, layout, matrix_view
from commpress.errors import CommpressError, error_context


def _unsigned(x: torch.Tensor) -> tuple[np.ndarray, Layout]:
    """The bit patterns of ``x`` as unsigned numpy integers of the same width."""
    lay = layout(x.dtype)
    t = x.detach().reshape(-1).contiguous().cpu().view(lay.int_dtype).numpy()
    return t.view({16: np.uint16, 32: np.uint32, 64: np.uint64}[lay.bits]), lay


def entropy_of_counts(counts: np.ndarray) -> float:
    """Entropy in bits of the distribution given by non-negative ``counts``."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def _h(values: np.ndarray, size: int) -> float:
    return entropy_of_counts(np.bincount(values.ravel().astype(np.int64), minlength=size))


def bit_entropy(x: torch.Tensor) -> np.ndarray:
    """Entropy of each bit position, most significant (the sign) first."""
    u, lay = _unsigned(x)
    out = np.zeros(lay.bits)
    if u.size == 0:
        return out
    for i, k in enumerate(reversed(range(lay.bits))):
        p = float(((u >> np.array(k, dtype=u.dtype)) & 1).mean())
        out[i] = 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    return out


def byte_plane_entropy(x: torch.Tensor) -> np.ndarray:
    """Order-0 entropy (bits per byte) of each byte plane, most significant first."""
    u, lay = _unsigned(x)
    if u.size == 0:
        return np.zeros(lay.nbytes)
    b = u.view(np.uint8).reshape(-1, lay.nbytes)
    return np.array([_h(b[:, k], 256) for k in reversed(range(lay.nbytes))])


def exponents(x: torch.Tensor) -> np.ndarray:
    """The biased exponent field of every element."""
    u, lay = _unsigned(x)
    return ((u >> np.array(lay.man_bits, dtype=u.dtype)) & lay.emask).astype(np.int64)


def _low_planes_bits(u: np.ndarray, lay: Layout) -> float:
    """Order-0 bits of the byte planes below the top 16 bits."""
    if lay.bits == 16:
        return 0.0
    b = u.view(np.uint8).reshape(-1, lay.nbytes)
    return u.size * sum(_h(b[:, k], 256) for k in range(lay.nbytes - 2))


def order0_bits(x: torch.Tensor) -> float:
    """Bits of the order-0 bound: top 16 bits as one symbol + the lower byte planes."""
    u, lay = _unsigned(x)
    if u.size == 0:
        return 0.0
    top = (u >> np.array(lay.bits - 16, dtype=u.dtype)).astype(np.int64)
    return u.size * _h(top, 1 << 16) + _low_planes_bits(u, lay)


def row_context_bits(x: torch.Tensor) -> float:
    """Bits of the row-context bound: ``H(exponent | row)`` plus everything else order-0
    (sign and mantissa bits as byte planes, top byte together with the sign)."""
    u, lay = _unsigned(x)
    n = u.size
    if n == 0:
        return 0.0
    rows, cols, _ = matrix_view(tuple(x.shape), n)
    e = ((u >> np.array(lay.man_bits, dtype=u.dtype)) & lay.emask).astype(np.int64)
    row = np.arange(n, dtype=np.int64) // cols
    nsym = lay.emask + 1
    joint = np.bincount(row * nsym + e, minlength=rows * nsym).reshape(rows, nsym)
    per_row = joint.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(joint > 0, joint / np.maximum(per_row[:, None], 1), 1.0)
        cond_bits = float(-(joint * np.log2(p)).sum())
    sm = ((u >> np.array(lay.bits - 1, dtype=u.dtype)).astype(np.int64) << lay.man_bits) | (
        u & np.array((1 << lay.man_bits) - 1, dtype=u.dtype)
    ).astype(np.int64)
    rest = 0.0
    for q in range(lay.mant_planes):
        rest += n * _h((sm >> (8 * q)) & 255, 256)
    if lay.rem_bits:
        rest += n * _h(sm >> (8 * lay.mant_planes), 1 << lay.rem_bits)
    return cond_bits + rest


@dataclass(slots=True)
class TensorStats:
    """Entropy statistics of one tensor (see the module docs)."""

    name: str
    dtype: str
    numel: int
    bits_per_element: int
    bit_entropy: np.ndarray
    plane_entropy: np.ndarray
    exponent_entropy: float
    exponent_hist: np.ndarray
    order0_bits: float
    row_bits: float
    zero_fraction: float

    @property
    def raw_bits(self) -> float:
        return float(self.numel * self.bits_per_element)


def analyze_tensor(name: str, x: torch.Tensor) -> TensorStats:
    """All statistics of one tensor."""
    with error_context(f"analysing {name!r}"):
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise CommpressError(
                f"{name}: analysis needs a float32/float16/bfloat16/float64 tensor, got "
                f"{x.dtype}"
            )
        lay = layout(x.dtype)
        e = exponents(x)
        hist = np.bincount(e, minlength=lay.emask + 1)
        u, _ = _unsigned(x)
        return TensorStats(
            name=name,
            dtype=str(x.dtype).replace("torch.", ""),
            numel=x.numel(),
            bits_per_element=lay.bits,
            bit_entropy=bit_entropy(x),
            plane_entropy=byte_plane_entropy(x),
            exponent_entropy=entropy_of_counts(hist),
            exponent_hist=hist,
            order0_bits=order0_bits(x),
            row_bits=row_context_bits(x),
            zero_fraction=float((u == 0).mean()) if u.size else 0.0,
        )


@dataclass(slots=True)
class GroupStats:
    """Statistics of a set of tensors of one dtype (weighted by element count)."""

    label: str
    tensors: list[TensorStats] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def raw_bits(self) -> float:
        return sum(t.raw_bits for t in self.tensors)

    def _weighted(self, attr: str) -> np.ndarray:
        n = self.numel
        if not n:
            return np.zeros(0)
        total = np.zeros_like(np.asarray(getattr(self.tensors[0], attr), dtype=np.float64))
        for t in self.tensors:
            total = total + t.numel * np.asarray(getattr(t, attr), dtype=np.float64)
        return total / n

    @property
    def bit_entropy(self) -> np.ndarray:
        """Element-weighted mean of the tensors' per-bit entropies."""
        return self._weighted("bit_entropy")

    @property
    def plane_entropy(self) -> np.ndarray:
        return self._weighted("plane_entropy")

    @property
    def exponent_entropy(self) -> float:
        return float(self._weighted("exponent_entropy")) if self.numel else 0.0

    @property
    def exponent_hist(self) -> np.ndarray:
        return sum(t.exponent_hist for t in self.tensors)  # type: ignore[return-value]

    @property
    def zero_fraction(self) -> float:
        return float(self._weighted("zero_fraction")) if self.numel else 0.0

    @property
    def order0_ratio(self) -> float:
        """Raw size over the per-tensor order-0 bound."""
        bits = sum(t.order0_bits for t in self.tensors)
        return self.raw_bits / bits if bits else float("inf")

    @property
    def row_ratio(self) -> float:
        bits = sum(t.row_bits for t in self.tensors)
        return self.raw_bits / bits if bits else float("inf")


def analyze(named: Iterable[tuple[str, torch.Tensor]], label: str = "") -> GroupStats:
    """Statistics of named tensors (all of one dtype, or the group mixes bit widths)."""
    group = GroupStats(label=label)
    for name, x in named:
        group.tensors.append(analyze_tensor(name, x))
    widths = {t.bits_per_element for t in group.tensors}
    if len(widths) > 1:
        raise CommpressError(
            f"group {label!r} mixes element widths {sorted(widths)}; analyse one dtype at a time"
        )
    return group


def achieved_ratio(codec: Any, tensors: Sequence[torch.Tensor]) -> float:
    """Raw bytes over payload bytes of ``codec`` on ``tensors``, checking each round trip is
    bit-exact when the codec claims to be lossless."""
    raw = wire = 0
    for x in tensors:
        payload = codec.encode(x)
        if codec.lossless:
            out = codec.decode(payload)
            lay = layout(x.dtype)
            a = out.reshape(-1).view(lay.int_dtype).cpu().numpy()
            b = x.reshape(-1).view(lay.int_dtype).cpu().numpy()
            if not np.array_equal(a, b):
                raise CommpressError(f"{codec} is not bit-exact on a tensor of {x.shape}")
        raw += x.numel() * x.element_size()
        wire += payload.nbytes
    return raw / wire if wire else float("inf")


# ---------------------------------------------------------------------- plotting
def _field_colors(lay: Layout) -> list[str]:
    colors = []
    for k in reversed(range(lay.bits)):
        if k == lay.bits - 1:
            colors.append("#d62728")  # sign
        elif k >= lay.man_bits:
            colors.append("#1f77b4")  # exponent
        else:
            colors.append("#7f7f7f")  # mantissa
    return colors


def plot(groups: Sequence[GroupStats], path: str | Path, *, title: str = "") -> Path:
    """Per-bit entropy (upper panel) and exponent histogram (lower panel) of each group, up
    to four groups per row of panels, written as a PNG. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    groups = [g for g in groups if g.tensors]
    if not groups:
        raise CommpressError("nothing to plot: no tensors were analysed")
    ncol = min(4, len(groups))
    nblock = -(-len(groups) // ncol)
    fig, axes = plt.subplots(2 * nblock, ncol, figsize=(3.9 * ncol, 5.6 * nblock),
                             squeeze=False)
    for c in range(len(groups), nblock * ncol):  # unused cells of the last block
        axes[2 * (c // ncol)][c % ncol].axis("off")
        axes[2 * (c // ncol) + 1][c % ncol].axis("off")
    for i, g in enumerate(groups):
        block, c = divmod(i, ncol)
        lay = layout(getattr(torch, g.tensors[0].dtype))
        ax = axes[2 * block][c]
        h = g.bit_entropy
        positions = np.arange(lay.bits)
        ax.bar(positions, h, color=_field_colors(lay), width=0.85)
        ax.set_ylim(0, 1.05)
        step = max(1, lay.bits // 8)
        ticks = positions[::step]
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(lay.bits - 1 - int(t)) for t in ticks])
        ax.set_xlabel("bit position (left: sign)")
        if c == 0:
            ax.set_ylabel("entropy (bits)")
        ax.set_title(f"{g.label}\norder-0 bound {g.order0_ratio:.3f}x, row {g.row_ratio:.3f}x",
                     fontsize=9)
        ax2 = axes[2 * block + 1][c]
        hist = g.exponent_hist
        nz = np.nonzero(hist)[0]
        if nz.size:
            lo, hi = int(nz[0]), int(nz[-1])
            xs = np.arange(lo, hi + 1)
            ax2.bar(xs - ((1 << (lay.exp_bits - 1)) - 1), hist[lo : hi + 1] / hist.sum(),
                    color="#1f77b4", width=0.9)
            ax2.set_yscale("log")
        ax2.set_xlabel("unbiased exponent")
        if c == 0:
            ax2.set_ylabel("fraction of elements")
        ax2.set_title(f"H(exponent) = {g.exponent_entropy:.2f} bits", fontsize=9)
    legend = [Patch(color="#d62728", label="sign"), Patch(color="#1f77b4", label="exponent"),
              Patch(color="#7f7f7f", label="mantissa")]
    fig.legend(handles=legend, loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.92, 0.97 if title else 1.0))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------- loading
def load_tensors(paths: Sequence[str | Path]) -> list[tuple[str, str, torch.Tensor]]:
    """``(file, name, tensor)`` for every tensor of every safetensors file in ``paths``
    (directories are searched for ``*.safetensors``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.glob("*.safetensors")))
        elif p.exists():
            files.append(p)
        else:
            raise CommpressError(f"no such file or directory: {p}")
    if not files:
        raise CommpressError(f"no .safetensors files found in {', '.join(map(str, paths))}")
    out: list[tuple[str, str, torch.Tensor]] = []
    for f in files:
        with error_context(f"reading {f}"):
            try:
                tensors: Mapping[str, torch.Tensor] = load_file(str(f))
            except SafetensorError as exc:
                raise CommpressError(f"{f} is not a readable safetensors file: {exc}") from None
        for name, t in tensors.items():
            if t.is_floating_point():
                out.append((f.name, name, t))
    return out


__all__ = [
    "GroupStats",
    "TensorStats",
    "achieved_ratio",
    "analyze",
    "analyze_tensor",
    "bit_entropy",
    "byte_plane_entropy",
    "entropy_of_counts",
    "exponents",
    "load_tensors",
    "order0_bits",
    "plot",
    "row_context_bits",
]
