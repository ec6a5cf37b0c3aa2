#!/usr/bin/env bash
# Coverage-guided fuzzing of the pools: libFuzzer (clang) + AddressSanitizer + UBSan over
# cpp/tests/fuzz_pools.cpp and the whole core.
#
#   tools/fuzz.sh [SECONDS] [libFuzzer args...]     default 60 s; prints libFuzzer's final stats
#
# New corpus entries go to build/fuzz/corpus (seeded from cpp/tests/fuzz_corpus); a crash leaves
# its input in build/fuzz/artifacts/ -- replay it with `build/fuzz/fuzz_pools FILE` (or the plain
# CMake build's fuzz_pools, which needs no clang; FUZZ_TRACE=1 prints each operation). ASan may
# return NULL for a huge request, as glibc does: the host upstream turns that into out of memory.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
[ $# -gt 0 ] && shift
out=${FUZZ_BUILD:-build/fuzz}
cxx=${FUZZ_CXX:-clang++}

if ! command -v "$cxx" >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "fuzz: installing clang (libFuzzer ships with it)"
    apt-get install -y -q clang >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -q clang >/dev/null; }
  else
    echo "fuzz: $cxx not found; install clang (it ships libFuzzer)" >&2
    exit 1
  fi
fi

mkdir -p "$out/obj" "$out/corpus" "$out/artifacts"
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined
       -fno-sanitize-recover=all -DPOOLKEEPER_LIBFUZZER -Icpp/include)
newest_header=$(ls -t cpp/include/poolkeeper/*/*.hpp cpp/src/*/*.hpp | head -1)
pids=() objs=()
for src in cpp/src/*/*.cpp cpp/tests/fuzz_pools.cpp; do
  obj="$out/obj/$(basename "${src%.cpp}").o"
  objs+=("$obj")
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ] || [ "$newest_header" -nt "$obj" ]; then
    "$cxx" "${flags[@]}" -c "$src" -o "$obj" &
    pids+=($!)
    if [ ${#pids[@]} -ge "${JOBS:-2}" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
"$cxx" -fsanitize=fuzzer,address,undefined "${objs[@]}" -o "$out/fuzz_pools"

ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1} \
  "$out/fuzz_pools" -max_total_time="$secs" -max_len=2048 -timeout=30 -rss_limit_mb=4096 \
  -artifact_prefix="$out/artifacts/" -print_final_stats=1 "$@" "$out/corpus" cpp/tests/fuzz_corpus
