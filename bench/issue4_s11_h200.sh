#!/usr/bin/env bash
# Issue 4, session 11, call 1: the issue's table with every column from one run (mlcc on session 10's default
# libraries, transformers eager + torch.compile on the 8B shape, the copy-bandwidth roofline), then the per-kernel
# floor: empty kernels back to back in one CUDA graph, with and without PDL, by grid size (bench/kernel_floor.py).
# Prepare here:
#   python bench/kernel_floor.py build --out .dev/floor
#   python bench/decode.py build --out .dev/bench10 && cp .dev/ref11/reference.npz .dev/bench10/
# Device: run(command="bash bench/issue4_s11_h200.sh", carry=[".gpu-rt", ".dev/floor", ".dev/bench10"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
T0=$(date +%s)
python3 bench/decode.py mlcc --libs "${LIBS:-.dev/bench10}" --out "$OUT"
echo "mlcc done at $(( $(date +%s) - T0 )) s"
python3 bench/decode.py hf --out "$OUT" --models llama3-8b --modes eager,compile-static --tag h200
echo "transformers done at $(( $(date +%s) - T0 )) s"
python3 bench/decode.py table "$OUT"/decode_mlcc.json "$OUT"/decode_hf_h200.json
(cd bench && python3 kernel_floor.py run --libs ../.dev/floor --out "$OUT")
echo "all done at $(( $(date +%s) - T0 )) s"
