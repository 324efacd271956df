"""`python -m ledger`: the `jobledger` command line."""

from ledger.cli import main

main(prog_name="jobledger")
