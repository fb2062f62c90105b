// Byte FIFO between the RPC endpoint and its channel. A deque keeps it simple; throughput is irrelevant here.
#ifndef MLCC_SRC_SUPPORT_RING_BUFFER_H_
#define MLCC_SRC_SUPPORT_RING_BUFFER_H_

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

namespace tvm {
namespace support {

class RingBuffer {
 public:
  size_t bytes_available() const { return data_.size() - head_; }

  void Reserve(size_t n) { data_.reserve(head_ + n); }

  void Read(void* out, size_t size) {
    std::memcpy(out, data_.data() + head_, size);
    Consume(size);
  }

  void Write(const void* in, size_t size) {
    const char* p = static_cast<const char*>(in);
    data_.insert(data_.end(), p, p + size);
  }

  /*! \brief hand up to max_nbytes to frecv(data, size) -> sent; drop what it took. */
  template <typename FSend>
  size_t ReadWithCallback(FSend frecv, size_t max_nbytes) {
    size_t n = std::min(max_nbytes, bytes_available());
    if (n == 0) return 0;
    size_t sent = frecv(data_.data() + head_, n);
    Consume(sent);
    return sent;
  }

  /*! \brief let fsend(buf, size) -> received fill up to max_nbytes at the tail. */
  template <typename FRecv>
  size_t WriteWithCallback(FRecv fsend, size_t max_nbytes) {
    size_t old = data_.size();
    data_.resize(old + max_nbytes);
    size_t got = fsend(data_.data() + old, max_nbytes);
    data_.resize(old + got);
    return got;
  }

 private:
  void Consume(size_t n) {
    head_ += n;
    if (head_ == data_.size()) {
      data_.clear();
      head_ = 0;
    }
  }
  std::vector<char> data_;
  size_t head_ = 0;
};

}  // namespace support
}  // namespace tvm

#endif  // MLCC_SRC_SUPPORT_RING_BUFFER_H_
