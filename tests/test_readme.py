"""The README's Python examples run as written, in order, in one namespace (as a reader pastes them)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(_blocks()) >= 8


def test_readme_examples_run(capsys):
    pytest.importorskip("transformers")
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(_blocks()):
        try:
            exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message names the block
            raise AssertionError(f"README python block {i + 1} failed: {type(e).__name__}: {e}\n{code}") from e


# Examples moved out of the README into docs/ run the same way, one namespace per file.
DOC_EXAMPLES = ["docs/SPARSE_OPERANDS.md", "docs/SELECTIONS.md", "docs/CONTEXT_PARALLEL.md"]


@pytest.mark.parametrize("name", DOC_EXAMPLES)
def test_doc_examples_run(name):
    path = README.parent / name
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    assert blocks, f"{name} has no python example"
    if any("transformers" in code for code in blocks):
        pytest.importorskip("transformers")
    namespace: dict = {"__name__": "docs"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{name} python block {i + 1}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message names the block
            raise AssertionError(f"{name} python block {i + 1} failed: {type(e).__name__}: {e}\n{code}") from e
