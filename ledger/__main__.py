"""`python -m ledger`: the `jobledger` command line."""

from ledger.cli import main

if __name__ == "__main__":  # importing the module (tests/client/test_imports.py) runs nothing
    main(prog_name="jobledger")
