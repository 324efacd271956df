"""jobledger register --max-concurrent N: the option reaches ledger.register_job and is shown."""

import json

from clihelp import jobledger


def test_register_max_concurrent_is_set_shown_and_kept(dsn):
    done = jobledger("register", "pair", "--ttl", "5m", "--max-concurrent", "2", dsn=dsn)
    assert done.returncode == 0, done.stderr
    assert "max concurrent 2" in done.stdout
    done = jobledger("register", "pair", "--ttl", "6m", "--json", dsn=dsn)
    assert json.loads(done.stdout)["max_concurrent"] == 2
    done = jobledger("register", "pair", "--max-concurrent", "0", dsn=dsn)
    assert done.returncode != 0
    done = jobledger("register", "pair", "--max-concurrent", "1001", dsn=dsn)
    assert done.returncode != 0 and "max_concurrent" in done.stderr
    assert "--max-concurrent" in jobledger("register", "--help").stdout
