"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

from pathlib import Path

from alembic import op

from ledger.migrate import execute_sql

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}

# Raw SQL, frozen beside this file (never read the live sql/): the change
# in <this file>.sql, its reverse in <this file>.downgrade.sql. Then make
# sql/ say the same, so that a fresh install and an upgrade stay identical
# (tests/release/test_migrations.py compares their catalogs).
UPGRADE_SQL = Path(__file__).with_suffix(".sql")
DOWNGRADE_SQL = Path(__file__).with_suffix(".downgrade.sql")


def upgrade() -> None:
    execute_sql(op.get_context(), UPGRADE_SQL.read_text())


def downgrade() -> None:
    execute_sql(op.get_context(), DOWNGRADE_SQL.read_text())
