"""``netzip``: the lossless codec, one module per concern.

========================  ============================================================
module                    what it holds
========================  ============================================================
``codec``                 :class:`NetZip`: parameters, the stages in order (delta,
                          zeros, grouping, backends, framing), previous-step state,
                          ``auto`` choices, the fast default path, ``reduce``
``framing``               the stream format: header fields, varints, section table,
                          framing and parsing, the checksum
``grouping``              bit layouts of the float dtypes, matrix view, zero bitmap,
                          byte and bit planes, order-preserving keys for ``delta``
``exponent``              the exponent grouping's context model (row/column
                          statistics, 4-bit residual codes, escapes), plain torch
``backends``              the entropy backends per plane (raw, lz4, zstd, huffman,
                          ans) and the ``auto`` choice between them
``kernels``               every numba kernel of netzip and its one loader, behind
                          the library's backend switch (``COMMPRESS_KERNELS``)
========================  ============================================================

The algorithm and the tuning advice are in :mod:`commpress.codecs.netzip.codec`; the user
guide is ``docs/lossless.md``.
"""

from commpress.codecs.netzip.codec import HostEntropyWarning, NetZip

__all__ = ["HostEntropyWarning", "NetZip"]
