#include "messages/errors.hpp"

#include <caf/atom.hpp>
#include <caf/message.hpp>

namespace refit {

const char* to_string(errc code) {
  switch (code) {
    case errc::none: return "none";
    case errc::runtime_unsupported: return "runtime_unsupported";
    case errc::runtime_invalid_argument: return "runtime_invalid_argument";
    case errc::runtime_invalid_state: return "runtime_invalid_state";
    case errc::runtime_protocol_version: return "runtime_protocol_version";
    case errc::runtime_malformed: return "runtime_malformed";
    case errc::runtime_internal: return "runtime_internal";
    case errc::runtime_validation: return "runtime_validation";
    case errc::runtime_injected: return "runtime_injected";
    case errc::protocol_error: return "protocol_error";
    case errc::runtime_timeout: return "runtime_timeout";
    case errc::runtime_exited: return "runtime_exited";
    case errc::spawn_failed: return "spawn_failed";
    case errc::not_attached: return "not_attached";
    case errc::broken: return "broken";
    case errc::busy: return "busy";
    case errc::asleep: return "asleep";
    case errc::update_open: return "update_open";
    case errc::needs_publication: return "needs_publication";
    case errc::invalid_argument: return "invalid_argument";
    case errc::invalid_state: return "invalid_state";
    case errc::validation_failed: return "validation_failed";
    case errc::poisoned: return "poisoned";
    case errc::restart_limit: return "restart_limit";
    case errc::shutting_down: return "shutting_down";
    case errc::preflight_failed: return "preflight_failed";
    case errc::gate_failed: return "gate_failed";
    case errc::manifest_mismatch: return "manifest_mismatch";
    case errc::verification_failed: return "verification_failed";
    case errc::unauthorized: return "unauthorized";
    case errc::protocol_mismatch: return "protocol_mismatch";
    case errc::join_refused: return "join_refused";
    case errc::rank_lost: return "rank_lost";
    case errc::coordinator_lost: return "coordinator_lost";
    case errc::coordinator_unreachable: return "coordinator_unreachable";
    case errc::barrier_timeout: return "barrier_timeout";
  }
  return "unknown";
}

caf::error make_refit_error(errc code, std::string where, std::string message) {
  return caf::make_error(code, std::move(where), std::move(message));
}

namespace {

bool is_refit(const caf::error& err) {
  return err && err.category() == caf::atom("refit");
}

std::string context_string(const caf::error& err, size_t index) {
  const auto& ctx = err.context();
  if (ctx.size() == 2 && ctx.match_element<std::string>(index))
    return ctx.get_as<std::string>(index);
  return {};
}

} // namespace

std::string error_where(const caf::error& err) {
  return is_refit(err) ? context_string(err, 0) : std::string{};
}

std::string error_message(const caf::error& err) {
  if (is_refit(err))
    return context_string(err, 1);
  return err ? caf::to_string(err) : std::string{};
}

std::string render(const caf::error& err) {
  if (!err)
    return "no error";
  if (!is_refit(err))
    return caf::to_string(err);
  std::string out = "refit.";
  out += to_string(static_cast<errc>(err.code()));
  auto where = error_where(err);
  if (!where.empty())
    out += " at " + where;
  auto msg = error_message(err);
  if (!msg.empty())
    out += ": " + msg;
  return out;
}

} // namespace refit
