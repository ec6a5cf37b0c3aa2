#!/usr/bin/env bash
# Everything the committed H200 results need, in one command on the device machine (the device
# tool runs it from the repository root with $OUT as the folder that comes back):
#
#   bash benchmarks/run_h200.sh [step ...]     steps: build gpu_tests vmm uploader matrix replay (default: all)
#                                              and dask (not in the default: needs the .whl wheelhouse
#                                              carried along, see docs/distributed.md)
#                                              and real_models (not in the default: ~4 minutes alone)
#                                              and threads (not in the default: thread_scaling.py, medians of 3, the reference arm included, ~6 minutes)
#                                              and time_rounds (not in the default: install()'s default pool against PyTorch's
#                                              allocator, 3 rounds, every arm on cores 0-7, ~7 minutes)
#                                              and time_pieces (not in the default: the Llama workload's 4 rounds with
#                                              install()'s default also in 20 MiB pieces, the arms together, ~4 minutes)
#                                              and time_together (not in the default: time_rounds' arms in 5 rounds, the
#                                              arms' processes at once on cores 0-7 and 8-15, ~6 minutes)
#                                              and live_logs (not in the default: the arena's and the expandable arena's
#                                              every allocation and free in the real-model runs, gzipped CSVs for
#                                              `poolkeeper replay`, ~3 minutes)
#
# The build step compiles the tree, unless .devwheel holds the wheel tools/device_wheel.sh built
# from this same tree (carry .devwheel in the device call): then it installs that in seconds.
#
# Each step writes its output under $OUT and goes on after a failure (the summary says which).
# Everything also lands in $OUT/h200_run.tgz: the device tool brings back only a few files a call.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build gpu_tests vmm uploader matrix replay)
export COLUMNS=220 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
status=()
step() {  # name command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  status+=("$name rc=$rc $((SECONDS - t0))s")
  echo "== $name rc=$rc $((SECONDS - t0))s"; tail -4 "$OUT/$name.txt"
}
for s in "${steps[@]}"; do
  case $s in
    build)
      # A wheel built beforehand from this very tree (tools/device_wheel.sh, .devwheel carried)
      # saves the lease its compile. Only the one wheel of this Python, vouched for by a stamp
      # equal to this tree's, is installed; anything else, or a failed install, compiles the tree.
      tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
      wheels=(.devwheel/poolkeeper-*-"$tag"-*.whl)
      [ -e "${wheels[0]}" ] || wheels=()
      want=$(bash tools/device_wheel.sh --stamp 2>/dev/null || true)
      have=$(cat .devwheel/STAMP 2>/dev/null || true)
      compile=(python3 -m pip install -q --no-build-isolation --no-deps --no-index --upgrade --target /tmp/site .)
      if [ ${#wheels[@]} -eq 1 ] && [[ $want =~ ^[0-9a-f]{16}$ ]] && [ "$have" = "$want" ]; then
        echo "build: installing ${wheels[0]} (stamp $have)"
        step build bash -c 'python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/site "$1" \
          || { echo "build: the wheel did not install; compiling"; shift; "$@"; }' _ "${wheels[0]}" "${compile[@]}"
      else
        [ -d .devwheel ] && echo "build: .devwheel holds no single $tag wheel of this tree; compiling"
        step build "${compile[@]}"
      fi ;;
    gpu_tests) step pytest_gpu timeout 570 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rs ;;
    vmm)
      step vmm_latency timeout 120 python3 benchmarks/vmm_latency.py --json "$OUT/vmm_latency_h200.json"
      step vmm_driver_calls timeout 120 python3 benchmarks/vmm_driver_calls.py --background 0,1000,4000 \
        --json "$OUT/vmm_driver_calls_h200.json"
      step vmm_bandwidth timeout 180 python3 benchmarks/vmm_bandwidth.py --json "$OUT/vmm_bandwidth_h200.json" ;;
    uploader) step uploader timeout 420 python3 benchmarks/uploader_bench.py "$OUT/uploader_h200.json" --sizes 256M,2G \
                --engine native,python --nt off --tail on,off --chunks 1M,2M,4M,8M --threads 8,12 --reps 5 ;;
    matrix)
      step h200 timeout 420 python3 -m poolkeeper.cli bench --backend cuda --no-progress --json "$OUT/h200.json"
      step h200_compare python3 -m poolkeeper.cli compare "$OUT/h200.json" --plot "$OUT/h200_compare.png" \
        --json "$OUT/h200_compare.json" ;;
    replay)
      for t in torch_gpt2_generate torch_bert_serve; do
        step "replay_cuda_$t" timeout 120 python3 -m poolkeeper.cli replay "benchmarks/traces/$t.pickle.gz" \
          --backend cuda --include-pre-trace --no-progress --json "$OUT/replay_cuda_$t.json"
      done ;;
    dask)
      step dask_wheels python3 -m pip install -q --no-index --find-links .whl distributed
      step pytest_dask_gpu timeout 400 python3 -m pytest -q -m gpu tests/gpu/test_dask_gpu.py -p no:cacheprovider -rs -s
      step dask_cupy_bench timeout 500 python3 benchmarks/dask_cupy_bench.py --json "$OUT/dask_cupy_bench_h200.json" ;;
    real_models) step real_models timeout 580 python3 benchmarks/real_models.py --out "$OUT/real_models_h200" ;;
    time_rounds) step real_models_rounds timeout 590 python3 benchmarks/real_models.py --workloads bert,llama \
                   --arms torch,arena_expandable+single_stream+wide_stitch --rounds 3 --cpus 0-7 --out "$OUT/real_models_rounds" ;;
    time_pieces) step real_models_pieces timeout 590 python3 benchmarks/real_models.py --workloads llama \
                   --arms torch,arena_expandable+single_stream+wide_stitch,arena_expandable+single_stream+wide_stitch+map_piece=20MiB \
                   --rounds 4 --together --cpus 0-14 --out "$OUT/real_models_pieces" ;;
    time_together) step real_models_together timeout 590 python3 benchmarks/real_models.py --workloads bert,llama \
                   --arms torch,arena_expandable+single_stream+wide_stitch --rounds 5 --together --cpus 0-15 \
                   --out "$OUT/real_models_together" ;;
    live_logs)
      step real_models_logs timeout 400 python3 benchmarks/real_models.py --workloads bert,llama \
        --arms arena,arena_expandable --no-warmup --log-dir "$OUT/live_logs" --out "$OUT/real_models_logs"
      gzip -f "$OUT"/live_logs/*.csv ;;
    threads) step thread_scaling_h200 timeout 580 python3 benchmarks/thread_scaling.py --backend cuda --seconds 0.4 \
               --warmup 0.2 --reps 3 --counters --json "$OUT/thread_scaling_h200.json" --key h200 ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
printf '%s\n' "${status[@]}" | tee "$OUT/steps.txt"
tar czf /tmp/h200_run.tgz -C "$OUT" . && mv /tmp/h200_run.tgz "$OUT/"
