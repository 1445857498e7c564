#!/usr/bin/env bash
# The flashinfer plugin on 2 GPUs (nvidia-h200-x2): correctness first, then the benchmark.
#
#   bash plugins/flashinfer/gpu_check.sh          # all steps (about 8 min on a cold machine: the
#                                                 # FlashInfer trtllm_comm JIT build alone is ~262 s)
#   bash plugins/flashinfer/gpu_check.sh check    # stage + correctness (saves the JIT cache to $OUT)
#   bash plugins/flashinfer/gpu_check.sh bench    # the benchmark (same warm machine, or carry .gpu/fijit.tgz)
#
# Carry .gpu/flashinfer.zip (built by ../shared/gpu/bundle.sh flashinfer: flashinfer-python
# 0.7.2.post1 + apache-tvm-ffi) with the first command on a machine; carry .gpu/fijit.tgz too (a
# JIT cache this script left under $OUT on an earlier machine, copied to .gpu/) to skip the build.
# Nothing is pip-installed: the core and the plugin run from the tree, and a dist-info folder
# registers the plugin's entry point. Every step runs under `timeout`; logs and results go to $OUT.
set -u
step=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
SITE=/tmp/lb_site
export PYTHONPATH=$ROOT/core:$ROOT/plugins/flashinfer:$SITE:/tmp/site${PYTHONPATH:+:$PYTHONPATH}

stage() {
  if [ ! -d /tmp/site/flashinfer ]; then
    [ -f .gpu/flashinfer.zip ] || { echo "no FlashInfer here: carry .gpu/flashinfer.zip (../shared/gpu/bundle.sh flashinfer)"; return 1; }
    mkdir -p /tmp/site && timeout 120 python3 -c "import zipfile; zipfile.ZipFile('.gpu/flashinfer.zip').extractall('/tmp/site')" || return 1
  fi
  if [ -f .gpu/fijit.tgz ] && [ ! -d "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" ]; then
    mkdir -p "$FLASHINFER_WORKSPACE_BASE" && tar xzf .gpu/fijit.tgz -C "$FLASHINFER_WORKSPACE_BASE" && echo "JIT cache restored"
  fi
  # the plugin's entry point without pip: importlib.metadata reads dist-info folders on sys.path
  mkdir -p "$SITE/layer_boundary_flashinfer-0.1.0.dist-info" "$SITE/layer_boundary-0.1.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: layer-boundary-flashinfer\nVersion: 0.1.0\n' > "$SITE/layer_boundary_flashinfer-0.1.0.dist-info/METADATA"
  printf '[layer_boundary]\nflashinfer = layer_boundary_flashinfer.plugin\n' > "$SITE/layer_boundary_flashinfer-0.1.0.dist-info/entry_points.txt"
  printf 'Metadata-Version: 2.1\nName: layer-boundary\nVersion: 0.1.0\n' > "$SITE/layer_boundary-0.1.0.dist-info/METADATA"
  {
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    nvidia-smi topo -m
    timeout 120 python3 -c "import torch, flashinfer, flashinfer.comm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'flashinfer', flashinfer.__version__)"
    timeout 60 python3 -m layer_boundary plugins
  } 2>&1 | tee "$OUT/env.log"
  grep -q "flashinfer  *ok" "$OUT/env.log" || { echo "the flashinfer plugin is not registered (see $OUT/env.log)"; return 1; }
}

check() {
  local cold=1
  [ -d "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" ] && cold=0
  timeout 450 python3 -m layer_boundary_flashinfer.gpu_check --out "$OUT" 2>&1 | tee "$OUT/check.log"
  local rc=${PIPESTATUS[0]}
  if [ "$cold" = 1 ] && [ -d "$FLASHINFER_WORKSPACE_BASE" ]; then
    tar czf "$OUT/fijit.tgz" -C "$FLASHINFER_WORKSPACE_BASE" . && echo "saved the JIT cache: $OUT/fijit.tgz (copy it to .gpu/fijit.tgz)"
  fi
  echo "check rc=$rc"
  return "$rc"
}

bench() {
  timeout 300 python3 -m layer_boundary bench fusion -- --out "$OUT/fusion.json" --replays 20 --batches 5 2>&1 | tee "$OUT/bench.log"
  local rc=${PIPESTATUS[0]}
  echo "bench rc=$rc"
  return "$rc"
}

case $step in
  stage) stage ;;
  check) stage && check ;;
  bench) stage && bench ;;
  all) stage && { check; c=$?; bench; b=$?; echo "summary: check rc=$c bench rc=$b (logs and results in $OUT)"; [ "$c" = 0 ] && [ "$b" = 0 ]; } ;;
  *) echo "usage: $0 [all|stage|check|bench]"; exit 2 ;;
esac
