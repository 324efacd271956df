"""one pass for a scrape

Revision ID: 0011
Revises: 0010

Drafted by tools/draft_revision.py from sql/; frozen once released.
"""

from __future__ import annotations

from pathlib import Path

from alembic import op

from ledger.migrate import execute_sql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# Frozen beside this file; never the live sql/, or history would move with it.
UPGRADE_SQL = Path(__file__).with_name("0011_one_pass_for_a_scrape.sql")
DOWNGRADE_SQL = Path(__file__).with_name("0011_one_pass_for_a_scrape.downgrade.sql")


def upgrade() -> None:
    execute_sql(op.get_context(), UPGRADE_SQL.read_text())


def downgrade() -> None:
    execute_sql(op.get_context(), DOWNGRADE_SQL.read_text())
