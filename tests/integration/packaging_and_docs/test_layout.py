"""kstore's layout holds: the import contracts in pyproject.toml ([tool.importlinter]: the layers, which
modules may import kafka-python and the PostgreSQL drivers) are kept, and no module of kstore imports
itself back through others; the top of kstore holds at most ten modules, and processor.py only what a
user writes against; the unit tests of the mirrored packages sit where the module they test does.
Static: nothing is imported or run but the import linter."""

from __future__ import annotations

import ast
import re
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


#: The subpackages whose unit tests mirror them: kstore/<package>/<module>.py is tested in
#: tests/unit/<package>/test_<module>.py (a module with several concerns may have more files, each
#: test_<module>_<concern>.py, and a subpackage counts as a module); a top-level kstore/<module>.py in
#: tests/unit/test_<module>.py.
MIRRORED_PACKAGES = ("cli", "db", "engine", "ops", "relay", "running", "telemetry")


def test_unit_tests_sit_where_the_module_they_test_does() -> None:
    unit, package = REPO_DIR / "tests" / "unit", REPO_DIR / "kstore"
    homes = [(unit, package), *((unit / name, package / name) for name in MIRRORED_PACKAGES)]
    astray = []
    for tests, code in homes:
        modules = {path.stem for path in code.glob("*.py") if path.stem != "__init__"}
        modules |= {path.parent.name for path in code.glob("*/__init__.py")}
        for test in sorted(tests.glob("test_*.py")):
            tested = test.stem.removeprefix("test_")
            if not any(tested == m or tested.startswith(f"{m}_") for m in modules):
                astray.append(f"{test.relative_to(REPO_DIR)}: no {code.relative_to(REPO_DIR)}/{tested}.py")
    assert not astray, astray


def test_every_package_of_kstore_is_shipped() -> None:
    """setuptools' package list in pyproject.toml is written by hand: a new subpackage missing from it
    imports from a checkout but not from the wheel (the installed kstore fails at its first import)."""
    text = (REPO_DIR / "pyproject.toml").read_text()
    start = text.index("\npackages = [", text.index("[tool.setuptools]"))
    listed = set(re.findall(r'"([\w.]+)"', text[start:text.index("\n]", start)]))
    code = REPO_DIR / "kstore"
    packages = {".".join(("kstore", *init.parent.relative_to(code).parts)) for init in code.rglob("__init__.py")}
    assert packages - listed == set(), "subpackages missing from [tool.setuptools] packages"
