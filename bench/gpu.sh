#!/usr/bin/env bash
# Measures the Triton packed-expert kernel on this machine's CUDA GPU (bench/triton_bandwidth.py):
# correctness against the reference decoder first, then bandwidth against the card's copy bandwidth.
# Needs only python with torch (CUDA build) and triton; the repository need not be pip-installed.
#     bench/gpu.sh [--experts 32] [--batches 1 4 16 64] [--budget 240] [--no-dense]
# Results: bench/results/triton_bandwidth.{json,md}. Exits 2 without a GPU. At most ~5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    PYTHON=.venv/bin/python
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "bench/gpu.sh: no NVIDIA GPU here (nvidia-smi finds none); nothing measured" >&2
    exit 2
fi
if ! "$PYTHON" -c "import torch, triton, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "bench/gpu.sh: $PYTHON lacks triton or a CUDA build of torch (torch.cuda.is_available() is false); nothing measured" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export MOESHRINK_GIT_COMMIT=${MOESHRINK_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
unset TRITON_INTERPRET
exec timeout 300 "$PYTHON" bench/triton_bandwidth.py --out bench/results "$@"
