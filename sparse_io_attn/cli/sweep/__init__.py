"""``sparse-io-attn sweep cache|dim|sparsity|seq-len``: the seed summary's experiments.

Each sweep prints a table, writes ``sweep_<name>.csv`` (machine header as ``#`` comment lines),
``sweep_<name>.md`` and a PNG plot ``sweep_<name>.png`` into ``--out-dir`` (matplotlib, from the
``plot`` extra; ``--no-plot`` skips the picture). ``--json`` prints header + rows as JSON instead
of the table.

One module per sweep (:mod:`.cache`, :mod:`.dim`, :mod:`.sparsity`, :mod:`.seq_len`) holds its flags,
table columns and plot; the numbers come from :mod:`sparse_io_attn.experiments.sweeps`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from sparse_io_attn.cli import _common as common
from sparse_io_attn.cli.sweep import cache, dim, seq_len, sparsity

EXAMPLES = """examples:
  sparse-io-attn sweep cache --seq-len 1024 --head-dim 64
  sparse-io-attn sweep cache --seq-len 8192 --head-dim 128 --count-n 128
  sparse-io-attn sweep dim --device h100 --dtype fp32
  sparse-io-attn sweep sparsity --seq-len 1024
  sparse-io-attn sweep seq-len --max-seq-len 131072 --pattern sliding_window:512 --pattern bigbird
  sparse-io-attn sweep seq-len --max-seq-len 4k --out-dir /tmp/res --no-plot --json"""


#: sweep name -> its module (``DOC``, ``add_args(parser)``, ``run(args)`` returning what :func:`emit` takes)
KINDS = {"cache": cache, "dim": dim, "sparsity": sparsity, "seq-len": seq_len}


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="run one of the paper's experiments, writing CSV and a PNG",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="sweep", required=True, parser_class=type(p))
    for name, kind in KINDS.items():
        q = kinds.add_parser(name, help=kind.DOC.split("\n")[0], description=kind.DOC,
                             epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
        kind.add_args(q)
        q.add_argument("--out-dir", default=str(common.RESULTS_DIR), help="where CSV/PNG/MD go (default benchmarks/results)")
        q.add_argument("--no-plot", action="store_true", help="write the CSV only")
        q.add_argument("--json", action="store_true", help="print header and rows as JSON")
        q.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    common.check_writable_dir(args.out_dir, "--out-dir")   # before the sweep runs, not after
    from sparse_io_attn.experiments import sweeps  # the dense Triton kernels (and Triton): only when a sweep runs

    result = KINDS[args.sweep].run(args, sweeps)
    return emit(args, *result)


def emit(args, name: str, header: dict, rows: list[dict], columns, notes: list[str], plot,
         table_rows: list[dict] | None = None) -> int:
    """Write CSV (all ``rows``), MD and (unless --no-plot) PNG for one sweep; print the table of
    ``table_rows`` (default all rows) or, with --json, everything as JSON."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [common.write_csv(out / f"sweep_{name}.csv", rows, header)]
    png = out / f"sweep_{name}.png"
    if not args.no_plot:
        plot(png)
        files.append(png)
    table = common.format_table(rows if table_rows is None else table_rows, columns)
    base = common.machine_header()
    text = "\n".join([common.format_header(header), "# " + ", ".join(f"{k}={v}" for k, v in header.items()
                                                                if k not in base), table]
                     + [f"- {n}" for n in notes])
    md = out / f"sweep_{name}.md"
    md.write_text(f"# sweep {name}\n\n```\n{text}\n```\n" + (f"\n![sweep {name}](sweep_{name}.png)\n"
                                                               if not args.no_plot else ""))
    files.append(md)
    if args.json:
        print(common.to_json({"header": header, "rows": rows, "notes": notes, "files": [str(f) for f in files]}))
    else:
        print(text)
        print("wrote " + ", ".join(str(f) for f in files))
    return 0
