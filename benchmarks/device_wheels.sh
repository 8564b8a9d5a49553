#!/usr/bin/env bash
# The wheels the device machine lacks (it has torch, transformers, safetensors, tokenizers,
# jinja2, msgpack, numpy; no network): downloaded here for its Python 3.12 into .whl/, which
# .git/info/exclude ignores and the device call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
for spec in llguidance pyzmq gguf; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
ls -la .whl
