"""Every module of the ledger package imports on its own, in a fresh interpreter.

An import circle (a module that needs a name of a module that is still
importing it) fails only when the circle is entered at the wrong module, so
each module is imported first, by itself, in a process of its own. The
modules are found with pkgutil, so a new module is covered without a change
here.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import ledger


def _modules() -> list[str]:
    found = ["ledger"]
    found += [info.name for info in pkgutil.walk_packages(ledger.__path__, prefix="ledger.")]
    return sorted(found)


MODULES = _modules()


def test_the_modules_are_found():
    assert {"ledger.cli", "ledger.cli._options", "ledger.cli._output", "ledger.cli.run", "ledger.cli.report",
            "ledger.render", "ledger.text", "ledger.wrapper", "ledger.queries", "ledger.__main__"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_the_module_imports_on_its_own(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"python -c 'import {module}' failed:\n{result.stderr}"
    assert not result.stdout, f"importing {module} printed:\n{result.stdout}"  # it runs nothing
