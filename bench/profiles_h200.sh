#!/usr/bin/env bash
# Where the time goes for the small shapes' decode and for the 8B prefill (issue 4), one device call.
# Prepare as for bench/issue4_h200.sh; run(command="bash bench/profiles_h200.sh", carry=[".gpu-rt", ".dev/bench"])
set -uo pipefail
source .gpu-rt/setup.sh
for m in smollm2-135m-q4f16_1 qwen2.5-0.5b-q4f16_1; do
  python3 bench/profile_decode.py --libs .dev/bench --model $m --out "$OUT"
done
for n in 512 2048; do
  python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --prefill $n --steps 3 --out "$OUT"
done
