"""Imports run downhill: every import of the package against the layer table of
docs/architecture.md (module-level and function-level imports alike), and no import cycle
between its packages."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_hybrid"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# (importing package, imported package) -> why it is allowed. Each entry must still exist and
# be a function-level import, so the list cannot outlive its reason.
ALLOWED = {
    ("modules", "model"): "deprecated alias megatron_hybrid.modules.HybridModel (removed in 0.2)",
}


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
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        found += module_imports(path.read_text(), module, is_package, root)
    return found


def layering_violations(imports: list[Import], layers: dict[str, int]) -> list[str]:
    """Imports of a higher layer, or of another package of the same layer."""
    problems = []
    for imp in imports:
        src, dst = package_of(imp.importer), package_of(imp.imported)
        if src == dst or (src, dst) in ALLOWED:
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
    graph: dict[str, set[str]] = {}
    for imp in imports:
        src, dst = package_of(imp.importer), package_of(imp.imported)
        graph.setdefault(src, set())
        graph.setdefault(dst, set())
        if src != dst and (src, dst) not in ALLOWED:
            graph[src].add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph has a dozen nodes
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


def test_imports_run_downhill(imports, layers):
    assert len(imports) > 100  # the walk found the package's imports at all
    assert layering_violations(imports, layers) == []


def test_no_import_cycle_between_packages(imports):
    assert package_cycles(imports) == []


def test_no_private_name_is_imported_across_modules(imports):
    assert private_imports(imports) == []


def test_allowed_exceptions_are_lazy_and_still_needed(imports):
    for src, dst in ALLOWED:
        uses = [
            i for i in imports if (package_of(i.importer), package_of(i.imported)) == (src, dst)
        ]
        assert uses, f"{src} -> {dst} is allowed but no longer imported: drop it from ALLOWED"
        assert all(i.in_function for i in uses), f"{src} -> {dst} must stay a lazy import"


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
