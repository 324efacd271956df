"""The scheduler (issue 23): the jobs file, its sync, the one loop, and ``ledger.serve`` for functions.

- :mod:`ledger.scheduler.jobsfile`: the TOML jobs file, checked offline;
- :mod:`ledger.scheduler.crontab`: a crontab converted into a jobs file;
- :mod:`ledger.scheduler.sync`: the file into the ledger (``ledger.sync_jobs``), and its watch;
- :mod:`ledger.scheduler.loop`: the loop (``next_start``, ``start_due_runs``, the scheduler's heartbeat
  and the upkeep it leads), with a runner per kind of job;
- :mod:`ledger.scheduler.serve`: ``ledger.serve``/``ledger.serve_async`` and ``@ledger.job``.

A library package: the command runner (``jobledger run``'s semantics) is the wrapper's
(``ledger.wrapper.CommandRunner``), the command line ``ledger.cli.scheduler``.
"""
