#!/usr/bin/env bash
# One GPU session: CUDA tests, the memory checker on the kernel, the benchmarks, the host-cost breakdown.
#   OUT=/some/dir bash benchmarks/gpu_session.sh [tests] [sanitize] [bench_op] [bench_gemv] [bench_module]
#       [bench_module_quick] [bench_whole] [bench_whole_mid] [host] [bench_draft_ctx] [bench_draft_step] [demo] [tests_cache]
#       [bench_gemv_epilogue] [bench_module_epilogue] [bench_uncaptured] [tests_epilogue] [sanitize_epilogue]
#       [bench_module_swap]
# Installs the checkout editable first (offline: the build needs setuptools>=77 already installed), so
# everything runs against the installed package; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if ! python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
  tail -n 5 "$OUT/install.log"
  echo "pip install --no-deps --no-build-isolation -e . failed (is setuptools>=77 installed?); see $OUT/install.log" >&2
  exit 1
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize bench_op bench_module)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
for step in "${steps[@]}"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    tests_cache) timeout 300 python -m pytest -q -p no:cacheprovider -k "cuda" tests/test_cache_writes.py > "$OUT/pytest_cache_cuda.log" 2>&1; tail -n 3 "$OUT/pytest_cache_cuda.log" ;;
    tests) timeout 420 python -m pytest -q -p no:cacheprovider -k "cuda or reduce_overhead or gpu" tests > "$OUT/pytest_cuda.log" 2>&1; tail -n 3 "$OUT/pytest_cuda.log" ;;
    sanitize) (cd tests && timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python gpu_sanitize_cases.py) > "$OUT/sanitizer.log" 2>&1; echo "sanitizer exit $?"; tail -n 5 "$OUT/sanitizer.log" ;;
    bench_op) timeout 300 python benchmarks/bench_op.py --out "$OUT" 2>&1 | tail -n 30 ;;
    bench_gemv) timeout 240 python benchmarks/bench_grouped_gemv.py --out "$OUT/bench_grouped_gemv.json" 2>&1 | tail -n 40 ;;
    bench_gemv_epilogue) timeout 240 python benchmarks/bench_grouped_gemv.py --epilogue --workloads qwen3-8b-dflash,qwen3-1layer --tokens 1,16,32,64 --out "$OUT/bench_grouped_gemv_epilogue.json" 2>&1 | tail -n 12 ;;
    bench_module_epilogue) timeout 400 python benchmarks/bench_module.py --seq-lens 1,16,32 --columns ind_graph,frz_graph,sglang_graph,fxf,fxf_graph,fxf_sep,fxf_sep_graph --out "$OUT/module_epilogue" 2>&1 | tail -n 20 ;;
    tests_epilogue) timeout 300 python -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_k_epilogue.py tests/test_whole_models.py tests/test_rotary_angles.py > "$OUT/pytest_epilogue_cuda.log" 2>&1; tail -n 3 "$OUT/pytest_epilogue_cuda.log" ;;
    sanitize_epilogue) (cd tests && timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python gpu_sanitize_cases.py k-epilogue gemv angles) > "$OUT/sanitizer_epilogue.log" 2>&1; echo "sanitizer exit $?"; tail -n 3 "$OUT/sanitizer_epilogue.log" ;;
    bench_module_swap) timeout 400 python benchmarks/bench_module.py --l2-flush read --seq-lens 1,4,16,32 --columns fxf_graph,fxf_mma_t_graph,fxf_tab_graph,sglang_graph --out "$OUT/module_swap" 2>&1 | tail -n 16 ;;
    bench_module) timeout 540 python benchmarks/bench_module.py --out "$OUT" 2>&1 | tail -n 60 ;;
    host) timeout 240 python benchmarks/host_overhead.py --out "$OUT" 2>&1 | tail -n 60 ;;
    bench_uncaptured) timeout 560 python benchmarks/bench_uncaptured.py --repeats 12 --out "$OUT" 2>&1 | tail -n 24 ;;
    bench_module_quick) timeout 400 python benchmarks/bench_module.py --quick --out "$OUT" 2>&1 | tail -n 40 ;;
    bench_whole) timeout 480 python benchmarks/bench_whole_model.py --device cuda --quick --out "$OUT/whole" 2>&1 | tail -n 40 ;;
    bench_draft_ctx) timeout 560 python benchmarks/bench_draft_step.py --parts context --out "$OUT" 2>&1 | tail -n 40 ;;
    bench_draft_step) timeout 560 python benchmarks/bench_draft_step.py --parts step --quick --caches bf16 --out "$OUT/step" 2>&1 | tail -n 30 ;;
    demo) timeout 300 python -m fx_fusion demo > "$OUT/demo.log" 2>&1; echo "demo exit $?"; tail -n 25 "$OUT/demo.log" ;;
    bench_whole_mid) timeout 480 python benchmarks/bench_whole_model.py --device cuda --seq-lens 16,512 --out "$OUT/whole_mid" 2>&1 | tail -n 40 ;;
  esac
done
