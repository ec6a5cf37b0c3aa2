#!/usr/bin/env bash
# Build this platform's wheel and smoke-test it the way a user would get it: installed into a
# fresh venv, with no compiler on PATH, imported from outside the checkout (tools/wheel_smoke.py).
#
#   tools/build_wheels.sh [PYTHON ...]      # default: python3; e.g. python3.10 python3.13
#   WHEEL_TESTS="tests/test_buffer_protocol.py" tools/build_wheels.sh ...
#                                           # also run those tests against the installed wheel
#
# Release wheels for every supported Python and manylinux_2_28 x86_64/aarch64 come from
# cibuildwheel ([tool.cibuildwheel] in pyproject.toml), which needs Docker; this script runs the
# same build backend and the same smoke test locally. Wheels land in $WHEEL_DIR (default dist/).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${WHEEL_DIR:-$root/dist}
mkdir -p "$out"
[ $# -gt 0 ] || set -- python3
export PIP_DISABLE_PIP_VERSION_CHECK=1

# A PATH with the interpreter's venv and readelf (for the NEEDED check), and no compiler.
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
if command -v readelf >/dev/null; then ln -s "$(command -v readelf)" "$tools/readelf"; fi

for py in "$@"; do
  t0=$SECONDS
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  echo "== $py ($tag): building the wheel"
  # Build isolation on, like cibuildwheel: the build environment comes from [build-system].
  "$py" -m pip wheel -q --no-deps -w "$out" "$root"
  wheel=$(ls -t "$out"/poolkeeper-*-"$tag"-*.whl "$out"/poolkeeper-*-"$tag"-abi3-*.whl 2>/dev/null | head -1 || true)
  [ -n "$wheel" ] || { echo "no $tag wheel in $out"; exit 1; }
  echo "   built $(basename "$wheel") in $((SECONDS - t0)) s"

  venv="$tools/venv-$tag"
  "$py" -m venv "$venv"
  nocc="$venv/bin:$tools"
  if PATH=$nocc command -v cc >/dev/null || PATH=$nocc command -v c++ >/dev/null; then
    echo "a compiler is still on the smoke test's PATH"; exit 1
  fi
  # --only-binary: nothing may be compiled on the way in, the wheel's dependencies included.
  PATH=$nocc "$venv/bin/python" -m pip install -q --only-binary :all: "$wheel"
  (cd "$tools" && PATH=$nocc "$venv/bin/python" "$root/tools/wheel_smoke.py")
  if [ -n "${WHEEL_TESTS:-}" ]; then
    PATH=$nocc "$venv/bin/python" -m pip install -q --only-binary :all: pytest numpy
    # From the checkout's tests/, but importing the installed wheel (src/ is not on sys.path).
    # shellcheck disable=SC2086
    PATH=$nocc "$venv/bin/python" -m pytest -q -p no:cacheprovider $WHEEL_TESTS
  fi
  echo "== $py ($tag): built, installed and smoke-tested in $((SECONDS - t0)) s"
done
