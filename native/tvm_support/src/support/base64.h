// Base64 streams (RFC 4648 alphabet, '=' padding) wrapping another Stream; used for tensors in JSON.
#ifndef MLCC_SRC_SUPPORT_BASE64_H_
#define MLCC_SRC_SUPPORT_BASE64_H_

#include <tvm/support/io.h>

#include <cctype>
#include <cstdint>
#include <string>

namespace tvm {
namespace support {

namespace base64 {
inline const char* Alphabet() { return "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"; }
inline int Decode(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}
}  // namespace base64

class Base64OutStream : public Stream {
 public:
  explicit Base64OutStream(Stream* out) : out_(out) {}
  using Stream::Read;
  using Stream::Write;
  size_t Read(void*, size_t) final { return 0; }
  size_t Write(const void* ptr, size_t size) final {
    const uint8_t* p = static_cast<const uint8_t*>(ptr);
    for (size_t i = 0; i < size; ++i) {
      buf_[nbuf_++] = p[i];
      if (nbuf_ == 3) Flush3();
    }
    return size;
  }
  /*! \brief write the final partial group with padding */
  void Finish() {
    if (nbuf_ == 0) return;
    const char* a = base64::Alphabet();
    char enc[4];
    uint32_t v = (buf_[0] << 16) | ((nbuf_ > 1 ? buf_[1] : 0) << 8);
    enc[0] = a[(v >> 18) & 63];
    enc[1] = a[(v >> 12) & 63];
    enc[2] = nbuf_ > 1 ? a[(v >> 6) & 63] : '=';
    enc[3] = '=';
    out_->Write(enc, 4);
    nbuf_ = 0;
  }

 private:
  void Flush3() {
    const char* a = base64::Alphabet();
    uint32_t v = (buf_[0] << 16) | (buf_[1] << 8) | buf_[2];
    char enc[4] = {a[(v >> 18) & 63], a[(v >> 12) & 63], a[(v >> 6) & 63], a[v & 63]};
    out_->Write(enc, 4);
    nbuf_ = 0;
  }
  Stream* out_;
  uint8_t buf_[3];
  int nbuf_ = 0;
};

class Base64InStream : public Stream {
 public:
  explicit Base64InStream(Stream* in) : in_(in) {}
  using Stream::Read;
  using Stream::Write;
  /*! \brief skip leading whitespace before the encoded data */
  void InitPosition() {}
  size_t Write(const void*, size_t) final { return 0; }
  size_t Read(void* ptr, size_t size) final {
    uint8_t* out = static_cast<uint8_t*>(ptr);
    size_t n = 0;
    while (n < size) {
      if (pos_ == len_ && !Refill()) break;
      out[n++] = dec_[pos_++];
    }
    return n;
  }

 private:
  // decode the next 4 significant characters into up to 3 bytes
  bool Refill() {
    char quad[4];
    int k = 0;
    while (k < 4) {
      char c;
      if (in_->Read(&c, 1) != 1) return false;
      if (std::isspace(static_cast<unsigned char>(c))) continue;
      quad[k++] = c;
    }
    uint32_t v = 0;
    int valid = 0;
    for (int i = 0; i < 4; ++i) {
      int d = quad[i] == '=' ? 0 : base64::Decode(quad[i]);
      if (d < 0) return false;
      if (quad[i] != '=') ++valid;
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    dec_[0] = (v >> 16) & 255;
    dec_[1] = (v >> 8) & 255;
    dec_[2] = v & 255;
    len_ = valid == 4 ? 3 : valid == 3 ? 2 : 1;
    pos_ = 0;
    return valid >= 2;
  }
  Stream* in_;
  uint8_t dec_[3];
  int len_ = 0;
  int pos_ = 0;
};

}  // namespace support
}  // namespace tvm

#endif  // MLCC_SRC_SUPPORT_BASE64_H_
