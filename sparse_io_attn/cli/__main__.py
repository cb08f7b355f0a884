"""``python -m sparse_io_attn.cli ...`` runs the ``sparse-io-attn`` command."""
import sys

from sparse_io_attn.cli import main

sys.exit(main())
