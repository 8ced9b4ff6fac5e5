// refit-runtime's test-only faults (--fault COMMAND:KIND[:AFTER]): parsing, and applying one
// instead of running the command.
#include "runtime/child/server.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <stdexcept>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

#include "runtime/child/command_error.hpp"
#include "runtime/child/server_util.hpp"
#include "runtime/control/framing.hpp"
#include "runtime/control/protocol.hpp"
#include "runtime/control/protocol_version.hpp"


namespace refit::child {

using namespace detail;

namespace {

const char* fault_kind_name(fault_kind kind) {
  switch (kind) {
    case fault_kind::stall: return "stall";
    case fault_kind::exit: return "exit";
    case fault_kind::sigkill: return "sigkill";
    case fault_kind::error: return "error";
    case fault_kind::bad_frame: return "bad_frame";
    case fault_kind::wrong_id: return "wrong_id";
    case fault_kind::wrong_command: return "wrong_command";
    case fault_kind::wrong_result: return "wrong_result";
    case fault_kind::wrong_version: return "wrong_version";
    case fault_kind::forge_receipt: return "forge_receipt";
    case fault_kind::skew_logprobs: return "skew_logprobs";
  }
  return "unknown";
}

constexpr fault_kind all_fault_kinds[] = {
  fault_kind::stall,    fault_kind::exit,          fault_kind::sigkill,
  fault_kind::error,    fault_kind::bad_frame,     fault_kind::wrong_id,
  fault_kind::wrong_command, fault_kind::wrong_result, fault_kind::wrong_version,
  fault_kind::forge_receipt, fault_kind::skew_logprobs};

std::string known_command_names() {
  std::string names;
  for (int c = pb::Command_MIN + 1; c <= pb::Command_MAX; ++c)
    names += (names.empty() ? "" : ", ") + command_name(static_cast<pb::Command>(c));
  return names;
}

std::string known_fault_kinds() {
  std::string names;
  for (fault_kind kind : all_fault_kinds)
    names += (names.empty() ? "" : ", ") + std::string(fault_kind_name(kind));
  return names;
}

} // namespace

fault_spec parse_fault(const std::string& text) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (;;) {
    std::size_t colon = text.find(':', start);
    parts.push_back(text.substr(start, colon - start));
    if (colon == std::string::npos)
      break;
    start = colon + 1;
  }
  if (parts.size() < 2 || parts.size() > 3)
    throw std::invalid_argument("'" + text + "' is not COMMAND:KIND[:AFTER]");

  fault_spec fault;
  auto command = protocol::command_from_name(parts[0]);
  if (!command)
    throw std::invalid_argument("'" + text + "': unknown command '" + parts[0]
                                + "' (expected one of " + known_command_names() + ")");
  fault.command = *command;

  bool kind_found = false;
  for (fault_kind kind : all_fault_kinds) {
    if (parts[1] == fault_kind_name(kind)) {
      fault.kind = kind;
      kind_found = true;
    }
  }
  if (!kind_found)
    throw std::invalid_argument("'" + text + "': unknown fault kind '" + parts[1]
                                + "' (expected one of " + known_fault_kinds() + ")");

  if (parts.size() == 3) {
    const std::string& after = parts[2];
    if (after.empty() || after.size() > 9
        || after.find_first_not_of("0123456789") != std::string::npos)
      throw std::invalid_argument("'" + text + "': AFTER '" + after
                                  + "' is not a count of earlier occurrences (0..999999999)");
    fault.after = static_cast<std::uint32_t>(std::stoul(after));
  }
  return fault;
}

const fault_spec* server::take_fault(pb::Command command) {
  const std::uint32_t occurrence = occurrences_[command]++;
  for (const auto& fault : options_.faults)
    if (fault.command == command && fault.after == occurrence)
      return &fault;
  return nullptr;
}

server::fault_reply server::apply_fault(const fault_spec& fault, const pb::Request& request) {
  const pb::Command command = request.command();
  log_line(std::string("injecting fault ") + fault_kind_name(fault.kind) + " on "
           + command_name(command) + " (occurrence " + std::to_string(fault.after + 1) + ")");
  fault_reply reply;
  pb::Response response = envelope(request.request_id(), command);
  switch (fault.kind) {
    case fault_kind::stall:
      for (;;)
        std::this_thread::sleep_for(std::chrono::hours(1));
    case fault_kind::exit:
      ::_exit(fault_exit_code);
    case fault_kind::sigkill:
      ::raise(SIGKILL);
      ::_exit(fault_exit_code); // not reached: SIGKILL cannot be caught
    case fault_kind::error:
      set_error(response, pb::ERROR_CODE_INJECTED, command_name(command),
                "injected fault 'error' on " + command_name(command) + " (occurrence "
                  + std::to_string(fault.after + 1) + ")");
      break;
    case fault_kind::bad_frame:
      reply.raw_bytes = "refit:bad-frame!"; // 16 bytes; "refi" is not the magic "RFT1"
      return reply;
    case fault_kind::wrong_id:
      response.set_request_id(request.request_id() + 1);
      response.set_ok(true);
      set_empty_result(response, command);
      break;
    case fault_kind::wrong_command:
      response.set_command(other_command(command));
      response.set_ok(true);
      set_empty_result(response, command);
      break;
    case fault_kind::wrong_result:
      response.set_ok(true);
      set_empty_result(response, other_command(command));
      break;
    case fault_kind::wrong_version:
      response.set_protocol_version(wrong_protocol_version);
      response.set_ok(true);
      set_empty_result(response, command);
      break;
    case fault_kind::forge_receipt:
    case fault_kind::skew_logprobs:
      break; // handled in the serve loop: the command runs first
  }
  reply.response = std::move(response);
  return reply;
}


} // namespace refit::child
