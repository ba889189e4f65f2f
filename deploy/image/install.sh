#!/bin/sh
# The image's install steps: deploy/Dockerfile's build stage runs this script, and
# `make image-check` runs the same script into a scratch virtual environment (no Docker
# engine is needed for that), so the two cannot drift apart.
#   install.sh VENV        with EXTRAS (default train,s3) and TORCH_INDEX_URL (optional)
set -eu
venv=${1:?usage: install.sh VENV}
extras=${EXTRAS-train,s3}
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip
case ",$extras," in
  *,train,*|*,gpu,*)
    # torch first, from the index given (CPU or a CUDA build), so that the extras do not
    # choose one for it.
    if [ -n "${TORCH_INDEX_URL-}" ]; then
      "$venv/bin/pip" install --quiet --disable-pip-version-check torch --index-url "$TORCH_INDEX_URL"
    fi ;;
esac
if [ -n "$extras" ]; then target=".[$extras]"; else target="."; fi
"$venv/bin/pip" install --quiet --disable-pip-version-check "$target"
# The entry point runs and every role's command is there.
"$venv/bin/agl-stream" --help >/dev/null
for command in worker serve gateway dashboard topics db status; do
  "$venv/bin/agl-stream" "$command" --help >/dev/null
done
