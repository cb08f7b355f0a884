"""Experiments: the paper's reproductions and studies, users of the ops (above them, below the CLI)."""
