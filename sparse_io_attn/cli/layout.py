"""``sparse-io-attn layout PATTERN``: draw a block-sparse pattern (█ full block, ▒ partial block,
░ skipped) with its stats."""
from __future__ import annotations

import argparse

from sparse_io_attn.accounting import traffic
from sparse_io_attn.cli._common import build_layout, check_writable, parse_count, pyplot, to_json

EXAMPLES = """examples:
  sparse-io-attn layout sliding_window:256 --seq-len 2048 --block 64
  sparse-io-attn layout bigbird --seq-len 4096 --block 128 --png bigbird.png
  sparse-io-attn layout causal --seq-len 1000 --block 64 --json

PATTERN is a spec for sparse_io_attn.layout.patterns.from_spec, e.g. dense, causal, sliding_window:512,
bigbird, longformer, random:0.1 (run with an unknown name to list the known ones)."""


def add_parser(sub) -> None:
    p = sub.add_parser("layout", help="draw a pattern and print its stats", epilog=EXAMPLES,
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pattern", help="pattern spec, e.g. sliding_window:512")
    p.add_argument("--seq-len", type=parse_count, default=4096, help="sequence length (default 4096; 4k, 131k accepted)")
    p.add_argument("--block", type=parse_count, default=64, help="block size (default 64)")
    p.add_argument("--heads", type=int, default=1, help="layout heads for per-head patterns (default 1)")
    p.add_argument("--limit", type=int, default=64, help="block rows/cols drawn before truncating (default 64)")
    p.add_argument("--png", metavar="PATH", help="also save the block mask as a PNG")
    p.add_argument("--json", action="store_true", help="print the stats as JSON instead of the picture")
    p.set_defaults(func=run)


def layout_stats(layout) -> dict:
    """Sizes, kept blocks, density and per-row counts of a layout (elements clipped to seqlen)."""
    rows = layout.row_counts()
    sq, sk = layout.seqlen
    kept_elements = traffic.kept_elements(layout, layout.layout_batch, layout.layout_heads)
    return {
        "name": layout.name,
        "seqlen": list(layout.seqlen),
        "block_size": list(layout.block_size),
        "blocks": [layout.num_q_blocks, layout.num_kv_blocks],
        "layouts": layout.num_layouts,
        "nnz_blocks": layout.nnz_blocks,
        "density": layout.density,
        "kept_elements": kept_elements,
        "element_density": kept_elements / (layout.num_layouts * sq * sk),
        "blocks_per_row_min": int(rows.min().item()),
        "blocks_per_row_mean": float(rows.double().mean().item()),
        "blocks_per_row_max": int(rows.max().item()),
        "empty_rows": int((rows == 0).sum().item()),
    }


def save_png(layout, path: str, index: int = 0) -> None:
    plt = pyplot()
    mask = layout.to_block_mask().reshape(-1, layout.num_q_blocks, layout.num_kv_blocks)[index].cpu()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.imshow(mask.numpy(), cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    ax.set_title(f"{layout.name}: n={layout.seqlen_q}, block={layout.BLOCK_SIZE_Q}, "
                 f"density {layout.density:.3f}", fontsize=9)
    ax.set_xlabel("key block")
    ax.set_ylabel("query block")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    if args.heads < 1:
        raise ValueError(f"--heads must be >= 1, got {args.heads}")
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    check_writable(args.png, "--png")
    layout = build_layout(args.pattern, args.seq_len, args.block, num_heads=args.heads)
    stats = layout_stats(layout)
    if args.png:
        save_png(layout, args.png)
        stats["png"] = args.png
    if args.json:
        print(to_json(stats))
        return 0
    print(repr(layout))
    if layout.num_layouts > 1:
        print(f"(layout 0 of {layout.num_layouts} shown)")
    print(layout.draw(limit=args.limit))
    print(f"kept blocks {stats['nnz_blocks']:,} of {layout.num_layouts * layout.num_q_blocks * layout.num_kv_blocks:,} "
          f"(density {stats['density']:.4f}); kept elements {stats['kept_elements']:,} "
          f"({stats['element_density']:.4f}); key blocks per query row min/mean/max "
          f"{stats['blocks_per_row_min']}/{stats['blocks_per_row_mean']:.1f}/{stats['blocks_per_row_max']}; "
          f"empty rows {stats['empty_rows']}")
    if args.png:
        print(f"wrote {args.png}")
    return 0
