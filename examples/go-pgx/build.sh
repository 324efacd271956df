#!/bin/sh
# Build offline from Debian's Go packages (golang, golang-github-jackc-pgx-v4-dev):
# GOPATH mode (GO111MODULE=off) with GOPATH=/usr/share/gocode, where Debian
# installs the library and its dependencies as source. No go.mod, no module
# download (GOPROXY=off). Debian 12's Go is 1.19.
#
#   sh build.sh [OUTDIR]    # the binary is OUTDIR/ledger-pgx (default: build/, gitignored)
set -eu
cd "$(dirname "$0")"
out=${1:-build}
mkdir -p "$out"
export GO111MODULE=off GOPATH=/usr/share/gocode GOPROXY=off GOFLAGS=
# Go's build cache: its default (~/.cache/go-build), or OUTDIR without a home.
if [ -z "${GOCACHE:-}" ] && [ -z "${HOME:-}" ] && [ -z "${XDG_CACHE_HOME:-}" ]; then
    export GOCACHE="$(cd "$out" && pwd)/gocache"
fi
exec go build -o "$out/ledger-pgx" .
