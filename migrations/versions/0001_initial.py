"""initial: the whole ledger, from a frozen copy of sql/

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Until the first release, `make freeze-initial` regenerates 0001_initial.sql
from sql/; after it, this revision never changes again.
"""

from __future__ import annotations

from pathlib import Path

from alembic import op

from ledger.migrate import execute_sql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Frozen beside this file; never the live sql/, or history would move with it.
UPGRADE_SQL = Path(__file__).with_suffix(".sql")


def upgrade() -> None:
    execute_sql(op.get_context(), UPGRADE_SQL.read_text())


def downgrade() -> None:
    # Undoing 0001 is uninstalling. env.py does it once the version row is
    # gone: it drops schema ledger (with alembic's version table, which must
    # outlive this step) and the roles nothing else uses.
    pass
