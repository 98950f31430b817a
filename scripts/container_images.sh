#!/usr/bin/env bash
# The Docker engine and the images of the container tier (`make test-containers`), and of a CPU
# machine that runs the deploy files: `make image-cpu`, `make image-prometheus`.
#
#   scripts/container_images.sh engine       a Docker engine that answers (installs and starts one where root)
#   scripts/container_images.sh base         the Debian base image: pulled, or made with debootstrap
#   scripts/container_images.sh rolefleet    the CPU image of every role (deploy/Dockerfile), from a wheelhouse
#   scripts/container_images.sh prometheus   Prometheus from Debian's package (deploy/prometheus.Dockerfile)
#
# No registry needs to answer: where the base cannot be pulled, debootstrap builds it from Debian's
# package mirror, and the Python packages come from a wheelhouse that pip fills on the host.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# The base of both images: Debian's own where it can be pulled, else one made here (LOCAL_BASE).
BASE_IMAGE=${BASE_IMAGE:-debian:bookworm}
LOCAL_BASE=rolefleet-base:bookworm
ROLEFLEET_IMAGE=${ROLEFLEET_IMAGE:-rolefleet:$VERSION-cpu}
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-rolefleet-prometheus:debian}
PYTHON=${PYTHON:-.venv/bin/python}
WHEELHOUSE=deploy/wheelhouse
# What deploy/Dockerfile's system stage needs, so that it installs nothing (a debootstrap base
# has no package index); passwd gives useradd.
BASE_PACKAGES=python3,python3-venv,python3-dev,gcc,g++,libc6-dev,ca-certificates,passwd
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

# Temporary directories, removed when the script exits (whichever way).
TEMPORARY=()
trap 'for dir in "${TEMPORARY[@]}"; do as_root rm -rf "$dir"; done' EXIT
temporary() { local dir; dir=$(mktemp -d); TEMPORARY+=("$dir"); printf -v "$1" %s "$dir"; }  # temporary VAR

say() { echo "container_images: $*" >&2; }
die() { say "$*"; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

engine() {
  docker info >/dev/null 2>&1 && return
  command -v dockerd >/dev/null || {
    say "no Docker engine answers: installing Debian's docker.io"
    as_root apt-get install -y -q --no-install-recommends docker.io >/dev/null \
      || { as_root apt-get update -q >/dev/null && as_root apt-get install -y -q --no-install-recommends docker.io >/dev/null; } \
      || die "cannot install docker.io (needs root or sudo, and Debian's packages): install a Docker engine and start it"
  }
  say "starting dockerd (log: /tmp/rolefleet-dockerd.log)"
  as_root sh -c 'nohup dockerd >/tmp/rolefleet-dockerd.log 2>&1 &' \
    || die "cannot start dockerd (needs root or sudo): start the Docker engine, then run this again"
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
  die "dockerd did not answer within 60 s: see /tmp/rolefleet-dockerd.log"
}

base() {
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return
  if timeout 60 docker pull -q "$BASE_IMAGE" >/dev/null 2>&1; then return; fi
  say "$BASE_IMAGE cannot be pulled: using $LOCAL_BASE, made with debootstrap from $MIRROR"
  BASE_IMAGE=$LOCAL_BASE
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return
  command -v debootstrap >/dev/null || as_root apt-get install -y -q --no-install-recommends debootstrap >/dev/null \
    || die "debootstrap is not installed and cannot be (needs root or sudo)"
  local root
  temporary root
  as_root debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$root" "$MIRROR" >/dev/null \
    || die "debootstrap failed (is $MIRROR reachable?)"
  # The package cache and lists are of no use in an image.
  as_root rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  as_root tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
}

wheelhouse() {
  # The versions the project's venv was tested with, and torch's CPU build: pip takes them from the
  # host's index (or its local files) into the build context.
  [ -x "$PYTHON" ] || die "$PYTHON is missing: run make first (the wheelhouse pins the venv's versions)"
  local pins
  temporary pins
  pins=$pins/pins.txt
  "$PYTHON" -m pip freeze --exclude-editable | grep -v '^rolefleet' >"$pins"
  "$PYTHON" -m pip download -q --dest "$WHEELHOUSE" -c "$pins" torch . "setuptools>=68" pip \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) \
    || die "pip download failed: the wheelhouse needs PyPI (or its files) on the host"
}

rolefleet() {
  wheelhouse
  base
  say "building $ROLEFLEET_IMAGE"
  DOCKER_BUILDKIT=0 docker build -q -f deploy/Dockerfile -t "$ROLEFLEET_IMAGE" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH=cpu --build-arg EXTRAS= --build-arg PIP_NO_INDEX=1 . >/dev/null
}

prometheus() {
  docker image inspect "$PROMETHEUS_IMAGE" >/dev/null 2>&1 && return
  base
  local context
  temporary context
  ( cd "$context" && apt-get download prometheus >/dev/null 2>&1 ) \
    || { as_root apt-get update -q >/dev/null && ( cd "$context" && apt-get download prometheus >/dev/null ); } \
    || die "cannot download Debian's prometheus package"
  cp deploy/prometheus.Dockerfile "$context/Dockerfile"
  say "building $PROMETHEUS_IMAGE"
  DOCKER_BUILDKIT=0 docker build -q -t "$PROMETHEUS_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" "$context" >/dev/null
}

[ $# -gt 0 ] || die "usage: $0 engine|base|rolefleet|prometheus ..."
for target in "$@"; do
  case "$target" in
    engine|base|rolefleet|prometheus) "$target" ;;
    *) die "unknown target $target (engine, base, rolefleet, prometheus)" ;;
  esac
done
