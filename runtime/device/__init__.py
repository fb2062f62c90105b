"""mlcc.runtime.device: a compiled model on its device: loading library and weights, the KV-cache calls, the CUDA decode graph, token read-back, tensor parallelism (disco + NCCL), CPU threads."""
