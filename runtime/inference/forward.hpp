// The Qwen3-MoE forward pass of ONE tensor-parallel rank over that rank's resident weights
// (the tp_layout of runtime/model/qwen3_moe.hpp), computing in fp32 on the CPU.
//
// This header is torch-free. The implementation (torch_forward.cpp, the only LibTorch
// translation unit) is built as a shared module, librefit_torch_forward.so, that
// make_rank_forward loads with dlopen on first use, so only processes that actually run the
// model pay for loading LibTorch (about 0.5 s) and nothing else links it.
//
// Per rank: qkv_proj column-parallel ([q rows of the rank; k rows; v rows], KV heads
// replicated when tp > kv heads), q/k per-head RMSNorm, RoPE (HF rotate_half over head_dim),
// grouped-query causal attention over a paged KV cache, o_proj row-parallel + all-reduce;
// router replicated (softmax, top-k, norm_topk_prob renormalization); experts w13 = [gate; up]
// (I/tp rows each), SiLU(gate) * up, w2 (I/tp columns) + all-reduce; vocab-split embedding
// (ids outside the rank's rows contribute zeros) + all-reduce; final norm; vocab-split lm_head
// + all-gather, padded rows past vocab_size dropped.
//
// KV cache: a caller-owned arena of fixed-size blocks (kv_geometry). A block holds
// `block_size` consecutive positions of one sequence for every layer, as fp32
// [layer][k|v][kv head][slot][head_dim]. A sequence is a block table; position p lives in
// block_table[p / block_size], slot p % block_size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/inference/tp_comm.hpp"
#include "runtime/model/qwen3_moe.hpp"

namespace refit::inference {

struct kv_geometry {
  std::uint32_t layers = 0;
  std::uint32_t kv_heads = 0;   // per rank (1 when replicated)
  std::uint32_t head_dim = 0;
  std::uint32_t block_size = 0; // positions per block

  std::uint64_t block_bytes() const {
    return std::uint64_t{layers} * 2 * kv_heads * block_size * head_dim * sizeof(float);
  }
  // Byte offset of (layer, k = 0 / v = 1) inside a block.
  std::uint64_t part_offset(std::uint32_t layer, std::uint32_t kv) const {
    return (std::uint64_t{layer} * 2 + kv) * kv_heads * block_size * head_dim * sizeof(float);
  }
  static kv_geometry of(const model::model_config& cfg, std::uint32_t tp,
                        std::uint32_t block_size);
};

// The resident tensors one rank's forward reads (pointers into the rank's resident storage).
struct layer_weights {
  const std::byte* qkv = nullptr;
  const std::byte* o = nullptr;
  const std::byte* q_norm = nullptr;
  const std::byte* k_norm = nullptr;
  const std::byte* router = nullptr;
  const std::byte* w13 = nullptr;
  const std::byte* w2 = nullptr;
  const std::byte* input_norm = nullptr;
  const std::byte* post_attention_norm = nullptr;
};

struct rank_weights {
  model::dtype dt = model::dtype::bfloat16;
  const std::byte* embed = nullptr;
  const std::byte* final_norm = nullptr;
  const std::byte* lm_head = nullptr; // == embed when tie_word_embeddings
  std::vector<layer_weights> layers;
};

// Binds the residents of `layout` (one pointer per resident tensor, layout order).
// Throws model_error if the count does not match or a pointer is null.
rank_weights bind_weights(const model::model_config& cfg, const model::tp_layout& layout,
                          const std::vector<const std::byte*>& residents);

// New tokens of one sequence: tokens[0..count) at positions [position, position + count);
// the blocks must cover position + count positions. Attention sees positions
// [0, position + count) (earlier ones from the cache).
struct forward_item {
  const std::uint32_t* block_table = nullptr;
  std::size_t block_count = 0;
  std::uint32_t position = 0;
  const std::int32_t* tokens = nullptr;
  std::uint32_t count = 0;
};

enum class logits_rows { last_token, every_token };

struct rank_forward_options {
  model::model_config model;
  std::uint32_t tp = 1;
  std::uint32_t rank = 0;
  rank_weights weights;
  tp_comm* comm = nullptr;     // world_size() == tp
  kv_geometry kv;
  // Keep the fp32 conversion of each weight for the lifetime of the rank_forward (create
  // one per request); otherwise convert on every use.
  bool cache_fp32_weights = true;
  // LibTorch intra-op threads of the calling thread (0: leave as is).
  int compute_threads = 0;
  // >= 0: the weights and the KV arena are in the memory of CUDA device `cuda_device` and the
  // forward runs there (a LibTorch with CUDA is needed); collectives and the returned logits
  // go through host memory. -1: CPU.
  int cuda_device = -1;
  // The dtype activations and matmuls compute in. The forward computes in fp32 (bf16 / fp16
  // residents converted on use) and refuses anything else; a faster engine may honour
  // bfloat16. Paths that need the fp32 reference (the runtime's SCORE command) set float32
  // explicitly so that they keep it whatever a default becomes.
  model::dtype compute_dtype = model::dtype::float32;
};

// Distinct experts the router chose in one forward call (for the generation statistics and
// the decode roofline of refit-bench generate).
struct routing_counts {
  bool counted = false;            // false: this forward does not count them
  std::uint64_t distinct_experts = 0; // sum over layers of the distinct experts routed to
  std::uint32_t layers = 0;
};

class rank_forward {
public:
  virtual ~rank_forward() = default;
  // Runs the items' new tokens through the model (every rank with identical items), writes
  // their K/V into the cache blocks (arena at `kv_base`) and returns full-vocabulary logits
  // (vocab_size floats per row, identical on every rank): one row per item (its last token)
  // or one row per token (items in order).
  virtual std::vector<float> forward(const std::vector<forward_item>& items, std::byte* kv_base,
                                     logits_rows rows) = 0;
  // The routing of the last forward call: per layer the number of distinct experts that at
  // least one of its tokens was routed to (this rank's router is replicated, so every rank
  // counts the same), summed over layers.
  virtual routing_counts last_routing() const { return {}; }
};

// Loads the LibTorch backend on first use. Throws std::runtime_error naming the paths tried
// when it cannot be loaded. Search order: $REFIT_TORCH_FORWARD (a file path), the directory of
// the running executable, the path the build produced it at.
std::unique_ptr<rank_forward> make_rank_forward(const rank_forward_options& options);

// The path the backend was loaded from ("" before the first make_rank_forward).
std::string loaded_backend_path();

// ABI handshake between make_rank_forward and the module.
constexpr std::uint32_t backend_abi_version = 3; // 3: compute_dtype, last_routing
struct backend_entry {
  std::uint32_t abi_version;
  std::size_t options_size; // sizeof(rank_forward_options) in the module
  rank_forward* (*create)(const rank_forward_options& options);
};

} // namespace refit::inference

// Exported by librefit_torch_forward.so.
extern "C" const refit::inference::backend_entry* refit_torch_forward_entry();
