#!/usr/bin/env bash
# Incremental developer build into a private target dir (so several worktrees can build at once):
#   tools/dev_build.sh /tmp/site-NAME && PYTHONPATH=/tmp/site-NAME python -m pytest tests/...
set -euo pipefail
target=${1:-/tmp/site-dev}
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-build-isolation --no-deps --upgrade -Cbuild-dir=build/dev --target "$target" . 2>&1 \
  | grep -v -E "^WARNING|Running pip as|Location .* is ignored" || true
test -d "$target/poolkeeper" && echo "built into $target"
