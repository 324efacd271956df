"""max concurrent runs per job

Revision ID: 0012
Revises: 0011

Drafted by tools/draft_revision.py from sql/; frozen once released.
"""

from __future__ import annotations

from pathlib import Path

from alembic import op

from ledger.migrate import execute_sql

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# Frozen beside this file; never the live sql/, or history would move with it.
UPGRADE_SQL = Path(__file__).with_name("0012_max_concurrent_runs_per_job.sql")
DOWNGRADE_SQL = Path(__file__).with_name("0012_max_concurrent_runs_per_job.downgrade.sql")


def upgrade() -> None:
    execute_sql(op.get_context(), UPGRADE_SQL.read_text())


def downgrade() -> None:
    execute_sql(op.get_context(), DOWNGRADE_SQL.read_text())
