"""kstore's layout holds: the import contracts in pyproject.toml ([tool.importlinter]: the layers, which
modules may import kafka-python and the PostgreSQL drivers) are kept, and no module of kstore imports
itself back through others; the top of kstore holds at most ten modules, and processor.py only what a
user writes against. Static: nothing is imported or run but the import linter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

from tests.support.harness import REPO_DIR


def test_the_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--no-cache"], cwd=REPO_DIR, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Contracts:" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


def test_no_module_imports_itself_back() -> None:
    """No cycle between two modules, even inside one subpackage (which the layers do not see)."""
    graph = grimp.build_graph("kstore", cache_dir=None)
    cycles = [
        " -> ".join([module, *chain])
        for module in sorted(graph.modules)
        for imported in sorted(graph.find_modules_directly_imported_by(module))
        if (chain := graph.find_shortest_chain(importer=imported, imported=module))
    ]
    assert not cycles, cycles


#: What a user imports from the top of kstore; everything else lives in a subpackage that names its role.
MOST_TOP_LEVEL_MODULES = 10


def test_the_top_of_kstore_is_the_users_api() -> None:
    package = REPO_DIR / "kstore"
    modules = sorted(path.name for path in package.glob("*.py"))
    assert len(modules) <= MOST_TOP_LEVEL_MODULES, modules


def test_processor_defines_only_processor_and_message() -> None:
    """kstore/processor.py is what a user writes against: how kstore runs a processor lives in kstore.running."""
    tree = ast.parse((REPO_DIR / "kstore" / "processor.py").read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update(alias.asname or alias.name for alias in node.names if alias.asname)
    public = {name for name in defined if not name.startswith("_")}
    assert public <= {"Processor", "Message"}, sorted(public - {"Processor", "Message"})
    assert "Processor" in defined
