// A Hugging Face model directory as refit's weight source: config.json mapped onto refit's
// model config, and the safetensors tensors (per-expert or fused expert layout) read as
// canonical tensors, straight from the mmap'ed files. The runtime loads it as version 0 and
// the trainer ranks start from it (model::synthetic_weights::initial).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/model/synthetic.hpp"

namespace refit::checkpoint {

// config.json of `dir` as refit's model config (dense qwen3 normalized), validated at tp 1.
// Fields HF configs carry that refit ignores are returned in `warnings` when given.
model::model_config read_model_config(const std::string& dir,
                                      std::vector<std::string>* warnings = nullptr);

class model_source final : public model::initial_weights {
public:
  // Opens every safetensors file of `dir` and checks that it holds exactly the tensors of
  // `cfg`'s canonical key stream (shapes, dtypes, both expert layouts). Throws
  // checkpoint_error naming file, tensor and field.
  static std::shared_ptr<const model_source> open(const std::string& dir,
                                                  const model::model_config& cfg);
  ~model_source() override;

  void read(const model::param_meta& p, std::uint64_t byte_begin, std::uint64_t bytes,
            std::byte* out) const override;
  std::string source() const override;

  std::uint64_t tensor_count() const;  // canonical tensors
  std::uint64_t bytes() const;         // canonical bytes
  std::string fingerprint() const;     // model::structural_manifest of the key stream

  struct impl;

private:
  explicit model_source(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

} // namespace refit::checkpoint
