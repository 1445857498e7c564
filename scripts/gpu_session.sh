#!/usr/bin/env bash
# One GPU session in steps (the device machine keeps /tmp between calls while it stays warm).
#   stage-cute1   (carry .gpu/cutedsl.part1)   stage-fi (carry .gpu/flashinfer.zip)
#   unpack-cute2  (carry .gpu/cutedsl.part2)   then: cutedsl | graphs | models
set -u
step=${1:?step}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE=/tmp/fiws HF_HUB_OFFLINE=1
export PYTHONPATH=$PWD/core:$PWD/plugins/cutedsl:/tmp/site:/tmp/cute:/tmp/cute/nvidia_cutlass_dsl/dsl_packages
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case $step in
stage-cute1) mkdir -p /tmp/stage && cp .gpu/cutedsl.part1 /tmp/stage/ && nvidia-smi --query-gpu=name,memory.total --format=csv ;;
stage-fi) mkdir -p /tmp/site && python3 -c "import zipfile; zipfile.ZipFile('.gpu/flashinfer.zip').extractall('/tmp/site')" && ls /tmp/site | head ;;
unpack-cute2) cat /tmp/stage/cutedsl.part1 .gpu/cutedsl.part2 | xz -d | (mkdir -p /tmp/cute && tar xf - -C /tmp/cute) && python3 -c "import cutlass; print('cutlass', cutlass.__version__ if hasattr(cutlass,'__version__') else 'ok')" ;;
cutedsl)
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/plugins/cutedsl/test_kernels_gpu.py 2>&1 | tee "$OUT/cutedsl_gpu.log" | tail -15
  timeout 250 python3 benchmarks/cutedsl_bench.py --out "$OUT/cutedsl_bench.json" 2>&1 | tee "$OUT/cutedsl_bench.log" | tail -40 ;;
graphs)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/models/test_static_decode.py 2>&1 | tee "$OUT/graphs.log" | tail -6
  timeout 300 python3 -m layer_boundary.bench.decode --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -12 ;;
models)
  pip install -q --no-deps --no-build-isolation -e . -e plugins/cutedsl >/dev/null 2>&1 || echo "editable install failed"
  for m in qwen3 qwen3_moe; do timeout 120 python3 -m layer_boundary run --model $m --tp 1 --device cuda --dtype bfloat16 --json > "$OUT/run_$m.json" 2>"$OUT/run_$m.err"; echo "$m rc=$?"; python3 -c "import json;d=json.load(open('$OUT/run_$m.json'));print(d['check'],d['timings']['decode_step_s'])"; done
  LAYER_BOUNDARY_CUTEDSL=1 timeout 200 python3 -m layer_boundary run --model qwen3_moe --tp 1 --device cuda --dtype bfloat16 --json > "$OUT/run_moe_cutedsl.json" 2>"$OUT/run_moe_cutedsl.err"; echo "cutedsl rc=$?"; tail -3 "$OUT/run_moe_cutedsl.err"; python3 -c "import json;d=json.load(open('$OUT/run_moe_cutedsl.json'));print(d['check'])" ;;
diagnose)
  timeout 250 python3 plugins/cutedsl/gpu_diagnose.py --out "$OUT" 2>&1 | tee "$OUT/diagnose.log" | tail -60
  timeout 60 python3 -m layer_boundary run --model gemma --tp 1 --device cuda --dtype bfloat16 --check single 2>&1 | grep -E "check|rror" ;;
*) echo "unknown step $step"; exit 2 ;;
esac
