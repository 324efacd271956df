"""A token is never issued twice: not after a crash with synchronous_commit
off, not after an asynchronous standby is promoted."""

import pytest

from cluster import cluster_root  # noqa: F401  (fixture)

pytestmark = pytest.mark.cluster

ACQUIRE = "SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')"


def test_tokens_survive_a_crash_even_when_the_session_set_synchronous_commit_off(cluster_root):
    primary = cluster_root("crash").initdb()
    # The WAL writer sleeps long: an asynchronous commit is lost in a crash
    # unless it woke the writer by filling a WAL page.
    primary.configure(wal_writer_delay="10s")
    primary.start()
    primary.install_ledger()
    with primary.connect() as conn:
        conn.execute("CREATE TABLE control (n int)")
        conn.execute("SET synchronous_commit = off")
        tokens = [conn.execute(ACQUIRE).fetchone()[0] for _ in range(30)]
        # Control: one plain write under the same setting, after the last token.
        before = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'").fetchone()[0]
        conn.execute("INSERT INTO control VALUES (1)")
        after = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'").fetchone()[0]
        assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "off"
    primary.stop("immediate")  # a crash: no shutdown checkpoint
    primary.start()
    with primary.connect() as conn:
        if before // 8192 == after // 8192:
            # The control stayed on a WAL page nobody had to write: the crash
            # lost it, so this setup does lose asynchronous commits...
            assert conn.execute("SELECT count(*) FROM control").fetchone()[0] == 0
        # ...but not one token: the next one is above every token handed out.
        assert tokens == list(range(1, 31))
        assert conn.execute("SELECT token FROM ledger.leases WHERE job = 'nightly'").fetchone()[0] == 30
        assert conn.execute(ACQUIRE).fetchone()[0] == 31


# Every function that issues a token, as the hostile caller of issue 8 would
# call it: the token is acknowledged, then the setting lowered before COMMIT.
ISSUERS = {
    "acquire": "SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')",
    "start_run": "SELECT token FROM ledger.start_run('nightly', 'host-1', '1 hour')",
    "start_due_run": "SELECT token FROM ledger.start_due_run('due', 'host-1', '1 hour')",
}


@pytest.mark.parametrize("issuer", sorted(ISSUERS))
def test_a_token_survives_a_crash_when_the_caller_lowers_synchronous_commit_after_the_call(cluster_root, issuer):
    """BEGIN; <issue a token>; SET LOCAL synchronous_commit = off; COMMIT — in a loop, then a crash."""
    primary = cluster_root(f"lowered-{issuer}").initdb()
    primary.configure(wal_writer_delay="10s")
    primary.start()
    primary.install_ledger()
    job = "due" if issuer == "start_due_run" else "nightly"
    acknowledged = []
    with primary.connect() as conn:
        # A schedule whose slot is always due: a 10 ms interval, one slot a run.
        conn.execute("SELECT ledger.register_job('due', '10 milliseconds', ttl => '1 hour')")
        conn.autocommit = False
        for _ in range(30):
            token = conn.execute(ISSUERS[issuer]).fetchone()[0]
            conn.execute("SET LOCAL synchronous_commit = off")
            conn.commit()
            if token is not None:
                acknowledged.append(token)
            if issuer == "start_due_run":
                conn.execute("SELECT pg_sleep(0.011)")  # the next 10 ms slot is due
                conn.commit()
    # (A start by the same owner supersedes its previous run: every call issues a token.)
    primary.stop("immediate")  # a crash: no shutdown checkpoint
    primary.start()
    assert len(acknowledged) >= 25 and acknowledged == sorted(set(acknowledged))
    with primary.connect() as conn:
        # No acknowledged token is lost: the high-water mark is the last one handed out...
        assert conn.execute("SELECT token FROM ledger.leases WHERE job = %s", (job,)).fetchone()[0] == acknowledged[-1]
        # ...so the next one is above every token anybody was given.
        conn.execute("SELECT pg_sleep(0.011)")
        assert conn.execute(ISSUERS[issuer]).fetchone()[0] == acknowledged[-1] + 1


def test_tokens_jump_past_the_old_primary_after_an_async_standby_is_promoted(cluster_root):
    primary = cluster_root("primary").initdb()
    primary.start()
    primary.install_ledger()
    with primary.connect() as conn:
        replicated = [conn.execute(ACQUIRE).fetchone()[0] for _ in range(3)]
        conn.execute("SELECT ledger.fence('nightly', 'articles', %s)", (replicated[-1],))
    standby = cluster_root("standby")
    primary.basebackup_into(standby)
    standby.start()
    with standby.connect() as conn:
        for _ in range(100):  # caught up with the primary's three tokens?
            if conn.execute("SELECT token FROM ledger.leases WHERE job = 'nightly'").fetchone()[0] == 3:
                break
            import time
            time.sleep(0.1)
    # The standby falls behind (stopped), while the old primary keeps issuing.
    standby.stop()
    with primary.connect() as conn:
        lost = [conn.execute(ACQUIRE).fetchone()[0] for _ in range(5)]
        lost_new_job = conn.execute("SELECT token FROM ledger.acquire('brand-new', 'h', '1 hour')").fetchone()[0]
    assert lost == [4, 5, 6, 7, 8] and lost_new_job == 1
    primary.stop("immediate")

    standby.start()
    standby.promote()
    standby.wait_ready()
    with standby.connect() as conn:
        assert conn.execute("SELECT token FROM ledger.leases WHERE job = 'nightly'").fetchone()[0] == 3
        assert conn.execute("SELECT ledger._timeline()").fetchone()[0] == 2
        after = [conn.execute(ACQUIRE).fetchone()[0] for _ in range(3)]
        new_job = conn.execute("SELECT token FROM ledger.acquire('brand-new', 'h', '1 hour')").fetchone()[0]
    # Never reissued: above anything the old primary handed out, then by one again.
    assert after[0] > max(lost)
    assert after == [after[0], after[0] + 1, after[0] + 2]
    assert after[0] == 3 + 2 ** 32
    assert new_job > lost_new_job and new_job == 2 ** 32 + 1
