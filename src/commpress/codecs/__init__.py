"""Codecs: tensor -> payload -> tensor, one family per module, looked up by id.

Importing this package registers every built-in codec.
"""
# ruff: noqa: I001  (the family imports at the end are ordered by hand)

from commpress.codecs import cast  # noqa: F401  (registers identity, fp16, bf16)
from commpress.codecs.base import (
    SUPPORTED_DTYPES,
    Codec,
    CodecContext,
    Payload,
    param,
    require,
)
from commpress.codecs.protocol import AllGather, AllReduce, Protocol, Reduced, Request
from commpress.codecs.registry import (
    codec_class,
    codec_ids,
    get_codec,
    list_codecs,
    parse_codec_spec,
    register_codec,
)
from commpress.codecs.simulate import Simulation, simulate, single_worker

# Codec families, one module each (importing registers them).
from commpress.codecs import (  # noqa: E402,F401,I001
    quantize,
    thc,
    sparse,
    topkc,
    randomk,
    powersgd,
    netzip,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "AllGather",
    "AllReduce",
    "Codec",
    "CodecContext",
    "Payload",
    "Protocol",
    "Reduced",
    "Request",
    "Simulation",
    "codec_class",
    "codec_ids",
    "get_codec",
    "list_codecs",
    "param",
    "parse_codec_spec",
    "register_codec",
    "require",
    "simulate",
    "single_worker",
]
