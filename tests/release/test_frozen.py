"""Released revisions never change: an installed database at 0.1.0 must be
able to trust that revision 0001 means what it meant on the day it shipped.

A schema change is a new revision (Makefile.migrations: make revision); when
this test fails, the change went into a released file instead.
"""

from __future__ import annotations

import hashlib

import pytest

from ledger import migrate, resources

# Each released revision's files, with their SHA-256 on the day of the release.
FROZEN = {
    "0001_initial.sql": "2b4dbd7e8560410053ac2859f95214bd6697a7aa1a731e782d505432f28b49e4",
    "0001_initial.py": "40c349aba49c4e10c3b7cd7815f5e1cb703ba99d6c80df8df25969a1e265f6f8",
}


@pytest.mark.parametrize("name", sorted(FROZEN))
def test_a_released_revision_file_is_byte_for_byte_what_shipped(name):
    path = resources.migrations_dir() / "versions" / name
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == FROZEN[name], (
        f"{name} belongs to a released version and changed: put the change in a new revision "
        "(make revision REV=... MESSAGE=...) and restore the file")


def test_every_release_names_a_revision_that_this_package_carries():
    revisions = {path.name.split("_", 1)[0] for path in (resources.migrations_dir() / "versions").glob("*.py")}
    assert migrate.RELEASES, "no release is recorded"
    for release, revision in migrate.RELEASES.items():
        assert revision in revisions, f"release {release} is at revision {revision}, which is missing"
    # A released revision is frozen, its .py and its .sql both.
    frozen = {name.split("_", 1)[0] for name in FROZEN}
    for release, revision in migrate.RELEASES.items():
        assert revision in frozen, f"release {release}'s revision {revision} has no hash in FROZEN"
