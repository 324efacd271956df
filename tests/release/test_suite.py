"""The suite itself: every skip says what would run the test, and the run's last line counts the skips.

tests/conftest.py ends each run with ``skipped N: K need WHAT (HOW), ...``; that needs each
skip reason to start ``needs WHAT (HOW)``. The reasons written in tests/ are read here from
the source (pytest.skip(...), skipif(..., reason=...)), so a new skip without it fails.
"""

from __future__ import annotations

import ast

from skips import NEEDS, skip_summary
from repo import TESTS


def test_the_summary_counts_the_skips_by_what_they_need() -> None:
    assert skip_summary([]) == "skipped 0"
    chromium = "needs chromium (apt-get install chromium chromium-driver)"
    promtool = "needs promtool (apt-get install prometheus)"
    assert skip_summary([chromium, promtool, chromium, f"{promtool}: with a why", chromium]) == (
        "skipped 5: 3 need chromium (apt-get install chromium chromium-driver), "
        "2 need promtool (apt-get install prometheus)")
    assert skip_summary([promtool, "just because"]) == (
        "skipped 2: 1 needs promtool (apt-get install prometheus), 1 other: just because")


def _text(node: ast.expr) -> str | None:
    """A string literal's text; an f-string's with {} for each placeholder; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return None


def skip_reasons() -> list[tuple[str, str]]:
    """(where, reason) of every skip in tests/ whose reason is written where it is raised."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr == "skip" and node.args:
                reason = node.args[0]
            elif node.func.attr == "skipif":
                reason = next((k.value for k in node.keywords if k.arg == "reason"), None)
                if reason is None:
                    continue
            else:
                continue
            text = _text(reason)
            if text is not None and not text.startswith("{}"):  # a reason made elsewhere: its maker's
                found.append((f"{path.relative_to(TESTS)}:{node.lineno}", text))
    return found


def test_every_skip_reason_says_what_would_run_the_test() -> None:
    reasons = skip_reasons()
    assert len(reasons) >= 20  # the reader still finds them
    assert [(where, text) for where, text in reasons if not NEEDS.match(text)] == []


def test_the_reasons_made_elsewhere_say_it_too() -> None:
    # autofailover.missing() and test_pg_cron's _pg_cron_missing() make theirs: every string they return.
    for path, function in (("autofailover.py", "missing"), ("field/test_pg_cron.py", "_pg_cron_missing")):
        tree = ast.parse((TESTS / path).read_text())
        [made] = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == function]
        texts = [_text(node.value) for node in ast.walk(made) if isinstance(node, ast.Return) and node.value]
        texts = [text for text in texts if text is not None]
        assert texts, function
        assert [text for text in texts if not NEEDS.match(text)] == [], function
