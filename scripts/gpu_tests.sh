#!/usr/bin/env bash
# Every GPU test and check of the core and all plugins, on a GPU machine that has nothing
# installed but CPython, torch, pytest and hypothesis. Ranks outnumbering the GPUs share them
# (gloo; correctness only); with a GPU a rank they run NCCL.
#
#   bash scripts/gpu_tests.sh stage             unpack what .gpu/ holds into /tmp (idempotent)
#   bash scripts/gpu_tests.sh run [GROUP ...]   run groups (default: all), logs and JSON under $OUT
#   bash scripts/gpu_tests.sh together GROUP ... run groups side by side (correctness only: they share the GPU)
#   bash scripts/gpu_tests.sh summary           the table of everything run on this machine so far
#
# Groups (each fits one 10-minute device command; `run all` is for a machine without that limit):
#   core        the core's GPU tests (graph decode, fused qkv), tbo's
#   core-ranks  ranks on the GPU: collectives on CUDA tensors, the CLI at TP=2 against a single rank
#   moe-verdicts the MoE models' `run --device cuda` default check (bf16 against Hugging Face, plugins on);
#               moe-qwen3-tp2, moe-qwen3-tp4 (attention DP 2) and moe-deepseek: its cases one at a time
#   cutedsl     CuTe DSL kernels, the model with the plugin, the fused one-shot all-reduce
#   cutedsl-allreduce the fused one-shot all-reduce's GPU tests alone (ranks as processes on the GPUs)
#   flashinfer  the flashinfer plugin's fused all-reduce + add + RMSNorm at 2 ranks (workspace memory,
#               boundaries, two-shot, MoE finalize, fallback, FlashInfer's kernel limits, FP8 reads, models
#               with the plugin on and off, every fused call of a model shadowed, graph decode)
#   flashinfer4 the same at 4 ranks (boundaries, MoE finalize, models, graph decode)
#   contract    the provider contract suite's CUDA cases
#   soak        benchmarks/gpu_soak.py at 2 ranks: 10,000 decode steps with the flashinfer plugin
#               (GPU memory, live tensors and streams before and after), then a rank killed
#               mid-forward (the others must raise, not hang); JSON in $OUT/soak.json, soak_kill.json
#   compile     torch.compile on the GPU: reduce-overhead decode vs CapturedStep, TP=2 flashinfer fullgraph
#   compile-cpu the CPU compile tests (graph breaks, recompiles, eager parity) under this machine's
#               torch, which is not the CPU box's: Dynamo's differences between versions show here
#   compile-ops torch.library.opcheck on the plugins' fused kernel ops (cutedsl MoE, flashinfer at 2 ranks)
#   addnorm     the local add + RMSNorm kernels (cutedsl, flashinfer) against the torch path, their
#               order, a CUDA graph, a qwen3 TP=1 decode step launching fewer kernels
#   addnorm-kernels the same without the qwen3 step (FlashInfer's Python modules are enough)
#   decode-kernels the flashinfer plugin's rope, decode attention and gated activation (silu/gelu_tanh/
#               gelu_and_mul) against the torch path (alone, in a qwen3 static-cache decode with
#               prepare_model, a CUDA graph, torch.compile); the first run JIT-builds the three
#               activation modules (not in fijit.tgz)
#   bench-decode   `layer-boundary bench decode` (batch 1, 32: graph replay, kernels vs HF, floor) of each
#               family in BENCH_MODELS (default qwen3)
#   qk-norm-rope the CuTe DSL q/k norm + rope kernel's GPU tests alone (also in `cutedsl`)
#   bench-cutedsl  `layer-boundary bench cutedsl` (CuTe DSL add + RMSNorm vs FlashInfer, copy baseline)
#   bench-cutedsl-cells  the same for CUTEDSL_SHAPES (default: T=1024 at each width) in CUTEDSL_CELL_RUNS (3)
#               fresh processes, each with its buffers on other pages
#   bands-cutedsl `layer-boundary bench cutedsl -- --bands-out`: the add + RMSNorm band kernels against the
#               default tiling over the band grid, and the band table they suggest ($OUT/add_norm_bands.json;
#               export LAYER_BOUNDARY_CUTEDSL_ADD_NORM_BANDS=that file and the groups after it, bench-cutedsl
#               and the tests, run plain calls with it)
#   reread      the GPU tests of the add + RMSNorm kernels that re-read the staged row from shared memory
#               alone (also in `cutedsl` and `cutedsl-kernels`)
#   late-gamma  the GPU tests of the late gamma read, of L1 staging and of a plain call's kernel by token
#               count (`layout=AUTO` with the test's own band table) alone (also in `cutedsl`)
#   norms       the norms kernels of post-norm, sandwich and LayerNorm layers (also in `cutedsl`): the local
#               kernel vs float64 and the unfused path, in a CUDA graph, its launches in a gemma3/olmo2/gpt_neox
#               decode step; the one-shot variant at 2 ranks and the three models at TP=2
#   norms-local the same, one GPU only (the local kernel and the TP=1 models)
#
# The archives do not fit one command (64 MiB a command), so a fresh machine is staged in three
# commands sent back to back (the machine keeps /tmp while it stays warm), then the groups:
#   1. carry .gpu/cutedsl.part1 .gpu/fijit.tgz   bash scripts/gpu_tests.sh stage
#   2. carry .gpu/cutedsl.part2                  bash scripts/gpu_tests.sh stage
#   3. carry .gpu/flashinfer.zip                 bash scripts/gpu_tests.sh stage run core core-ranks
#   4. ...                                       bash scripts/gpu_tests.sh run flashinfer
# (.gpu/flashinfer.zip and the cutedsl parts: ../shared/gpu/bundle.sh; fijit.tgz: FlashInfer's
# trtllm_comm JIT cache for the machine, which saves its ~5-minute build.)
# For the CuTe DSL add + RMSNorm alone (its tests, its bench against FlashInfer's CuTe DSL norm),
# two commands do: FlashInfer's Python modules (scripts/bundle_flashinfer_py.sh) travel with part 2:
#   1. carry .gpu/cutedsl.part1                            bash scripts/gpu_tests.sh stage
#   2. carry .gpu/cutedsl.part2 .gpu/flashinfer_py.zip     bash scripts/gpu_tests.sh stage run cutedsl-kernels bench-cutedsl
#
# A group fails on a failed test or check, and on a skip no one expects (a missing package is a
# failure here, not a skip). The summary table is printed last. Logs, junit XML and the checks'
# JSON accumulate in /tmp/gpu_tests_work across the commands of one machine; each command leaves
# them as one archive in $OUT (gpu_tests.tgz) beside summary.txt (the device returns few files).
set -u
RETURN=${OUT:-}
OUT=/tmp/gpu_tests_work
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
SITE=/tmp/lb_site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LAYER_BOUNDARY_STRICT_PLUGINS=1
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
PLUGIN_PATHS=$(for p in plugins/*/; do printf '%s:' "$ROOT/${p%/}"; done)
export PYTHONPATH=$ROOT/core:${PLUGIN_PATHS}$SITE:/tmp/site:/tmp/cute:/tmp/cute/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
RESULTS=/tmp/gpu_tests_results  # one line per group run on this machine: name rc seconds log
touch "$RESULTS"

log() { echo "[gpu_tests $(date +%H:%M:%S)] $*"; }

stage() {
  if [ -f .gpu/fijit.tgz ] && [ ! -d "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" ]; then
    mkdir -p "$FLASHINFER_WORKSPACE_BASE" && tar xzf .gpu/fijit.tgz -C "$FLASHINFER_WORKSPACE_BASE" && log "FlashInfer JIT cache restored"
    touch /tmp/gpu_tests_fijit_restored
  fi
  if [ -f .gpu/cutedsl.part1 ] && [ ! -d /tmp/cute/nvidia_cutlass_dsl ]; then
    mkdir -p /tmp/stage && cp .gpu/cutedsl.part1 /tmp/stage/ && log "cutedsl part 1 kept in /tmp/stage"
  fi
  if [ -f .gpu/cutedsl.part2 ] && [ ! -d /tmp/cute/nvidia_cutlass_dsl ]; then
    if [ -f /tmp/stage/cutedsl.part1 ]; then
      mkdir -p /tmp/cute && cat /tmp/stage/cutedsl.part1 .gpu/cutedsl.part2 | xz -d | tar xf - -C /tmp/cute && log "nvidia-cutlass-dsl unpacked"
    else
      log "cutedsl part 2 came without part 1 on this machine (a fresh one?): send part 1 first, then part 2 again"
    fi
  fi
  # flashinfer.zip (../shared/gpu/bundle.sh): the kernel sources the JIT builds need; or
  # flashinfer_py.zip (scripts/bundle_flashinfer_py.sh, 18 MiB, fits beside cutedsl.part2): the
  # Python modules alone, enough for FlashInfer's CuTe DSL norms (with nvidia-cutlass-dsl staged)
  # the full zip replaces the Python-only one unpacked by an earlier command (the device keeps
  # .gpu/ between commands, so both may be here; /tmp/site/.flashinfer_from says which one is in)
  if [ -f .gpu/flashinfer.zip ] && [ "$(cat /tmp/site/.flashinfer_from 2>/dev/null)" = .gpu/flashinfer_py.zip ]; then
    rm -rf /tmp/site/flashinfer /tmp/site/.flashinfer_from && log "flashinfer's Python-only modules replaced by the full zip"
  fi
  for zip in .gpu/flashinfer.zip .gpu/flashinfer_py.zip; do
    if [ -f "$zip" ] && [ ! -d /tmp/site/flashinfer ]; then
      mkdir -p /tmp/site && python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/site')" "$zip" \
        && echo "$zip" > /tmp/site/.flashinfer_from && log "flashinfer unpacked ($zip)"
      # the JIT cache's objects must be newer than the sources ninja checks them against, and an
      # unzip dates every source now: date them back, or the ~5-minute build runs again
      find /tmp/site -exec touch -h -d '2020-01-01 00:00:00' {} + && log "flashinfer sources dated 2020 (the JIT cache stays valid)"
    fi
  done
  # the core's and every plugin's entry point without pip: importlib.metadata reads dist-info folders
  python3 - "$SITE" <<'EOF'
import pathlib, sys, tomllib
site = pathlib.Path(sys.argv[1])
for project in [pathlib.Path("pyproject.toml")] + sorted(pathlib.Path("plugins").glob("*/pyproject.toml")):
    meta = tomllib.loads(project.read_text())["project"]
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    points = meta.get("entry-points", {}).get("layer_boundary", {})
    (info / "entry_points.txt").write_text("[layer_boundary]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
EOF
  {
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
    python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
    python3 -c "import cutlass; print('cutlass dsl ok')" 2>&1 | tail -1
    timeout 60 python3 -m layer_boundary plugins 2>&1 | head -9
  } > "$OUT/env.log" 2>&1
  cat "$OUT/env.log"
}

# expected skips: none, except what this machine's GPU count makes irrelevant
UNEXPECTED_SKIP_FILTER='needs 2 GPUs for timing'

# GPU_TESTS_CAP: no group's command runs longer than this many seconds (a device command ends at
# its own limit, and what this script has not yet copied back is lost with it)
capped() {  # a runner's time limit
  if [ -n "${GPU_TESTS_CAP:-}" ] && [ "$GPU_TESTS_CAP" -lt "$1" ]; then echo "$GPU_TESTS_CAP"; else echo "$1"; fi
}

run_pytest() {  # name timeout pytest-args...
  local name=$1 limit; limit=$(capped "$2"); shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$OUT/$name.xml" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -4 "$OUT/$name.log"
  if [ "$rc" = 0 ] && grep -E "^SKIPPED" "$OUT/$name.log" | grep -v -E "$UNEXPECTED_SKIP_FILTER" >/dev/null; then
    log "$name: unexpected skips:"; grep -E "^SKIPPED" "$OUT/$name.log" | grep -v -E "$UNEXPECTED_SKIP_FILTER" | head -20
    rc=3
  fi
  echo "$name $rc $((SECONDS - t0)) $OUT/$name.log" >> "$RESULTS"
  return "$rc"
}

run_bench() {  # name timeout command...: a benchmark; its table is the log's tail
  local name=$1 limit; limit=$(capped "$2"); shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -40 "$OUT/$name.log"
  echo "$name $rc $((SECONDS - t0)) $OUT/$name.log" >> "$RESULTS"
  return "$rc"
}

run_check() {  # name timeout command...
  local name=$1 limit; limit=$(capped "$2"); shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -a -E "^FAIL|checks passed|correctness only|^check vs|^soak|^kill|^  rank|^    (before|step|after)" "$OUT/$name.log" | tail -15
  echo "$name $rc $((SECONDS - t0)) $OUT/$name.log" >> "$RESULTS"
  return "$rc"
}

group() {
  case $1 in
    core) run_pytest core 560 tests/models/test_static_decode.py tests/models/test_fused_qkv.py tests/plugins/tbo ;;
    # the CLI at TP=2 on the GPU against a single rank: its qwen3 bf16 run alone takes ~280 s
    core-ranks) run_pytest core_ranks 560 tests/models/test_gpu_ranks.py -k "not default_bf16" ;;
    # qwen3_moe (TP=2, TP=4 with attention DP 2) and deepseek_v4 (TP=2): `run --device cuda`'s default bf16 check
    # against Hugging Face with every plugin on
    moe-verdicts) run_pytest moe_verdicts 580 -s tests/models/test_gpu_ranks.py -k default_bf16 ;;
    # its three cases one by one (to run side by side with `together`: each takes minutes)
    moe-qwen3-tp2) run_pytest moe_qwen3_tp2 580 -s tests/models/test_gpu_ranks.py -k "default_bf16 and qwen3_moe and tp2" ;;
    moe-qwen3-tp4) run_pytest moe_qwen3_tp4 580 -s tests/models/test_gpu_ranks.py -k "default_bf16 and qwen3_moe and tp4" ;;
    moe-deepseek) run_pytest moe_deepseek 580 -s tests/models/test_gpu_ranks.py -k "default_bf16 and deepseek_v4" ;;
    cutedsl) run_pytest cutedsl 560 tests/plugins/cutedsl ;;
    # torch.compile: reduce-overhead decode vs CapturedStep and vs the Inductor step captured whole (timings
    # printed and in compile_gpu.json), TP=2 with the flashinfer plugin or the CuTe DSL fusion compiled fullgraph
    compile) LAYER_BOUNDARY_COMPILE_JSON="$OUT/compile_gpu.json" run_pytest compile 560 -s tests/models/test_compile_gpu.py ;;
    # COMPILE_CPU_K: a -k filter; the whole group takes ~400 s and can hang at pytest's exit until
    # its time limit: run it filtered
    compile-cpu) run_pytest compile_cpu "${COMPILE_CPU_TIMEOUT:-500}" -m "not gpu" --tb=short ${COMPILE_CPU_K:+-k "$COMPILE_CPU_K"} \
      tests/core/test_compile_core.py tests/models/test_compile.py tests/plugins/test_fused_ops_compile.py tests/models/test_compile_gpu.py ;;
    # the plugins' fused kernel ops: torch.library.opcheck (CuTe DSL MoE ops on one rank; FlashInfer's fused
    # all-reduce + add + RMSNorm and its FP8 variant, the CuTe DSL one-shot ops on 2 ranks of the shared-device world)
    compile-ops) run_pytest compile_ops 560 -s tests/plugins/test_fused_ops_gpu.py ;;
    # the fused all-reduce + add + RMSNorm's GPU tests (tests/plugins/flashinfer/flashinfer_fusion_checks.py
    # says what each compares); rank 0's checks and their facts are printed into the log
    flashinfer) run_pytest flashinfer 560 -s tests/plugins/flashinfer/test_flashinfer_fusion_gpu.py -k "not tp4" ;;
    flashinfer4) run_pytest flashinfer4 560 -s tests/plugins/flashinfer/test_flashinfer_fusion_gpu.py -k tp4 ;;
    addnorm) run_pytest addnorm 560 tests/plugins/test_add_norm_gpu.py ;;
    addnorm-kernels) run_pytest addnorm_kernels 400 tests/plugins/test_add_norm_gpu.py -k "not qwen3" ;;
    cutedsl-kernels) run_pytest cutedsl_kernels 480 tests/plugins/cutedsl/test_kernels_gpu.py ;;
    cutedsl-allreduce) run_pytest cutedsl_allreduce 400 tests/plugins/cutedsl/test_allreduce_gpu.py ;;
    decode-kernels) run_pytest decode_kernels 560 -s tests/plugins/flashinfer/test_flashinfer_decode_kernels_gpu.py \
      tests/plugins/flashinfer/test_flashinfer_gated_activation_gpu.py ;;
    # BENCH_MODELS: the families timed, one process each (default qwen3)
    bench-decode)
      local m rc=0
      for m in ${BENCH_MODELS:-qwen3}; do
        run_bench "bench_decode_$m" 290 python3 -m layer_boundary bench decode -- --model "$m" --out "$OUT/decode_$m.json" || rc=1
      done
      return "$rc" ;;
    qk-norm-rope) run_pytest qk_norm_rope 300 tests/plugins/cutedsl/test_qk_norm_rope_gpu.py ;;
    reread) run_pytest reread 200 tests/plugins/cutedsl/test_kernels_gpu.py -k "reread" ;;
    late-gamma) run_pytest late_gamma 200 tests/plugins/cutedsl/test_kernels_gpu.py -k "late_gamma or token_counts_kernel" ;;
    norms) run_pytest norms 400 tests/plugins/cutedsl/test_norms_gpu.py ;;
    norms-local) run_pytest norms_local 300 tests/plugins/cutedsl/test_norms_gpu.py -k "not two_ranks and not tp2" ;;
    # the band grid timed (bench cutedsl --bands-out) and the ROWS_BANDS table it suggests
    bands-cutedsl) run_bench bands_cutedsl 500 python3 -m layer_boundary bench cutedsl -- --bands-out "$OUT/add_norm_bands.json" \
      --out "$OUT/add_norm_bands_timings.json" ;;
    # CUTEDSL_KERNEL: the add + RMSNorm kernel timed, by name (tiling.parse_candidate; default: auto, a plain call's)
    bench-cutedsl) run_bench bench_cutedsl 290 python3 -m layer_boundary bench cutedsl -- --kernel "${CUTEDSL_KERNEL:-auto}" \
      --out "$OUT/cutedsl_bench.json" ;;
    # CUTEDSL_SHAPES (TxH ...) re-timed in CUTEDSL_CELL_RUNS fresh processes: each lands its buffers on
    # other pages, so the runs show how much of a near-tie between ours and FlashInfer's is placement
    bench-cutedsl-cells)
      local k rc=0
      for k in $(seq "${CUTEDSL_CELL_RUNS:-3}"); do
        run_bench "bench_cutedsl_cells_$k" 200 python3 -m layer_boundary bench cutedsl -- --kernel "${CUTEDSL_KERNEL:-auto}" \
          --shapes ${CUTEDSL_SHAPES:-1024x2048 1024x4096 1024x7168 1024x8192} --out "$OUT/cutedsl_cells_$k.json" || rc=1
      done
      return "$rc" ;;
    # the soak stops at its --budget-s (agreed by the ranks) with the steps it ran and its rate
    soak)
      local soak="python3 benchmarks/gpu_soak.py --device cuda --tp 2" rc=0
      run_check soak 360 $soak --only soak --steps "${SOAK_STEPS:-10000}" --budget-s "${SOAK_BUDGET_S:-240}" --out "$OUT/soak.json" || rc=1
      run_check soak_kill 150 $soak --only kill --out "$OUT/soak_kill.json" || rc=1
      return $rc ;;
    contract) run_pytest contract 560 tests/plugins/test_contract_plugins.py tests/plugins/test_contract_suite.py tests/test_example_provider.py ;;
    *) log "unknown group $1 (the groups are listed at the top of this script)"; return 2 ;;
  esac
}

summary() {
  python3 - "$RESULTS" "$OUT" <<'EOF'
import json, pathlib, sys, xml.etree.ElementTree as ET
rows = [line.split() for line in pathlib.Path(sys.argv[1]).read_text().splitlines() if line.strip()]
out = pathlib.Path(sys.argv[2])
print(f"{'group':<14}{'result':<8}{'seconds':>8}  details")
ok = True
for name, rc, seconds, log in rows:
    detail = ""
    xml = out / f"{name}.xml"
    soak = out / f"{name}.json"
    if xml.is_file():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        detail = f"tests {suite.get('tests')}, failures {suite.get('failures')}, errors {suite.get('errors')}, skipped {suite.get('skipped')}"
    elif soak.is_file():
        data = json.loads(soak.read_text())
        mib = lambda n: "-" if n is None else f"{n / 2**20:.1f}"
        if data.get("soak"):
            r = data["soak"]["ranks"][0]
            detail = (f"steps {data['soak']['steps']}, {r['steps_per_s']:.0f}/s, rank 0 allocated MiB {mib(r['samples'][0]['allocated'])}"
                      f" -> {mib(r['samples'][-1]['allocated'])}, device used MiB {mib(r['samples'][0]['device_used'])}"
                      f" -> {mib(r['samples'][-1]['device_used'])}, grew {r['grew'] or 'nothing'}")
        if data.get("kill"):
            k = data["kill"]
            detail = f"kill: {k['outcome']} {k['seconds_from_death_to_error']} s after the death, survivors raised {k['survivors_raised']}"
    result = "PASS" if rc == "0" else ("TIMEOUT" if rc in ("124", "137") else f"FAIL({rc})")
    ok = ok and rc == "0"
    print(f"{name:<14}{result:<8}{seconds:>8}  {detail}")
print("all groups passed" if ok else "SOME GROUPS FAILED")
sys.exit(0 if ok else 1)
EOF
}

# the GROUP words after step $i (up to the next step word) into `groups`; i moves past them
take_groups() {
  groups=()
  while [ $((i + 1)) -lt ${#steps[@]} ]; do
    case ${steps[$((i + 1))]} in stage | summary | run | together) break ;; esac
    i=$((i + 1)); groups+=("${steps[$i]}")
  done
}

status=0
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(stage run)
i=0
while [ $i -lt ${#steps[@]} ]; do
  step=${steps[$i]}
  case $step in
    stage) stage ;;
    summary) ;;
    run)
      take_groups
      [ ${#groups[@]} -eq 0 ] && groups=(core core-ranks cutedsl flashinfer flashinfer4 contract soak addnorm decode-kernels compile-cpu compile compile-ops)
      for g in "${groups[@]}"; do
        log "group $g"
        group "$g" || status=1
      done ;;
    together)
      # groups side by side, each in its own background job: for correctness checks only (they share
      # the GPU and the cores, so timings mean nothing); each group's printout follows when all end
      take_groups; pids=()
      for g in "${groups[@]}"; do
        log "group $g (side by side)"
        group "$g" > "$OUT/together_$g.out" 2>&1 &
        pids+=($!)
      done
      for k in "${!groups[@]}"; do
        wait "${pids[$k]}" || status=1
        log "group ${groups[$k]} ended"; cat "$OUT/together_${groups[$k]}.out"
      done ;;
    *) log "unknown step $step (stage, run [GROUP ...], together [GROUP ...], summary)"; exit 2 ;;
  esac
  i=$((i + 1))
done
summary > "$OUT/summary.txt" 2>&1 || status=1
cat "$OUT/summary.txt"
if [ -n "$RETURN" ] && [ "$RETURN" != "$OUT" ]; then
  mkdir -p "$RETURN" && cp "$OUT/summary.txt" "$RETURN/" && tar czf "$RETURN/gpu_tests.tgz" -C "$OUT" .
  # a JIT build ran here (no cache came along, it was stale, or a module it lacked was built, as the
  # rope and decode kernels are): send the new cache back once, to be carried next time
  if [ -f /tmp/gpu_tests_fijit_restored ]; then
    so=$(find "$FLASHINFER_WORKSPACE_BASE" -name '*.so' -newer /tmp/gpu_tests_fijit_restored 2>/dev/null | head -1)
  else
    so=$(find "$FLASHINFER_WORKSPACE_BASE" -name '*.so' 2>/dev/null | head -1)
  fi
  if [ -n "$so" ] && [ ! -f /tmp/gpu_tests_fijit_sent ]; then
    tar czf "$RETURN/fijit.tgz" -C "$FLASHINFER_WORKSPACE_BASE" . && touch /tmp/gpu_tests_fijit_sent && log "the new FlashInfer JIT cache is in \$OUT/fijit.tgz"
  fi
fi
exit $status
