"""``commpress codecs``: the table of every registered codec."""

from __future__ import annotations

import argparse
import json

from commpress.codecs import Codec, list_codecs
from commpress.report import render_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "codecs",
        help="list every codec: id, summable, lossless, error feedback fit, parameters",
    )
    p.add_argument("--json", action="store_true", help="print the default configs as JSON")
    p.add_argument(
        "--verbose", "-v", action="store_true",
        help="describe each codec's traits, NaN/Inf behaviour and parameters",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    classes = list_codecs()
    if args.json:
        print(json.dumps([cls().get_config() for cls in classes], indent=2))
        return 0
    rows = []
    for cls in classes:
        codec = cls()  # traits may depend on parameters: read them from the defaults
        params = ", ".join(f"{name}={default!r}" for name, default, _ in cls.parameters())
        rows.append([
            cls.codec_id, cls.summable, cls.lossless, cls.multi_round, codec.feedback_fit,
            params or "-", cls.summary,
        ])
    headers = [
        "id", "summable", "lossless", "multi-round", "error feedback", "parameters",
        "what it does",
    ]
    print(render_table(headers, rows))
    if args.verbose:
        for cls in classes:
            codec = cls()
            print(f"\n{cls.codec_id}: {cls.summary}")
            print(f"  traits (defaults): {traits(codec)}")
            print(f"  error feedback: {codec.feedback_fit} ({FIT_MEANING[codec.feedback_fit]})")
            print(f"  NaN/Inf: {cls.nonfinite}")
            for name, default, doc in cls.parameters():
                print(f"  {name} (default {default!r}): {doc}")
    return 0


#: What each :attr:`Codec.feedback_fit` value means for ``error_feedback``.
FIT_MEANING = {
    "needed": "biased and contractive: error_feedback=None turns it on",
    "optional": "harmless, not needed: error_feedback=None leaves it off",
    "incompatible": "not contractive, the residual would grow: error_feedback=True is refused",
}


def traits(codec: Codec) -> str:
    """``"elementwise, unbiased, contractive"`` style list; ``not ...`` for the false ones
    among unbiased/contractive, so the line always says both."""
    words = [name for name in ("elementwise", "stateful") if getattr(codec, name)]
    words.append("unbiased" if codec.unbiased else "biased")
    words.append("contractive" if codec.contractive else "not contractive")
    return ", ".join(words)
