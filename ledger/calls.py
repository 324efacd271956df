"""The parameters and results of the client's ledger calls; no I/O, shared by both clients.

``ledger/aio.py`` (the source) and ``ledger/client.py`` (generated from it)
build their calls and read their rows here, so that what a call sends and
what its row means is written once.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb

from ledger import queries
from ledger.errors import FenceNotCommitted, LeaseLost
from ledger.models import Run, RunStart

__all__ = ["ENDED_AS", "conninfo_of", "describe", "end_call", "jsonb", "run_start", "split_time_left"]


def jsonb(detail: Mapping[str, Any] | None) -> Jsonb | None:
    return None if detail is None else Jsonb(dict(detail))


def describe(exc: BaseException) -> str:
    """The text a failed or cancelled run records: ``Type: message``."""
    text = str(exc)
    name = type(exc).__qualname__
    return f"{name}: {text}" if text else name


def split_time_left(row: dict[str, Any]) -> tuple[dict[str, Any], timedelta | None]:
    values = dict(row)
    return values, values.pop("time_left")


def run_start(row: dict[str, Any]) -> tuple[RunStart, timedelta | None]:
    values, time_left = split_time_left(row)
    return RunStart(**values), time_left


ENDED_AS: dict[str, tuple[str, str | None]] = {
    queries.COMPLETE_RUN: ("success", None),
    queries.COMPLETE_FENCED_RUN: ("success", None),
    queries.FAIL_RUN: ("failure", "error"),
    queries.CANCEL_RUN: ("failure", "cancelled"),
}
"""(status, failure_reason) that each end statement leaves on the run's row."""


def end_call(run_id: int | None, token: int | None, exc: BaseException | None, error_text: str | None,
             lost: LeaseLost | None, detail: Mapping[str, Any],
             fenced: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
    """The statement that ends a run context, and its parameters.

    A normal exit completes the run, unless the lease is known lost (or its
    local deadline passed): then the run is failed with the LeaseLost's text,
    so a success is never recorded by a holder that could not vouch for its
    lease. An Exception fails it; any other BaseException cancels it. A
    completion names the resources the run ``fenced``, when it fenced any.
    """
    params: dict[str, Any] = {"run_id": run_id, "token": token}
    if exc is None and lost is None:
        params["detail"] = jsonb(detail or None)
        if fenced:
            params["fenced"] = list(fenced)
            return queries.COMPLETE_FENCED_RUN, params
        return queries.COMPLETE_RUN, params
    if exc is None or isinstance(exc, Exception):
        reason = exc if exc is not None else lost
        assert reason is not None
        params["error"] = error_text or describe(reason)
        params["detail"] = jsonb(detail or None)
        return queries.FAIL_RUN, params
    params["error"] = error_text or describe(exc)
    return queries.CANCEL_RUN, params


def ended_by_us(run: Run | None, query: str, token: int | None) -> bool:
    """Whether ``run``'s row is what our end statement ``query`` would have left (it took effect)."""
    if run is None or run.token != token:
        return False
    return (run.status, run.failure_reason) == ENDED_AS[query] or (
        query == queries.COMPLETE_FENCED_RUN and fence_not_committed(run) is not None)


def fence_not_committed(run: Run) -> list[str] | None:
    """The resources whose fence did not hold the run's token, when ``complete_run`` failed the run for them."""
    detail = run.detail or {}
    resources = detail.get("fence_not_committed") if run.status == "failure" else None
    return [str(r) for r in resources] if isinstance(resources, list) else None


def fence_failure(run: Run) -> FenceNotCommitted:
    """What the client raises once ``complete_run`` recorded ``run`` as failure for its fences."""
    resources = fence_not_committed(run) or []
    tokens = (run.detail or {}).get("fence_tokens", {})
    return FenceNotCommitted(
        f"fence not committed: run {run.run_id} of job {run.job} is recorded as failure, not success: "
        f"the fence of {', '.join(resources)} does not hold its token {run.token} (the fenced write did not commit)",
        {"run_id": run.run_id, "job": run.job, "token": run.token, "resources": resources,
         "fence_tokens": tokens}, run=run)


def conninfo_of(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    """The conninfo of ``conn`` for a second connection; ``info.dsn`` omits the password.

    It names the one host ``conn`` reached: psycopg tries the hosts of a
    multi-host conninfo one by one, and the connection keeps only the one that
    answered. A context's own connection derived from it would stay on that
    host after a failover, so a connection whose conninfo asks for a
    read-write (or primary) server draws a warning: pass the whole conninfo
    as ``heartbeat_conninfo``.
    """
    dsn = conn.info.dsn
    attrs = conninfo_to_dict(dsn).get("target_session_attrs")
    if attrs not in (None, "any"):
        warnings.warn(
            f"the connection asked for target_session_attrs={attrs} (a multi-host conninfo?) but names only "
            f"host {conn.info.host}: a run's or lease's own connection would stay on that host after a failover; "
            "pass the whole conninfo as heartbeat_conninfo", RuntimeWarning, stacklevel=3)
    password = conn.info.password
    return make_conninfo(dsn, password=password) if password else dsn
