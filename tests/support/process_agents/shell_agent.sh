#!/usr/bin/env bash
# A process agent in the shell: its task (a JSON string) says what to do.
set -euo pipefail
what=${AGL_TASK_INPUT//\"/}
case "$what" in
  exit\ *)
    echo "failing on purpose" >&2
    exit "${what#exit }" ;;
  sleep)
    sleep 600 &  # a child of its own: stopping the attempt must stop it too
    echo $! > "$CHILD_PID_FILE"
    wait ;;
  noise\ *)
    head -c "${what#noise }" /dev/zero | tr '\0' 'x'
    curl -sf -X POST -H "Authorization: Bearer $AGL_KEY" -d '{"type": "reward", "value": 1}' \
      "$AGL_EVENT_URL" > /dev/null ;;
  reward\ *)
    curl -sf -X POST -H "Authorization: Bearer $AGL_KEY" \
      -d "{\"type\": \"reward\", \"value\": ${what#reward }}" "$AGL_EVENT_URL" > /dev/null ;;
  *)
    echo "unknown task: $what" >&2
    exit 64 ;;
esac
