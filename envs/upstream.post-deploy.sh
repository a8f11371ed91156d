#!/usr/bin/env bash
# Snakemake runs this once in the new environment: moeshrink from this workflow's source (the Snakefile
# sets MOESHRINK_SOURCE), editable so that jobs run the workflow's own code, with the upstream stage's extras.
set -euo pipefail
python -m pip install --no-input -e "${MOESHRINK_SOURCE:?set by the Snakefile: run through snakemake}[upstream]"
