#!/usr/bin/env bash
# Builds ggml's CPU library from a ggml source folder (a fetched snapshot of github.com/ggml-org/ggml)
# in a temporary folder, for bench/quality.py's peers; nothing of ggml is kept in this repository.
#   bench/build_ggml.sh /path/to/ggml-source [build-folder]
# prints the path of libggml-base.so: pass it to bench/quality.py --ggml (or MOESHRINK_GGML_LIB).
set -euo pipefail
source_dir=${1:?usage: bench/build_ggml.sh GGML_SOURCE_FOLDER [BUILD_FOLDER]}
build_dir=${2:-$(mktemp -d /tmp/ggml-build.XXXXXX)}
[ -f "$source_dir/include/ggml.h" ] || { echo "build_ggml.sh: $source_dir has no include/ggml.h" >&2; exit 2; }
cmake -S "$source_dir" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON \
  -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF > "$build_dir.cmake.log" 2>&1
cmake --build "$build_dir" -j "$(nproc)" --target ggml-base > "$build_dir.build.log" 2>&1
ls "$build_dir"/src/libggml-base.so
