"""one writer of skip counts

Revision ID: 0013
Revises: 0012

Drafted by tools/draft_revision.py from sql/; frozen once released.
"""

from __future__ import annotations

from pathlib import Path

from alembic import op

from ledger.migrate import execute_sql

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# Frozen beside this file; never the live sql/, or history would move with it.
UPGRADE_SQL = Path(__file__).with_name("0013_one_writer_of_skip_counts.sql")
DOWNGRADE_SQL = Path(__file__).with_name("0013_one_writer_of_skip_counts.downgrade.sql")


def upgrade() -> None:
    execute_sql(op.get_context(), UPGRADE_SQL.read_text())


def downgrade() -> None:
    execute_sql(op.get_context(), DOWNGRADE_SQL.read_text())
