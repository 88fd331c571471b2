"""The house rules of ``cachedstore/``, checked: layering, class sizes, a test file per module.

- **Layering**: no module imports one above it -- the import graph of the package (every
  import, function-level ones included; ``if TYPE_CHECKING:`` blocks excepted) has no cycle.
- **Class sizes**: a class over ~300 lines says why at its top (its docstring holds a
  paragraph starting "Longer than").
- **A test file of its own**: every module has a test file that imports it (``MODULE_TESTS``
  names it where the names differ), so that a newcomer finds where a module is tested.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
from util import import_graph, package_modules

PACKAGE = Path(__file__).resolve().parent.parent / "cachedstore"
TESTS = Path(__file__).resolve().parent

#: Module (relative to cachedstore/, without .py) -> its test file (relative to tests/),
#: where that is not ``test_<module>.py``.
MODULE_TESTS = {
    "__main__": "test_cli.py",
    "aio": "test_steps.py",
    "client": "test_demo.py",
    "connection": "test_connection_deadline.py",
    "errors": "test_failures_errors.py",
    "metrics": "test_metrics_series.py",
    "opener": "test_scoped_watch.py",
    "reads": "test_coherence.py",
    "scoping": "test_scoped_watch.py",
    "snapshot": "test_watcher.py",
    "watchstream": "test_watcher.py",
    "writes": "test_versioned.py",
    "demo/figures": "test_demo.py",
    "demo/report": "test_demo.py",
    "demo/run": "test_demo.py",
    "demo/settings": "test_demo.py",
    "demo/uncached": "test_demo.py",
    "demo/workload": "test_demo.py",
    "server/base": "test_server.py",
    "server/binaries": "test_server.py",
    "server/member": "test_server.py",
    "server/process": "test_server.py",
    "server/tls": "test_security.py",
    "torch/heartbeats": "test_rendezvous_heartbeats.py",
    "torch/rendezvous": "test_rendezvous.py",
    "torch/store": "test_torch_store.py",
    "testing/cluster": "test_testing.py",
    "testing/proxy": "test_testing.py",
    "testing/tls": "test_testing.py",
}
#: The paragraph a class over ``LONG_CLASS`` lines starts its reason with.
REASON = "Longer than"
LONG_CLASS = 320


def _modules() -> dict[str, Path]:
    return package_modules(PACKAGE)


def _import_graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE)


def test_no_module_imports_one_above_it() -> None:
    graph = _import_graph()
    assert len(graph) > 40
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_layering_check_sees_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """The check is not vacuous: a lower module importing the store is a cycle."""
    fake = tmp_path / "cachedstore"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "low.py").write_text("def f():\n    from .high import g\n")
    (fake / "high.py").write_text("from . import low\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    graph = _import_graph()
    assert graph["cachedstore.low"] == {"cachedstore.high"}
    assert graph["cachedstore.high"] == {"cachedstore.low"}


def _long_classes() -> list[tuple[str, str, int, str]]:
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > LONG_CLASS:
                    found.append((name, node.name, size, ast.get_docstring(node) or ""))
    return found


def test_a_long_class_says_why_at_its_top() -> None:
    silent = [f"{module}.{cls} ({size} lines)" for module, cls, size, doc in _long_classes()
              if not any(p.strip().startswith(REASON) for p in doc.split("\n\n"))]
    assert not silent, f"classes over {LONG_CLASS} lines without a reason: {silent}"


def _tested_modules(test_file: Path) -> set[str]:
    """The cachedstore modules ``test_file`` imports, or imports something defined in
    (``from cachedstore import EtcdStore`` tests ``cachedstore.store``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(test_file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module \
                and node.module.startswith("cachedstore"):
            found.add(node.module)
            source = importlib.import_module(node.module)
            for alias in node.names:
                obj = getattr(source, alias.name, None)
                if inspect.ismodule(obj):
                    found.add(obj.__name__)
                elif obj is not None:
                    found.add(getattr(obj, "__module__", "") or "")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("module", sorted(m for m, path in _modules().items()
                                         if path.name != "__init__.py"))  # re-exports only
def test_every_module_has_a_test_file_of_its_own(module: str) -> None:
    """``test_<module>.py`` imports the module (or something defined in it); a test file
    named in ``MODULE_TESTS`` instead tests it through the store or its package, and says
    so: it imports it or names it (``reads.py``, ``cachedstore.reads``)."""
    relative = module.split(".", 1)[1].replace(".", "/")
    mapped = MODULE_TESTS.get(relative)
    test_file = TESTS / (mapped or f"test_{relative.rsplit('/', 1)[-1]}.py")
    assert test_file.exists(), f"{module}: no {test_file.name}"
    if module in _tested_modules(test_file):
        return
    assert mapped is not None, f"{test_file.name} imports nothing of {module}"
    text = test_file.read_text()
    assert module in text or f"{relative.rsplit('/', 1)[-1]}.py" in text, \
        f"{test_file.name} neither imports nor names {module}"
