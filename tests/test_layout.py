"""The code's shape: the package's modules import one another without a cycle and never back up
out of a subpackage, and no product file or function grows past what a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = "imagenet_ais"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}


def _package_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (anywhere in it, lazily too,
    except a package's ``__getattr__``: PEP 562's names on first use, once the package is imported;
    every ``from imagenet_ais import x`` imports the package, so counting those would forbid any)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        tree = ast.parse(path.read_text())
        if path.name == "__init__.py":
            tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from pkg import mod" imports the module mod; "from mod import name", mod
                targets |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
                targets.add(node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target, [*path, target])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = _cycle(_package_imports())
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_no_subpackage_imports_back_up_out_of_itself() -> None:
    """A subpackage (storage/) stands on its own: the package uses it, never the other way round.
    Outside itself it may import only the package's leaves, which import nothing of ours (errors)."""
    paths, imports = _modules(), _package_imports()
    for name, targets in imports.items():
        folder = paths[name].parent.relative_to(ROOT)
        if folder != Path(PACKAGE):
            home = ".".join(folder.parts)
            outside = sorted(t for t in targets if t != home and not t.startswith(home + ".") and imports.get(t))
            assert not outside, f"{name} imports {outside}, outside its subpackage {home}"


def test_a_cycle_is_found_when_there_is_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _product_python() -> list[Path]:
    files = [*(ROOT / PACKAGE).rglob("*.py"), *(ROOT / "tools").glob("*.py")]
    return sorted([*files, ROOT / "train.py", ROOT / "imagenet_shards.py"])


def test_no_product_file_or_function_is_too_long() -> None:
    too_long = []
    for path in _product_python():
        name = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            # from the def line: a click command's option decorators are a table, not logic
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function: {too_long}"
