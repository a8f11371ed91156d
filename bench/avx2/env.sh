# Source this to time moeshrink as on an AVX2-only CPU (see sitecustomize.py beside it):
#   source bench/avx2/env.sh && .venv/bin/snakemake --cores all report/r013.html
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
