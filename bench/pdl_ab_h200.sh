#!/usr/bin/env bash
# Programmatic dependent launch, A/B in one device call: the q4 GEMVs launched back to back with and without PDL,
# then batch-1 decode of every shape built with PDL (logits of the small shapes checked against the CPU build
# first) and the 8B q4f16_1 shape built without it (MLCC_CUDA_PDL=0), then the 8B decode profile with PDL.
# Prepare here:
#   bash bench/prepare_device.sh
#   python bench/gemv_kernels.py build --out .dev/gemv
#   python bench/decode.py build --out .dev/bench
#   python bench/decode.py reference --out .dev/ref && cp .dev/ref/reference.npz .dev/bench/
#   MLCC_CUDA_PDL=0 python bench/decode.py build --out .dev/bench-nopdl --only llama3-8b/q4f16_1
# Device: run(command="bash bench/pdl_ab_h200.sh", carry=[".gpu-rt", ".dev/gemv", ".dev/bench", ".dev/bench-nopdl"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 bench/gemv_kernels.py run --libs .dev/gemv --out "$OUT"
python3 bench/decode.py mlcc --libs .dev/bench-nopdl --only llama3-8b/q4f16_1 --out "$OUT/nopdl"
python3 bench/decode.py mlcc --libs .dev/bench --out "$OUT/pdl"
python3 bench/decode.py mlcc --libs .dev/bench-nopdl --only llama3-8b/q4f16_1 --out "$OUT/nopdl2"
python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --out "$OUT"
for f in "$OUT"/nopdl/decode_mlcc.json "$OUT"/pdl/decode_mlcc.json "$OUT"/nopdl2/decode_mlcc.json; do
  python3 -c "import json,sys; [print(sys.argv[1].split('/')[-2], r['model'], r['quant'], round(r.get('decode_tok_s', 0), 1), 'tok/s', round(100*r.get('fraction_of_roofline', 0), 1), '%', r.get('error', '')) for r in json.load(open(sys.argv[1]))]" "$f"
done
