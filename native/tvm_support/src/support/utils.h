// String helpers the runtime sources use.
#ifndef MLCC_SRC_SUPPORT_UTILS_H_
#define MLCC_SRC_SUPPORT_UTILS_H_

#include <cctype>
#include <string>
#include <vector>

namespace tvm {
namespace support {

inline bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

inline bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

inline bool IsNumber(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

inline std::vector<std::string> Split(const std::string& s, char delim) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : s) {
    if (c == delim) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  parts.push_back(cur);
  return parts;
}

}  // namespace support
}  // namespace tvm

#endif  // MLCC_SRC_SUPPORT_UTILS_H_
