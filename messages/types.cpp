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

const char* to_string(phase_kind k) {
  switch (k) {
    case phase_kind::prepare: return "prepare";
    case phase_kind::materialize: return "materialize";
    case phase_kind::transfer: return "transfer";
    case phase_kind::manifest: return "manifest";
    case phase_kind::final: return "final";
  }
  return "unknown";
}

std::string to_string(const phase_id& p) {
  std::string out = to_string(p.k());
  if (p.k() == phase_kind::materialize || p.k() == phase_kind::transfer)
    out += "[" + std::to_string(p.chunk) + "]";
  return out + " of " + p.publication_id;
}

const char* to_string(publication_state s) {
  switch (s) {
    case publication_state::idle: return "Idle";
    case publication_state::initialized: return "Initialized";
    case publication_state::started: return "Started";
    case publication_state::loading: return "Loading";
    case publication_state::finalizing: return "Finalizing";
    case publication_state::committed: return "Committed";
    case publication_state::released: return "Released";
    case publication_state::poisoned: return "Poisoned";
  }
  return "Unknown";
}

} // namespace refit
