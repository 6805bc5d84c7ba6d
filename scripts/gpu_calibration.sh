#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, CuPy and PyTorch (for the loads): the GPU tests (tests/gpu), then
# the GPU probe as `neuralgrid node probe-gpu` runs it, three times idle and once each beside a
# compute-bound and a memory-bound load in another process (an inference server's two kinds of
# work). Each probe's figures go to DIR/NAME.json: a GPU model's calibration (docs/security.md).
set -u
out=${1:?usage: scripts/gpu_calibration.sh DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pytest -c /dev/null --noconftest -p no:cacheprovider -q -rA tests/gpu 2>&1 | tee "$out/pytest.log"

probe() { python3 -m neuralgrid.cli node probe-gpu --share "$1" --json "$out/$2.json"; }
beside() {  # $1: the load's name, $2: its Python loop; then the probe at $3 of free memory
    python3 -c "import torch, time
$2" &
    local load=$!
    sleep 8  # the load's allocations and first kernels
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    probe "$3" "$1"
    kill "$load"; wait "$load" 2>/dev/null
}

for i in 1 2 3; do probe 0.5 "idle-$i"; done
beside busy-compute 'a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
while True: a @ a' 0.4
beside busy-memory 'a = torch.empty(8 << 30, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
while True: b.copy_(a)' 0.4
