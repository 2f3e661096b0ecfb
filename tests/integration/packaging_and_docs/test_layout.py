"""kstore's layout holds: the import contracts in pyproject.toml ([tool.importlinter]: the layers, which
modules may import kafka-python and the PostgreSQL drivers) are kept, and no module of kstore imports
itself back through others. Static: nothing is imported or run but the import linter."""

from __future__ import annotations

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
