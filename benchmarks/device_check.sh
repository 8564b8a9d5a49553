#!/usr/bin/env bash
# The prepared GPU check, for a session lent a device machine: one call, under 8 minutes.
#   here:   bash benchmarks/device_wheels.sh          (the few packages that machine lacks -> .whl/)
#   there:  run(command="bash benchmarks/device_check.sh", carry=[".whl"], timeout_s=540)
# It runs the CUDA tests, then benchmarks/device_check.py (parity on a random-weight model of the
# default model's shape made on the device, and tokens/s against transformers on the same GPU),
# and leaves every result under $OUT (the device tool brings that folder back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvserve-device-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"; } \
    > "$OUT/machine.txt" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
    tests/model/test_paged_attention.py tests/tp/test_tp_cuda.py -k "cuda" \
    > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests: exit $?" | tee -a "$OUT/machine.txt"
timeout 240 python3 -m benchmarks.device_check --out "$OUT" > "$OUT/device_check.log" 2>&1
status=$?
echo "device check: exit $status" | tee -a "$OUT/machine.txt"
cat "$OUT/device_check.md" 2>/dev/null
tail -5 "$OUT/cuda_tests.log"
exit $status
