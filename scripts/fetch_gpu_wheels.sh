#!/usr/bin/env bash
# Run HERE (not on the GPU machine): download the pinned wheels the GPU image lacks into .whl/
# (git-ignored), so scripts/gpu_check.sh can install them there without network.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl transformers==5.24.0 huggingface_hub==2.4.0 hydra-core==1.3.8 omegaconf==2.3.1 \
  antlr4-python3-runtime==4.9.3 2>/dev/null || \
python3 -m pip download --no-deps -d .whl transformers==5.24.0 huggingface_hub==2.4.0 \
  hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
du -sh .whl
