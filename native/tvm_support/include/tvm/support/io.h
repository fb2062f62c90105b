// Minimal binary stream interface used by the TVM runtime sources (tensor and executable (de)serialization).
#ifndef MLCC_TVM_SUPPORT_IO_H_
#define MLCC_TVM_SUPPORT_IO_H_

#include <cstddef>
#include <cstdint>

namespace tvm {
namespace support {

template <typename T>
struct Serializer;

class Stream {
 public:
  virtual ~Stream() = default;
  /*! \return bytes actually read */
  virtual size_t Read(void* ptr, size_t size) = 0;
  /*! \return bytes written */
  virtual size_t Write(const void* ptr, size_t size) = 0;

  template <typename T>
  void Write(const T& data) {
    Serializer<T>::Write(this, data);
  }
  template <typename T>
  bool Read(T* out) {
    return Serializer<T>::Read(this, out);
  }
  template <typename T>
  void WriteArray(const T* data, size_t num_elems) {
    for (size_t i = 0; i < num_elems; ++i) Write<T>(data[i]);
  }
  template <typename T>
  bool ReadArray(T* data, size_t num_elems) {
    for (size_t i = 0; i < num_elems; ++i) {
      if (!Read<T>(data + i)) return false;
    }
    return true;
  }
};

}  // namespace support
}  // namespace tvm

#include <tvm/support/serializer.h>

#endif  // MLCC_TVM_SUPPORT_IO_H_
