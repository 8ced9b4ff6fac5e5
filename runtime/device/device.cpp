#include "runtime/device/device.hpp"

#include <cstdio>
#include <fstream>
#include <stdexcept>

#include <openssl/sha.h>

namespace refit::device {

spec parse(const std::string& text, const std::string& where) {
  auto colon = text.find(':');
  auto bad = [&](const std::string& why) {
    return std::invalid_argument(where + ": device '" + text + "' " + why
                                 + " (expected cpu:N or cuda:N)");
  };
  if (colon == std::string::npos)
    throw bad("has no ':'");
  spec s;
  auto k = text.substr(0, colon);
  if (k == "cpu")
    s.k = kind::cpu;
  else if (k == "cuda")
    s.k = kind::cuda;
  else
    throw bad("has unknown kind '" + k + "'");
  auto idx = text.substr(colon + 1);
  if (idx.empty() || idx.size() > 6 || idx.find_first_not_of("0123456789") != std::string::npos)
    throw bad("has no valid index");
  s.index = std::stoi(idx);
  return s;
}

std::string to_string(const spec& s) {
  return std::string(s.k == kind::cpu ? "cpu:" : "cuda:") + std::to_string(s.index);
}

std::string cpu_uuid(int index) {
  std::string machine;
  for (const char* path : {"/etc/machine-id", "/var/lib/dbus/machine-id"}) {
    std::ifstream in(path);
    if (in && std::getline(in, machine) && !machine.empty())
      break;
  }
  if (machine.empty())
    machine = "no-machine-id";
  std::string key = machine + "/cpu/" + std::to_string(index);
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(key.data()), key.size(), d);
  return format_uuid("CPU", d);
}

std::string format_uuid(const char* prefix, const unsigned char* b) {
  char buf[80];
  std::snprintf(buf, sizeof(buf),
                "%s-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", prefix,
                b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
                b[13], b[14], b[15]);
  return buf;
}

std::uint64_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:")
      return kb * 1024;
  return 0;
}

} // namespace refit::device
