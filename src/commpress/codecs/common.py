"""Helpers shared by several codec families (one place, so codec modules never import
each other): seeds, all-reduce replies, power-of-two scaling of sparse values, scatters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from commpress.codecs import kernels
from commpress.codecs.base import CodecContext, require
from commpress.errors import CommpressError

#: Seeds of every seeded codec are integers in ``[0, 2**63)``: they fit a signed 64-bit integer
#: in any JSON reader or C API, and equal configurations hash to equal fingerprints.
SEED_LIMIT = 2**63


def require_seed(seed: int) -> None:
    """Refuse a codec ``seed`` outside ``[0, 2**63)`` (the one rule for every seeded codec:
    ``minmax``, ``qsgd``, ``terngrad``, ``thc``, ``randomk``, ``powersgd``, ``dgc``)."""
    require(0 <= seed < SEED_LIMIT, "seed must be in [0, 2**63)", seed)


def kernel_seed(ctx: CodecContext, seed: int, *, shared: bool = False) -> int:
    """A 63-bit seed for the kernels' own counter-based generators, drawn (on the host) from
    this worker's stream (quantizers' and THC's rounding noise), or with ``shared`` from the
    stream every worker shares (Random-K's coordinates on a GPU)."""
    g = ctx.generator(seed, shared=shared, device=torch.device("cpu"))
    return int(torch.randint(0, SEED_LIMIT - 1, (1,), generator=g).item())


def reply_part(reply: Any, name: str, like: torch.Tensor) -> torch.Tensor:
    """Fetch ``name`` from an all-reduce reply, checking it matches what was sent."""
    if not isinstance(reply, Mapping) or name not in reply:
        raise CommpressError(f"all-reduce reply lacks part {name!r}: driver bug?")
    t = reply[name]
    if not isinstance(t, torch.Tensor) or t.shape != like.shape or t.dtype != like.dtype:
        raise CommpressError(
            f"all-reduce reply part {name!r} is not a {tuple(like.shape)} {like.dtype} tensor"
        )
    return t


_HALF = (torch.float16, torch.bfloat16)
_KEYED = (torch.float32, *_HALF)  # dtypes whose magnitude keys the kernels read


def kept_buffer(
    scratch: dict[str, torch.Tensor], key: str, numel: int, dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The flat buffer ``scratch[key]`` of ``numel`` elements of ``dtype`` on ``device``,
    made (or replaced, when its size, dtype or device no longer fit) and kept there: the
    payload memory of an encode with ``scratch=`` (:attr:`Codec.encodes_into`)."""
    buf = scratch.get(key)
    if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
        buf = kernels.empty(numel, dtype, device)
        scratch[key] = buf
    return buf


def kept_codes(
    scratch: dict[str, torch.Tensor] | None, n: int, bits: int, device: torch.device
) -> torch.Tensor | None:
    """The kept uint8 buffer for the packed ``bits``-bit codes of ``n`` values (``None``
    without ``scratch``), which the quantizers' kernels write into (``codes=``)."""
    if scratch is None:
        return None
    return kept_buffer(scratch, "codes", -(-n * bits // 8), torch.uint8, device)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in for values of ``dtype``: float64 stays, the rest float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_max_abs(values: torch.Tensor) -> torch.Tensor:
    """``max |v|`` over the finite entries of ``values`` (0 when there are none), 0-d."""
    if values.numel() == 0:
        return values.new_zeros((), dtype=torch.float32)
    if values.dtype in _KEYED and kernels.use_kernels(values, "finite_max_abs"):
        # one pass over the bits (torch's abs, isfinite, where and amax: four passes, the
        # 16-bit ones through float32; 1.5 ms for a 64 MB bfloat16 Top-K's 320 k values)
        return kernels.finite_max_abs(values.reshape(-1).contiguous())
    # |v| with NaN and +inf (all the non-finite magnitudes) as 0, in place: three device
    # operations (abs, isfinite, where and zeros_like took five)
    return values.abs().nan_to_num_(nan=0.0, posinf=0.0).amax()


def scale_values(
    values: torch.Tensor, value_dtype: torch.dtype, exponent: torch.Tensor
) -> torch.Tensor:
    """``values * 2^-exponent`` cast to ``value_dtype`` (an exact scaling; no-op for 0).

    On a CPU an exponent of 0 (no value near the wire type's top: the usual case) skips the
    scaling: the cast alone, in one pass (the numba conversion between the two 16-bit types,
    which torch runs through float32 at a fraction of memory speed); the same values. It may
    then return ``values`` itself when it already has ``value_dtype``."""
    if values.device.type == "cpu" and exponent.numel() == 1 and int(exponent) == 0:
        if (values.dtype in _HALF and value_dtype in _HALF and values.dtype != value_dtype
                and values.numel() and kernels.use_kernels(values, "convert")):
            out = kernels.empty(values.numel(), value_dtype)
            return kernels.convert(values.reshape(-1).contiguous(), out).reshape(values.shape)
        return values.to(value_dtype)
    work = work_dtype(values.dtype)
    factor = torch.exp2(-exponent.to(work))
    return (values.to(work) * factor).to(value_dtype)


def unscale_values(
    values: torch.Tensor, exponent: torch.Tensor, work: torch.dtype
) -> torch.Tensor:
    """``values * 2^exponent`` in ``work``; a finite value whose product overflows ``work``
    (a value rounded up to the top of its 16-bit range, times the largest exponent) saturates
    at ``work``'s largest finite value instead of becoming Inf."""
    v = values.to(work)
    scaled = v * torch.exp2(exponent.reshape(()).to(work))
    top = torch.finfo(work).max
    overflowed = torch.isinf(scaled) & torch.isfinite(v)
    return torch.where(overflowed, torch.copysign(torch.full_like(scaled, top), v), scaled)


def scatter_into(flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[indices] = values`` (same dtype). 16-bit floats are scattered as their int16
    bit patterns (the same bits; torch's CPU ``scatter_`` is ~50x slower on float16 and
    bfloat16 than on integers)."""
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat.view(torch.int16).scatter_(0, indices, values.view(torch.int16))
    else:
        flat.scatter_(0, indices, values)


__all__ = [
    "SEED_LIMIT",
    "kernel_seed",
    "finite_max_abs",
    "reply_part",
    "require_seed",
    "scale_values",
    "scatter_into",
    "unscale_values",
    "work_dtype",
]
