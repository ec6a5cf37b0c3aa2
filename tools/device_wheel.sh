#!/usr/bin/env bash
# A device lease should not spend its minutes compiling: build the device machine's wheel here
# (its Python is 3.12), carry .devwheel in the device call, and `benchmarks/run_h200.sh build`
# installs that wheel when it was built from the tree that travelled, and compiles as before when
# it was not (a stale wheel would time code that is not the tree's).
#
#   tools/device_wheel.sh [PYTHON]     # default python3.12; the wheel and its STAMP in .devwheel/
#   tools/device_wheel.sh --stamp      # print the stamp of the tree's build inputs
#
# The stamp hashes the build's inputs as they lie in the working tree (what travels to the
# device: no .git there), compiled and cached files left out.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp() {
  # -L: a linked header or folder is hashed by what it points at, as the compiler reads it.
  find -L cpp src/poolkeeper CMakeLists.txt pyproject.toml -type f \
    ! -name '*.so' ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}
if [ "${1:-}" = "--stamp" ]; then stamp; exit 0; fi
py=${1:-python3.12}
rm -rf .devwheel
before=$(stamp)
WHEEL_DIR=$PWD/.devwheel tools/build_wheels.sh "$py"
# A source edited while the build ran may or may not be in the wheel: no stamp vouches for it.
if [ "$(stamp)" != "$before" ]; then
  rm -rf .devwheel
  echo "the sources changed during the build; run again" >&2
  exit 1
fi
echo "$before" > .devwheel/STAMP
echo "stamp $(cat .devwheel/STAMP): carry .devwheel in the device call"
