#!/bin/sh
# compose.yaml run under podman-compose (from PyPI) with the images built here
# (compose.standins.yaml): Kafka, PostgreSQL, the setup job, a projector, two runners, a
# trainer, serve and the dashboard. 64 train-mode tasks of the demo (8 groups of 8 attempts,
# one trainer step with the trainer's defaults) go through the runners, the projector puts
# them in the read model and the trainer publishes a new policy version from them; then
# everything is taken down with its volumes. Prints how long each part took.
#   AGL_COMPOSE_KEEP=1  leave the stack up at the end
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
    "$cache/podman-compose/bin/pip" install --quiet --disable-pip-version-check podman-compose==1.6.0
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
down
# AGL_COMPOSE_KEEP=1 leaves the stack up at the end (`podman-compose ... down -v` ends it).
[ "${AGL_COMPOSE_KEEP:-}" = 1 ] || trap down EXIT

start=$(date +%s)
# In stages, each waited for here, rather than one `up`: podman before 4.6 (Debian 12 has
# 4.3) runs no healthchecks without systemd, so podman-compose skips compose.yaml's
# service_healthy conditions, and its --requires on the setup job fails to start the roles
# ("depends on container ... not found in input list"). The healthchecks are compose.yaml's
# own, run with `podman healthcheck run`.
compose up -d --no-build kafka postgres
for service in kafka postgres; do
  until podman healthcheck run "${project}_${service}_1" >/dev/null 2>&1; do
    [ $(( $(date +%s) - start )) -lt 300 ] || { compose logs "$service" | tail -40; exit 1; }
    sleep 2
  done
done
echo "== kafka and postgres healthy after $(( $(date +%s) - start )) s"
compose up -d --no-build --no-deps setup
setup_exit=$(podman wait "${project}_setup_1")
[ "$setup_exit" = 0 ] || { compose logs setup | tail -40; exit 1; }
echo "== setup (topics apply, db upgrade) done after $(( $(date +%s) - start )) s"
compose up -d --no-build --no-deps projector runner trainer serve dashboard
until agl query workers --json 2>/dev/null | grep -q '"role": "projector"'; do
  [ $(( $(date +%s) - start )) -lt 600 ] || { compose logs projector | tail -80; exit 1; }
  sleep 3
done
# The demo's agent needs the policy: a task a runner takes before the trainer's first version
# (version 0, published when it starts) has reached it fails with "no resource for parameter
# 'policy'" (the runner does not wait for one); compose's `run --rm enqueue` right after `up`
# loses tasks that way too.
until agl query resources --json 2>/dev/null | grep -q '"version": 0'; do
  [ $(( $(date +%s) - start )) -lt 600 ] || { compose logs trainer | tail -80; exit 1; }
  sleep 3
done
sleep 5  # the runners read the resources topic as it grows: a moment for version 0 to arrive
up=$(date +%s)
echo "== stack and roles up (a projector's heartbeat, the trainer's version 0) after $(( up - start )) s"

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
echo "== $(echo "$ids" | wc -w) rollouts run by the runners and projected after $(( done_at - up )) s"
agl query rollouts --json --limit 100 | python3 -c "
import collections, json, sys
rows = json.load(sys.stdin)['items']
print(dict(collections.Counter(r['status'] for r in rows)))
for r in rows:
    if r['status'] != 'succeeded':
        print(r['rollout_id'], r['status'], r['error']); sys.exit(1)"

# The trainer's step: a policy version after the one it starts with (version 0).
stepped() {
  agl query resources --json 2>/dev/null | python3 -c "
import json, sys; sys.exit(not any(r['version'] >= 1 for r in json.load(sys.stdin)))"
}
until stepped; do
  [ $(( $(date +%s) - done_at )) -lt 600 ] || { compose logs trainer | tail -80; exit 1; }
  sleep 5
done
echo "== the trainer published a policy version $(( $(date +%s) - done_at )) s later; $(( $(date +%s) - start )) s in all"
agl query resources --json | python3 -c "import json, sys; print(*(r['resources_id'] for r in json.load(sys.stdin)))"
# serve follows the trainer's versions; the dashboard answers.
python3 - <<'PY'
import json, time, urllib.request
deadline = time.monotonic() + 120
while json.load(urllib.request.urlopen("http://127.0.0.1:8000/health"))["resources_id"] in (None, "demo-v0"):
    assert time.monotonic() < deadline, "serve did not load the trainer's new version"
    time.sleep(2)
assert urllib.request.urlopen("http://127.0.0.1:8765/").status == 200
print("== serve loaded the new version; the dashboard answers")
PY
