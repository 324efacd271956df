"""The jobs page over more jobs than a page holds: the counts per state are over every job the name
filter keeps, and a page holds its 100 jobs by name (the state filter too), read in SQL, the last
page the rest; a page past the end shows the last."""

from __future__ import annotations

import json
import urllib.request

from ledger.web.app import create_app
from ledger.web.pages import PAGE_SIZE
from ledger.web.server import BackgroundServer


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def test_the_jobs_page_counts_every_job_and_shows_one_page_of_them(db, dsn):
    # 250 jobs, by name job-000 .. job-249: every third failing (one failure), the rest never run
    db.execute("SELECT ledger.register_job('job-' || lpad(i::text, 3, '0'), ttl => '1 minute')"
               " FROM generate_series(0, 249) AS i")
    for i in range(0, 250, 3):
        run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run(%s, 'w')",
                                   (f"job-{i:03}",)).fetchone()
        db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (run_id, token))
    counts = dict(db.execute("SELECT state, count(*) FROM ledger.job_status GROUP BY state").fetchall())
    assert counts == {"failing": 84, "never_run": 166}
    names = [f"job-{i:03}" for i in range(250)]
    failing = [f"job-{i:03}" for i in range(0, 250, 3)]

    with BackgroundServer(create_app(dsn)) as server:
        pages = [_get(f"{server.url}/api/jobs?page={n}") for n in (1, 2, 3)]
        assert [p["pages"] for p in pages] == [3, 3, 3] and [p["total"] for p in pages] == [250] * 3
        assert all(p["counts"]["failing"] == 84 and p["counts"]["never_run"] == 166 for p in pages)
        assert [row["job"] for p in pages for row in p["jobs"]] == names
        assert [len(p["jobs"]) for p in pages] == [PAGE_SIZE, PAGE_SIZE, 50]
        # past the end: the last page
        assert _get(f"{server.url}/api/jobs?page=9")["page"] == 3

        by_state = [_get(f"{server.url}/api/jobs?state=failing&page={n}") for n in (1, 2)]
        assert [p["total"] for p in by_state] == [84, 84] and by_state[0]["pages"] == 1
        assert [row["job"] for row in by_state[0]["jobs"]] == failing
        assert {row["state"] for row in by_state[0]["jobs"]} == {"failing"}
        # the counts are over the name filter only; the page over both
        named = _get(f"{server.url}/api/jobs?q=JOB-1&state=never_run")
        hundreds = names[100:200]
        quiet = [n for n in hundreds if n not in failing]
        assert named["counts"]["failing"] == len(hundreds) - len(quiet) == 33
        assert named["counts"]["never_run"] == named["total"] == len(quiet) == 67
        assert [row["job"] for row in named["jobs"]] == quiet
        # the HTML page draws the page's jobs, not the others
        with urllib.request.urlopen(f"{server.url}/?page=3", timeout=30) as response:
            html = response.read().decode()
        assert "job-249" in html and "job-200" in html and "job-199" not in html
