// NVTX ranges are profiling annotations; there is no NVTX in wasm, so they do nothing.
#ifndef MLCC_TVM_SUPPORT_CUDA_NVTX_H_
#define MLCC_TVM_SUPPORT_CUDA_NVTX_H_
#include <string>
namespace tvm {
namespace support {
class NVTXScopedRange {
 public:
  explicit NVTXScopedRange(const char*) {}
  explicit NVTXScopedRange(const std::string&) {}
};
}  // namespace support
}  // namespace tvm
#endif  // MLCC_TVM_SUPPORT_CUDA_NVTX_H_
