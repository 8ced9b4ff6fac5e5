// The error a refit-runtime command answers with: a control-protocol error code and `where`
// (the field, tensor name or component the error is about). Thrown by the server and by
// worker jobs; the server turns it into the Response's Error unchanged.
#pragma once

#include <stdexcept>
#include <string>

#include "messages/control.pb.h"

namespace refit::child {

struct command_error : std::runtime_error {
  command_error(refit::control::v1::ErrorCode code, std::string where, const std::string& message)
    : std::runtime_error(message), code(code), where(std::move(where)) {}
  refit::control::v1::ErrorCode code;
  std::string where;
};

} // namespace refit::child
