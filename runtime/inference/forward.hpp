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
// Two implementations live in the module: the fp32 reference path (compute_dtype float32:
// every weight converted to fp32, the parity baseline) and the bf16 engine
// (compute_dtype bfloat16, torch_fast_forward.cpp: bf16 weights and activations with fp32
// accumulation, residual stream and norms in fp32, experts sorted by id through one grouped
// GEMM per projection, batched decode attention over the paged cache, sampling on the device,
// the TP-1 decode step replayed from CUDA graphs per batch-size bucket).
//
// KV cache: a caller-owned arena of fixed-size blocks (kv_geometry). A block holds
// `block_size` consecutive positions of one sequence for every layer, as
// [layer][k|v][kv head][slot][head_dim] elements of the compute dtype (fp32 or bf16). A
// sequence is a block table; position p lives in block_table[p / block_size], slot
// p % block_size.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/inference/sampling.hpp"
#include "runtime/inference/tp_comm.hpp"
#include "runtime/model/qwen3_moe.hpp"

namespace refit::inference {

struct kv_geometry {
  std::uint32_t layers = 0;
  std::uint32_t kv_heads = 0;   // per rank (1 when replicated)
  std::uint32_t head_dim = 0;
  std::uint32_t block_size = 0; // positions per block
  std::uint32_t element_bytes = 4; // 4: fp32 cache, 2: bf16 cache

  std::uint64_t block_bytes() const {
    return std::uint64_t{layers} * 2 * kv_heads * block_size * head_dim * element_bytes;
  }
  // Byte offset of (layer, k = 0 / v = 1) inside a block.
  std::uint64_t part_offset(std::uint32_t layer, std::uint32_t kv) const {
    return (std::uint64_t{layer} * 2 + kv) * kv_heads * block_size * head_dim * element_bytes;
  }
  static kv_geometry of(const model::model_config& cfg, std::uint32_t tp,
                        std::uint32_t block_size, std::uint32_t element_bytes = 4);
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
  // forward runs there (a LibTorch with CUDA is needed); the returned logits go through host
  // memory, the collectives through `comm` (host memory, or the device when
  // comm->on_device(): the bf16 engine then all-reduces and all-gathers in device memory).
  // -1: CPU.
  int cuda_device = -1;
  // float32: the reference path (KV fp32). bfloat16: the bf16 engine (KV bf16; the residents
  // must be bf16). Paths that need the fp32 reference (the runtime's SCORE command) set float32
  // explicitly.
  model::dtype compute_dtype = model::dtype::float32;
  // bf16 engine on a GPU at tp 1, or at tp > 1 with a device comm: replay decode steps from
  // CUDA graphs.
  bool cuda_graphs = true;
  // Blocks of the KV arena at kv_base (block ids of forward_item tables are below it).
  std::uint32_t kv_blocks = 0;
  // bf16 engine on a GPU: the fused CUDA kernels of torch_kernels.cu where the shapes allow
  // (false: the same arithmetic as chains of ATen ops; tests compare the two).
  bool fused_kernels = true;
};

// A TP rank's share of the model's dimensions, the shapes both LibTorch forwards
// (torch_forward.cpp, the bf16 engine) are written in: its query / KV heads, its expert width
// and the vocab rows [first_vocab_, first_vocab_ + vocab_rows_) of its lm_head slice.
class tp_rank_dims {
protected:
  explicit tp_rank_dims(const rank_forward_options& o)
    : hidden_(o.model.hidden_size),
      head_dim_(o.model.head_dim),
      q_heads_(o.model.num_attention_heads / o.tp),
      kv_heads_(std::max<std::uint32_t>(1, o.model.num_key_value_heads / o.tp)),
      inter_(o.model.moe_intermediate_size / o.tp),
      experts_(o.model.num_experts),
      top_k_(o.model.num_experts_per_tok),
      vocab_rows_((std::int64_t{o.model.vocab_size} + o.tp - 1) / o.tp),
      first_vocab_(vocab_rows_ * o.rank) {}
  const std::int64_t hidden_, head_dim_, q_heads_, kv_heads_, inter_, experts_, top_k_;
  const std::int64_t vocab_rows_, first_vocab_;
};

// One token to draw from the logits of forward row `row`, with the counter-based stream
// (prompt, sample, step) of sampling.hpp.
struct sample_draw {
  std::uint32_t row = 0;
  std::uint32_t prompt = 0;
  std::uint32_t sample = 0;
  std::uint64_t step = 0;
};

// Counters of one rank_forward (cumulative since it was created).
struct forward_counters {
  std::uint64_t forwards = 0;
  std::uint64_t graph_replays = 0;   // decode steps replayed from a CUDA graph
  std::uint64_t graph_captures = 0;
  std::uint64_t expert_loads = 0;        // sum over forwards and layers of distinct routed experts
  std::uint64_t decode_expert_loads = 0; // the same over decode forwards (one token per item)
  std::uint64_t peak_workspace_bytes = 0; // device memory the engine allocated beyond weights/KV
  bool counts_experts = false;            // the expert_loads fields are counted
  // Dense projections run on the preloading GEMM: launched eagerly, and a captured graph's own
  // count at each of its replays (the capture itself runs none).
  std::uint64_t preload_gemms = 0;
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

  // forward() of the items' last tokens followed by one token per draw (sample_token's
  // semantics; several draws may read one row). The reference path samples on the host from
  // the returned logits; the bf16 engine samples on the device (the draws' uniforms computed
  // here, sampling_uniform) and moves only the tokens and their log-probabilities to the host.
  std::vector<sampled_token> forward_sample(const std::vector<forward_item>& items,
                                            std::byte* kv_base, const sampling_config& params,
                                            const std::vector<sample_draw>& draws);

  // Pipelined decode (when pipelines_samples()): begin_sample enqueues forward_sample's work
  // and returns without waiting for it; finish_sample waits for the oldest begun step and
  // returns its draws. So the host prepares step N + 1 while the device still runs step N:
  // `feed` (empty, or one entry per item) names, for an item of one token, the draw of the
  // step begun just before this one whose token it takes (on the device: the host does not
  // know it yet; item.tokens[0] is then only a placeholder and must still be a vocabulary id);
  // -1 keeps item.tokens. At most two steps are begun and not finished.
  virtual bool pipelines_samples() const { return false; }
  void begin_sample(const std::vector<forward_item>& items, std::byte* kv_base,
                    const sampling_config& params, const std::vector<sample_draw>& draws,
                    const std::vector<std::int64_t>& feed);
  virtual std::vector<sampled_token> finish_sample() {
    throw std::logic_error("rank_forward: this backend does not pipeline decode steps");
  }
  // Waits for every begun step and forgets its draws (a request that ends early, an error).
  virtual void drop_samples() {}

  virtual forward_counters counters() const { return {}; }
  // Decode steps replayed from CUDA graphs so far (no device synchronization).
  virtual std::uint64_t graph_replays() const { return 0; }

protected:
  virtual bool samples_on_device() const { return false; }
  // Only called when samples_on_device(); uniforms[i] belongs to draws[i] (unused: greedy).
  // (Every virtual is defined in this header: the module must not need a symbol of the
  // process that loads it.)
  virtual std::vector<sampled_token> forward_sample_device(const std::vector<forward_item>&,
                                                           std::byte*, const sampling_config&,
                                                           const std::vector<sample_draw>&,
                                                           const std::vector<double>&) {
    throw std::logic_error("rank_forward: this backend does not sample on the device");
  }
  // Only called when pipelines_samples(), with begin_sample's arguments checked.
  virtual void begin_sample_device(const std::vector<forward_item>&, std::byte*,
                                   const sampling_config&, const std::vector<sample_draw>&,
                                   const std::vector<double>&, const std::vector<std::int64_t>&) {
    throw std::logic_error("rank_forward: this backend does not pipeline decode steps");
  }
};

// Loads the LibTorch backend on first use. Throws std::runtime_error naming the paths tried
// when it cannot be loaded. Search order: $REFIT_TORCH_FORWARD (a file path), the directory of
// the running executable, the path the build produced it at.
std::unique_ptr<rank_forward> make_rank_forward(const rank_forward_options& options);

// The path the backend was loaded from ("" before the first make_rank_forward).
std::string loaded_backend_path();

// ABI handshake between make_rank_forward and the module (5: tp_comm's device collectives,
// which the module calls through the vtable; 6: pipelined decode, begin_sample / finish_sample).
constexpr std::uint32_t backend_abi_version = 6;
struct backend_entry {
  std::uint32_t abi_version;
  std::size_t options_size; // sizeof(rank_forward_options) in the module
  rank_forward* (*create)(const rank_forward_options& options);
};

} // namespace refit::inference

// Exported by librefit_torch_forward.so.
extern "C" const refit::inference::backend_entry* refit_torch_forward_entry();
