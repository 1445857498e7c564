#!/usr/bin/env bash
# .gpu/flashinfer_py.zip: FlashInfer's Python modules and apache-tvm-ffi for the GPU machine,
# without the kernel sources and data the JIT builds read (~18 MiB instead of ~53): enough for
# FlashInfer's CuTe DSL norms once nvidia-cutlass-dsl is staged, and small enough to travel with
# .gpu/cutedsl.part2 in one command. The JIT-built paths (communication, rope, decode) need the
# full .gpu/flashinfer.zip of ../shared/gpu/bundle.sh. Run from the project root.
set -euo pipefail
FLASHINFER=${FLASHINFER_VERSION:-0.7.2.post1}
TVMFFI=${TVMFFI_VERSION:-0.1.12}
out=$PWD/.gpu; mkdir -p "$out"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --target "$tmp/site" "flashinfer-python==$FLASHINFER" "apache-tvm-ffi==$TVMFFI"
cd "$tmp/site"
rm -rf bin flashinfer/data
(cd flashinfer && find experimental moe_ep fused_moe -type f ! -name '*.py' -delete)
find . -name __pycache__ -prune -exec rm -rf {} +
rm -f "$out/flashinfer_py.zip" && zip -qr -9 "$out/flashinfer_py.zip" .
ls -la "$out/flashinfer_py.zip"
