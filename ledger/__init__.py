"""Postgres-native job ledger: leases, fencing tokens, execution log, bounded catch-up.

All semantics live in PL/pgSQL functions in schema ``ledger`` (see ``sql/``);
this package is a thin layer over them.
"""

from ledger.errors import (
    InvalidArgument,
    JobNotFound,
    LeaseSuperseded,
    LedgerError,
    RunNotFound,
    RunNotRunning,
    StaleToken,
)

__all__ = [
    "InvalidArgument",
    "JobNotFound",
    "LeaseSuperseded",
    "LedgerError",
    "RunNotFound",
    "RunNotRunning",
    "StaleToken",
]
__version__ = "0.1.0"
