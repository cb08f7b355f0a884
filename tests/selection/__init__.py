"""A package, so that its test modules may share basenames with those of tests/block_sparse/
(test_correctness.py, test_bad_input.py, test_torch_path.py) in one pytest session."""
