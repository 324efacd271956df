"""The layers: the applications use the library, never each other; the library never reaches up.

The package has two layers. The library (``ledger.client``, ``ledger.connect``,
``ledger.readonly``, ``ledger.queries``, ``ledger.schedule_words``,
``ledger._backoff``, ...) knows no application. The applications stand on it:

- the command line, ``ledger.cli`` (click, rich; it may import every other
  part: it is the shell of all of them);
- the dashboard, ``ledger.web`` (starlette, jinja2, uvicorn);
- the metrics, ``ledger.metrics`` (prometheus_client; the dashboard's
  ``/metrics`` serves its collector, the one application module another one
  imports, so that both expose the same families);
- the notifier's delivery, ``ledger.webhook`` (``jobledger notify``);
- the process wrapper, ``ledger.wrapper`` (``jobledger run``);
- the report guard, ``ledger.report`` (sqlglot), which ``jobledger report``
  alone needs: the metrics and the dashboard read in the same read-only
  transaction (``ledger.readonly``) without its parser;
- the demo, ``ledger.demo`` (``jobledger demo``; rich, through the
  library's tables, ``ledger.render``).

What two applications share lives in the library: the read-only transaction
(``ledger.readonly``), a schedule in words (``ledger.schedule_words``), the
wait between two attempts (``ledger._backoff``). The scheduler's loop, its jobs
file and ``ledger.serve`` (``ledger.scheduler``) are library too: the command
runner it hands a jobs file's commands to is the wrapper's
(``ledger.wrapper.CommandRunner``), joined to the loop by ``jobledger
scheduler`` (``ledger.cli.scheduler``).

Each module is imported in a fresh interpreter and ``sys.modules`` is read
afterwards, so an import made on the way (a module that imports one that
imports the CLI) counts too. A module may load what its own third-party
libraries bring: uvicorn, the dashboard's server, imports click for its own
command line (:data:`BROUGHT_BY_DEPENDENCIES`); the ``ledger.cli`` modules
themselves are never loaded that way.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import ledger

CLI = ("ledger.cli", "click", "rich")
DASHBOARD = ("ledger.web", "starlette", "jinja2", "uvicorn")
REPORT_GUARD = ("ledger.report", "sqlglot")
METRICS = ("ledger.metrics", "prometheus_client")
NOTIFIER = ("ledger.webhook",)
WRAPPER = ("ledger.wrapper",)

#: What importing each application module must not load: the other applications and their libraries.
NEVER_LOADS: dict[str, tuple[str, ...]] = {
    "ledger.web": CLI + REPORT_GUARD + NOTIFIER + WRAPPER,
    "ledger.metrics": CLI + DASHBOARD + REPORT_GUARD + NOTIFIER + WRAPPER,
    "ledger.webhook": CLI + DASHBOARD + REPORT_GUARD + METRICS + WRAPPER,
    "ledger.wrapper": CLI + DASHBOARD + REPORT_GUARD + METRICS + NOTIFIER,
    "ledger.report": CLI + DASHBOARD + METRICS + NOTIFIER + WRAPPER,
    "ledger.demo": ("ledger.cli", "click") + DASHBOARD + REPORT_GUARD + METRICS + NOTIFIER + WRAPPER,
}

#: What a module's own third-party libraries load, allowed although listed above.
BROUGHT_BY_DEPENDENCIES: dict[str, tuple[str, ...]] = {
    "ledger.web.server": ("click",),  # uvicorn's own command line
}

#: The applications; no module outside them loads one of them (the library never reaches up).
APPLICATIONS = ("ledger.cli", "ledger.__main__", *NEVER_LOADS)


def _modules() -> list[str]:
    return sorted(["ledger"] + [info.name for info in pkgutil.walk_packages(ledger.__path__, prefix="ledger.")])


MODULES = _modules()


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _part(module: str, prefixes: tuple[str, ...] | list[str]) -> str | None:
    return next((prefix for prefix in prefixes if _within(module, prefix)), None)


def _loaded_by(module: str) -> set[str]:
    """The modules in ``sys.modules`` after ``import module`` in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", f"import sys, {module}; print('\\n'.join(sys.modules))"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"python -c 'import {module}' failed:\n{result.stderr}"
    return set(result.stdout.split())


def _forbidden(module: str) -> tuple[str, ...]:
    application = _part(module, list(NEVER_LOADS))
    if application is None:  # the library: no application at all
        return APPLICATIONS if _part(module, APPLICATIONS) is None else ()
    allowed = BROUGHT_BY_DEPENDENCIES.get(module, ())
    return tuple(name for name in NEVER_LOADS[application] if name not in allowed)


CHECKED = [module for module in MODULES if _forbidden(module)]


def test_every_application_and_the_library_are_checked():
    assert {"ledger.web.schedules", "ledger.web.reads", "ledger.metrics", "ledger.webhook", "ledger.wrapper",
            "ledger", "ledger.client", "ledger.readonly", "ledger.schedule_words", "ledger._backoff",
            "ledger.scheduler.loop", "ledger.scheduler.jobsfile", "ledger.scheduler.serve",
            "ledger.scheduler.sync", "ledger.scheduler.crontab"} <= set(CHECKED)
    assert not any(_within(module, "ledger.cli") for module in CHECKED)  # the CLI may import every part


@pytest.mark.parametrize("module", CHECKED)
def test_a_module_does_not_reach_sideways_or_up(module):
    loaded = _loaded_by(module)
    reached = sorted(name for name in loaded for part in _forbidden(module) if _within(name, part))
    assert not reached, (f"importing {module} loads {', '.join(reached)}: an application uses the library, "
                         f"never another application; what two of them share moves into the library")
