"""Per-token selection tests (a package, so that module names here may repeat those of other test folders)."""
