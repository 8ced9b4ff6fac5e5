// The control loop of refit-runtime: reads Request frames, validates and dispatches them to
// the command handlers (commands.cpp) or a test fault (faults.cpp), and answers each one.
#include "runtime/child/server.hpp"

#include "runtime/publication/memory_preflight.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

#include "runtime/checkpoint/source.hpp"
#include "runtime/child/command_error.hpp"
#include "runtime/child/load_progress.hpp"
#include "runtime/child/server_util.hpp"
#include "runtime/control/framing.hpp"
#include "runtime/control/protocol.hpp"
#include "runtime/control/protocol_version.hpp"
#include "runtime/control/trace_wire.hpp"
#include "runtime/trace/trace.hpp"
#if REFIT_HAVE_CUDA
#include "runtime/cuda/nccl_tp_comm.hpp"
#endif


namespace refit::child {

using namespace detail;

void log_line(const std::string& message) {
  std::string line = "refit-runtime[" + std::to_string(::getpid()) + "]: " + message + "\n";
  // One write per line, so lines of concurrent processes do not interleave.
  (void)!::write(STDERR_FILENO, line.data(), line.size());
}


std::unique_ptr<inference::tp_comm> make_tp_comm(const std::vector<device::spec>& devices,
                                                 std::chrono::milliseconds timeout) {
  const auto tp = static_cast<std::uint32_t>(devices.size());
  std::string names;
  std::vector<int> ordinals;
  bool distinct_cuda = tp > 1;
  for (const auto& d : devices) {
    names += (names.empty() ? "" : ",") + device::to_string(d);
    if (d.k != device::kind::cuda
        || std::find(ordinals.begin(), ordinals.end(), d.index) != ordinals.end())
      distinct_cuda = false;
    ordinals.push_back(d.index);
  }
  const char* env = std::getenv("REFIT_TP_COMM");
  const std::string forced = env == nullptr ? "" : env;
  if (!forced.empty() && forced != "inproc" && forced != "nccl")
    throw std::invalid_argument("REFIT_TP_COMM='" + forced
                                + "': expected 'inproc' (host memory) or 'nccl'");
  if (forced == "nccl" && (!REFIT_HAVE_CUDA || !distinct_cuda))
    throw std::invalid_argument("REFIT_TP_COMM=nccl: the NCCL TP communicator needs a CUDA build "
                                "and tp > 1 on distinct CUDA devices, got " + names);
#if REFIT_HAVE_CUDA
  if (distinct_cuda && forced != "inproc") {
    try {
      return cuda::make_nccl_tp_comm(std::move(ordinals), timeout);
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string(e.what())
                               + " (REFIT_TP_COMM=inproc falls back to host memory)");
    }
  }
#endif
  return std::make_unique<inference::inproc_comm>(tp, timeout);
}

server::server(server_options options)
  : options_(std::move(options)),
    layout_(std::make_shared<const model::tp_layout>(
      options_.model, static_cast<std::uint32_t>(options_.devices.size()))),
    transfer_(options_.model, layout_, workers_) {
  const std::uint32_t tp = layout_->tp();
  // Before any allocation: the workers' resident weights and KV caches must fit what the
  // devices have (the parent checked too; this covers a direct command line). Throws
  // publication::memory_refusal naming the key; main exits with exit_preflight.
  publication::preflight_runtime_memory(options_.model, options_.devices, options_.kv_cache_bytes);
  comm_ = make_tp_comm(options_.devices,
                       std::chrono::duration_cast<std::chrono::milliseconds>(collective_timeout));
  for (std::uint32_t rank = 0; rank < tp; ++rank)
    workers_.push_back(std::make_unique<worker>(rank, static_cast<int>(rank),
                                                options_.devices[rank], layout_,
                                                options_.kv_cache_bytes,
                                                options_.exportable_weights));
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
  log_line("serving tp=" + std::to_string(tp) + " on " + devices + " (TP collectives: "
           + (tp == 1 ? "none" : comm_->on_device() ? "NCCL" : "in-process, host memory") + "): "
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
  const auto start = std::chrono::steady_clock::now();
  if (!options_.checkpoint_dir.empty()) {
    auto source = checkpoint::model_source::open(options_.checkpoint_dir, options_.model);
    checkpoint_.path = source->source();
    checkpoint_.tensors = source->tensor_count();
    checkpoint_.bytes = source->bytes();
    checkpoint_.fingerprint = source->fingerprint();
    synthetic.initial = std::move(source);
  }
  load_progress progress(params, !options_.checkpoint_dir.empty() && ::isatty(STDERR_FILENO));
  if (workers_.front()->device_kind() == device::kind::cuda) {
    // Each GPU worker reads (checkpoint: through bounded pinned staging) or generates every
    // canonical tensor on its own device and slices it there.
    on_all_workers(workers_, [&](worker& w) {
      w.load_synthetic(params, synthetic, w.rank() == 0 ? &progress : nullptr);
    });
  } else {
    // One canonical tensor at a time in host memory (bounded by the largest tensor).
    std::vector<std::byte> canonical;
    for (const auto& param : params) {
      canonical.resize(param.nbytes());
      model::fill_synthetic(param, synthetic, 0, 0, param.numel(), canonical.data());
      on_all_workers(workers_, [&](worker& w) { w.load_tensor(param, canonical.data()); });
      progress.advance(param);
    }
  }
  progress.finish();
  checkpoint_.load_seconds =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!options_.checkpoint_dir.empty())
    log_line(load_summary(checkpoint_));
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
    if (fault && fault->kind == fault_kind::skew_logprobs) {
      // Runs generation for real, then reports logprobs that the weights do not give: the
      // parent's parity check against its reference forward must catch it.
      pb::Response response = execute(request);
      if (response.ok() && response.has_generate()) {
        for (auto& s : *response.mutable_generate()->mutable_samples())
          for (auto& lp : *s.mutable_logprobs())
            lp += 0.5f;
        log_line("injecting fault skew_logprobs on " + command_name(request.command()));
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
  trace::span traced(command_name(command), {{"request_id", request.request_id()}});
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
      case pb::COMMAND_SCORE: *response.mutable_score() = score(request.score()); break;
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

bool server::send(const pb::Response& response) {
  std::string payload = response.SerializeAsString();
  wire::append_trace(payload, options_.max_frame_bytes); // --trace only
  auto status = wire::write_frame(options_.control_fd, payload, options_.max_frame_bytes,
                                  wire::clock::now() + write_timeout);
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

} // namespace refit::child
