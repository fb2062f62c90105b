#!/usr/bin/env bash
# Issue 4, session 8: the issue's table with the engine's pipelined batch-1 decode loop (runtime.decode_pipeline;
# the synchronous loop's tok/s in the same rows, alternating rounds), one device call, on session 7's libraries
# (the kernels did not change). Each shape is checked before it is timed (argmax, decode_graph vs decode, the small
# shapes' logits vs the CPU build, pipelined vs synchronous greedy ids). Prepare here as issue4_s7_table_h200.sh.
# Device: run(command="bash bench/issue4_s8_table_h200.sh", carry=[".gpu-rt", ".dev/bench7"])
LIBS=${LIBS:-.dev/bench7} exec bash "$(dirname "$0")/issue4_s6_table_h200.sh"
