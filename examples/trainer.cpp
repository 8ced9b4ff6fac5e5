// An example trainer process: one rank of a multi-process refit deployment, using only the
// public embedding API (refit/host.hpp). Start one per rank next to `refit-coordinator serve`
// (same recipe, same shared secret in the environment):
//
//   REFIT_TOKEN=... refit-coordinator serve -c recipe.yaml --port 7400 &
//   REFIT_TOKEN=... refit-example-trainer --config recipe.yaml --rank 0 --port 7400 &
//   REFIT_TOKEN=... refit-example-trainer --config recipe.yaml --rank 1 --port 7400
//
// Each iteration takes one (synthetic) optimizer step and publishes the next model version
// collectively; every rank prints the committed result or the typed failure.
#include <refit/host.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s --config FILE --rank R [--port P] [--host H] [--iterations K]\n",
               argv0);
  return 2;
}

} // namespace

int main(int argc, char** argv) {
  refit::api::host_options options;
  refit::api::rank_spec spec;
  bool have_rank = false;
  unsigned iterations = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    std::string value = argv[i + 1];
    if (flag == "--config")
      options.config_path = value;
    else if (flag == "--rank")
      spec.rank = static_cast<std::uint32_t>(std::strtoul(value.c_str(), nullptr, 10)), have_rank = true;
    else if (flag == "--port")
      options.coordinator_port = std::atoi(value.c_str());
    else if (flag == "--host")
      options.coordinator_host = value;
    else if (flag == "--iterations")
      iterations = static_cast<unsigned>(std::strtoul(value.c_str(), nullptr, 10));
    else
      return usage(argv[0]);
  }
  if (options.config_path.empty() || !have_rank || argc % 2 == 0)
    return usage(argv[0]);

  // 1. A refit host for this process: the recipe shared with the coordinator.
  auto created = refit::api::host::create(options);
  if (!created) {
    std::fprintf(stderr, "rank %u: %s\n", spec.rank, created.failure().text.c_str());
    return 1;
  }
  auto& host = *created.value();
  // 2. Which rank this process is, and its weight source.
  if (auto e = host.register_rank(spec)) {
    std::fprintf(stderr, "rank %u: %s\n", spec.rank, e.text.c_str());
    return 1;
  }
  host.register_weights(host.recipe_weights());
  // 3. Join the coordinator (protocol version and shared secret are checked there).
  if (auto e = host.connect()) {
    std::fprintf(stderr, "rank %u: cannot join: %s\n", spec.rank, e.text.c_str());
    return 1;
  }
  std::printf("rank %u of %u joined (refit %s, wire protocol %u)\n", host.rank(), host.world(),
              refit::api::library_version(), refit::api::wire_protocol_version());
  // 4. The training loop: an optimizer step, then the collective publish of the next version.
  for (unsigned k = 1; k <= iterations; ++k) {
    auto step = host.step();
    if (!step) {
      std::fprintf(stderr, "rank %u: step failed: %s\n", spec.rank, step.failure().text.c_str());
      return 1;
    }
    auto published = host.publish(k);
    if (!published) {
      std::fprintf(stderr, "rank %u: publish(%u) failed: %s\n", spec.rank, k,
                   published.failure().text.c_str());
      return 1;
    }
    const auto& p = published.value();
    std::printf("rank %u: version %llu committed (%s): %llu tensors, %llu bytes, %u chunks, "
                "%.2f ms, %zu receipts\n",
                spec.rank, static_cast<unsigned long long>(p.model_version),
                p.publication_id.c_str(), static_cast<unsigned long long>(p.tensors),
                static_cast<unsigned long long>(p.bytes), p.chunks, p.seconds * 1000.0,
                p.receipts.size());
    std::fflush(stdout);
  }
  return 0;
}
