#!/usr/bin/env bash
# Two simulated nodes (network namespaces + veth, torchrun --nnodes 2, gloo): see scripts/two_nodes.py.
# Needs root. Uses .venv's python unless PYTHON names another.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" scripts/two_nodes.py "$@"
