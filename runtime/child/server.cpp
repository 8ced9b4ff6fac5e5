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
#include "runtime/framing.hpp"
#include "runtime/protocol.hpp"
#include "runtime/protocol_version.hpp"

namespace refit::child {

namespace {

std::string command_name(pb::Command command) { return protocol::command_name(command); }

constexpr const char* runtime_kind = "refit-runtime";
constexpr const char* runtime_version = "0.1.0";
constexpr std::uint32_t wrong_protocol_version = 99;
constexpr int fault_exit_code = 3;
constexpr auto write_timeout = std::chrono::seconds(30);
// Generation: KV block (prefix-cache granularity) and how long a TP worker waits for the
// others inside one collective before the group is aborted.
constexpr std::uint32_t kv_block_size = 16;
constexpr auto collective_timeout = std::chrono::seconds(120);

inference::engine_options generation_options() {
  inference::engine_options o;
  o.block_size = kv_block_size;
  o.compute_threads = 1; // one core per TP worker thread
  return o;
}

inference::generate_input to_input(const pb::GenerateRequest& request) {
  inference::generate_input in;
  for (const auto& prompt : request.prompts())
    in.prompts.emplace_back(prompt.token_ids().begin(), prompt.token_ids().end());
  const auto& p = request.params();
  in.params.n = p.n();
  in.params.max_tokens = p.max_tokens();
  in.params.temperature = p.temperature();
  in.params.top_k = p.top_k();
  in.params.top_p = p.top_p();
  in.params.seed = p.seed();
  in.params.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  in.params.max_prompt_length = p.max_prompt_length();
  return in;
}

// Where two ranks' samples first differ ("" when identical).
std::string first_difference(const std::vector<inference::generation>& a,
                             const std::vector<inference::generation>& b) {
  if (a.size() != b.size())
    return std::to_string(a.size()) + " vs " + std::to_string(b.size()) + " samples";
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i])
      return "sample " + std::to_string(i) + " (prompt " + std::to_string(a[i].prompt_index)
             + ") differs";
  return {};
}

std::string payload_name(pb::Request::PayloadCase payload) {
  if (payload == pb::Request::PAYLOAD_NOT_SET)
    return "none";
  return pb::Request::descriptor()->FindFieldByNumber(payload)->name();
}

// Sets the (empty) result case that belongs to `command`; used by faults, which answer
// without running the command.
void set_empty_result(pb::Response& response, pb::Command command) {
  const auto* field = pb::Response::descriptor()->FindFieldByNumber(
    protocol::result_case_for(command));
  response.GetReflection()->MutableMessage(&response, field);
}

// A command other than `command` (for the wrong_command / wrong_result faults).
pb::Command other_command(pb::Command command) {
  return command == pb::COMMAND_DESCRIBE ? pb::COMMAND_SHUTDOWN : pb::COMMAND_DESCRIBE;
}

pb::Response envelope(std::uint64_t request_id, pb::Command command) {
  pb::Response response;
  response.set_protocol_version(wire::protocol_version);
  response.set_request_id(request_id);
  response.set_command(command);
  return response;
}

void set_error(pb::Response& response, pb::ErrorCode code, const std::string& where,
               const std::string& message) {
  response.clear_result();
  response.set_ok(false);
  auto* error = response.mutable_error();
  error->set_code(code);
  error->set_where(where);
  error->set_message(message);
}

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
  }
  return "unknown";
}

constexpr fault_kind all_fault_kinds[] = {
  fault_kind::stall,    fault_kind::exit,          fault_kind::sigkill,
  fault_kind::error,    fault_kind::bad_frame,     fault_kind::wrong_id,
  fault_kind::wrong_command, fault_kind::wrong_result, fault_kind::wrong_version,
  fault_kind::forge_receipt};

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

void log_line(const std::string& message) {
  std::string line = "refit-runtime[" + std::to_string(::getpid()) + "]: " + message + "\n";
  // One write per line, so lines of concurrent processes do not interleave.
  (void)!::write(STDERR_FILENO, line.data(), line.size());
}

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

server::server(server_options options)
  : options_(std::move(options)),
    layout_(std::make_shared<const model::tp_layout>(
      options_.model, static_cast<std::uint32_t>(options_.devices.size()))),
    transfer_(options_.model, layout_, workers_) {
  const std::uint32_t tp = layout_->tp();
  comm_ = std::make_unique<inference::inproc_comm>(
    tp, std::chrono::duration_cast<std::chrono::milliseconds>(collective_timeout));
  for (std::uint32_t rank = 0; rank < tp; ++rank)
    workers_.push_back(std::make_unique<worker>(rank, static_cast<int>(rank),
                                                options_.devices[rank], layout_,
                                                options_.kv_cache_bytes));
  on_all_workers(workers_, [](worker& w) {
    w.allocate_weights();
    w.allocate_kv_cache();
  });
  load_checkpoint();
  weights_valid_ = true;
  sleep_level_ = 0;
  model_version_ = 0;

  std::string devices;
  for (const auto& d : options_.devices)
    devices += (devices.empty() ? "" : ",") + device::to_string(d);
  log_line("serving tp=" + std::to_string(tp) + " on " + devices + ": "
           + std::to_string(layout_->residents().size()) + " resident tensors ("
           + std::to_string(layout_->resident_bytes()) + " bytes) and "
           + std::to_string(options_.kv_cache_bytes) + " bytes of KV cache per worker");
}

server::~server() = default;

void server::load_checkpoint() {
  model::synthetic_weights synthetic;
  synthetic.seed = options_.seed;
  synthetic.init_scale = options_.init_scale;
  const auto params = model::expected_key_stream(options_.model);
  if (workers_.front()->device_kind() == device::kind::cuda) {
    // Each GPU worker generates every canonical tensor on its own device and slices it there.
    on_all_workers(workers_, [&](worker& w) { w.load_synthetic(params, synthetic); });
    return;
  }
  for (const auto& param : params) {
    std::vector<std::byte> canonical(param.nbytes());
    model::fill_synthetic(param, synthetic, 0, 0, param.numel(), canonical.data());
    on_all_workers(workers_, [&](worker& w) { w.load_tensor(param, canonical.data()); });
  }
}

int server::serve() {
  for (;;) {
    std::string frame;
    auto status = wire::read_frame(options_.control_fd, frame, options_.max_frame_bytes,
                                   wire::clock::time_point::max());
    if (status.code == wire::frame_errc::eof) {
      log_line("the parent closed the control channel; exiting");
      return 0;
    }
    if (!status) {
      log_line(std::string("control channel broken (") + wire::to_string(status.code)
               + "): " + status.message);
      return 1;
    }

    decoded input = decode(frame);
    if (!input.request) {
      if (!send(input.rejection))
        return 1;
      continue;
    }
    const pb::Request& request = *input.request;

    const fault_spec* fault = take_fault(request.command());
    if (fault && fault->kind == fault_kind::forge_receipt) {
      // Runs the command for real, then lies about it: the parent must catch the forgery.
      pb::Response response = execute(request);
      if (response.ok() && response.has_finish_weight_update()
          && response.finish_weight_update().receipts_size() > 0) {
        auto* receipts = response.mutable_finish_weight_update()->mutable_receipts();
        receipts->Mutable(receipts->size() - 1)
          ->set_device_uuid("GPU-00000000-0000-0000-0000-000000000000");
        log_line("injecting fault forge_receipt on " + command_name(request.command()));
      }
      if (!send(response))
        return 1;
      continue;
    }
    if (fault) {
      fault_reply reply = apply_fault(*fault, request);
      if (reply.response && !send(*reply.response))
        return 1;
      if (!reply.raw_bytes.empty() && !send_raw(reply.raw_bytes))
        return 1;
      continue;
    }

    pb::Response response = execute(request);
    if (!send(response))
      return 1;
    if (request.command() == pb::COMMAND_SHUTDOWN) {
      log_line("shutdown requested; exiting");
      return 0;
    }
  }
}

server::decoded server::decode(const std::string& frame) const {
  decoded out;
  pb::Request request;
  if (!request.ParseFromString(frame)) {
    out.rejection = envelope(0, pb::COMMAND_UNSPECIFIED);
    set_error(out.rejection, pb::ERROR_CODE_MALFORMED, "request",
              "a frame of " + std::to_string(frame.size())
                + " bytes is not a refit.control.v1.Request");
    return out;
  }
  out.rejection = envelope(request.request_id(), request.command());
  if (request.protocol_version() != wire::protocol_version) {
    set_error(out.rejection, pb::ERROR_CODE_PROTOCOL_VERSION, "protocol_version",
              "request speaks protocol version " + std::to_string(request.protocol_version())
                + ", this runtime speaks " + std::to_string(wire::protocol_version));
    return out;
  }
  auto expected = protocol::payload_case_for(request.command());
  if (expected == pb::Request::PAYLOAD_NOT_SET) {
    set_error(out.rejection, pb::ERROR_CODE_MALFORMED, "command",
              "unknown command " + std::to_string(request.command()));
    return out;
  }
  if (request.payload_case() != expected) {
    set_error(out.rejection, pb::ERROR_CODE_MALFORMED, "payload",
              "command " + command_name(request.command()) + " carries payload '"
                + payload_name(request.payload_case()) + "', expected '"
                + payload_name(expected) + "'");
    return out;
  }
  out.request = std::move(request);
  return out;
}

pb::Response server::execute(const pb::Request& request) {
  const pb::Command command = request.command();
  pb::Response response = envelope(request.request_id(), command);
  try {
    switch (command) {
      case pb::COMMAND_DESCRIBE: *response.mutable_describe() = describe(); break;
      case pb::COMMAND_SLEEP: *response.mutable_sleep() = sleep(request.sleep()); break;
      case pb::COMMAND_WAKE_UP: *response.mutable_wake_up() = wake_up(request.wake_up()); break;
      case pb::COMMAND_RESET_PREFIX_CACHE:
        *response.mutable_reset_prefix_cache() = reset_prefix_cache();
        break;
      case pb::COMMAND_SHUTDOWN: response.mutable_shutdown(); break;
      case pb::COMMAND_INIT_WEIGHT_TRANSFER:
        *response.mutable_init_weight_transfer() =
          init_weight_transfer(request.init_weight_transfer());
        break;
      case pb::COMMAND_START_WEIGHT_UPDATE:
        *response.mutable_start_weight_update() =
          start_weight_update(request.start_weight_update());
        break;
      case pb::COMMAND_UPDATE_WEIGHTS:
        *response.mutable_update_weights() = transfer_.update(request.update_weights());
        break;
      case pb::COMMAND_FINISH_WEIGHT_UPDATE:
        *response.mutable_finish_weight_update() =
          finish_weight_update(request.finish_weight_update());
        break;
      case pb::COMMAND_RELEASE_IPC:
        *response.mutable_release_ipc() = transfer_.release(request.release_ipc());
        break;
      case pb::COMMAND_GENERATE: *response.mutable_generate() = generate(request.generate()); break;
      default:
        throw command_error(pb::ERROR_CODE_MALFORMED, "command",
                            "unknown command " + std::to_string(command));
    }
    response.set_ok(true);
  } catch (const command_error& e) {
    set_error(response, e.code, e.where, e.what());
  } catch (const worker_failure& e) {
    log_line(command_name(command) + " failed: " + e.what());
    set_error(response, pb::ERROR_CODE_INTERNAL, e.where, e.what());
  } catch (const std::exception& e) {
    log_line(command_name(command) + " failed: " + e.what());
    set_error(response, pb::ERROR_CODE_INTERNAL, runtime_kind, e.what());
  }
  return response;
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
      break; // handled in the serve loop: the command runs first
  }
  reply.response = std::move(response);
  return reply;
}

bool server::send(const pb::Response& response) {
  auto status = wire::write_frame(options_.control_fd, response.SerializeAsString(),
                                  options_.max_frame_bytes, wire::clock::now() + write_timeout);
  if (!status)
    log_line("cannot answer " + command_name(response.command()) + " (request "
             + std::to_string(response.request_id()) + "): " + wire::to_string(status.code) + ": "
             + status.message);
  return static_cast<bool>(status);
}

bool server::send_raw(const std::string& bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::send(options_.control_fd, bytes.data() + done, bytes.size() - done,
                       MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0) {
      log_line(std::string("cannot write raw bytes on the control channel: ")
               + std::strerror(errno));
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  return true;
}

std::vector<worker_report> server::worker_reports() {
  std::vector<worker_report> reports(workers_.size());
  on_all_workers(workers_, [&reports](worker& w) { reports[w.rank()] = w.report(); });
  return reports;
}

void server::require_weights_awake(const std::string& command) {
  for (const auto& r : worker_reports())
    if (!r.weights_resident)
      throw command_error(pb::ERROR_CODE_INVALID_STATE, command,
                          command + " needs resident weights, but TP worker "
                            + std::to_string(r.rank) + " has none (sleep level "
                            + std::to_string(sleep_level_) + "); wake_up the weights first");
}

pb::DescribeResult server::describe() {
  const std::vector<worker_report> reports = worker_reports();

  pb::DescribeResult result;
  result.set_runtime_kind(runtime_kind);
  result.set_runtime_version(runtime_version);
  result.set_tp_world_size(static_cast<std::uint32_t>(workers_.size()));
  bool weights_awake = true;
  bool kv_cache_awake = true;
  for (const auto& r : reports) {
    auto* info = result.add_workers();
    info->set_rank(r.rank);
    info->set_device_index(r.device_index);
    info->set_device_uuid(r.device_uuid);
    info->set_weight_bytes_resident(r.weight_bytes_resident);
    info->set_kv_cache_bytes_resident(r.kv_cache_bytes_resident);
    info->set_weight_bytes_offloaded(r.weight_bytes_offloaded);
    info->set_device_free_bytes(r.device_free_bytes);
    info->set_resident_tensor_count(weights_valid_ ? r.resident_tensors : 0);
    info->set_producer_buffers_open(r.producer_buffers_open);
    info->set_producer_buffers_opened(r.producer_buffers_opened);
    weights_awake = weights_awake && r.weights_resident;
    kv_cache_awake = kv_cache_awake && r.kv_cache_resident;
  }
  result.set_sleep_level(sleep_level_);
  result.set_weights_awake(weights_awake);
  result.set_kv_cache_awake(kv_cache_awake);
  result.set_model_version(model_version_);
  result.set_weights_valid(weights_valid_);
  result.set_pid(static_cast<std::uint32_t>(::getpid()));
  return result;
}

pb::MemoryResult server::sleep(const pb::SleepRequest& request) {
  if (const pb::PublicationHeader* open = transfer_.open_publication())
    throw command_error(pb::ERROR_CODE_INVALID_STATE, "sleep",
                        "cannot sleep while publication '" + open->publication_id()
                          + "' is open (its weights are being written); finish_weight_update "
                            "first");
  const std::uint32_t level = request.level();
  if (level == 1) {
    on_all_workers(workers_, [](worker& w) {
      w.offload_weights();
      w.free_kv_cache();
    });
  } else if (level == 2) {
    weights_valid_ = false;
    on_all_workers(workers_, [](worker& w) {
      w.discard_weights();
      w.free_kv_cache();
    });
  } else {
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "sleep.level",
                        "sleep level " + std::to_string(level)
                          + " is not supported (1: offload weights to host and drop the KV "
                            "cache, 2: drop weights and KV cache)");
  }
  sleep_level_ = level;
  pb::MemoryResult result;
  *result.mutable_state() = describe();
  return result;
}

pb::MemoryResult server::wake_up(const pb::WakeUpRequest& request) {
  bool wake_weights = request.tags().empty();
  bool wake_kv_cache = request.tags().empty();
  for (int i = 0; i < request.tags_size(); ++i) {
    switch (request.tags(i)) {
      case pb::WAKE_TAG_WEIGHTS: wake_weights = true; break;
      case pb::WAKE_TAG_KV_CACHE: wake_kv_cache = true; break;
      default:
        throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT,
                            "wake_up.tags[" + std::to_string(i) + "]",
                            "wake tag " + std::to_string(request.tags(i))
                              + " is neither WAKE_TAG_WEIGHTS nor WAKE_TAG_KV_CACHE");
    }
  }
  if (wake_weights) {
    std::vector<weights_wake> outcomes(workers_.size());
    on_all_workers(workers_, [&outcomes](worker& w) { outcomes[w.rank()] = w.wake_weights(); });
    // Storage without a host backup is zero-filled: only a publication can make it valid.
    if (std::find(outcomes.begin(), outcomes.end(), weights_wake::zero_filled) != outcomes.end())
      weights_valid_ = false;
  }
  if (wake_kv_cache)
    on_all_workers(workers_, [](worker& w) { w.allocate_kv_cache(); });

  pb::MemoryResult result;
  *result.mutable_state() = describe();
  if (result.state().weights_awake() && result.state().kv_cache_awake()) {
    sleep_level_ = 0;
    result.mutable_state()->set_sleep_level(0);
  }
  return result;
}

pb::ResetPrefixCacheResult server::reset_prefix_cache() {
  std::vector<std::uint64_t> dropped(workers_.size());
  on_all_workers(workers_, [&dropped](worker& w) { dropped[w.rank()] = w.reset_prefix_cache(); });
  pb::ResetPrefixCacheResult result;
  result.set_entries_dropped(dropped.empty() ? 0 : dropped[0]);
  return result;
}

pb::GenerateResult server::generate(const pb::GenerateRequest& request) {
  if (const pb::PublicationHeader* open = transfer_.open_publication())
    throw command_error(pb::ERROR_CODE_INVALID_STATE, "generate",
                        "cannot generate while publication '" + open->publication_id()
                          + "' is open (its weights are being written); finish_weight_update "
                            "first");
  for (const auto& r : worker_reports()) {
    if (!r.weights_resident)
      throw command_error(pb::ERROR_CODE_INVALID_STATE, "generate",
                          "generate needs resident weights, but TP worker " + std::to_string(r.rank)
                            + " has none (sleep level " + std::to_string(sleep_level_)
                            + "); wake_up the weights first");
    if (!r.kv_cache_resident)
      throw command_error(pb::ERROR_CODE_INVALID_STATE, "generate",
                          "generate needs the KV cache, but TP worker " + std::to_string(r.rank)
                            + " has none (sleep level " + std::to_string(sleep_level_)
                            + "); wake_up the KV cache first");
  }
  if (!weights_valid_)
    throw command_error(pb::ERROR_CODE_INVALID_STATE, "generate",
                        "the resident weights are not valid (dropped by sleep level 2 or left "
                        "half-written by a publication); publish weights first");

  const inference::generate_input input = to_input(request);
  const inference::engine_options options = generation_options();
  try {
    inference::plan_request(options_.model,
                            inference::kv_geometry::of(options_.model, layout_->tp(),
                                                       options.block_size),
                            options_.kv_cache_bytes, input);
  } catch (const inference::request_error& e) {
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "generate." + e.where, e.what());
  }

  const auto start = std::chrono::steady_clock::now();
  const std::size_t tp = workers_.size();
  std::vector<std::vector<inference::generation>> results(tp);
  std::vector<inference::generate_stats> stats(tp);
  std::vector<std::future<void>> done;
  for (const auto& w : workers_)
    done.push_back(w->post([&](worker& self) {
      try {
        results[self.rank()] = self.generate(options_.model, options, *comm_, input,
                                             model_version_, &stats[self.rank()]);
      } catch (const std::exception& e) {
        comm_->abort("TP worker " + std::to_string(self.rank()) + " failed: " + e.what());
        throw;
      } catch (...) {
        comm_->abort("TP worker " + std::to_string(self.rank()) + " failed");
        throw;
      }
    }));
  // Wait for every worker; the cause is the first failure that is not a consequence (a
  // collective aborted because another worker failed).
  std::exception_ptr cause;
  std::uint32_t cause_rank = 0;
  bool cause_is_abort = false;
  for (std::uint32_t rank = 0; rank < done.size(); ++rank) {
    try {
      done[rank].get();
    } catch (const inference::comm_error&) {
      if (!cause) {
        cause = std::current_exception();
        cause_rank = rank;
        cause_is_abort = true;
      }
    } catch (...) {
      if (!cause || cause_is_abort) {
        cause = std::current_exception();
        cause_rank = rank;
        cause_is_abort = false;
      }
    }
  }
  comm_->reset();

  std::string mismatch;
  std::uint32_t mismatch_rank = 0;
  for (std::uint32_t rank = 1; !cause && rank < tp && mismatch.empty(); ++rank) {
    mismatch = first_difference(results[0], results[rank]);
    mismatch_rank = rank;
  }
  if (cause || !mismatch.empty()) {
    // Ranks may have stopped at different points: keep their prefix caches identical.
    reset_prefix_cache();
    if (!mismatch.empty())
      throw command_error(pb::ERROR_CODE_INTERNAL, "worker[" + std::to_string(mismatch_rank) + "]",
                          "TP worker " + std::to_string(mismatch_rank)
                            + " generated other samples than TP worker 0: " + mismatch);
    try {
      std::rethrow_exception(cause);
    } catch (const inference::request_error& e) {
      throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "generate." + e.where, e.what());
    } catch (const command_error&) {
      throw;
    } catch (const std::exception& e) {
      throw worker_failure(cause_rank, e.what());
    } catch (...) {
      throw worker_failure(cause_rank, "unknown exception");
    }
  }

  pb::GenerateResult result;
  result.set_model_version(model_version_);
  for (const auto& g : results[0]) {
    auto* sample = result.add_samples();
    sample->set_prompt_index(g.prompt_index);
    sample->mutable_prompt_token_ids()->Add(g.prompt_token_ids.begin(), g.prompt_token_ids.end());
    sample->mutable_token_ids()->Add(g.token_ids.begin(), g.token_ids.end());
    sample->mutable_logprobs()->Add(g.logprobs.begin(), g.logprobs.end());
    sample->set_finish_reason(g.finish_reason);
    sample->set_prompt_truncated(g.prompt_truncated);
  }
  const auto& st = stats[0];
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::steady_clock::now() - start)
                    .count();
  log_line("generate: model_version=" + std::to_string(st.model_version)
           + " prompts=" + std::to_string(st.prompts) + " samples=" + std::to_string(st.samples)
           + " prompt_tokens=" + std::to_string(st.prompt_tokens)
           + " prefix_hit_tokens=" + std::to_string(st.prefix_hit_tokens)
           + " computed_prompt_tokens=" + std::to_string(st.computed_prompt_tokens)
           + " generated_tokens=" + std::to_string(st.generated_tokens)
           + " waves=" + std::to_string(st.waves)
           + " stale_entries_dropped=" + std::to_string(st.stale_entries_dropped)
           + " ms=" + std::to_string(ms));
  return result;
}

pb::InitWeightTransferResult server::init_weight_transfer(
  const pb::InitWeightTransferRequest& request) {
  require_weights_awake("init_weight_transfer");
  return transfer_.init(request);
}

pb::StartWeightUpdateResult server::start_weight_update(
  const pb::StartWeightUpdateRequest& request) {
  require_weights_awake("start_weight_update");
  pb::StartWeightUpdateResult result = transfer_.start(request, model_version_);
  // Resident storage is about to be overwritten: only a finished publication makes it valid.
  weights_valid_ = false;
  return result;
}

pb::FinishWeightUpdateResult server::finish_weight_update(
  const pb::FinishWeightUpdateRequest& request) {
  pb::FinishWeightUpdateResult result = transfer_.finish(request);
  model_version_ = result.model_version();
  weights_valid_ = true;
  reset_prefix_cache();
  result.set_prefix_cache_reset(true);
  return result;
}

} // namespace refit::child
