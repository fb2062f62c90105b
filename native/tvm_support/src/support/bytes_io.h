// Streams over an in-memory byte string.
#ifndef MLCC_SRC_SUPPORT_BYTES_IO_H_
#define MLCC_SRC_SUPPORT_BYTES_IO_H_

#include <tvm/support/io.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

namespace tvm {
namespace support {

class BytesInStream : public Stream {
 public:
  // Owns a copy: callers pass ffi::Bytes, whose conversion to std::string is a temporary.
  explicit BytesInStream(std::string bytes) : owned_(std::move(bytes)), data_(owned_.data()), size_(owned_.size()) {}
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
  std::string owned_;
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
