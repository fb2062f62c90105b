#!/usr/bin/env bash
# Session 4 step: RMSNorm/SwiGLU folded into the q4 GEMVs, and PDL, measured in one device call — interleaved A/B
# of the three builds per shape (bench/ab_decode.py, small shapes' logits checked against the CPU build first),
# the full decode table of the default build, and 8B profiles of the default and no-PDL builds.
# Prepare here:
#   bash bench/prepare_device.sh
#   python bench/decode.py build --out .dev/bench
#   python bench/decode.py reference --out .dev/ref && cp .dev/ref/reference.npz .dev/bench/ && cp .dev/ref/reference.npz .dev/ab/
#   (cd bench && python ab_decode.py build --out ../.dev/ab)
# Device: run(command="bash bench/fold_pdl_h200.sh", carry=[".gpu-rt", ".dev/bench", ".dev/ab"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab --out "$OUT")
python3 bench/decode.py mlcc --libs .dev/bench --out "$OUT"
python3 bench/profile_decode.py --libs .dev/ab/no-pdl --model llama3-8b-q4f16_1 --out "$OUT/no-pdl"
python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --out "$OUT"
python3 -c "import json,sys; [print(r['model'], r['quant'], round(r.get('decode_tok_s', 0), 1), 'tok/s', round(100*r.get('fraction_of_roofline', 0), 1), '%', r.get('check_vs_cpu'), r.get('error', '')) for r in json.load(open(sys.argv[1]))]" "$OUT"/decode_mlcc.json
