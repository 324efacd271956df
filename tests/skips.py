"""What a skipped test needs, and the run's last line that counts the skips by it.

tests/conftest.py prints the line at the end of the run; tests/release/test_suite.py
checks that every skip reason in the suite has the form.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

# A skip reason says what would run the test: "needs WHAT (HOW TO GET IT)", and after a colon
# why, if that needs saying. The run ends with one line that counts the skips by what they need:
#   skipped 5: 3 need chromium (apt-get install chromium chromium-driver), 2 need promtool (apt-get ...)
NEEDS = re.compile(r"^needs (?P<what>[^()]+?) \((?P<how>[^()]+)\)")


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text.removeprefix("Skipped: ")


def skip_summary(reasons: list[str]) -> str:
    """``skipped N: K need WHAT (HOW), ...``, the most frequent first; a reason not in that form last, as it is."""
    needs: Counter[str] = Counter()
    other: Counter[str] = Counter()
    for reason in reasons:
        found = NEEDS.match(reason)
        if found:
            needs[f"{found['what']} ({found['how']})"] += 1
        else:
            other[reason] += 1
    parts = [f"{n} {'needs' if n == 1 else 'need'} {what}" for what, n in sorted(needs.items(), key=_most)]
    parts += [f"{n} other: {reason}" for reason, n in sorted(other.items(), key=_most)]
    return f"skipped {len(reasons)}" + (f": {', '.join(parts)}" if parts else "")


def _most(item: tuple[str, int]) -> tuple[int, str]:
    return -item[1], item[0]
