"""The ``sparse-io-attn`` command. Each subcommand lives in its own module of this package and
exposes ``add_parser(subparsers)`` (which sets ``func``) ; ``main`` wires them together."""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("demo",)


class _Parser(argparse.ArgumentParser):
    """Bad flags: one line on stderr, exit code 2, no traceback."""

    def error(self, message):  # pragma: no cover - exercised through subprocess tests
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sparse-io-attn", description=__doc__.split("\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as e:
        print(f"sparse-io-attn {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
