#!/usr/bin/env bash
# Issue 4, session 6: the table on the default build, one device call (each shape checked before it is
# timed: decode_graph vs decode exactly, the small shapes' logits vs the CPU build), with transformers (eager,
# torch.compile) on the 8B shape in the same call. Prepare here:
#   bash bench/prepare_device.sh && python bench/decode.py reference --out .dev/ref
#   python bench/decode.py build --out .dev/bench6 && cp .dev/ref/reference.npz .dev/bench6/
# Device: run(command="bash bench/issue4_s6_table_h200.sh", carry=[".gpu-rt", ".dev/bench6"])
# LIBS=DIR times another build folder (issue4_s7_table_h200.sh).
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 bench/decode.py mlcc --libs "${LIBS:-.dev/bench6}" --out "$OUT"
python3 bench/decode.py hf --out "$OUT" --models llama3-8b --modes eager,compile-static --tag h200
python3 bench/decode.py table "$OUT"/decode_mlcc.json "$OUT"/decode_hf_h200.json
