// Version of the control protocol in messages/control.proto. The parent sends it in every
// Request; refit-runtime echoes it and answers ERROR_CODE_PROTOCOL_VERSION to any other.
#pragma once

#include <cstdint>

namespace refit::wire {

inline constexpr std::uint32_t protocol_version = 1;

} // namespace refit::wire
