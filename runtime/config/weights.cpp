// The trainer's weight source of a recipe (config.hpp: trainer_weights).
#include "runtime/config/config.hpp"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

#include "runtime/checkpoint/source.hpp"

namespace refit::config {

model::synthetic_weights trainer_weights(const refit_config& cfg) {
  model::synthetic_weights w{cfg.job.seed, cfg.trainer.lr, cfg.trainer.init_scale, nullptr};
  if (cfg.model_path.empty())
    return w;
  // One open checkpoint per directory and process: the files stay mapped read-only.
  static std::mutex mtx;
  static std::map<std::string, std::shared_ptr<const checkpoint::model_source>> open;
  std::lock_guard<std::mutex> guard(mtx);
  auto& source = open[cfg.model_path];
  if (!source)
    source = checkpoint::model_source::open(cfg.model_path, cfg.model);
  w.initial = source;
  return w;
}

} // namespace refit::config

namespace refit::config {

void use_model_dir(refit_config& cfg, const std::string& dir) {
  const std::string abs = std::filesystem::absolute(dir).lexically_normal().string();
  cfg.model = checkpoint::read_model_config(abs);
  cfg.model_path = abs;
  validate(cfg);
}

std::string embedded_base_dir() {
  if (const char* env = std::getenv("REFIT_CONFIGS_DIR"); env != nullptr && *env != '\0')
    return env;
  // Installed: <prefix>/bin/<exe> next to <prefix>/share/refit/configs.
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto installed = exe.parent_path().parent_path() / "share" / "refit" / "configs";
    if (std::filesystem::is_directory(installed, ec))
      return installed.string();
  }
  return REFIT_CONFIGS_DIR; // the source tree's configs/ (build tree)
}

} // namespace refit::config
