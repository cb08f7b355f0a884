"""Per-token selection tests: a package, so that module names here (test_correctness.py,
test_bad_input.py, test_cpu_backend.py, ...) may repeat those of other test folders in one session."""
