#!/usr/bin/env bash
# Issue 4, session 7: the issue's table on the default build, one device call (each shape checked before it is
# timed: decode_graph vs decode exactly, the small shapes' logits vs the CPU build), with transformers (eager,
# torch.compile) on the 8B shape in the same call: session 6's script on this session's builds. Prepare here:
#   bash bench/prepare_device.sh && python bench/decode.py reference --out .dev/ref11
#   python bench/decode.py build --out .dev/bench7 && cp .dev/ref11/reference.npz .dev/bench7/
# Device: run(command="bash bench/issue4_s7_table_h200.sh", carry=[".gpu-rt", ".dev/bench7"])
LIBS=.dev/bench7 exec bash "$(dirname "$0")/issue4_s6_table_h200.sh"
