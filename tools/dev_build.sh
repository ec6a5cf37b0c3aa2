#!/usr/bin/env bash
# Incremental developer build into a private target dir (so several worktrees can build at once):
#   tools/dev_build.sh /tmp/site-NAME && PYTHONPATH=/tmp/site-NAME python -m pytest tests/...
set -euo pipefail
target=${1:-/tmp/site-dev}
cd "$(dirname "$0")/.."
# pip's own status decides: a failed compile used to end in "built into" all the same whenever the
# target still held an earlier build (the filter's status was the pipeline's).
rc=0
out=$(python3 -m pip install -q --no-build-isolation --no-deps --upgrade -Cbuild-dir=build/dev --target "$target" . 2>&1) || rc=$?
grep -v -E "^WARNING|Running pip as|Location .* is ignored" <<<"$out" || true
if [ "$rc" -ne 0 ]; then
  echo "BUILD FAILED (pip exit $rc); $target is unchanged" >&2
  exit "$rc"
fi
test -d "$target/poolkeeper" && echo "built into $target"
