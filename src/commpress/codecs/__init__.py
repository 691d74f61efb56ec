"""Codecs: tensor -> payload -> tensor, one family per module, looked up by id.

Importing this package registers every built-in codec. A family module is named after its
codec when it holds one codec (``thc``, ``topkc``, ``randomk``, ``powersgd``, ``netzip``);
families of several codecs are named after what they share. :data:`CODEC_MODULES` maps every
built-in id to its module (a test checks it against the registry). Helpers that several
families use live in :mod:`commpress.codecs.common`, :mod:`~commpress.codecs.bitpack` and
:mod:`~commpress.codecs.kernels`; family modules never import each other.
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

#: Where each built-in codec id is defined (module under ``commpress.codecs``).
CODEC_MODULES: dict[str, str] = {
    "identity": "cast",
    "fp16": "cast",
    "bf16": "cast",
    "minmax": "quantize",
    "qsgd": "quantize",
    "terngrad": "quantize",
    "sign": "quantize",
    "thc": "thc",
    "topk": "sparse",
    "dgc": "sparse",
    "topkc": "topkc",
    "randomk": "randomk",
    "powersgd": "powersgd",
    "netzip": "netzip",
}

__all__ = [
    "CODEC_MODULES",
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
