"""one state per job

Revision ID: 0005
Revises: 0004

Drafted by tools/draft_revision.py from sql/; frozen once released.
"""

from __future__ import annotations

from pathlib import Path

from alembic import op

from ledger.migrate import execute_sql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Frozen beside this file; never the live sql/, or history would move with it.
UPGRADE_SQL = Path(__file__).with_name("0005_one_state_per_job.sql")
DOWNGRADE_SQL = Path(__file__).with_name("0005_one_state_per_job.downgrade.sql")


def upgrade() -> None:
    execute_sql(op.get_context(), UPGRADE_SQL.read_text())


def downgrade() -> None:
    execute_sql(op.get_context(), DOWNGRADE_SQL.read_text())
