"""The code's shape: the package's modules import one another without a cycle, each dependency
runs one way (cli → train → loader → shards → storage, the shared leaves under all), only the CLIs
know click, and no product function grows past what a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = "imagenet_ais"
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}


def _package_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (anywhere in it, lazily too,
    except a package's ``__getattr__``: PEP 562's names on first use, once the package is imported).
    ``from pkg import mod`` counts as importing mod alone: pkg's face runs first, but it only hands
    on names from below it, so counting it would draw a loop for every submodule of a face."""
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
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                targets |= submodules
                if len(submodules) < len(node.names):  # names of the module itself (a package: its face)
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


# (importer, imported, why): no module of the first reaches one of the second by an import of its own
NEVER = [
    ("loader", "train", "the loader is a library: a training loop of anyone's uses it"),
    ("loader", "cli", "the loader is a library"),
    ("shards", "loader", "the shard format stands below the loader that reads it"),
    ("shards", "train", "the shard tools work without a training run"),
    ("shards", "cli", "the shard tools are a library under their CLI"),
    ("storage", "shards", "storage knows locations, not what is stored"),
    ("storage", "loader", "storage knows locations, not what is stored"),
    ("storage", "train", "storage knows locations, not what is stored"),
    ("storage", "cli", "storage knows locations, not what is stored"),
    ("train", "cli", "the run is called by its CLI, never the other way"),
]
WINGS = ("shards", "loader", "train", "cli", "storage")
SHARED = ("errors", "distributed", "children")  # the leaves every wing may use


def _wing(module: str) -> str:
    """``imagenet_ais.loader.worker`` → "loader"; a module at the top → its own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _broken(graph: dict[str, set[str]], never: list[tuple[str, str, str]]) -> list[str]:
    return sorted(
        f"{name} imports {target}: {why}"
        for name, targets in graph.items()
        for target in targets
        for importer, imported, why in never
        if _wing(name) == importer and _wing(target) == imported
    )


def test_each_dependency_runs_one_way() -> None:
    broken = _broken(_package_imports(), NEVER)
    assert not broken, broken


def test_the_shared_modules_import_no_wing() -> None:
    shared = {f"{PACKAGE}.{name}" for name in SHARED}
    found = [f"{m} imports {t}" for m, ts in _package_imports().items() if m in shared for t in ts if _wing(t) in WINGS]
    assert not found, found


def test_a_broken_rule_is_found() -> None:
    graph = {f"{PACKAGE}.loader.worker": {f"{PACKAGE}.train.metrics"}, f"{PACKAGE}.train.loop": {f"{PACKAGE}.loader"}}
    assert _broken(graph, NEVER) == [f"{PACKAGE}.loader.worker imports {PACKAGE}.train.metrics: " + NEVER[0][2]]


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_importing_the_loader_reaches_no_module_of_the_training_run() -> None:
    """Lazy imports counted too: a caller's loop gets the loader and nothing of our run."""
    reached = _reached(_package_imports(), f"{PACKAGE}.loader")
    assert f"{PACKAGE}.loader.worker" in reached
    assert not {m for m in reached if _wing(m) in ("train", "cli")}


def _imports_click(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        if any(name == "click" or name.startswith("click.") for name in names):
            return True
    return False


def test_only_the_clis_import_click() -> None:
    """The package is for others' programs too: its failures are typed, a CLI turns them into one line."""
    outside = [
        str(path.relative_to(ROOT))
        for name, path in _modules().items()
        if _wing(name) != "cli" and _imports_click(path)
    ]
    assert outside == [f"{PACKAGE}/__main__.py"]  # (the front door, where the CLIs meet)


def test_a_cycle_is_found_when_there_is_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _product_python() -> list[Path]:
    files = [*(ROOT / PACKAGE).rglob("*.py"), *(ROOT / "tools").glob("*.py")]
    return sorted([*files, ROOT / "train.py", ROOT / "imagenet_shards.py"])


def test_no_product_function_is_too_long() -> None:
    too_long = []
    for path in _product_python():
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            # from the def line: a click command's option decorators are a table, not logic
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, f"over {MAX_FUNCTION_LINES} lines a function: {too_long}"
