"""The scrape's per-job lines written by PostgreSQL (ledger.metrics.read_text, what `jobledger
metrics` and /metrics answer) say what the Python writer says for the same rows
(text(samples(read_snapshot(...))), prometheus_client's families): the eight situations of issue 22,
a job whose name the text format escapes, values that are no plain number."""

from __future__ import annotations

import math

import psycopg
from prometheus_client.parser import text_string_to_metric_families

from ledger.metrics import JOB_FAMILIES, _escape, _sql_label, _sql_number, read_snapshot, read_text, samples, text
from situations import build_situations

#: Quote, backslash and characters beyond ASCII: what a label value escapes or carries (a job's name
#: has no control character: register_job refuses one; the line feed is tested on the expression).
ESCAPED = 'nightly "etl" \\ C:\\tmp – ünïcode ✓'

#: A live run's running time moves between the two reads: its series are compared, its values bounded.
MOVING = "jobledger_run_running_seconds"


def _parsed(body: str) -> dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]]:
    return {family.name: (family.type, family.documentation,
                          {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples})
            for family in text_string_to_metric_families(body)}


def test_the_sql_written_lines_parse_as_the_python_written_ones_for_every_situation(db, dsn, ledger_clock):
    states = build_situations(db, ledger_clock)
    db.execute("SELECT ledger.register_job(%s, ttl => '90 seconds')", (ESCAPED,))
    for end in ("complete_run(run_id => %s, token => %s)", "fail_run(run_id => %s, token => %s, error => 'boom')",
                "complete_run(run_id => %s, token => %s)"):
        run = db.execute("SELECT run_id, token FROM ledger.start_run(%s, 'w')", (ESCAPED,)).fetchone()
        db.execute(f"SELECT ledger.{end}", run)
    with psycopg.connect(dsn, autocommit=True) as conn:
        theirs_text = text(samples(read_snapshot(conn, audit=True))).decode()
        # a session that rounds floats (extra_float_digits 0) gets the exact values all the same
        conn.execute("SET extra_float_digits = 0")
        ours_text = read_text(conn, audit=True).decode()
    ours, theirs = _parsed(ours_text), _parsed(theirs_text)
    # line for line the same text, in the same order (but the running time, which moved)
    assert [line for line in ours_text.splitlines() if not line.startswith(MOVING)] == [
        line for line in theirs_text.splitlines() if not line.startswith(MOVING)]

    assert ours.keys() == theirs.keys()
    moving_ours, moving_theirs = ours.pop(MOVING), theirs.pop(MOVING)
    assert ours == theirs
    assert moving_ours[:2] == moving_theirs[:2] and moving_ours[2].keys() == moving_theirs[2].keys()
    assert all(0 <= moving_ours[2][key] - value < 60 for key, value in moving_theirs[2].items())
    assert moving_ours[2], "the running job has a running time"

    # every job, the escaped one included, has its one state; the ratios are not rounded
    job_state = ours["jobledger_job_state"][2]
    assert {dict(labels)["job"]: dict(labels)["state"] for _, labels in job_state} == {**states, ESCAPED: "ok"}
    ratio = ours["jobledger_run_failure_ratio"][2][("jobledger_run_failure_ratio", (("job", ESCAPED),))]
    assert ratio == 1 / 3
    # the HELP and TYPE lines are the family table's, in its order, before the alerts and risks
    headers = [line for line in ours_text.splitlines() if line.startswith("# TYPE")]
    assert headers[:len(JOB_FAMILIES)] == [
        f"# TYPE {name}_total counter" if kind == "counter" else f"# TYPE {name} {kind}"
        for name, kind, *_ in JOB_FAMILIES]


def test_infinities_and_nan_are_written_as_prometheus_reads_them(db):
    expression = _sql_number("ttl_seconds")
    numbers = [0.1, 1e-7, 123456789.125, 600.0, -3.0, 0.0, 1 / 3, 2.5e-5, 1e15, 12345678901234.0]
    rows = db.execute(f"SELECT {expression} FROM unnest(%s::float8[]) WITH ORDINALITY AS q(ttl_seconds, n)"
                      f" ORDER BY q.n", ([math.inf, -math.inf, math.nan, *numbers],)).fetchall()
    written = [row[0] for row in rows]
    assert written[:3] == ["+Inf", "-Inf", "NaN"]
    # spelled as the Python writer spells them (1e15: "1e+15", Python's "1000000000000000.0")
    assert [w for w, n in zip(written[3:], numbers) if w != repr(n)] == ["1e+15"]
    body = "".join(f'x{{n="{i}"}} {value}\n' for i, value in enumerate(written))
    values = [s.value for family in text_string_to_metric_families(body) for s in family.samples]
    assert values[0] == math.inf and values[1] == -math.inf and math.isnan(values[2])
    assert values[3:] == numbers


def test_a_label_value_is_escaped_as_the_python_writer_escapes_it(db):
    values = ['plain', 'a "quoted" name', 'back\\slash\\', 'line\nfeed', '\\"\n\\n', 'ünïcode ✓ 名前', '']
    written = [row[0] for row in db.execute(
        f"SELECT {_sql_label('job')} FROM unnest(%s::text[]) WITH ORDINALITY AS m(job, n) ORDER BY m.n",
        (values,)).fetchall()]
    assert written == [_escape(value) for value in values]
    body = "".join(f'x{{job="{value}"}} 1\n' for value in written)
    assert [s.labels["job"] for f in text_string_to_metric_families(body) for s in f.samples] == values
