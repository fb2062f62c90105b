#!/usr/bin/env bash
# Issue 4, session 6, one device call: interleaved A/B of builds of the three q4f16_1 shapes (ab_decode.py's variants:
# the decode attention's tokens per step and block count, the cross-kernel L2 prefetch), every build checked first
# (argmax vs numpy, decode_graph vs decode exactly, the small shapes' logits vs the CPU build). Prepare here:
#   bash bench/prepare_device.sh && python bench/decode.py reference --out .dev/ref
#   (cd bench && python ab_decode.py build --out ../.dev/ab10 --variants base \
#       --model llama3-8b-q4f16_1,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1) && cp .dev/ref/reference.npz .dev/ab10/
#   and a "prev" folder with the same shapes from .dev/bench6 (the two-launch attention, against the one-launch
#   build of commit 7d9d5ec)
# (session 6's earlier calls built "attn-s5", "attn-128" and the L2-prefetch variants, from commit 45fdaf2 and the
# working tree before it: bench/results/README.md)
# Device: run(command="bash bench/issue4_s6_h200.sh", carry=[".gpu-rt", ".dev/ab10"]); EXTRA=--fixed-context: every
# round from the same 128-token prompt (otherwise the context grows ~130 tokens a round).
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab10 --out "$OUT" --variants base ${EXTRA:-} --rounds ${ROUNDS:-8})
