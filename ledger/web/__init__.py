"""``jobledger web``: a read-only dashboard of the ledger, in a browser.

Starlette, Jinja2 and uvicorn (the ``web`` extra: ``pip install 'pg-job-ledger[web]'``).
Every page reads in one read-only transaction as ``ledger_reader``
(:func:`ledger.readonly.read_only_transaction`, as ``jobledger metrics`` does);
no endpoint writes. One module a job:

- :mod:`ledger.web.app`: the application factory (:func:`~ledger.web.app.create_app`);
- :mod:`ledger.web.routes`: the endpoints, HTML and JSON;
- :mod:`ledger.web.reads`: the reads, one function per statement of ``ledger.queries``;
- :mod:`ledger.web.pages`: what each page shows, from the reads (plain data, also its JSON);
- :mod:`ledger.web.schedules`: a schedule in plain words;
- :mod:`ledger.web.charts`: the SVG charts and the badge, drawn on the server;
- :mod:`ledger.web.commands`: the exact ``jobledger`` command of each operator action;
- :mod:`ledger.web.access`: loopback by default, a token or basic-auth credentials elsewhere;
- :mod:`ledger.web.display`: times and durations as the pages write them;
- :mod:`ledger.web.jsonable`: the JSON endpoints' values;
- :mod:`ledger.web.server`: uvicorn, in the foreground or in a background thread.
"""
