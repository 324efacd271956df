"""Where the SQL and the migrations are: inside the wheel, or in the source tree."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _locate(packaged: str, source: str) -> Path:
    # A wheel carries them as ledger/_sql and ledger/_migrations (see
    # pyproject's force-include); a source checkout has them beside ledger/.
    inside = _PACKAGE / packaged
    return inside if inside.is_dir() else _PACKAGE.parent / source


def sql_dir() -> Path:
    return _locate("_sql", "sql")


def migrations_dir() -> Path:
    return _locate("_migrations", "migrations")


def sql_files() -> list[Path]:
    """The install files, in the order they apply."""
    return sorted(sql_dir().glob("*.sql"))


def install_sql() -> str:
    """The whole current schema (sql/, the truth) as one script."""
    return "\n".join(path.read_text() for path in sql_files())
