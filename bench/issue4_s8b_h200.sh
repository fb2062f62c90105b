#!/usr/bin/env bash
# Issue 4, session 8, second call: (1) decode.py mlcc on session 7's libraries, the pipelined loop (now waiting for
# the previous step before queuing the next one's KV metadata) beside the synchronous one; (2) the A/B of the
# float16 GEMV with RMSNorm as a deferred 1/rms(x) row scale (commit 9182ae4, reverted in 7e8d903) against the
# default build, 8B and SmolLM2 q0f16. Prepare here:
#   git worktree add /tmp/wt_defer 9182ae4 && mkdir -p /tmp/mlccdefer && ln -sfn /tmp/wt_defer /tmp/mlccdefer/mlcc
#   M=llama3-8b-q0f16,smollm2-135m-q0f16; cd bench && python ab_decode.py build --out ../.dev/ab14 --variants base \
#     --model $M && PYTHONPATH=/tmp/mlccdefer python ab_decode.py build --out ../.dev/ab14d --variants base --model $M
#   mv .dev/ab14d/base .dev/ab14/new && cp .dev/ref11/reference.npz .dev/ab14/
# Device: run(command="bash bench/issue4_s8b_h200.sh", carry=[".gpu-rt", ".dev/bench7", ".dev/ab14"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 bench/decode.py mlcc --libs .dev/bench7 --out "$OUT"
python3 bench/decode.py table "$OUT"/decode_mlcc.json
(cd bench && python3 ab_decode.py run --libs ../.dev/ab14 --out "$OUT" --variants base,sync --rounds 6)
