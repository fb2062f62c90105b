// Bump allocator for the RPC endpoint's short-lived argument arrays; everything is freed at once by RecycleAll.
#ifndef MLCC_SRC_SUPPORT_ARENA_H_
#define MLCC_SRC_SUPPORT_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace tvm {
namespace support {

class Arena {
 public:
  void* Alloc(size_t size, size_t align = alignof(std::max_align_t)) {
    size_t space = size + align;
    blocks_.emplace_back(new uint8_t[space == 0 ? 1 : space]);
    uintptr_t p = reinterpret_cast<uintptr_t>(blocks_.back().get());
    p = (p + align - 1) / align * align;
    return reinterpret_cast<void*>(p);
  }

  template <typename T>
  T* allocate_(int count = 1) {
    return static_cast<T*>(Alloc(sizeof(T) * static_cast<size_t>(count), alignof(T)));
  }

  void RecycleAll() { blocks_.clear(); }

 private:
  std::vector<std::unique_ptr<uint8_t[]>> blocks_;
};

}  // namespace support
}  // namespace tvm

#endif  // MLCC_SRC_SUPPORT_ARENA_H_
