#!/usr/bin/env bash
# Issue 4 in one device call: per-kernel GEMV and decode-attention checks (numpy) + timings, then batch-1 decode/prefill of every shape
# (logits checked against the CPU build on the same random weights before anything is timed), then a kernel
# profile of the 8B q4f16_1 decode step. Prepare here first:
#   bash bench/prepare_device.sh
#   python bench/gemv_kernels.py build --out .dev/gemv
#   python bench/decode_attention.py build --out .dev/attn
#   python bench/decode.py build --out .dev/bench
#   python bench/decode.py reference --out .dev/ref && cp .dev/ref/reference.npz .dev/bench/
#   (cd bench && python ab_decode.py build --out ../.dev/ab) && cp .dev/ref/reference.npz .dev/ab/
# Device: run(command="bash bench/issue4_h200.sh", carry=[".gpu-rt", ".dev/gemv", ".dev/attn", ".dev/bench", ".dev/ab"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 bench/gemv_kernels.py run --libs .dev/gemv --out "$OUT"
python3 bench/decode_attention.py run --libs .dev/attn --out "$OUT"
python3 bench/decode.py mlcc --libs .dev/bench --out "$OUT"
# programmatic dependent launch on/off, interleaved in one process (the step time drifts between calls)
[ -d .dev/ab ] && (cd bench && python3 ab_decode.py run --libs ../.dev/ab --out "$OUT")
python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --out "$OUT"
# PDL overlaps a kernel's wait with its predecessor, which the profiler counts as busy: kernel times from the no-PDL build
[ -d .dev/ab ] && python3 bench/profile_decode.py --libs .dev/ab/no-pdl --model llama3-8b-q4f16_1 --out "$OUT/no-pdl"
python3 bench/profile_decode.py --libs .dev/bench --model llama3-8b-q4f16_1 --prefill 2048 --steps 3 --out "$OUT"
# transformers on the same shapes in the same call: generate() eager (static cache) and torch.compile steps, gpt-fast style
python3 bench/decode.py hf --out "$OUT" --models "${HF_MODELS:-llama3-8b}" --modes eager,compile-static --tag h200
python3 bench/decode.py table "$OUT"/decode_mlcc.json "$OUT"/decode_hf_h200.json
