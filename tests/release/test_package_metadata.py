"""The package's metadata, read without a build (``make package-check`` builds
the sdist and the wheel and runs the wheel in a fresh venv; these are the
seconds-long parts of that, for every ``make test``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

import ledger
from ledger import resources
from repo import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

# Which extra a module's imports may come from, besides [project].dependencies.
EXTRA_OF = {"ledger/web/": "web", "ledger/embedded.py": "embedded", "ledger/testing.py": "pytest"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert found, f"cannot read the requirement {requirement!r}"
        names.add(normalized(found.group()))
    return names


def test_the_version_has_one_source_and_the_installed_metadata_agrees():
    assert "version" in PROJECT["dynamic"] and "version" not in PROJECT
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "ledger/__init__.py"
    installed = importlib.metadata.version(PROJECT["name"])
    assert installed == ledger.__version__, (
        f"the dev install says {installed}, ledger/__init__.py {ledger.__version__}: the venv predates the "
        "version change; reinstall it (rm .venv/.installed && make venv)")


def test_the_wheel_puts_sql_and_migrations_where_resources_looks(tmp_path, monkeypatch):
    force_include = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert force_include == {"sql": "ledger/_sql", "migrations": "ledger/_migrations"}
    # An installed package: ledger/ with _sql and _migrations beside its modules, no source tree.
    package = tmp_path / "site-packages" / "ledger"
    for target in force_include.values():
        (tmp_path / "site-packages" / target).mkdir(parents=True)
    monkeypatch.setattr(resources, "_PACKAGE", package)
    assert resources.sql_dir() == package / "_sql"
    assert resources.migrations_dir() == package / "_migrations"


def third_party_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return {module for module in modules
            if module not in sys.stdlib_module_names and module not in ("ledger", "__future__")}


def test_every_import_of_the_package_is_a_declared_dependency():
    """A module imported directly is declared, by the core or by the extra its module belongs to
    (a dependency of a dependency is not enough: it can go away in that one's next release)."""
    core = requirement_names(PROJECT["dependencies"])
    extras = {name: requirement_names(requirements)
              for name, requirements in PROJECT["optional-dependencies"].items()}
    distributions = importlib.metadata.packages_distributions()
    undeclared = []
    for path in sorted((ROOT / "ledger").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        extra = next((name for prefix, name in EXTRA_OF.items() if relative.startswith(prefix)), None)
        allowed = core | (extras[extra] if extra else set())
        for module in sorted(third_party_imports(path)):
            provided_by = {normalized(name) for name in distributions.get(module, [module])}
            if not provided_by & allowed:
                where = f"[project].dependencies nor the {extra} extra" if extra else "[project].dependencies"
                undeclared.append(f"{relative} imports {module} ({', '.join(sorted(provided_by))}): "
                                  f"not in {where}")
    assert not undeclared, "\n".join(undeclared)
