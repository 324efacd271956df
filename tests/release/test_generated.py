"""The sync client is generated from the async one, and the generator does what it says.

``ledger/client.py`` is written by ``tools/async_to_sync.py`` from
``ledger/aio.py`` (``make sync``); a hand edit of the generated file, or a
source change without ``make sync``, fails here (and so in CI).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from repo import ROOT

sys.path.insert(0, str(ROOT / "tools"))

import async_to_sync as generator  # noqa: E402


def test_every_generated_file_is_what_its_async_source_makes_of_it() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "async_to_sync.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"stale generated file, run 'make sync':\n{result.stdout[-4000:]}{result.stderr}"


def test_a_generated_file_says_it_is_generated_and_from_what() -> None:
    for source, target in generator.FILES.items():
        first = (ROOT / target).read_text().splitlines()[0]
        assert first.startswith(f"# Generated from {source} by tools/async_to_sync.py"), (target, first)


def sync_of(source: str) -> str:
    return generator.transform(generator.resolve_flavour_blocks(source))


def test_async_and_await_go_and_async_names_become_their_sync_twins() -> None:
    source = (
        "async def f(conn: AsyncConnection) -> None:\n"
        "    async with ALock():\n"
        "        rows = (await conn.execute('x'))[0]\n"
        "        async for row in rows:\n"
        "            await aspawn(g, 'name')\n"
    )
    assert sync_of(source) == (
        "def f(conn: Connection) -> None:\n"
        "    with Lock():\n"
        "        rows = conn.execute('x')[0]\n"
        "        for row in rows:\n"
        "            spawn(g, 'name')\n"
    )


def test_parentheses_stay_where_removing_them_would_change_what_binds() -> None:
    assert sync_of("async def f():\n    return (await a() + b)[0]\n") == "def f():\n    return (a() + b)[0]\n"
    assert sync_of("async def f():\n    return g(await a())\n") == "def f():\n    return g(a())\n"


def test_awaitable_and_ashield_unwrap_to_what_they_hold() -> None:
    source = "async def f(cb: Callable[[], Awaitable[int]]) -> None:\n    await ashield(cb())\n"
    assert sync_of(source) == "def f(cb: Callable[[], int]) -> None:\n    cb()\n"


def test_flavour_blocks_keep_the_sync_branch_only() -> None:
    source = (
        "def f():\n"
        "    if ASYNC:\n"
        "        a()\n"
        "    else:\n"
        "        b()\n"
        "    if not ASYNC:\n"
        "        c()\n"
        "    d()\n"
    )
    assert sync_of(source) == "def f():\n    b()\n    c()\n    d()\n"


def test_continuation_lines_follow_their_opening_bracket() -> None:
    source = "async def f(a: int,\n            b: int) -> None:\n    pass\n"
    assert sync_of(source) == "def f(a: int,\n      b: int) -> None:\n    pass\n"
    source = "async def f():\n    await g('a',\n            'b')\n"  # a continuation line that starts with a string
    assert sync_of(source) == "def f():\n    g('a',\n      'b')\n"


def test_an_else_after_a_blank_line_still_belongs_to_its_flavour_block() -> None:
    source = "def f():\n    if ASYNC:\n        a()\n\n    else:\n        b()\n"
    assert sync_of(source) == "def f():\n    b()\n"


def test_docstrings_and_comments_are_renamed_too() -> None:
    source = 'def f():\n    """Use ``async with AsyncLedger(dsn)``; an AsyncConnection."""  # AsyncRunContext\n'
    assert sync_of(source) == 'def f():\n    """Use ``with Ledger(dsn)``; a Connection."""  # RunContext\n'


@pytest.mark.parametrize("source", [
    "async def f():\n    x = ASYNC\n",           # the flag outside `if ASYNC:`
    "async def f():\n    async = 1\n",            # `async` before anything but def/with/for
])
def test_what_the_generator_cannot_translate_is_refused(source: str) -> None:
    with pytest.raises((generator.GenerateError, SyntaxError)):
        sync_of(source)
