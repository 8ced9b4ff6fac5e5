#include "runtime/checkpoint/source.hpp"

#include <filesystem>

#include "runtime/checkpoint/weights.hpp"

namespace refit::checkpoint {

model::model_config read_model_config(const std::string& dir, std::vector<std::string>* warnings) {
  hf_model m = read_hf_config(dir);
  if (warnings != nullptr)
    *warnings = m.warnings;
  try {
    model::validate(m.cfg, 1);
  } catch (const model::model_error& e) {
    throw checkpoint_error((std::filesystem::path(dir) / "config.json").string(), "", e.where,
                           e.what());
  }
  return m.cfg;
}

struct model_source::impl {
  checkpoint_files files;
  model_weights weights;
  std::uint64_t bytes = 0;
};

std::shared_ptr<const model_source> model_source::open(const std::string& dir,
                                                       const model::model_config& cfg) {
  // The caller's model config (read from this directory's config.json by
  // read_model_config): config.json is not read a second time.
  hf_model m;
  m.model_type = cfg.model_type;
  m.cfg = cfg;
  m.intermediate_size = cfg.intermediate_size;
  m.dtype_declared = true;
  auto files = checkpoint_files::open(dir);
  model_weights weights(files, m);
  std::uint64_t bytes = 0;
  for (const auto& t : weights.tensors())
    bytes += t.meta.nbytes();
  auto p = std::unique_ptr<impl>(new impl{std::move(files), std::move(weights), bytes});
  return std::shared_ptr<const model_source>(new model_source(std::move(p)));
}

model_source::model_source(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
model_source::~model_source() = default;

void model_source::read(const model::param_meta& p, std::uint64_t byte_begin, std::uint64_t bytes,
                        std::byte* out) const {
  const std::uint64_t es = model::dtype_size(p.dt);
  if (byte_begin % es != 0 || bytes % es != 0)
    throw checkpoint_error(impl_->files.dir(), p.name, "",
                           "byte range [" + std::to_string(byte_begin) + ", +"
                             + std::to_string(bytes) + ") is not whole elements of "
                             + std::to_string(es) + " bytes");
  impl_->weights.read_canonical(p, byte_begin / es, bytes / es, out);
}

std::string model_source::source() const { return impl_->files.dir(); }
std::uint64_t model_source::tensor_count() const { return impl_->weights.tensors().size(); }
std::uint64_t model_source::bytes() const { return impl_->bytes; }
std::string model_source::fingerprint() const { return impl_->weights.fingerprint(); }

} // namespace refit::checkpoint
