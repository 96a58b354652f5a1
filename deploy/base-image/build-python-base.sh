#!/usr/bin/env bash
# Build a Python 3.11 base image from Debian packages and import it into the local docker engine, for hosts
# that reach Debian's package mirror but no container registry (so `python:3.11-slim` cannot be pulled).
#
#   deploy/base-image/build-python-base.sh [TAG]          # default TAG: rlgate-python-base:3.11
#   docker build -f deploy/Dockerfile --build-arg PYTHON_IMAGE=rlgate-python-base:3.11 -t rlgate:local .
#
# The root filesystem is Debian bookworm (minbase) with python3 (3.11), python3-venv, python-is-python3 and
# ca-certificates, made by debootstrap from the mirror this host's apt already uses (read from
# /etc/apt/sources.list and /etc/apt/sources.list.d/; DEBIAN_MIRROR overrides it). Needs root, debootstrap
# and a running docker engine. Nothing is built when TAG already exists, unless REBUILD=1.
#
# Settings (environment): DEBIAN_MIRROR, DEBIAN_SUITE (bookworm), REBUILD (0), KEEP_ROOTFS_DIR (unset: a
# temporary directory, removed afterwards).
set -euo pipefail

TAG="${1:-rlgate-python-base:3.11}"
SUITE="${DEBIAN_SUITE:-bookworm}"
PACKAGES="python3,python3-venv,python-is-python3,ca-certificates"

log() { printf 'build-python-base: %s\n' "$*" >&2; }

if [ "${REBUILD:-0}" != "1" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  log "$TAG exists (REBUILD=1 to build it again)"
  exit 0
fi

# The first mirror that apt on this host uses for "$SUITE" itself (not -updates or -security), from
# one-line `deb URI SUITE COMPONENTS` entries and deb822 `.sources` stanzas alike.
detect_mirror() {
  local file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$file" ] || continue
    awk -v suite="$SUITE" '
      $1 == "deb" {
        i = 2
        if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }   # skip [ options ]
        if ($(i + 1) == suite) { print $i; exit }
      }' "$file"
  done
  for file in /etc/apt/sources.list.d/*.sources; do
    [ -f "$file" ] || continue
    awk -v suite="$SUITE" '
      function flush() {
        if (enabled && types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && uris != "") {
          split(uris, u, " "); print u[1]; found = 1
        }
        types = ""; uris = ""; suites = ""; enabled = 1
      }
      BEGIN { enabled = 1 }
      /^[ \t]*$/ { flush(); if (found) exit; next }
      /^[ \t]*#/ { next }
      tolower($1) == "types:"   { $1 = ""; types = $0 }
      tolower($1) == "uris:"    { $1 = ""; sub(/^ +/, ""); uris = $0 }
      tolower($1) == "suites:"  { $1 = ""; sub(/^ +/, ""); suites = $0 }
      tolower($1) == "enabled:" { enabled = (tolower($2) != "no") }
      END { if (!found) flush() }' "$file"
  done
}

MIRROR="${DEBIAN_MIRROR:-$(detect_mirror | head -n 1)}"
if [ -z "$MIRROR" ]; then
  log "no apt source for '$SUITE' in /etc/apt/sources.list*; set DEBIAN_MIRROR"
  exit 1
fi
command -v debootstrap >/dev/null || { log "debootstrap is not installed (apt-get install debootstrap)"; exit 1; }

if [ -n "${KEEP_ROOTFS_DIR:-}" ]; then
  WORK="$KEEP_ROOTFS_DIR"; mkdir -p "$WORK"
else
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/rlgate-python-base.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
fi
ROOT="$WORK/root"

log "debootstrap $SUITE from $MIRROR into $ROOT"
started=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
  tail -n 30 "$WORK/debootstrap.log" >&2; exit 1; }

# Trim what an image does not need: package caches and lists, docs, man pages, logs.
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/usr/share/doc/* \
       "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* "$ROOT"/var/log/* "$ROOT"/tmp/* "$ROOT"/dev/*
chroot "$ROOT" python -c 'import sys, venv, ssl; assert sys.version_info[:2] == (3, 11), sys.version'

log "importing as $TAG"
tar -C "$ROOT" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --message "debootstrap $SUITE ($PACKAGES) from $MIRROR" \
  - "$TAG" >/dev/null
docker run --rm "$TAG" python -c 'import sys, venv; print("python", sys.version.split()[0])' >&2
log "done in $(( $(date +%s) - started ))s"
