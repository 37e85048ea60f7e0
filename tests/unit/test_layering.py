"""Imports run downhill: every import of the package against the layer table of
docs/architecture.md (module-level and function-level imports alike), no import cycle between
its packages or its modules, and package-internal imports at the file head, except the few
function-level ones listed in :data:`LAZY_IMPORTERS` with their reason."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_hybrid"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# Modules that may import package modules inside functions, and why. Such an import must also
# be of a module whose import loads torch, megatron or an optional dependency (checked below, so
# the reason cannot go stale), and carry a "# lazy: <reason>" comment; every other
# package-internal import is at the file head, so the graph this test guards is the one a reader
# sees.
_CLI_REASON = "--help imports every command module and must not load torch or megatron"
LAZY_IMPORTERS = {
    "megatron_hybrid.cli.check_checkpoint": _CLI_REASON,
    "megatron_hybrid.cli.convert": _CLI_REASON,
    "megatron_hybrid.cli.logprobs": _CLI_REASON,
    "megatron_hybrid.cli.train": _CLI_REASON,
    "megatron_hybrid.runtime.cpu": "the CLI imports runtime (select_backend) for --help",
    "megatron_hybrid.hf.fp8_stream": "Triton loads only to quantize CUDA tensors",
}

#: Third-party packages whose import a lazy package import may defer.
HEAVY = frozenset(
    {"torch", "megatron", "transformer_engine", "triton", "fla", "transformers", "peft",
     "safetensors", "mamba_ssm", "causal_conv1d", "matplotlib"}
)  # fmt: skip
LAZY_MARK = "# lazy:"


@dataclass(frozen=True)
class Import:
    """One import of a package module: who imports what, where, and whether in a function."""

    importer: str
    imported: str
    line: int
    in_function: bool
    names: tuple[str, ...] = ()


def layer_table(text: str) -> dict[str, int]:
    """Package -> layer number, from the table under ``## Layers``."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for match in re.finditer(r"^\|\s*(\d+)\s*\|([^|]*)\|", section, flags=re.M):
        for name in re.findall(r"`([\w.]+)`", match.group(2)):
            layers[name] = int(match.group(1))
    return layers


def package_of(module: str) -> str:
    """``megatron_hybrid.hf.api`` -> ``hf``; the package root itself -> ``megatron_hybrid``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _functions_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    lines.add(inner.lineno)
    return lines


def module_imports(source: str, module: str, is_package: bool, root: Path) -> list[Import]:
    """Every import of a ``megatron_hybrid`` module in ``source`` (the module ``module``).

    ``from a.b import c`` counts as an import of ``a.b.c`` when that is a module, else of
    ``a.b``; relative imports are resolved against ``module``.
    """
    tree = ast.parse(source)
    in_function = _functions_lines(tree)
    found = []
    for node in ast.walk(tree):
        targets, names = [], ()
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = tuple(alias.name for alias in node.names)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if _is_module(root, sub) else base)
        for target in dict.fromkeys(targets):
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                lazy = node.lineno in in_function
                found.append(Import(module, target, node.lineno, lazy, names))
    return found


def package_imports(root: Path) -> list[Import]:
    """Every import inside the package at ``root`` (the folder that holds ``megatron_hybrid``)."""
    found = []
    for module, is_package, path in _package_files(root):
        found += module_imports(path.read_text(), module, is_package, root)
    return found


def _package_files(root: Path):
    """``(module name, is_package, path)`` of every module of the package at ``root``."""
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if is_package else parts), is_package, path


def _head_statements(body: list[ast.stmt]):
    """Import statements that run when the module is imported (not in functions or under
    ``if TYPE_CHECKING``)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            yield from _head_statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            handlers = [stmt for handler in node.handlers for stmt in handler.body]
            yield from _head_statements(node.body + handlers + node.orelse + node.finalbody)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _head_statements(node.body)


def heavy_modules(root: Path) -> dict[str, frozenset[str]]:
    """Module -> the third-party packages of :data:`HEAVY` that importing it loads (its head
    imports, their head imports and so on, parent packages included)."""
    package_imports_of: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for module, is_package, path in _package_files(root):
        source = path.read_text()
        heads = list(_head_statements(ast.parse(source).body))
        head_lines = {node.lineno for node in heads}
        ours = [i for i in module_imports(source, module, is_package, root) if i.line in head_lines]
        theirs = set()
        for node in heads:
            if isinstance(node, ast.Import):
                theirs |= {alias.name.split(".")[0] for alias in node.names}
            elif not node.level:
                theirs.add((node.module or "").split(".")[0])
        package_imports_of[module] = {imp.imported for imp in ours}
        external[module] = theirs & HEAVY

    def parents(module: str) -> list[str]:
        parts = module.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]

    result = {}
    for module in package_imports_of:
        seen, todo = set(), parents(module)
        while todo:
            current = todo.pop()
            if current in seen or current not in package_imports_of:
                continue
            seen.add(current)
            for imported in package_imports_of[current]:
                todo += parents(imported)
        result[module] = frozenset().union(*(external[m] for m in seen))
    return result


def lazy_import_problems(
    imports: list[Import], root: Path, allowed: dict[str, str] = LAZY_IMPORTERS
) -> list[str]:
    """Function-level package imports that should be at the head: outside :data:`LAZY_IMPORTERS`,
    of a module that loads nothing heavy, or without a ``# lazy:`` comment above them."""
    heavy = heavy_modules(root)
    problems = []
    for imp in imports:
        if not imp.in_function:
            continue
        where = f"{imp.importer}:{imp.line}: function-level import of {imp.imported}"
        if imp.importer not in allowed:
            problems.append(f"{where}: move it to the file head (or list the module in "
                            "LAZY_IMPORTERS with the reason it cannot be there)")  # fmt: skip
        elif not heavy.get(imp.imported):
            problems.append(f"{where} loads no torch, megatron or optional dependency: move it "
                            "to the file head")  # fmt: skip
        elif not _has_lazy_mark(root, imp):
            problems.append(f"{where} has no '{LAZY_MARK} <reason>' comment above it")
    return problems


def _has_lazy_mark(root: Path, imp: Import) -> bool:
    """Whether a ``# lazy:`` comment heads the run of import statements ``imp`` is part of."""
    path = root.joinpath(*imp.importer.split(".")).with_suffix(".py")
    if not path.is_file():
        path = path.with_suffix("") / "__init__.py"
    text = path.read_text()
    lines = text.splitlines()
    ends = {
        node.end_lineno: node.lineno
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    line = imp.line - 1  # the line above, 1-based
    while line in ends:  # skip the import statements right above
        line = ends[line] - 1
    return line > 0 and lines[line - 1].strip().startswith(LAZY_MARK)


def module_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one module in the module import graph, with
    function-level imports counted like head imports (a package's own ``__init__`` is a node;
    the implicit import of a parent package by its submodules is not an edge)."""
    return _cycles({(imp.importer, imp.imported) for imp in imports})


def layering_violations(imports: list[Import], layers: dict[str, int]) -> list[str]:
    """Imports of a higher layer, or of another package of the same layer."""
    problems = []
    for imp in imports:
        src, dst = package_of(imp.importer), package_of(imp.imported)
        if src == dst:
            continue
        if src not in layers or dst not in layers:
            missing = src if src not in layers else dst
            problems.append(
                f"{imp.importer}:{imp.line}: package {missing} is not in the layer table of "
                "docs/architecture.md"
            )
        elif layers[dst] >= layers[src]:
            kind = "same-layer" if layers[dst] == layers[src] else "upward"
            problems.append(
                f"{imp.importer}:{imp.line}: {kind} import of {imp.imported} "
                f"(layer {layers[src]} {src} -> layer {layers[dst]} {dst})"
            )
    return problems


def private_imports(imports: list[Import]) -> list[str]:
    """``from x import _name`` across modules: a private name is its module's business."""
    return [
        f"{imp.importer}:{imp.line}: imports {name} from {imp.imported}"
        for imp in imports
        for name in imp.names
        if name.startswith("_") and not name.startswith("__") and imp.imported != imp.importer
    ]


def package_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one package in the package import graph."""
    return _cycles({(package_of(imp.importer), package_of(imp.imported)) for imp in imports})


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node of a directed graph."""
    graph: dict[str, set[str]] = {}
    for src, dst in sorted(edges):
        graph.setdefault(src, set())
        graph.setdefault(dst, set())
        if src != dst:
            graph[src].add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph has a few hundred nodes
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


@pytest.fixture(scope="module")
def layers():
    return layer_table(ARCHITECTURE.read_text())


@pytest.fixture(scope="module")
def imports():
    return package_imports(ROOT)


def test_every_package_has_a_layer(layers):
    packages = {p.stem if p.suffix else p.name for p in (ROOT / PACKAGE).iterdir()}
    packages = {p for p in packages if not p.startswith("__") or p == "__main__"} - {"py"}
    packages = {p for p in packages if _is_module(ROOT, f"{PACKAGE}.{p}")} | {PACKAGE}
    assert packages <= set(layers), f"missing from docs/architecture.md: {packages - set(layers)}"


def test_rl_is_a_layer_between_training_and_cli(layers):
    """The RL trainer's API builds on train's machinery and nothing below it uses it."""
    assert layers["training"] < layers["rl"] < layers["cli"]


def test_imports_run_downhill(imports, layers):
    assert len(imports) > 100  # the walk found the package's imports at all
    assert layering_violations(imports, layers) == []


def test_no_import_cycle_between_packages(imports):
    assert package_cycles(imports) == []


def test_no_private_name_is_imported_across_modules(imports):
    assert private_imports(imports) == []


def test_no_import_cycle_between_modules(imports):
    assert any(i.in_function for i in imports)  # function-level imports are in the graph
    assert module_cycles(imports) == []


def test_package_imports_are_at_the_file_head(imports):
    assert lazy_import_problems(imports, ROOT) == []


def test_every_lazy_importer_still_needs_it(imports):
    lazy = {i.importer for i in imports if i.in_function}
    assert set(LAZY_IMPORTERS) <= lazy, f"drop from LAZY_IMPORTERS: {set(LAZY_IMPORTERS) - lazy}"


def test_the_command_line_modules_load_no_torch():
    """What ``--help`` imports (every command module) loads none of :data:`HEAVY`."""
    heavy = heavy_modules(ROOT)
    loaded = {m: sorted(heavy[m]) for m in heavy if m.startswith(f"{PACKAGE}.cli") and heavy[m]}
    assert loaded == {}


# Negative controls: the checks above must catch what they are for.


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "source",
    [
        "from megatron_hybrid.training.run import run_training\n",
        "def f():\n    from megatron_hybrid.training import run\n",
        "import megatron_hybrid.training.run\n",
        "from ..training import run\n",
        "from megatron_hybrid import HybridModel\n",  # the facade is the top layer
    ],
    ids=["module-level", "in-function", "plain-import", "relative", "facade"],
)
def test_an_upward_import_is_reported(tmp_path, layers, source):
    root = _fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "pattern/__init__.py": "",
            "pattern/grammar.py": source,
            "training/__init__.py": "",
            "training/run.py": "",
        },
    )
    problems = layering_violations(package_imports(root), layers)
    assert len(problems) == 1
    assert re.search(
        r"pattern\.grammar:\d+: upward import of megatron_hybrid(\.training)?", problems[0]
    )


def test_a_same_layer_import_is_reported(tmp_path, layers):
    root = _fake_package(
        tmp_path,
        {"hf/__init__.py": "", "hf/api.py": "from megatron_hybrid.testing import models\n",
         "testing/__init__.py": "", "testing/models.py": ""},
    )  # fmt: skip
    (problem,) = layering_violations(package_imports(root), layers)
    assert "same-layer import of megatron_hybrid.testing.models" in problem


def test_a_downhill_import_is_not_reported(tmp_path, layers):
    root = _fake_package(
        tmp_path,
        {"training/__init__.py": "", "training/run.py": "from ..pattern import grammar\n",
         "pattern/__init__.py": "", "pattern/grammar.py": ""},
    )  # fmt: skip
    (imp,) = package_imports(root)
    assert imp.imported == "megatron_hybrid.pattern.grammar"
    assert layering_violations([imp], layers) == []


def test_a_private_import_is_reported(tmp_path):
    root = _fake_package(
        tmp_path,
        {"padding/__init__.py": "", "padding/thd.py": "from .multiples import _count, quant\n",
         "padding/multiples.py": ""},
    )  # fmt: skip
    assert private_imports(package_imports(root)) == [
        "megatron_hybrid.padding.thd:1: imports _count from megatron_hybrid.padding.multiples"
    ]


def test_a_cycle_is_reported():
    imports = [
        Import("megatron_hybrid.training.run", "megatron_hybrid.testing.cpu", 1, False),
        Import("megatron_hybrid.testing.overlap", "megatron_hybrid.training.steps", 1, True),
        Import("megatron_hybrid.testing.overlap", "megatron_hybrid.pattern", 2, False),
    ]
    assert package_cycles(imports) == [["testing", "training"]]


def test_a_module_cycle_through_a_function_level_import_is_reported(tmp_path):
    files = {
        "__init__.py": "",
        "hf/__init__.py": "",
        "hf/api.py": "from megatron_hybrid.hf import weights\n",
        "hf/weights.py": "def load():\n    from megatron_hybrid.hf.api import conversion_for\n",
    }
    imports = package_imports(_fake_package(tmp_path / "cycle", files))
    assert module_cycles(imports) == [["megatron_hybrid.hf.api", "megatron_hybrid.hf.weights"]]
    assert package_cycles(imports) == []  # one package: only the module graph sees it
    files["hf/weights.py"] = "def load():\n    pass\n"
    assert module_cycles(package_imports(_fake_package(tmp_path / "none", files))) == []


_HEAVY_MODEL = {"model/__init__.py": "", "model/build.py": "import torch\n"}


@pytest.mark.parametrize(
    ("importer", "body", "problem"),
    [
        ("pattern/grammar.py", "from megatron_hybrid.model import build",
         "function-level import of megatron_hybrid.model.build: move it to the file head"),
        ("cli/convert.py", "# lazy: loads torch\n    from megatron_hybrid.pattern import layout",
         "function-level import of megatron_hybrid.pattern.layout loads no torch"),
        ("cli/convert.py", "from megatron_hybrid.model import build",
         "has no '# lazy: <reason>' comment above it"),
        ("cli/convert.py", "# lazy: loads torch\n    from megatron_hybrid.model import build",
         None),
        ("cli/convert.py", "# lazy: torch\n    import os\n    from megatron_hybrid.cli import x",
         None),  # heavy through its head import, below the comment with another import
    ],
    ids=["not-allowed", "light-target", "no-comment", "allowed", "transitive"],
)  # fmt: skip
def test_a_function_level_package_import_is_reported(tmp_path, importer, body, problem):
    root = _fake_package(
        tmp_path,
        {"__init__.py": "", "pattern/__init__.py": "", "pattern/layout.py": "",
         "pattern/grammar.py": "", "cli/__init__.py": "", "cli/convert.py": "",
         "cli/x.py": "from megatron_hybrid.model.build import y\n", **_HEAVY_MODEL,
         importer: f"def run():\n    {body}\n"},
    )  # fmt: skip
    problems = lazy_import_problems(package_imports(root), root)
    if problem is None:
        assert problems == []
    else:
        (found,) = problems
        assert problem in found
