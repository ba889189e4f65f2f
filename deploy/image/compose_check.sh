#!/bin/sh
# compose.yaml run under podman-compose (from PyPI) with the images built here
# (compose.standins.yaml): Kafka, PostgreSQL, the setup job, a projector, two runners, a
# trainer, serve and the dashboard. 64 train-mode tasks of the demo (8 groups of 8 attempts,
# one trainer step with the trainer's defaults) go through the runners, the projector puts
# them in the read model and the trainer publishes a new policy version from them; then
# everything is taken down with its volumes. Prints how long each part took.
#   AGL_IMAGE   the roles' image (default localhost/agl-stream:train-s3, built when missing:
#               the demo's runners and the trainer need torch)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
cache=${AGL_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agl-stream/image}
export AGL_IMAGE=${AGL_IMAGE:-localhost/agl-stream:train-s3}
project=agl-compose-check

compose_bin=$(command -v podman-compose || true)
if [ -z "$compose_bin" ]; then
  if [ ! -x "$cache/podman-compose/bin/podman-compose" ]; then
    python3 -m venv "$cache/podman-compose"
    "$cache/podman-compose/bin/pip" install --quiet --disable-pip-version-check podman-compose==1.5.0
  fi
  compose_bin=$cache/podman-compose/bin/podman-compose
fi

podman image exists "$AGL_IMAGE" || sh "$here/build.sh" agl train,s3
podman image exists localhost/agl-kafka:4.1.1 || sh "$here/build.sh" kafka
podman image exists localhost/agl-postgres:15 || sh "$here/build.sh" postgres

compose() {
  "$compose_bin" -p "$project" -f "$root/deploy/compose.yaml" \
    -f "$root/deploy/compose.standins.yaml" --profile roles "$@"
}
# The CLI from the image, on the host's network (compose publishes Kafka on 127.0.0.1:9092
# and PostgreSQL on 127.0.0.1:5432).
agl() {
  podman run --rm -i --network=host -e AGL_STREAM_BOOTSTRAP_SERVERS=127.0.0.1:9092 \
    -e AGL_STREAM_DATABASE_URL=postgresql://agl:agl@127.0.0.1:5432/agl_stream "$AGL_IMAGE" "$@"
}
down() { compose down -v >/dev/null 2>&1 || true; }
trap down EXIT
down

start=$(date +%s)
compose up -d --no-build
echo "== compose up returned after $(( $(date +%s) - start )) s"
# The setup job has run when the projector starts (it waits for it).
until agl query workers 2>/dev/null | grep -q projector; do
  [ $(( $(date +%s) - start )) -lt 600 ] || { compose logs setup projector kafka postgres | tail -80; exit 1; }
  sleep 3
done
up=$(date +%s)
echo "== stack and roles up (a projector's heartbeat in the read model) after $(( up - start )) s"

# 8 groups of 8 attempts (a group is the attempts of one task input, hence "group" in it).
python3 -c "
import json
for g in range(8):
    for _ in range(8):
        print(json.dumps({'letter': 'abcde'[g % 5], 'group': g}))
" | agl enqueue --mode train --key compose-check >/dev/null
ids=$(agl query rollouts --json --limit 100 | python3 -c "import json, sys; print(' '.join(r['rollout_id'] for r in json.load(sys.stdin)['items']))")
agl query wait --timeout 600 $ids >/dev/null || { compose logs runner projector | tail -80; exit 1; }
done_at=$(date +%s)
echo "== 64 rollouts run by the runners and projected after $(( done_at - up )) s"
agl query rollouts --status succeeded --json --limit 100 | python3 -c "
import json, sys; n = len(json.load(sys.stdin)['items']); print(f'{n} succeeded'); sys.exit(n != 64)"

# The trainer's step: a new resources version it published.
until agl query resources --json 2>/dev/null | grep -q '"trainer'; do
  [ $(( $(date +%s) - done_at )) -lt 600 ] || { compose logs trainer | tail -80; exit 1; }
  sleep 5
done
echo "== the trainer published a policy version $(( $(date +%s) - done_at )) s later; $(( $(date +%s) - start )) s in all"
agl query resources | head -8
