#!/usr/bin/env bash
# One device call: install, GPU tests, the demo, and (optionally) benchmark commands given as
# arguments. Everything is logged under $OUT (or ./.out when run by hand).
set -uo pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 FXFUSE_CACHE_DIR=/tmp/fxfuse-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || cat /tmp/install.log
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee -a "$OUT/versions.txt"
# clocks and power every 2 s while the call runs, appended to versions.txt at the end
(nvidia-smi dmon -s pc -d 2 >/tmp/dmon.log 2>&1 &) ; trap 'echo "== dmon (pwr W, gtemp, mtemp, sm MHz, mem MHz)" >>"$OUT/versions.txt"; cat /tmp/dmon.log >>"$OUT/versions.txt"' EXIT
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest tests -m cuda -q -x -o addopts="" 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
fi
if [ "${SKIP_DEMO:-0}" != 1 ]; then
  timeout 120 python3 -m fxfuse.demo 2>&1 | tee "$OUT/demo.log" | tail -6
fi
for cmd in "$@"; do
  echo "== $cmd"; bash -c "$cmd" 2>&1 | tee -a "$OUT/bench.log" | tail -60
done
