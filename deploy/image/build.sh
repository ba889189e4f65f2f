#!/bin/sh
# Build deploy/'s images with podman, without Docker or a container registry:
#   build.sh base              Debian bookworm from deb.debian.org (mmdebstrap), imported as
#                              $BASE_IMAGE: python3, venv, pip, ca-certificates
#   build.sh agl [EXTRAS]      deploy/Dockerfile on that base, then `check`: $AGL_IMAGE, by
#                              default localhost/agl-stream:slim for EXTRAS=s3 (the default),
#                              localhost/agl-stream:train-s3 for train,s3
#   build.sh check [IMAGE]     the image runs: --help and each role's --help
#   build.sh kafka|postgres    the stand-ins for compose.yaml's apache/kafka and postgres images
#                              (deploy/image/kafka, deploy/image/postgres), tagged as
#                              compose.standins.yaml names them
# Missing tools (podman, buildah, mmdebstrap, runc) come from Debian's packages. Where the host
# trusts an intercepting proxy's CA, its bundle and pip.conf are mounted into the build steps
# (never copied into an image). Each step prints how long it took.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
BASE_IMAGE=${BASE_IMAGE:-localhost/agl-stream-base:bookworm}
cache=${AGL_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agl-stream/image}

ensure_tools() {
  missing=
  for tool in podman buildah mmdebstrap runc; do
    command -v "$tool" >/dev/null || missing="$missing $tool"
  done
  if [ -n "$missing" ]; then
    echo "installing$missing from Debian's packages"
    apt-get update -qq && apt-get install -y -qq $missing >/dev/null
  fi
}

# Mounts for the build steps: the host's CA bundle and pip.conf, only when present.
trust_mounts() {
  for file in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf; do
    [ -f "$file" ] && printf ' -v %s:%s:ro' "$file" "$file"
  done
  return 0
}

timed() {
  start=$(date +%s)
  "$@"
  echo "== $* took $(( $(date +%s) - start )) s"
}

build_base() {
  if podman image exists "$BASE_IMAGE"; then
    echo "$BASE_IMAGE is there (podman rmi it to rebuild)"; return
  fi
  mkdir -p "$cache"
  tarball="$cache/base-bookworm.tar"
  if [ ! -s "$tarball" ]; then
    timed mmdebstrap --quiet --variant=minbase --format=tar \
      --include=python3,python3-venv,python3-pip,ca-certificates,passwd \
      bookworm "$tarball.part" http://deb.debian.org/debian
    mv "$tarball.part" "$tarball"
  fi
  timed podman import --quiet "$tarball" "$BASE_IMAGE" >/dev/null
}

# podman build with host networking (no bridge needed) and the CA mounts.
pbuild() {
  # shellcheck disable=SC2046  # the mounts are separate words on purpose
  podman build --network=host --build-arg "BASE_IMAGE=$BASE_IMAGE" $(trust_mounts) "$@" "$root"
}

case "${1:-}" in
  base) ensure_tools; build_base ;;
  agl)
    ensure_tools; build_base
    extras=${2:-s3}
    image=${AGL_IMAGE:-localhost/agl-stream:$( [ "$extras" = s3 ] && echo slim || echo "$extras" | tr ',' '-')}
    timed pbuild -f deploy/Dockerfile --build-arg "PYTHON_IMAGE=$BASE_IMAGE" \
      --build-arg "EXTRAS=$extras" --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL-}" -t "$image"
    podman image ls "$image"
    sh "$0" check "$image" ;;
  kafka)
    ensure_tools; build_base
    timed pbuild -f deploy/image/kafka/Containerfile -t localhost/agl-kafka:4.1.1
    podman image ls localhost/agl-kafka:4.1.1 ;;
  postgres)
    ensure_tools; build_base
    timed pbuild -f deploy/image/postgres/Containerfile -t localhost/agl-postgres:15
    podman image ls localhost/agl-postgres:15 ;;
  check)
    # The image runs: its entry point's --help and every role's, as install.sh checks them.
    image=${2:-localhost/agl-stream:slim}
    podman run --rm --network=host "$image" --help >/dev/null
    for command in "worker runner" "worker projector" "worker trainer" serve gateway dashboard \
        topics db status enqueue; do
      # shellcheck disable=SC2086  # "worker runner" is two words on purpose
      podman run --rm --network=host "$image" $command --help >/dev/null \
        || { echo "$image: agl-stream $command --help failed" >&2; exit 1; }
    done
    echo "$image: agl-stream --help and every role's --help run" ;;
  *) echo "usage: $0 base | agl [EXTRAS] | kafka | postgres | check [IMAGE]" >&2; exit 2 ;;
esac
