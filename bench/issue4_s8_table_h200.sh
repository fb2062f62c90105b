#!/usr/bin/env bash
# Issue 4, session 8: the issue's table on the default build (deferred float16 RMSNorm scale; q4 RMSNorm staged in shared memory) timed with the
# engine's pipelined batch-1 decode loop (runtime.decode_pipeline; the synchronous loop's tok/s in the same rows,
# alternating rounds), transformers (eager, torch.compile) on the 8B shape in the same call. Each shape is checked
# before it is timed (argmax, decode_graph vs decode, the small shapes' logits vs the CPU build, pipelined vs
# synchronous greedy ids). Prepare here:
#   bash bench/prepare_device.sh && python bench/decode.py reference --out .dev/ref11
#   python bench/decode.py build --out .dev/bench9 && cp .dev/ref11/reference.npz .dev/bench9/
# Device: run(command="bash bench/issue4_s8_table_h200.sh", carry=[".gpu-rt", ".dev/bench9"])
LIBS=${LIBS:-.dev/bench9} exec bash "$(dirname "$0")/issue4_s6_table_h200.sh"
