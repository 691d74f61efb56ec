"""``commpress codecs``: the table of every registered codec."""

from __future__ import annotations

import argparse
import json

from commpress.codecs import list_codecs
from commpress.report import render_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("codecs", help="list every codec: id, summable, lossless, parameters")
    p.add_argument("--json", action="store_true", help="print the default configs as JSON")
    p.add_argument("--verbose", "-v", action="store_true", help="describe each parameter")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    classes = list_codecs()
    if args.json:
        print(json.dumps([cls().get_config() for cls in classes], indent=2))
        return 0
    rows = []
    for cls in classes:
        params = ", ".join(f"{name}={default!r}" for name, default, _ in cls.parameters())
        rows.append([
            cls.codec_id, cls.summable, cls.lossless, cls.multi_round, params or "-", cls.summary,
        ])
    headers = ["id", "summable", "lossless", "multi-round", "parameters", "what it does"]
    print(render_table(headers, rows))
    if args.verbose:
        for cls in classes:
            print(f"\n{cls.codec_id}: {cls.summary}")
            print(f"  NaN/Inf: {cls.nonfinite}")
            for name, default, doc in cls.parameters():
                print(f"  {name} (default {default!r}): {doc}")
    return 0
