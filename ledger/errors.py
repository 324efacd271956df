"""The ledger's errors: one table from SQLSTATE to exception class.

The SQL functions raise SQLSTATE class ``LD`` with a JSON object as DETAIL;
:func:`translate` turns such a psycopg error into the matching class below,
with the DETAIL facts parsed into ``facts`` (and readable as attributes).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg


class LedgerError(Exception):
    """Base of every error the ledger raises on purpose."""

    sqlstate: str = ""

    def __init__(self, message: str, facts: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.facts: dict[str, Any] = facts or {}

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: expose DETAIL facts as attributes.
        facts = self.__dict__.get("facts", {})
        if name in facts:
            return facts[name]
        raise AttributeError(name)


class LeaseSuperseded(LedgerError):
    """LD001: the token is no longer the job's current live token, or the owner does not hold it.

    Also what a fence raises for a token that is not the job's current live
    token (a zombie whose lease expired or was taken over). DETAIL facts:
    ``job``, ``token``, ``current_token``, ``holder``, ``expires_at``, ``released``.
    """

    sqlstate = "LD001"


class StaleToken(LedgerError):
    """LD002: a fenced write carries a token lower than the highest accepted.

    The token was the job's current one when the fence checked it, yet a newer
    token of the job wrote first: a takeover committed in between. DETAIL
    facts: ``resource``, ``job``, ``token``, ``highest_token``.
    """

    sqlstate = "LD002"


class RunNotRunning(LedgerError):
    """LD003: heartbeat/complete/fail on a run that has already ended."""

    sqlstate = "LD003"


class RunNotFound(LedgerError):
    """LD004: no run with that id."""

    sqlstate = "LD004"


class JobNotFound(LedgerError):
    """LD005: a schedule function names a job that was never registered."""

    sqlstate = "LD005"


class FenceOfAnotherJob(LedgerError):
    """LD006: the resource is bound to another job (the one that first fenced it).

    Tokens of two jobs are numbers that mean nothing to each other, so a
    resource accepts only its own job's tokens. A programming error (two jobs
    share a resource name), not a lost lease. DETAIL facts: ``resource``,
    ``job`` (the caller's), ``bound_job`` (the owner's), ``token``.
    """

    sqlstate = "LD006"


class FenceNotCommitted(LedgerError):
    """LD007: the run's fenced write did not commit, so the ledger recorded the run as failure, not success.

    ``complete_run`` found a fence the run named (``fenced``) not holding its
    token: the transaction of the write rolled back, or its COMMIT was lost on
    the way (a driver behind a transaction pooler). The SQL function warns and
    commits the failure; the client raises this after that commit. Facts:
    ``run_id``, ``job``, ``token``, ``resources`` (the fences that do not hold
    the token), ``fence_tokens`` (``{resource: token or None}``); ``run`` is
    the failed run's row.
    """

    sqlstate = "LD007"

    def __init__(self, message: str, facts: dict[str, Any] | None = None, run: Any = None) -> None:
        super().__init__(message, facts)
        self.run = run


class PoolNotFound(LedgerError):
    """LD008: a pool that was never registered (``resize_pool``, ``register_job``'s ``pool``).

    DETAIL facts: ``pool`` (the name given), ``argument`` (the argument that named it).
    ``register_pool`` creates one.
    """

    sqlstate = "LD008"


class InvalidArgument(LedgerError, ValueError):
    """22004 (a required argument is NULL) or 22023 (an invalid value)."""

    sqlstate = "22023"


ERRORS: dict[str, type[LedgerError]] = {
    "LD001": LeaseSuperseded,
    "LD002": StaleToken,
    "LD003": RunNotRunning,
    "LD004": RunNotFound,
    "LD005": JobNotFound,
    "LD006": FenceOfAnotherJob,
    "LD007": FenceNotCommitted,
    "LD008": PoolNotFound,
    "22004": InvalidArgument,
    "22023": InvalidArgument,
}


def translate(error: psycopg.Error) -> LedgerError | None:
    """The ledger exception for a psycopg error, or None when it is not one of ours."""
    cls = ERRORS.get(error.sqlstate or "")
    if cls is None:
        return None
    diag = error.diag
    facts: dict[str, Any] = {}
    if diag.message_detail:
        try:
            parsed = json.loads(diag.message_detail)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            facts = parsed
    translated = cls(diag.message_primary or str(error), facts)
    translated.sqlstate = error.sqlstate or cls.sqlstate
    return translated


# A name that does not exist: a schema (3F000), a relation (42P01), a function (42883), a role (42704).
_UNDEFINED = frozenset({"3F000", "42P01", "42883", "42704"})
# How the ledger's own names appear in those messages: schema "ledger", relation "ledger.jobs",
# function ledger.start_run(...), role "ledger_reader".
_LEDGER_NAMES = ('"ledger"', "ledger.", '"ledger_owner"', '"ledger_client"', '"ledger_reader"')


def missing_ledger(error: BaseException) -> bool:
    """Whether ``error`` says that this database has no ledger, or an older one than this package's:
    a name of the ledger (its schema, a relation or function in it, one of its roles) does not exist.
    Installing, or upgrading, is the fix (``ledger.migrate.upgrade``, ``jobledger install``)."""
    if not isinstance(error, psycopg.Error) or error.sqlstate not in _UNDEFINED:
        return False
    message = error.diag.message_primary or str(error)
    return any(name in message for name in _LEDGER_NAMES)


class LeaseLost(LedgerError):
    """Client side: this run or lease context knows its lease is gone.

    Raised by ``run.fence(...)``/``run.check()`` once a heartbeat found the lease
    lost (or a fence or the end of the run did), so no further fenced write
    leaves this process. Its cause, when there is one, is the ledger error that
    told. ``reason`` says how it was learnt; ``facts`` hold job, token, run_id.
    """

    sqlstate = ""

    def __init__(self, message: str, facts: dict[str, Any] | None = None, reason: str = "") -> None:
        super().__init__(message, facts)
        self.reason = reason


class LedgerUnavailable(LedgerError, psycopg.OperationalError):
    """Client side: the ledger's database could not be reached, or stopped answering.

    Raised when a connection the ledger opens fails (``Ledger(dsn)`` and
    ``AsyncLedger(dsn)`` check one connection first, so a wrong DSN fails at
    once instead of in the pool 30 s later; a context's own connection; the
    ``jobledger`` commands), and when a call on a context's own connection got
    no answer within its bound and the connection was given up. The message
    names host and port, never the password; ``facts`` hold ``host``,
    ``port``, ``dbname``, ``user``. Also a ``psycopg.OperationalError``, so
    code that caught that for a database that is down keeps working. A
    heartbeat that meets it retries until the lease's local deadline.
    """

    sqlstate = ""


@contextmanager
def translated() -> Iterator[None]:
    """Run a ledger call; re-raise a ledger SQLSTATE as its exception class, ``from`` the psycopg error.

    Other errors (connection failures, SQL errors that are not ours) pass unchanged.
    Works around ``await`` too: the translation itself does no I/O.
    """
    try:
        yield
    except psycopg.Error as error:
        ledger_error = translate(error)
        if ledger_error is None:
            raise
        raise ledger_error from error
