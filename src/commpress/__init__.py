"""commpress: compression of gradients and activations for distributed PyTorch training.

>>> import commpress, torch
>>> codec = commpress.get_codec("topk", ratio=0.01)
>>> payload = codec.encode(torch.randn(1000))
>>> payload.bits_per_coordinate      # (48 * K + 8) / d: values, indices, one exponent byte
0.488
>>> codec.decode(payload).shape
torch.Size([1000])
"""

from commpress.codecs import (
    Codec,
    CodecContext,
    Payload,
    Reduced,
    codec_ids,
    get_codec,
    list_codecs,
    simulate,
)
from commpress.collectives import all_reduce, all_reduce_async, recv, send
from commpress.collectives.policy import CompressionState, Guard, StepStats
from commpress.errors import (
    CommpressError,
    ConfigError,
    ExchangeError,
    ExchangeTimeoutError,
    MismatchError,
    PayloadError,
    PeerLostError,
)
from commpress.procs import tune_cpu_allocator, use_huge_pages

__version__ = "0.1.0"

# The DDP comm hook (imported last: it builds on the codecs and the collectives layer).
from commpress import ddp  # noqa: E402,I001
from commpress.ddp import HookConfig  # noqa: E402

__all__ = [
    "Codec",
    "CodecContext",
    "CommpressError",
    "CompressionState",
    "Guard",
    "HookConfig",
    "ConfigError",
    "ExchangeError",
    "ExchangeTimeoutError",
    "MismatchError",
    "PayloadError",
    "PeerLostError",
    "Payload",
    "Reduced",
    "StepStats",
    "__version__",
    "all_reduce",
    "all_reduce_async",
    "codec_ids",
    "ddp",
    "get_codec",
    "list_codecs",
    "recv",
    "send",
    "simulate",
    "tune_cpu_allocator",
    "use_huge_pages",
]
