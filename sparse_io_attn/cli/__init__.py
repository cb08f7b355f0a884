"""The sparse-io-attn command: I/O bounds, benchmarks, sweeps and layout pictures.

Each subcommand lives in its own module of this package and exposes ``add_parser(subparsers)``
(which sets ``func``); ``main`` wires them together.

Exit codes: 0 success; 2 bad flags or an impossible combination (one line on stderr, no
traceback); 3 an optional extra that is not installed (matplotlib, the ``plot`` extra, for plots).
"""
from __future__ import annotations

import argparse
import sys

from sparse_io_attn.cli import bench, bounds, compile_report, demo, layout, sweep
from sparse_io_attn.cli._common import MissingExtra

#: command name -> its module, in the order ``--help`` lists them
COMMANDS = {"demo": demo, "bounds": bounds, "bench": bench, "sweep": sweep, "layout": layout,
            "compile-report": compile_report}
SUBCOMMANDS = tuple(COMMANDS)

EPILOG = """examples:
  sparse-io-attn bounds --seq-len 8192 --head-dim 128 --cache 228KiB --dtype bf16
  sparse-io-attn bench --pattern bigbird --seq-len 4096 --backends torch,sdpa
  sparse-io-attn sweep cache --seq-len 1024 --head-dim 64
  sparse-io-attn layout sliding_window:256 --seq-len 2048 --block 64
  sparse-io-attn compile-report --dtype bf16 --head-dim 128 --block 128
  sparse-io-attn <command> --help     (every command lists its own examples)

exit codes: 0 ok, 2 bad arguments, 3 an optional extra is not installed (matplotlib for plots)"""


class _Parser(argparse.ArgumentParser):
    """Bad flags: one line on stderr, exit code 2, no traceback."""

    def error(self, message):  # pragma: no cover - exercised through subprocess tests
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sparse-io-attn", description=__doc__.split("\n")[0], epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as e:
        print(f"sparse-io-attn {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except MissingExtra as e:
        print(f"sparse-io-attn {args.command}: missing optional dependency: {_one_line(e)}", file=sys.stderr)
        return 3
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"sparse-io-attn {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
