"""``python -m sparse_io_attn.cli ...`` runs the ``sparse-io-attn`` command."""
import sys

from . import main

sys.exit(main())
