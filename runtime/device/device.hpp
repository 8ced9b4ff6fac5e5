// Device identity shared by trainer ranks and the runtime: "cpu:N" / "cuda:N" specs and the
// physical identity string (UUID) each side reports for preflight and handle selection.
#pragma once

#include <cstdint>
#include <string>

namespace refit::device {

enum class kind : std::uint8_t { cpu, cuda };

struct spec {
  kind k = kind::cpu;
  int index = 0;
};

// Parses "cpu:N" or "cuda:N" (N >= 0). Throws std::invalid_argument naming `where`.
spec parse(const std::string& text, const std::string& where);
std::string to_string(const spec& s);

// Physical identity. CPU devices: "CPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", a stable
// hash of the host's machine id and the index, so trainer and runtime processes on one
// host agree. CUDA devices are resolved by the CUDA build (GPU-... as NVML prints it).
std::string cpu_uuid(int index);
// "<prefix>-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of 16 identity bytes (NVML's GPU UUID form).
std::string format_uuid(const char* prefix, const unsigned char* bytes16);

// MemAvailable from /proc/meminfo (bytes): the free memory a CPU device reports.
std::uint64_t host_available_bytes();

} // namespace refit::device
