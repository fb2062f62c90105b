// Streams over an in-memory byte string.
#ifndef MLCC_SRC_SUPPORT_BYTES_IO_H_
#define MLCC_SRC_SUPPORT_BYTES_IO_H_

#include <tvm/support/io.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace tvm {
namespace support {

class BytesInStream : public Stream {
 public:
  explicit BytesInStream(const std::string& bytes) : data_(bytes.data()), size_(bytes.size()) {}
  BytesInStream(const void* data, size_t size) : data_(static_cast<const char*>(data)), size_(size) {}
  using Stream::Read;
  using Stream::Write;
  size_t Read(void* ptr, size_t size) final {
    size_t n = std::min(size, size_ - pos_);
    if (n != 0) std::memcpy(ptr, data_ + pos_, n);
    pos_ += n;
    return n;
  }
  size_t Write(const void*, size_t) final { return 0; }

 private:
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

class BytesOutStream : public Stream {
 public:
  explicit BytesOutStream(std::string* out) : out_(out) {}
  using Stream::Read;
  using Stream::Write;
  size_t Read(void*, size_t) final { return 0; }
  size_t Write(const void* ptr, size_t size) final {
    out_->append(static_cast<const char*>(ptr), size);
    return size;
  }

 private:
  std::string* out_;
};

}  // namespace support
}  // namespace tvm

#endif  // MLCC_SRC_SUPPORT_BYTES_IO_H_
