"""The state row has one writer (issue 22, point 4): of every function of the ledger, only
ledger._set_state writes ledger.counters, and only it and purge write what the state is read from
beside the log (ledger.purged_state); ledger._count, kept for calls in flight across revision 0005,
is called by no body. Read from the catalog, so a new writer added anywhere fails here."""

from __future__ import annotations

import re

from sqlhelp import rows

# A write of the table, outside string literals and comments.
_WRITE = r"(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+ledger\.{table}\b"


def _bodies(db) -> dict[str, str]:
    found = {}
    for row in rows(db, "SELECT p.oid::regprocedure::text AS signature, p.prosrc AS body FROM pg_proc p "
                        "WHERE p.pronamespace = 'ledger'::regnamespace"):
        body = re.sub(r"--[^\n]*", "", row["body"])
        found[row["signature"]] = re.sub(r"'(?:[^']|'')*'", "''", body)
    return found


def _writers(db, table: str) -> set[str]:
    pattern = re.compile(_WRITE.format(table=table), re.IGNORECASE)
    return {signature.split("(", 1)[0] for signature, body in _bodies(db).items() if pattern.search(body)}


def test_only_set_state_writes_a_jobs_state_row(db):
    # ledger._count: the 0004 writer, left for the calls in flight across the upgrade, called by nothing
    assert _writers(db, "counters") == {"ledger._set_state", "ledger._count"}


def test_the_count_of_0004_is_called_by_no_body(db):
    callers = {signature for signature, body in _bodies(db).items() if "ledger._count(" in body}
    assert callers == set()


def test_only_set_state_and_purge_write_what_purge_removed_of_a_state(db):
    # purge adds what it removed; the 'forgotten' transition (unregister with history) deletes it
    assert _writers(db, "purged_state") == {"ledger._set_state", "ledger._purge_batch"}
