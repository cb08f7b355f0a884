"""The package's floors (docs/ARCHITECTURE.md, "Floors"), read from every ``import`` statement with
``ast``, those inside functions included: no module imports a floor above its own, no import cycle
(implicit imports of parent packages counted, as Python runs them), and the package's own modules are
imported inside functions only where :data:`LAZY` names the pair with the reason."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "sparse_io_attn"
PACKAGE = "sparse_io_attn"

#: top-level part of the package -> floor; a module may import its own floor and those below
FLOORS = {
    "_memory": 0, "_triton": 0, "_cpu": 0, "tally": 0, "layout": 0,
    "bounds": 1, "_attention": 1,
    "block_sparse": 2, "dense": 2, "sparse_operands": 2, "selection": 2,
    "nn": 3, "integrations": 3, "distributed": 3,
    # the facade over every traffic model, context parallelism's (distributed/traffic.py) included: above them all
    "accounting": 4,
    "experiments": 5,
    "cli": 6,
}
TOP = max(FLOORS.values()) + 1  # the package's own __init__: imports every floor, imported by none

#: former public paths kept as pure re-exports (no logic): exempt from the floor rule, not from cycles
ALIASES: dict[str, str] = {
}

#: (importer, imported) -> why the import sits inside a function (an optional or heavy dependency kept lazy)
LAZY: dict[tuple[str, str], str] = {
    ("sparse_io_attn.sparse_operands.api", "sparse_io_attn.sparse_operands.triton.launch"):
        "the @triton.jit kernels (and Triton itself) load on the first backend='triton' call",
    ("sparse_io_attn.block_sparse.op", "sparse_io_attn.block_sparse.triton.launch"):
        "backend 'triton' imports Triton (slow, optional): loaded when first chosen",
    # the CLI: every subcommand module is imported to build the parser, so what imports Triton (and fixes
    # its interpreter mode, which compile-report must choose itself) loads only in the run that needs it
    ("sparse_io_attn.cli.bench", "sparse_io_attn._triton.runtime"):
        "Triton and its interpreter switch: only when --backends names triton",
    ("sparse_io_attn.cli.sweep.sparsity", "sparse_io_attn._triton.runtime"):
        "Triton and its interpreter switch: only for sweep sparsity --count",
    ("sparse_io_attn.cli.compile_report", "sparse_io_attn.cli._compile_reports"):
        "every op's report imports Triton after compile-report sets TRITON_INTERPRET=0 (compiles for a GPU)",
    ("sparse_io_attn.cli.sweep", "sparse_io_attn.experiments.sweeps"):
        "the dense Triton kernels: only when a sweep runs (handed to the sweep's run)",
    ("sparse_io_attn.block_sparse.op", "sparse_io_attn.block_sparse.cpu"):
        "the C++ build module marks available_for_auto for torch.compile, which imports torch._dynamo and Triton",
    ("sparse_io_attn.selection.op", "sparse_io_attn.selection.triton.launch"):
        "backend 'triton' imports Triton (slow, optional): loaded when first chosen",
    ("sparse_io_attn.selection.op", "sparse_io_attn.selection.cpu"):
        "the C++ build module marks available_for_auto for torch.compile, which imports torch._dynamo and Triton",
    ("sparse_io_attn._attention.checks", "sparse_io_attn._cpu.build"):
        "backend 'auto' asks whether the C++ kernels build: the build module imports torch._dynamo and Triton",
    ("sparse_io_attn.cli.bench", "sparse_io_attn.block_sparse.cpu"):
        "the C++ build module imports torch._dynamo and Triton: only when --backends names cpu",
    ("sparse_io_attn.distributed", "sparse_io_attn.distributed.module"):
        "ContextParallelSelfAttention is an nn layer (nn imports torch._dynamo and Triton): loaded on first access, "
        "so accounting.traffic (and the CLI) reach the context-parallel traffic model without them",
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _read(path: pathlib.Path) -> str:
    return path.read_text()


def _imports(name: str, path: pathlib.Path):
    """``(imported module, line, inside a function)`` for every import of the package's own modules."""
    tree = ast.parse(_read(path), filename=str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(sub) for sub in ast.walk(node) if sub is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in MODULES]
            targets = subs if len(subs) == len(node.names) else [module] + subs
        else:
            continue
        for target in targets:
            if target.split(".")[0] == PACKAGE and target in MODULES and target != name:
                yield target, node.lineno, id(node) in in_function


def _floor(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1:
        return TOP
    return FLOORS[parts[1]]


def _graph():
    """Edges as Python runs them: ``import a.b.c`` also runs ``a`` and ``a.b`` (those not already
    being imported as the importer's own parents)."""
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        own_parents = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")) + 1)}
        for target, _, _ in _imports(name, path):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in MODULES and step not in own_parents:
                    edges[name].add(step)
    return edges


def test_aliases_only_re_export():
    """An alias module holds imports, ``__all__`` and a docstring: nothing that could carry logic."""
    for name in ALIASES:
        if name not in MODULES:
            continue
        tree = ast.parse(_read(MODULES[name]))
        for node in tree.body:
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            dunder_all = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
            assert isinstance(node, (ast.Import, ast.ImportFrom)) or docstring or dunder_all, \
                f"{name}:{node.lineno} is an alias module: only imports, __all__ and a docstring"


def test_every_part_of_the_package_has_a_floor():
    parts = {name.split(".")[1] for name in MODULES if "." in name}
    assert parts <= set(FLOORS), f"give these a floor in FLOORS and docs/ARCHITECTURE.md: {sorted(parts - set(FLOORS))}"


def test_no_import_runs_up_the_floors():
    upward = [f"{name}:{line} ({_floor(name)}) -> {target} ({_floor(target)})"
              for name, path in MODULES.items() for target, line, _ in _imports(name, path)
              if _floor(target) > _floor(name) and name not in ALIASES]
    assert not upward, "imports of a higher floor:\n" + "\n".join(upward)


#: the ops: one floor, side by side; what they share lives in the kit (``_attention``) below them
OPS = ("block_sparse", "selection", "dense", "sparse_operands")


def test_the_ops_never_import_each_other():
    crossing = [f"{name}:{line} -> {target}" for name, path in MODULES.items() for target, line, _ in _imports(name, path)
                if "." in name and "." in target and name.split(".")[1] in OPS
                and target.split(".")[1] in OPS and target.split(".")[1] != name.split(".")[1]]
    assert not crossing, "an op imports another op (move what they share to sparse_io_attn/_attention):\n" + "\n".join(crossing)


def test_no_import_cycle():
    edges = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components (the graph is small)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_in_function_imports_only_keep_dependencies_lazy():
    found = {(name, target) for name, path in MODULES.items()
             for target, _, inside in _imports(name, path) if inside}
    unexplained = sorted(found - set(LAZY))
    assert not unexplained, ("imports of the package's own modules inside functions, not in LAZY "
                             "(move them to the top, or name the optional dependency they keep lazy):\n"
                             + "\n".join(f"{a} -> {b}" for a, b in unexplained))
    stale = sorted(set(LAZY) - found)
    assert not stale, f"LAZY names imports that are gone: {stale}"
    assert len(LAZY) <= 12, f"{len(LAZY)} lazy imports; aim for a dozen at most"


@pytest.mark.parametrize("case", ["upward", "cycle"])
def test_the_checks_catch_what_they_are_for(case, monkeypatch):
    """The rule itself can fail: a synthetic upward import and a synthetic cycle (one side inside a
    function) are reported."""
    sources = {"upward": {"sparse_io_attn.layout.a": "from sparse_io_attn.cli import b\n",
                          "sparse_io_attn.cli.b": ""},
               "cycle": {"sparse_io_attn.layout.a": "from sparse_io_attn.layout import b\n",
                         "sparse_io_attn.layout.b": "def f():\n    from sparse_io_attn.layout import a\n",
                         "sparse_io_attn.layout": ""}}[case]
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "MODULES", {name: pathlib.Path(name) for name in sources})
    monkeypatch.setattr(module, "_read", lambda path: sources[str(path)])
    check = test_no_import_runs_up_the_floors if case == "upward" else test_no_import_cycle
    with pytest.raises(AssertionError):
        check()


def test_dense_models_load_without_the_kernels():
    """``dense``'s traffic model, regime choice and tiles (what ``bounds`` and ``accounting`` use)
    import without Triton, and so does the context-parallel model the facade re-exports; the kernel
    entry points load on first access."""
    code = ("import sys; import sparse_io_attn.dense as D; from sparse_io_attn.accounting import traffic; "
            "from sparse_io_attn.cli import bounds; "
            "print(callable(traffic.dense.large_cache_traffic) and callable(traffic.context_parallel), "
            "'triton' in sys.modules); "
            "print(callable(D.forward) and callable(D.attention) and 'backward_small_cache' in dir(D), "
            "'triton' in sys.modules)\n"
            "try:\n    D.no_such_name\nexcept AttributeError as e:\n    print('no_such_name' in str(e))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False", "True", "True", "True"], proc.stdout
