// Serializer<T>: how a value goes through a support::Stream. Trivially copyable values are written as their
// bytes (little-endian wasm/x86 only), strings and vectors as a uint64 length then elements.
#ifndef MLCC_TVM_SUPPORT_SERIALIZER_H_
#define MLCC_TVM_SUPPORT_SERIALIZER_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/string.h>
#include <tvm/support/io.h>

#include <map>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tvm {
namespace support {

template <typename T>
struct Serializer {
  static_assert(std::is_trivially_copyable<T>::value, "no Serializer for this type");
  static constexpr bool enabled = true;
  static void Write(Stream* strm, const T& data) { strm->Write(&data, sizeof(T)); }
  static bool Read(Stream* strm, T* out) { return strm->Read(out, sizeof(T)) == sizeof(T); }
};

template <>
struct Serializer<std::string> {
  static constexpr bool enabled = true;
  static void Write(Stream* strm, const std::string& s) {
    uint64_t n = s.size();
    strm->Write(&n, sizeof(n));
    if (n != 0) strm->Write(s.data(), n);
  }
  static bool Read(Stream* strm, std::string* out) {
    uint64_t n;
    if (strm->Read(&n, sizeof(n)) != sizeof(n)) return false;
    out->resize(n);
    return n == 0 || strm->Read(&(*out)[0], n) == n;
  }
};

template <typename T>
struct Serializer<std::vector<T>> {
  static constexpr bool enabled = true;
  static void Write(Stream* strm, const std::vector<T>& v) {
    uint64_t n = v.size();
    strm->Write(&n, sizeof(n));
    if constexpr (std::is_trivially_copyable<T>::value) {
      if (n != 0) strm->Write(v.data(), n * sizeof(T));
    } else {
      for (const T& e : v) Serializer<T>::Write(strm, e);
    }
  }
  static bool Read(Stream* strm, std::vector<T>* out) {
    uint64_t n;
    if (strm->Read(&n, sizeof(n)) != sizeof(n)) return false;
    out->resize(n);
    if constexpr (std::is_trivially_copyable<T>::value) {
      return n == 0 || strm->Read(out->data(), n * sizeof(T)) == n * sizeof(T);
    } else {
      for (auto& e : *out) {
        if (!Serializer<T>::Read(strm, &e)) return false;
      }
      return true;
    }
  }
};

template <typename A, typename B>
struct Serializer<std::pair<A, B>> {
  static constexpr bool enabled = true;
  static void Write(Stream* strm, const std::pair<A, B>& p) {
    Serializer<A>::Write(strm, p.first);
    Serializer<B>::Write(strm, p.second);
  }
  static bool Read(Stream* strm, std::pair<A, B>* out) {
    return Serializer<A>::Read(strm, &out->first) && Serializer<B>::Read(strm, &out->second);
  }
};

template <typename M>
struct MapSerializer {
  static constexpr bool enabled = true;
  using K = typename M::key_type;
  using V = typename M::mapped_type;
  static void Write(Stream* strm, const M& m) {
    std::vector<std::pair<K, V>> items(m.begin(), m.end());
    Serializer<std::vector<std::pair<K, V>>>::Write(strm, items);
  }
  static bool Read(Stream* strm, M* out) {
    std::vector<std::pair<K, V>> items;
    if (!Serializer<std::vector<std::pair<K, V>>>::Read(strm, &items)) return false;
    out->clear();
    out->insert(items.begin(), items.end());
    return true;
  }
};

template <typename K, typename V>
struct Serializer<std::map<K, V>> : MapSerializer<std::map<K, V>> {};
template <typename K, typename V>
struct Serializer<std::unordered_map<K, V>> : MapSerializer<std::unordered_map<K, V>> {};

// ffi containers use the same layout as their std counterparts
template <>
struct Serializer<ffi::String> {
  static constexpr bool enabled = true;
  static void Write(Stream* strm, const ffi::String& s) { Serializer<std::string>::Write(strm, std::string(s)); }
  static bool Read(Stream* strm, ffi::String* out) {
    std::string s;
    if (!Serializer<std::string>::Read(strm, &s)) return false;
    *out = ffi::String(std::move(s));
    return true;
  }
};

template <typename T>
struct Serializer<ffi::Array<T>> {
  static constexpr bool enabled = true;
  static void Write(Stream* strm, const ffi::Array<T>& a) {
    uint64_t n = a.size();
    strm->Write(&n, sizeof(n));
    for (const T& e : a) Serializer<T>::Write(strm, e);
  }
  static bool Read(Stream* strm, ffi::Array<T>* out) {
    uint64_t n;
    if (strm->Read(&n, sizeof(n)) != sizeof(n)) return false;
    ffi::Array<T> a;
    for (uint64_t i = 0; i < n; ++i) {
      T e;
      if (!Serializer<T>::Read(strm, &e)) return false;
      a.push_back(e);
    }
    *out = a;
    return true;
  }
};

template <typename K, typename V>
struct Serializer<ffi::Map<K, V>> {
  static constexpr bool enabled = true;
  static void Write(Stream* strm, const ffi::Map<K, V>& m) {
    uint64_t n = m.size();
    strm->Write(&n, sizeof(n));
    for (const auto& kv : m) {
      Serializer<K>::Write(strm, kv.first);
      Serializer<V>::Write(strm, kv.second);
    }
  }
  static bool Read(Stream* strm, ffi::Map<K, V>* out) {
    uint64_t n;
    if (strm->Read(&n, sizeof(n)) != sizeof(n)) return false;
    ffi::Map<K, V> m;
    for (uint64_t i = 0; i < n; ++i) {
      K k;
      V v;
      if (!Serializer<K>::Read(strm, &k) || !Serializer<V>::Read(strm, &v)) return false;
      m.Set(k, v);
    }
    *out = m;
    return true;
  }
};

}  // namespace support
}  // namespace tvm

#endif  // MLCC_TVM_SUPPORT_SERIALIZER_H_
