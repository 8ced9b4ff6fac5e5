// refit-runtime: the child TP rollout runtime behind vLLMRuntimeProxy.
//
//   refit-runtime --control-fd 3 --tp 2 --devices cpu:0,cpu:1 --model '<yaml flow map>'
//                 --kv-cache-bytes 4194304 [--max-frame-bytes 67108864] --seed 1234
//                 [--fault COMMAND:KIND[:AFTER]]... [--trace]
//
// Speaks the control protocol (messages/control.proto) over the stream socket --control-fd.
// Logs go to stderr. Exit codes: 0 after shutdown or when the parent closes the channel,
// 1 on a broken channel or a startup failure, 2 on bad command-line arguments.
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <sys/socket.h>
#include <vector>

#include <CLI/CLI.hpp>

#include "runtime/child/device_memory.hpp"
#include "runtime/child/server.hpp"
#include "runtime/publication/memory_preflight.hpp"
#include "runtime/config/config.hpp"
#include "runtime/device/device.hpp"
#include "runtime/control/framing.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/trace/trace.hpp"

namespace {

using refit::child::log_line;

constexpr int exit_bad_arguments = 2;
constexpr int exit_preflight = 3; // the recipe asks for more memory than the devices have

// A bad command-line value; `option` names the option ("--tp").
struct option_error : std::runtime_error {
  option_error(std::string option, const std::string& message)
    : std::runtime_error(message), option(std::move(option)) {}
  std::string option;
};

struct raw_arguments {
  int control_fd = -1;
  std::uint32_t tp = 0;
  std::string devices;
  std::string model;
  std::uint64_t kv_cache_bytes = 0;
  std::string compute_dtype = "auto";
  std::uint32_t max_batch = 256;
  std::uint64_t max_frame_bytes = refit::wire::default_max_frame_bytes;
  std::uint64_t seed = 0;
  float init_scale = 0.02f;
  std::string checkpoint;
  std::string publication_mode = "packed";
  std::vector<std::string> faults;
};

void check_control_fd(int fd) {
  if (fd < 0)
    throw option_error("--control-fd", "fd " + std::to_string(fd) + " is negative");
  int type = 0;
  socklen_t len = sizeof(type);
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0)
    throw option_error("--control-fd", "fd " + std::to_string(fd)
                                         + " is not an open socket: " + std::strerror(errno));
  if (type != SOCK_STREAM)
    throw option_error("--control-fd", "fd " + std::to_string(fd) + " is not a stream socket");
}

std::vector<refit::device::spec> parse_devices(const std::string& text, std::uint32_t tp) {
  std::vector<refit::device::spec> devices;
  std::set<std::string> seen;
  std::size_t start = 0;
  for (;;) {
    std::size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma - start);
    std::string where = "--devices[" + std::to_string(devices.size()) + "]";
    refit::device::spec spec;
    try {
      spec = refit::device::parse(item, where);
      refit::child::require_supported(spec);
    } catch (const std::invalid_argument& e) {
      throw option_error("--devices", e.what());
    }
    if (!seen.insert(refit::device::to_string(spec)).second)
      throw option_error("--devices", refit::device::to_string(spec) + " is listed twice in '"
                                        + text + "'");
    devices.push_back(spec);
    if (comma == std::string::npos)
      break;
    start = comma + 1;
  }
  if (devices.size() != tp)
    throw option_error("--tp", "tp " + std::to_string(tp) + " does not match the "
                                 + std::to_string(devices.size()) + " device(s) of --devices '"
                                 + text + "'");
  return devices;
}

refit::model::model_config parse_model(const std::string& text, std::uint32_t tp) {
  try {
    auto model = refit::config::parse_model_yaml(text, "--model");
    refit::model::validate(model, tp);
    return model;
  } catch (const std::exception& e) {
    throw option_error("--model", e.what());
  }
}

refit::child::server_options validate(const raw_arguments& args) {
  refit::child::server_options options;
  if (args.tp == 0)
    throw option_error("--tp", "tp must be at least 1");
  options.devices = parse_devices(args.devices, args.tp);
  options.model = parse_model(args.model, args.tp);
  if (args.kv_cache_bytes == 0)
    throw option_error("--kv-cache-bytes", "the KV cache needs at least 1 byte");
  options.kv_cache_bytes = args.kv_cache_bytes;
  if (args.compute_dtype == "auto") {
    const bool on_gpu = options.devices.front().k == refit::device::kind::cuda;
    options.compute_dtype = on_gpu && options.model.torch_dtype == refit::model::dtype::bfloat16
                              ? refit::model::dtype::bfloat16
                              : refit::model::dtype::float32;
  } else if (args.compute_dtype == "float32" || args.compute_dtype == "bfloat16") {
    options.compute_dtype = args.compute_dtype == "float32" ? refit::model::dtype::float32
                                                            : refit::model::dtype::bfloat16;
    if (options.compute_dtype == refit::model::dtype::bfloat16
        && options.model.torch_dtype != refit::model::dtype::bfloat16)
      throw option_error("--compute-dtype", "bfloat16 needs a bfloat16 model (--model has "
                                              + std::string(refit::model::dtype_name(
                                                options.model.torch_dtype))
                                              + ")");
  } else {
    throw option_error("--compute-dtype", "'" + args.compute_dtype
                                            + "' is not one of auto, float32, bfloat16");
  }
  if (args.max_batch == 0)
    throw option_error("--max-batch", "max batch must be at least 1");
  options.max_batch = args.max_batch;
  if (args.max_frame_bytes < 1024 || args.max_frame_bytes > UINT32_MAX)
    throw option_error("--max-frame-bytes", std::to_string(args.max_frame_bytes)
                                              + " is outside 1024..4294967295");
  options.max_frame_bytes = static_cast<std::size_t>(args.max_frame_bytes);
  options.seed = args.seed;
  options.init_scale = args.init_scale;
  options.checkpoint_dir = args.checkpoint;
  if (args.publication_mode != "packed" && args.publication_mode != "direct")
    throw option_error("--publication-mode", "'" + args.publication_mode
                                               + "' is not one of packed, direct");
  options.exportable_weights = args.publication_mode == "direct";
  for (const auto& text : args.faults) {
    try {
      options.faults.push_back(refit::child::parse_fault(text));
    } catch (const std::invalid_argument& e) {
      throw option_error("--fault", e.what());
    }
  }
  for (std::size_t i = 0; i < options.faults.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (options.faults[i].command == options.faults[j].command
          && options.faults[i].after == options.faults[j].after)
        throw option_error("--fault", "'" + args.faults[i] + "' and '" + args.faults[j]
                                        + "' target the same occurrence");
  check_control_fd(args.control_fd);
  options.control_fd = args.control_fd;
  return options;
}

} // namespace

int main(int argc, char** argv) {
  // A parent that goes away must turn writes into EPIPE errors, not kill us silently.
  std::signal(SIGPIPE, SIG_IGN);

  CLI::App app{"refit-runtime: tensor-parallel rollout runtime driven over a control socket",
               "refit-runtime"};
  raw_arguments args;
  app.add_option("--control-fd", args.control_fd, "fd of the control stream socket")->required();
  app.add_option("--tp", args.tp, "tensor-parallel world size")->required();
  app.add_option("--devices", args.devices, "comma-separated devices, one per TP rank (cpu:N)")
    ->required();
  app.add_option("--model", args.model, "the model section as a YAML (flow) map")->required();
  app.add_option("--kv-cache-bytes", args.kv_cache_bytes, "KV cache bytes per worker")
    ->required();
  app.add_option("--max-frame-bytes", args.max_frame_bytes, "largest control frame");
  app.add_option("--compute-dtype", args.compute_dtype,
                 "auto | float32 (reference forward) | bfloat16 (the bf16 engine)");
  app.add_option("--max-batch", args.max_batch, "samples decoding at once");
  app.add_option("--seed", args.seed, "seed of the synthetic checkpoint weights")->required();
  app.add_option("--init-scale", args.init_scale,
                 "scale of the synthetic checkpoint weights (the trainer's trainer.init_scale)")
    ->check(CLI::PositiveNumber & CLI::Range(0.0, 10.0));
  app.add_option("--checkpoint", args.checkpoint,
                 "a Hugging Face model directory (config.json, *.safetensors) loaded as version 0 "
                 "instead of the synthetic weights");
  app.add_option("--publication-mode", args.publication_mode,
                 "packed (default) or direct: resident weights in memory trainer ranks can open "
                 "and write (direct publication)");
  app.add_option("--fault", args.faults, "test-only fault COMMAND:KIND[:AFTER] (repeatable)");
  bool trace = false;
  app.add_flag("--trace", trace,
               "record trace events and send them to the parent with every response "
               "(runtime/control/trace_wire.hpp)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e); // --help
  } catch (const CLI::ParseError& e) {
    log_line(std::string("bad command line: ") + e.what());
    return exit_bad_arguments;
  }

  if (trace)
    refit::trace::enable();
  refit::trace::set_thread_track(refit::trace::tracks::runtime_server());

  refit::child::server_options options;
  try {
    options = validate(args);
  } catch (const option_error& e) {
    log_line("bad command line: " + e.option + ": " + e.what());
    return exit_bad_arguments;
  }

  try {
    refit::child::server server(std::move(options));
    return server.serve();
  } catch (const refit::publication::memory_refusal& e) {
    log_line(std::string("preflight: ") + e.what());
    return exit_preflight;
  } catch (const std::exception& e) {
    log_line(std::string("fatal: ") + e.what());
    return 1;
  }
}
