#include "messages/types.hpp"

namespace refit {

const char* to_string(connection_state s) {
  switch (s) {
    case connection_state::detached: return "DETACHED";
    case connection_state::idle: return "IDLE";
    case connection_state::inflight: return "INFLIGHT";
    case connection_state::broken: return "BROKEN";
  }
  return "UNKNOWN";
}

} // namespace refit
