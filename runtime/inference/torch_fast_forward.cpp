// The bf16 engine of rank_forward (forward.hpp): bf16 weights read in place, bf16 activations
// into every GEMM (fp32 accumulation in the GEMM), the residual stream, norms, RoPE, softmaxes
// and the expert mix in fp32, KV cache in bf16.
//
// One step, per layer: qkv GEMM, q/k RMSNorm + RoPE, K/V scattered into their paged slots
// (index_put over a view of the arena), attention (prefill: one causal SDPA over the batch of
// fresh prompts, per item over the cache when a cached prefix precedes; decode: the items'
// block tables gathered into [B, kv heads, L, head_dim] and one SDPA with a length mask in
// which the q heads of one KV head play the query positions), o_proj (+ TP all-reduce);
// router softmax in fp32, top-k by a stable sort (ties: lower expert id), the token copies
// sorted by expert (stable) and one grouped GEMM per projection over the expert-contiguous
// rows (at::_grouped_mm where LibTorch has it, else a loop over the non-empty experts),
// SiLU(gate) * up, the results put back in token order and mixed by the routing weights in
// fp32 (+ all-reduce). Nothing in a step reads device memory on the host except the sampled
// tokens at its end (and the expert counts of the fallback loop).
//
// On a CUDA device at tp 1 a decode step (every item one token) is captured once per
// (batch bucket, block-table bucket) as a CUDA graph and replayed: the step's inputs
// (tokens, positions, slots, block tables, lengths) are one int64 buffer copied host ->
// device before the replay; rows past the batch repeat row 0 and write row 0's K/V values to
// row 0's slot, so padding never touches another sequence's cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#if defined(REFIT_TORCH_CUDA)
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runtime/inference/forward.hpp"
#include "runtime/inference/torch_device_sampling.hpp"
#if defined(REFIT_TORCH_CUDA)
#include "runtime/inference/torch_kernels.hpp"
#endif

#if __has_include(<ATen/ops/_grouped_mm.h>)
#define REFIT_HAVE_GROUPED_MM 1
#endif
#if __has_include(<ATen/ops/scaled_dot_product_attention.h>)
#define REFIT_HAVE_SDPA 1
#endif

namespace refit::inference {

rank_forward* create_fast_forward(const rank_forward_options& options);

namespace {

using at::indexing::Slice;

// Step inputs, all int64 on the device. tokens/positions/src_row/write_block/write_slot: [n]
// (n = tokens of the step); table: [B, W] block ids; lengths: [B] context lengths (decode).
struct step_inputs {
  at::Tensor tokens;
  at::Tensor positions;
  at::Tensor write_block;
  at::Tensor write_slot;
  at::Tensor src_row; // K/V written for token i are those of token src_row[i]
  at::Tensor table;
  at::Tensor lengths;
};

std::int64_t bucket_of(std::int64_t n) {
  static const std::int64_t buckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256,
                                         384, 512};
  for (std::int64_t b : buckets)
    if (n <= b)
      return b;
  return 0; // no graph
}

std::int64_t pow2_at_least(std::int64_t n) {
  std::int64_t p = 1;
  while (p < n)
    p *= 2;
  return p;
}

class fast_rank_forward final : public rank_forward {
public:
  explicit fast_rank_forward(const rank_forward_options& o)
    : o_(o),
      cfg_(o_.model),
      hidden_(cfg_.hidden_size),
      head_dim_(cfg_.head_dim),
      q_heads_(cfg_.num_attention_heads / o.tp),
      kv_heads_(std::max<std::uint32_t>(1, cfg_.num_key_value_heads / o.tp)),
      inter_(cfg_.moe_intermediate_size / o.tp),
      experts_(cfg_.num_experts),
      top_k_(cfg_.num_experts_per_tok),
      vocab_rows_((std::int64_t{cfg_.vocab_size} + o.tp - 1) / o.tp),
      first_vocab_(vocab_rows_ * o.rank),
      device_(o.cuda_device >= 0
                ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(o.cuda_device))
                : at::Device(at::kCPU)),
      bf_(at::TensorOptions().dtype(at::kBFloat16).device(device_)),
      f32_(at::TensorOptions().dtype(at::kFloat).device(device_)),
      i64_(at::TensorOptions().dtype(at::kLong).device(device_)) {
    if (o.weights.dt != model::dtype::bfloat16)
      throw std::invalid_argument("bf16 engine: the residents are not bfloat16");
    if (head_dim_ % 2 != 0)
      throw std::invalid_argument("bf16 engine: head_dim " + std::to_string(head_dim_)
                                  + " must be even for RoPE");
    if (o.kv.layers != cfg_.num_hidden_layers || o.kv.kv_heads != kv_heads_
        || o.kv.head_dim != cfg_.head_dim || o.kv.block_size == 0 || o.kv.element_bytes != 2)
      throw std::invalid_argument("bf16 engine: KV geometry does not match the model");
    if (o.kv_blocks == 0)
      throw std::invalid_argument("bf16 engine: kv_blocks is 0");
    c10::InferenceMode inference_mode;
    c10::DeviceGuard guard(device_);
    bind();
    const std::int64_t half = head_dim_ / 2;
    inv_freq_.resize(static_cast<std::size_t>(half));
    for (std::int64_t i = 0; i < half; ++i)
      inv_freq_[static_cast<std::size_t>(i)] =
        1.0f / std::pow(static_cast<float>(cfg_.rope_theta),
                        static_cast<float>(2 * i) / static_cast<float>(head_dim_));
    expert_loads_ = at::zeros({2}, i64_); // [all forwards, decode forwards]
#if defined(REFIT_TORCH_CUDA)
    if (device_.is_cuda()) {
      stream_.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index()));
      c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
      baseline_bytes_ = allocated_bytes();
    }
#endif
    graphs_enabled_ = device_.is_cuda() && o.tp == 1 && o.cuda_graphs;
#if defined(REFIT_TORCH_CUDA)
    fused_ = device_.is_cuda() && o.fused_kernels;
    fused_decode_attention_ = kernels::decode_attention_supported(
      static_cast<int>(head_dim_), static_cast<int>(q_heads_ / kv_heads_));
#endif
  }

  std::vector<float> forward(const std::vector<forward_item>& items, std::byte* kv_base,
                             logits_rows rows) override {
    scope s(*this);
    const at::Tensor logits = run_eager(items, kv_base, rows);
    const at::Tensor host = logits.contiguous().cpu();
    const float* data = host.data_ptr<float>();
    return std::vector<float>(data, data + host.numel());
  }

  forward_counters counters() const override {
    forward_counters c = counters_;
    c.counts_experts = true;
    scope s(*this);
    const at::Tensor loads = expert_loads_.cpu();
    c.expert_loads = static_cast<std::uint64_t>(loads[0].item<std::int64_t>());
    c.decode_expert_loads = static_cast<std::uint64_t>(loads[1].item<std::int64_t>());
#if defined(REFIT_TORCH_CUDA)
    if (device_.is_cuda()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
      const auto& peak = stats.reserved_bytes[0].peak;
      c.peak_workspace_bytes = peak > baseline_bytes_ ? static_cast<std::uint64_t>(peak - baseline_bytes_) : 0;
    }
#endif
    return c;
  }

  std::uint64_t graph_replays() const override { return counters_.graph_replays; }

protected:
  bool samples_on_device() const override { return true; }

  std::vector<sampled_token> forward_sample_device(const std::vector<forward_item>& items,
                                                   std::byte* kv_base,
                                                   const sampling_config& params,
                                                   const std::vector<sample_draw>& draws,
                                                   const std::vector<double>& uniforms) override {
    scope s(*this);
    const at::Tensor logits = is_decode(items) && graphs_enabled_
                                ? run_graph(items, kv_base)
                                : run_eager(items, kv_base, logits_rows::last_token);
    std::vector<std::int64_t> rows;
    rows.reserve(draws.size());
    for (const auto& d : draws)
      rows.push_back(d.row);
    const at::Tensor row_index = upload(rows);
    const at::Tensor u = at::from_blob(const_cast<double*>(uniforms.data()),
                                       {static_cast<std::int64_t>(uniforms.size())}, at::kDouble)
                           .to(device_);
    const device_samples drawn = sample_on_device(logits, params, row_index, u);
    std::vector<sampled_token> out(draws.size());
    for (std::size_t i = 0; i < draws.size(); ++i)
      out[i] = {drawn.tokens[i], drawn.logprobs[i]};
    return out;
  }

private:
  // Inference mode, the device, the engine's stream and the threads, for one call.
  struct scope {
    explicit scope(const fast_rank_forward& f) : device_guard(f.device_) {
      if (f.o_.compute_threads > 0 && at::get_num_threads() != f.o_.compute_threads)
        at::set_num_threads(f.o_.compute_threads);
#if defined(REFIT_TORCH_CUDA)
      if (f.stream_)
        stream_guard.emplace(*f.stream_);
#endif
    }
    c10::InferenceMode inference_mode;
    c10::DeviceGuard device_guard;
#if defined(REFIT_TORCH_CUDA)
    std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
#endif
  };

  struct layer_tensors {
    at::Tensor qkv, o, q_norm, k_norm, router, w13, w2, input_norm, post_norm;
  };

  at::Tensor view(const std::byte* p, at::IntArrayRef shape) const {
    return at::from_blob(const_cast<std::byte*>(p), shape, bf_); // never written
  }

  void bind() {
    const rank_weights& w = o_.weights;
    embed_ = view(w.embed, {vocab_rows_, hidden_});
    final_norm_ = view(w.final_norm, {hidden_});
    lm_head_ = view(w.lm_head, {vocab_rows_, hidden_});
    for (const layer_weights& lw : w.layers) {
      layer_tensors t;
      t.qkv = view(lw.qkv, {(q_heads_ + 2 * kv_heads_) * head_dim_, hidden_});
      t.o = view(lw.o, {hidden_, q_heads_ * head_dim_});
      t.q_norm = view(lw.q_norm, {head_dim_});
      t.k_norm = view(lw.k_norm, {head_dim_});
      t.router = view(lw.router, {experts_, hidden_});
      t.w13 = view(lw.w13, {experts_, 2 * inter_, hidden_});
      t.w2 = view(lw.w2, {experts_, hidden_, inter_});
      t.input_norm = view(lw.input_norm, {hidden_});
      t.post_norm = view(lw.post_attention_norm, {hidden_});
      layers_.push_back(std::move(t));
    }
  }

  static bool is_decode(const std::vector<forward_item>& items) {
    return std::all_of(items.begin(), items.end(),
                       [](const forward_item& i) { return i.count == 1; });
  }

  at::Tensor upload(const std::vector<std::int64_t>& values) const {
    return at::from_blob(const_cast<std::int64_t*>(values.data()),
                         {static_cast<std::int64_t>(values.size())}, at::kLong)
      .to(device_);
  }

  // [nb, block, kv heads, head_dim] view of (layer, k|v) over the arena at kv_base (the bf16
  // engine's block layout: [layer][k|v][slot][kv head][head_dim]).
  at::Tensor kv_view(std::byte* kv_base, std::uint32_t layer, std::uint32_t kind) const {
    return at::from_blob(kv_base,
                         {static_cast<std::int64_t>(o_.kv_blocks), std::int64_t{cfg_.num_hidden_layers},
                          2, std::int64_t{o_.kv.block_size}, kv_heads_, head_dim_},
                         bf_)
      .select(1, layer)
      .select(1, kind);
  }

  void validate(const std::vector<forward_item>& items) const {
    if (items.empty())
      throw std::invalid_argument("forward: no items");
    for (const auto& item : items) {
      if (item.count == 0)
        throw std::invalid_argument("forward: an item without tokens");
      const std::uint64_t end = std::uint64_t{item.position} + item.count;
      if (item.block_count * std::uint64_t{o_.kv.block_size} < end)
        throw std::invalid_argument("forward: " + std::to_string(item.block_count)
                                    + " KV blocks do not cover " + std::to_string(end)
                                    + " positions");
      for (std::size_t b = 0; b < item.block_count; ++b)
        if (item.block_table[b] >= o_.kv_blocks)
          throw std::out_of_range("forward: KV block " + std::to_string(item.block_table[b])
                                  + " is outside the arena of " + std::to_string(o_.kv_blocks));
      for (std::uint32_t t = 0; t < item.count; ++t)
        if (item.tokens[t] < 0 || static_cast<std::uint32_t>(item.tokens[t]) >= cfg_.vocab_size)
          throw std::out_of_range("forward: token id " + std::to_string(item.tokens[t])
                                  + " is outside the vocabulary of "
                                  + std::to_string(cfg_.vocab_size));
    }
  }

  // Host-side step inputs of `items`, padded to `batch` rows (decode) and W table columns.
  struct host_inputs {
    std::vector<std::int64_t> tokens, positions, write_block, write_slot, src_row, table,
      lengths;
  };
  host_inputs gather_inputs(const std::vector<forward_item>& items, std::int64_t batch,
                            std::int64_t width) const {
    host_inputs h;
    const std::int64_t bs = o_.kv.block_size;
    for (const auto& item : items)
      for (std::uint32_t t = 0; t < item.count; ++t) {
        const std::int64_t pos = std::int64_t{item.position} + t;
        h.src_row.push_back(static_cast<std::int64_t>(h.tokens.size()));
        h.tokens.push_back(item.tokens[t]);
        h.positions.push_back(pos);
        h.write_block.push_back(item.block_table[pos / bs]);
        h.write_slot.push_back(pos % bs);
      }
    if (width > 0) {
      for (const auto& item : items) {
        for (std::int64_t b = 0; b < width; ++b)
          h.table.push_back(b < static_cast<std::int64_t>(item.block_count)
                              ? item.block_table[b]
                              : item.block_table[0]);
        h.lengths.push_back(std::int64_t{item.position} + item.count);
      }
      const auto real = static_cast<std::int64_t>(items.size());
      for (std::int64_t r = real; r < batch; ++r) { // padding: a copy of row 0
        h.tokens.push_back(h.tokens[0]);
        h.positions.push_back(h.positions[0]);
        h.write_block.push_back(h.write_block[0]);
        h.write_slot.push_back(h.write_slot[0]);
        h.src_row.push_back(0);
        for (std::int64_t b = 0; b < width; ++b)
          h.table.push_back(h.table[static_cast<std::size_t>(b)]);
        h.lengths.push_back(h.lengths[0]);
      }
    }
    return h;
  }

  // cos / sin tables [P, head_dim / 2] covering positions < `positions` (grown eagerly).
  void ensure_rope(std::int64_t positions) {
    if (rope_positions_ >= positions)
      return;
    const std::int64_t p = pow2_at_least(std::max<std::int64_t>(positions, 256));
    const std::int64_t half = head_dim_ / 2;
    at::Tensor c = at::empty({p, half}, at::kFloat);
    at::Tensor s = at::empty({p, half}, at::kFloat);
    float* cd = c.data_ptr<float>();
    float* sd = s.data_ptr<float>();
    for (std::int64_t t = 0; t < p; ++t)
      for (std::int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(t) * inv_freq_[static_cast<std::size_t>(i)];
        cd[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
        sd[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
      }
#if defined(REFIT_TORCH_CUDA)
    graphs_.clear(); // captured graphs read the old tables
#endif
    cos_ = c.to(device_);
    sin_ = s.to(device_);
    rope_positions_ = p;
  }

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const {
    const at::Tensor variance = x.pow(2).mean(-1, /*keepdim=*/true);
    return x * at::rsqrt(variance + cfg_.rms_norm_eps) * w; // fp32 (w promoted)
  }

  at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
    const std::int64_t half = head_dim_ / 2;
    const at::Tensor x1 = x.narrow(-1, 0, half);
    const at::Tensor x2 = x.narrow(-1, half, half);
    return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
  }

  void all_reduce(at::Tensor& t) const {
    if (o_.tp == 1)
      return;
    at::Tensor host = t.to(at::kFloat).contiguous().cpu();
    o_.comm->all_reduce_sum(o_.rank, host.data_ptr<float>(), static_cast<std::size_t>(host.numel()));
    t = host.to(t.device()).to(t.scalar_type());
  }

  // The model over the step; returns logits [rows, vocab] fp32 on the device. `decode`: every
  // item is one token and attention reads in.table / in.lengths; else `items` drive the
  // prefill attention.
  at::Tensor model(const step_inputs& in, std::byte* kv_base, const std::vector<forward_item>* items,
                   const at::Tensor& picked, bool decode) {
    const std::int64_t n = in.tokens.size(0);
    at::Tensor x;
    if (o_.tp == 1) {
      x = embed_.index_select(0, in.tokens).to(at::kFloat);
    } else {
      const at::Tensor row = in.tokens - first_vocab_;
      const at::Tensor valid = (row >= 0).logical_and(row < vocab_rows_);
      x = embed_.index_select(0, row.clamp(0, vocab_rows_ - 1)).to(at::kFloat)
          * valid.unsqueeze(1).to(at::kFloat);
      all_reduce(x);
    }
    const at::Tensor cos = cos_.index_select(0, in.positions).unsqueeze(1);
    const at::Tensor sin = sin_.index_select(0, in.positions).unsqueeze(1);
    const std::int64_t q_cols = q_heads_ * head_dim_;
    const std::int64_t kv_cols = kv_heads_ * head_dim_;

    const bool fused_attention = decode && fused_ && fused_decode_attention_;
    for (std::uint32_t layer = 0; layer < cfg_.num_hidden_layers; ++layer) {
      const layer_tensors& w = layers_[layer];
      at::Tensor h = norm_bf16(x, w.input_norm);
      const at::Tensor qkv = at::matmul(h, w.qkv.t());
      at::Tensor kc = kv_view(kv_base, layer, 0);
      at::Tensor vc = kv_view(kv_base, layer, 1);
      at::Tensor attn;
      if (fused_attention) {
        attn = fused_decode_layer_attention(qkv, w, in, kv_base, layer);
      } else {
        at::Tensor q = qkv.narrow(1, 0, q_cols).reshape({n, q_heads_, head_dim_});
        at::Tensor k = qkv.narrow(1, q_cols, kv_cols).reshape({n, kv_heads_, head_dim_});
        const at::Tensor v =
          qkv.narrow(1, q_cols + kv_cols, kv_cols).reshape({n, kv_heads_, head_dim_});
        q = rope(rms_norm(q.to(at::kFloat), w.q_norm), cos, sin).to(at::kBFloat16);
        k = rope(rms_norm(k.to(at::kFloat), w.k_norm), cos, sin).to(at::kBFloat16);
        const at::Tensor k_src = decode ? k.index_select(0, in.src_row) : k;
        const at::Tensor v_src = decode ? v.index_select(0, in.src_row) : v;
        kc.index_put_({in.write_block, in.write_slot}, k_src);
        vc.index_put_({in.write_block, in.write_slot}, v_src);
        attn = decode ? decode_attention(q, kc, vc, in) : prefill_attention(q, k, v, kc, vc, *items);
      }
      const at::Tensor out = at::matmul(attn, w.o.t());
      add_residual(x, out);

      h = norm_bf16(x, w.post_norm);
      experts(w, h, decode, x);
    }

    const at::Tensor xf = norm_bf16(x.index_select(0, picked).contiguous(), final_norm_);
    at::Tensor local = at::matmul(xf, lm_head_.t()).to(at::kFloat);
    if (o_.tp == 1)
      return local.narrow(1, 0, std::int64_t{cfg_.vocab_size});
    const std::int64_t r = local.size(0);
    at::Tensor host = local.contiguous().cpu();
    at::Tensor gathered = at::empty({static_cast<std::int64_t>(o_.tp), r, vocab_rows_}, at::kFloat);
    o_.comm->all_gather(o_.rank, host.data_ptr<float>(), static_cast<std::size_t>(host.numel()),
                        gathered.data_ptr<float>());
    return gathered.permute({1, 0, 2})
      .reshape({r, static_cast<std::int64_t>(o_.tp) * vocab_rows_})
      .narrow(1, 0, std::int64_t{cfg_.vocab_size})
      .to(device_);
  }

  // softmax(q k^T / sqrt(d)) v over [B, heads, Lq, d] with a boolean mask (true: attend).
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& mask, bool causal) const {
#if defined(REFIT_HAVE_SDPA)
    return at::scaled_dot_product_attention(q, k, v, mask, 0.0, causal && !mask);
#else
    at::Tensor scores = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-1, -2))
                        * (1.0 / std::sqrt(static_cast<double>(head_dim_)));
    if (mask)
      scores = scores.masked_fill(mask->logical_not(), -std::numeric_limits<float>::infinity());
    else if (causal) {
      const std::int64_t lq = q.size(-2);
      const at::Tensor allowed = at::ones({lq, k.size(-2)}, q.options().dtype(at::kBool)).tril();
      scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
    }
    return at::matmul(at::softmax(scores, -1), v.to(at::kFloat)).to(q.scalar_type());
#endif
  }

  // Decode: q [B, Hq, d]; the blocks of in.table gathered to [B, Hkv, W * block, d].
  at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                              const step_inputs& in) const {
    const std::int64_t b = in.table.size(0);
    const std::int64_t width = in.table.size(1);
    const std::int64_t bs = o_.kv.block_size;
    const std::int64_t length = width * bs;
    const at::Tensor flat = in.table.reshape({-1});
    const auto gather = [&](const at::Tensor& cache) { // [B, Hkv, L, d], strided
      return cache.index_select(0, flat).view({b, length, kv_heads_, head_dim_}).transpose(1, 2);
    };
    const at::Tensor keys = gather(kc);
    const at::Tensor values = gather(vc);
    const std::int64_t group = q_heads_ / kv_heads_;
    const at::Tensor queries = q.view({b, kv_heads_, group, head_dim_});
    const at::Tensor mask = (at::arange(length, i64_).unsqueeze(0) < in.lengths.unsqueeze(1))
                              .view({b, 1, 1, length});
    return attention(queries, keys, values, mask, false).reshape({b, q_heads_ * head_dim_});
  }

  // Prefill: fresh prompts (position 0) in one padded causal batch; items after a cached
  // prefix one by one over their cache.
  at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& kc, const at::Tensor& vc,
                               const std::vector<forward_item>& items) const {
    const std::int64_t n = q.size(0);
    const std::int64_t group = q_heads_ / kv_heads_;
    at::Tensor out = at::empty({n, q_heads_ * head_dim_}, bf_);
    std::vector<std::int64_t> fresh_rows, fresh_out, fresh_len;
    std::int64_t longest = 0;
    std::int64_t offset = 0;
    for (const auto& item : items) {
      if (item.position == 0) {
        longest = std::max<std::int64_t>(longest, item.count);
        fresh_len.push_back(item.count);
        fresh_out.push_back(offset);
      } else {
        const std::int64_t length = std::int64_t{item.position} + item.count;
        std::vector<std::int64_t> blocks(item.block_table,
                                         item.block_table + (length + o_.kv.block_size - 1)
                                                              / o_.kv.block_size);
        const at::Tensor index = upload(blocks);
        const auto gather = [&](const at::Tensor& cache) {
          return cache.index_select(0, index)
            .reshape({-1, kv_heads_, head_dim_})
            .narrow(0, 0, length)
            .permute({1, 0, 2})
            .repeat_interleave(group, 0)
            .unsqueeze(0);
        };
        const at::Tensor qi = q.narrow(0, offset, item.count).transpose(0, 1).unsqueeze(0);
        const at::Tensor key_pos = at::arange(length, i64_).view({1, length});
        const at::Tensor query_pos =
          at::arange(std::int64_t{item.position}, length, i64_).view({item.count, 1});
        const at::Tensor mask = (key_pos <= query_pos).view({1, 1, item.count, length});
        const at::Tensor ctx = attention(qi, gather(kc), gather(vc), mask, false);
        out.narrow(0, offset, item.count)
          .copy_(ctx.squeeze(0).transpose(0, 1).reshape({item.count, q_heads_ * head_dim_}));
      }
      offset += item.count;
    }
    if (fresh_len.empty())
      return out;
    // Padded [F, longest] batch of the fresh prompts (padding repeats an item's last row).
    const auto f = static_cast<std::int64_t>(fresh_len.size());
    for (std::int64_t i = 0; i < f; ++i)
      for (std::int64_t t = 0; t < longest; ++t)
        fresh_rows.push_back(fresh_out[static_cast<std::size_t>(i)]
                             + std::min(t, fresh_len[static_cast<std::size_t>(i)] - 1));
    const at::Tensor rows = upload(fresh_rows);
    const auto batch = [&](const at::Tensor& t, std::int64_t heads) {
      return t.index_select(0, rows).view({f, longest, heads, head_dim_}).transpose(1, 2);
    };
    const bool equal = std::all_of(fresh_len.begin(), fresh_len.end(),
                                   [&](std::int64_t l) { return l == longest; });
    std::optional<at::Tensor> mask;
    if (!equal) {
      const at::Tensor pos = at::arange(longest, i64_);
      const at::Tensor lens = upload(fresh_len).view({f, 1, 1, 1});
      mask = (pos.view({1, 1, 1, longest}) <= pos.view({1, 1, longest, 1}))
               .logical_and(pos.view({1, 1, 1, longest}) < lens);
    }
    const at::Tensor ctx = attention(batch(q, q_heads_), batch(k, kv_heads_).repeat_interleave(group, 1),
                                     batch(v, kv_heads_).repeat_interleave(group, 1), mask, true)
                             .transpose(1, 2)
                             .reshape({f * longest, q_heads_ * head_dim_});
    for (std::int64_t i = 0; i < f; ++i)
      out.narrow(0, fresh_out[static_cast<std::size_t>(i)], fresh_len[static_cast<std::size_t>(i)])
        .copy_(ctx.narrow(0, i * longest, fresh_len[static_cast<std::size_t>(i)]));
    return out;
  }

  // x [M, K] (rows grouped by expert: counts) times w [E, N, K]^T per group -> [M, N].
  at::Tensor grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts,
                     const at::Tensor& offsets) const {
#if defined(REFIT_HAVE_GROUPED_MM)
    const bool aligned = w.size(1) % 8 == 0 && w.size(2) % 8 == 0;
    if (device_.is_cuda() && aligned)
      return at::_grouped_mm(x, w.transpose(1, 2), offsets);
#endif
    (void)offsets;
    at::Tensor out = at::empty({x.size(0), w.size(1)}, x.options());
    const at::Tensor host = counts.cpu(); // the fallback's host sync
    const std::int64_t* c = host.data_ptr<std::int64_t>();
    std::int64_t start = 0;
    for (std::int64_t e = 0; e < experts_; ++e) {
      if (c[e] == 0)
        continue;
      out.narrow(0, start, c[e]).copy_(at::matmul(x.narrow(0, start, c[e]), w[e].t()));
      start += c[e];
    }
    return out;
  }

  // The routed experts of h, added into the residual stream x (after the TP all-reduce).
  void experts(const layer_tensors& w, const at::Tensor& h, bool decode, at::Tensor& x) {
    const std::int64_t n = h.size(0);
    const at::Tensor router_logits = at::matmul(h, w.router.t()); // bf16 [n, E]
    at::Tensor weights; // fp32 [n, k]
    at::Tensor chosen;  // int64 [n * k]
#if defined(REFIT_TORCH_CUDA)
    if (fused_ && kernels::route_supported(static_cast<int>(experts_), static_cast<int>(top_k_))) {
      at::Tensor ids = at::empty({n, top_k_}, i64_);
      weights = at::empty({n, top_k_}, f32_);
      kernels::route(router_logits.data_ptr(), static_cast<int>(n), static_cast<int>(experts_),
                     static_cast<int>(top_k_), cfg_.norm_topk_prob, ids.data_ptr<std::int64_t>(),
                     weights.data_ptr<float>(), stream());
      chosen = ids.reshape({-1});
    }
#endif
    if (!chosen.defined()) {
      const at::Tensor probs = at::softmax(router_logits.to(at::kFloat), -1);
      auto ranked = at::sort(probs, /*stable=*/true, /*dim=*/-1, /*descending=*/true);
      weights = std::get<0>(ranked).narrow(1, 0, top_k_);
      chosen = std::get<1>(ranked).narrow(1, 0, top_k_).reshape({-1});
      if (cfg_.norm_topk_prob)
        weights = weights / weights.sum(-1, /*keepdim=*/true);
    }
    const std::int64_t copies = n * top_k_;
    at::Tensor counts, offsets, order, src_token, inverse;
#if defined(REFIT_TORCH_CUDA)
    if (fused_ && kernels::bucket_supported(static_cast<int>(copies), static_cast<int>(experts_))) {
      counts = at::empty({experts_}, i64_);
      offsets = at::empty({experts_}, i64_.dtype(at::kInt));
      order = at::empty({copies}, i64_);
      src_token = at::empty({copies}, i64_);
      inverse = at::empty({copies}, i64_);
      kernels::bucket(chosen.data_ptr<std::int64_t>(), static_cast<int>(copies),
                      static_cast<int>(top_k_), static_cast<int>(experts_),
                      counts.data_ptr<std::int64_t>(), offsets.data_ptr<int>(),
                      order.data_ptr<std::int64_t>(), src_token.data_ptr<std::int64_t>(),
                      inverse.data_ptr<std::int64_t>(), expert_loads_.data_ptr<std::int64_t>(),
                      decode ? 2 : 1, stream());
    }
#endif
    if (!order.defined()) {
      auto by_expert = at::sort(chosen, c10::optional<bool>(true), /*dim=*/0, /*descending=*/false);
      order = std::get<1>(by_expert); // sorted position -> flat index
      counts = at::zeros({experts_}, i64_).scatter_add_(0, chosen, at::ones_like(chosen));
      offsets = counts.cumsum(0).to(at::kInt);
      src_token = at::floor_divide(order, top_k_);
      const at::Tensor used = counts.gt(0).sum();
      expert_loads_.narrow(0, 0, 1).add_(used);
      if (decode)
        expert_loads_.narrow(0, 1, 1).add_(used);
    }

    const at::Tensor xs = h.index_select(0, src_token);
    const auto project = [&](const at::Tensor& in, const at::Tensor& weight) {
#if defined(REFIT_TORCH_CUDA)
      if (fused_ && kernels::expert_gemv_supported(copies, weight.size(2))) {
        at::Tensor out = at::empty({copies, weight.size(1)}, bf_);
        kernels::expert_gemv(in.data_ptr(), weight.data_ptr(), chosen.data_ptr<std::int64_t>(),
                             order.data_ptr<std::int64_t>(), counts.data_ptr<std::int64_t>(),
                             offsets.data_ptr<int>(), out.data_ptr(), static_cast<int>(copies),
                             static_cast<int>(weight.size(1)), static_cast<int>(weight.size(2)),
                             stream());
        return out;
      }
#endif
      return grouped(in, weight, counts, offsets);
    };
    const at::Tensor gate_up = project(xs, w.w13);
    at::Tensor act;
#if defined(REFIT_TORCH_CUDA)
    if (fused_) {
      act = at::empty({copies, inter_}, bf_);
      kernels::silu_mul(gate_up.data_ptr(), act.data_ptr(), copies, static_cast<int>(inter_),
                        stream());
    }
#endif
    if (!act.defined())
      act = at::silu(gate_up.narrow(1, 0, inter_)) * gate_up.narrow(1, inter_, inter_);
    const at::Tensor ys = project(act, w.w2);
#if defined(REFIT_TORCH_CUDA)
    if (fused_ && o_.tp == 1) {
      if (!inverse.defined())
        inverse = at::empty_like(order).index_copy_(0, order, at::arange(copies, i64_));
      kernels::mix_experts(ys.data_ptr(), inverse.data_ptr<std::int64_t>(),
                           weights.contiguous().data_ptr<float>(), x.data_ptr<float>(),
                           static_cast<int>(n), static_cast<int>(top_k_),
                           static_cast<int>(hidden_), stream());
      return;
    }
#endif
    const at::Tensor y = at::empty_like(ys).index_copy_(0, order, ys); // back in token order
    at::Tensor moe = (y.view({n, top_k_, hidden_}).to(at::kFloat) * weights.unsqueeze(-1)).sum(1);
    all_reduce(moe);
    x.add_(moe);
  }

  // x (fp32, contiguous) += the all-reduced bf16 `out`.
  void add_residual(at::Tensor& x, const at::Tensor& out) {
#if defined(REFIT_TORCH_CUDA)
    if (fused_ && o_.tp == 1) {
      kernels::add_bf16(x.data_ptr<float>(), out.data_ptr(), x.numel(), stream());
      return;
    }
#endif
    at::Tensor o = out.to(at::kFloat);
    all_reduce(o);
    x.add_(o);
  }

  // RMSNorm of fp32 x (contiguous [n, H]) to bf16.
  at::Tensor norm_bf16(const at::Tensor& x, const at::Tensor& w) const {
#if defined(REFIT_TORCH_CUDA)
    if (fused_) {
      at::Tensor out = at::empty({x.size(0), x.size(1)}, bf_);
      kernels::rms_norm(x.data_ptr<float>(), w.data_ptr(), out.data_ptr(),
                        static_cast<int>(x.size(0)), static_cast<int>(x.size(1)),
                        static_cast<float>(cfg_.rms_norm_eps), stream());
      return out;
    }
#endif
    return rms_norm(x, w).to(at::kBFloat16);
  }

  // Decode attention of one layer through the fused kernels: q/k norm + RoPE + the K/V
  // writes, then attention over the paged cache.
  at::Tensor fused_decode_layer_attention(const at::Tensor& qkv, const layer_tensors& w,
                                          const step_inputs& in, std::byte* kv_base,
                                          std::uint32_t layer) {
#if defined(REFIT_TORCH_CUDA)
    const std::int64_t n = qkv.size(0);
    kernels::kv_target kv;
    kv.base = kv_base;
    kv.block_elems = static_cast<std::int64_t>(o_.kv.block_bytes() / 2);
    kv.part_elems = std::int64_t{o_.kv.block_size} * kv_heads_ * head_dim_;
    kv.layer_offset = std::int64_t{layer} * 2 * kv.part_elems;
    kv.block_size = static_cast<int>(o_.kv.block_size);
    at::Tensor q = at::empty({n, q_heads_, head_dim_}, bf_);
    kernels::qk_norm_rope_write(qkv.data_ptr(), w.q_norm.data_ptr(), w.k_norm.data_ptr(),
                                cos_.data_ptr<float>(), sin_.data_ptr<float>(),
                                in.positions.data_ptr<std::int64_t>(),
                                in.src_row.data_ptr<std::int64_t>(),
                                in.write_block.data_ptr<std::int64_t>(),
                                in.write_slot.data_ptr<std::int64_t>(), q.data_ptr(), kv,
                                static_cast<int>(n), static_cast<int>(q_heads_),
                                static_cast<int>(kv_heads_), static_cast<int>(head_dim_),
                                static_cast<float>(cfg_.rms_norm_eps), stream());
    at::Tensor out = at::empty({n, q_heads_ * head_dim_}, bf_);
    kernels::decode_attention(q.data_ptr(), kv, in.table.data_ptr<std::int64_t>(),
                              static_cast<int>(in.table.size(1)),
                              in.lengths.data_ptr<std::int64_t>(), out.data_ptr(),
                              static_cast<int>(n), static_cast<int>(q_heads_),
                              static_cast<int>(kv_heads_), static_cast<int>(head_dim_), stream());
    return out;
#else
    (void)qkv, (void)w, (void)in, (void)kv_base, (void)layer;
    throw std::logic_error("bf16 engine: fused kernels need a CUDA build");
#endif
  }

#if defined(REFIT_TORCH_CUDA)
  void* stream() const { return c10::cuda::getCurrentCUDAStream(device_.index()).stream(); }
#endif

  at::Tensor run_eager(const std::vector<forward_item>& items, std::byte* kv_base,
                       logits_rows rows) {
    validate(items);
    const bool decode = is_decode(items);
    std::int64_t width = 0;
    std::int64_t max_position = 0;
    for (const auto& item : items) {
      width = std::max<std::int64_t>(width, static_cast<std::int64_t>(item.block_count));
      max_position = std::max<std::int64_t>(max_position, std::int64_t{item.position} + item.count);
    }
    ensure_rope(max_position);
    const host_inputs h =
      gather_inputs(items, static_cast<std::int64_t>(items.size()), decode ? width : 0);
    step_inputs in;
    in.tokens = upload(h.tokens);
    in.positions = upload(h.positions);
    in.write_block = upload(h.write_block);
    in.write_slot = upload(h.write_slot);
    in.src_row = upload(h.src_row);
    if (decode) {
      in.table = upload(h.table).view({static_cast<std::int64_t>(items.size()), width});
      in.lengths = upload(h.lengths);
    }
    std::vector<std::int64_t> picked;
    std::int64_t offset = 0;
    for (const auto& item : items) {
      if (rows == logits_rows::last_token) {
        picked.push_back(offset + item.count - 1);
      } else {
        for (std::uint32_t t = 0; t < item.count; ++t)
          picked.push_back(offset + t);
      }
      offset += item.count;
    }
    ++counters_.forwards;
    return model(in, kv_base, &items, upload(picked), decode);
  }

#if defined(REFIT_TORCH_CUDA)
  struct graph_entry {
    at::cuda::CUDAGraph graph;
    at::Tensor host;   // pinned int64 staging of the inputs
    at::Tensor device; // the same on the device; `in` are views of it
    step_inputs in;
    at::Tensor picked;
    at::Tensor logits; // the graph's output
    std::byte* kv_base = nullptr;
  };

  static std::size_t allocated_bytes_of(c10::DeviceIndex d) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d);
    return static_cast<std::size_t>(stats.reserved_bytes[0].current);
  }
  std::int64_t allocated_bytes() const {
    return static_cast<std::int64_t>(allocated_bytes_of(device_.index()));
  }
#endif

  at::Tensor run_graph(const std::vector<forward_item>& items, std::byte* kv_base) {
#if defined(REFIT_TORCH_CUDA)
    validate(items);
    const auto real = static_cast<std::int64_t>(items.size());
    const std::int64_t batch = bucket_of(real);
    std::int64_t blocks = 1;
    for (const auto& item : items)
      blocks = std::max<std::int64_t>(blocks, static_cast<std::int64_t>(item.block_count));
    const std::int64_t width = pow2_at_least(blocks);
    if (batch == 0)
      return run_eager(items, kv_base, logits_rows::last_token);
    ensure_rope(width * o_.kv.block_size);
    const host_inputs h = gather_inputs(items, batch, width);
    const std::int64_t fields = 5 * batch + batch * width + batch;
    auto& slot = graphs_[{batch, width}];
    const bool fresh = !slot;
    if (fresh) {
      slot = std::make_unique<graph_entry>();
      slot->host = at::empty({fields}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
      slot->device = at::empty({fields}, i64_);
      std::int64_t at_ = 0;
      const auto take = [&](std::int64_t count) {
        at::Tensor t = slot->device.narrow(0, at_, count);
        at_ += count;
        return t;
      };
      slot->in.tokens = take(batch);
      slot->in.positions = take(batch);
      slot->in.write_block = take(batch);
      slot->in.write_slot = take(batch);
      slot->in.src_row = take(batch);
      slot->in.table = take(batch * width).view({batch, width});
      slot->in.lengths = take(batch);
      slot->picked = at::arange(batch, i64_);
      slot->kv_base = kv_base;
    }
    if (slot->kv_base != kv_base)
      throw std::logic_error("bf16 engine: the KV arena moved under a captured graph");
    std::int64_t* dst = slot->host.data_ptr<std::int64_t>();
    for (const auto* part : {&h.tokens, &h.positions, &h.write_block, &h.write_slot, &h.src_row,
                             &h.table, &h.lengths}) {
      std::copy(part->begin(), part->end(), dst);
      dst += part->size();
    }
    slot->device.copy_(slot->host, /*non_blocking=*/true);
    ++counters_.forwards;
    if (fresh) {
      // Warm-up outside the graph (kernel selection, workspaces; it writes the same K/V the
      // replay writes and its expert counts are taken back), then capture and replay.
      const at::Tensor counted = expert_loads_.clone();
      model(slot->in, kv_base, nullptr, slot->picked, true);
      expert_loads_.copy_(counted);
      slot->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
      slot->logits = model(slot->in, kv_base, nullptr, slot->picked, true);
      slot->graph.capture_end();
      ++counters_.graph_captures;
    }
    slot->graph.replay();
    ++counters_.graph_replays;
    return slot->logits.narrow(0, 0, real);
#else
    return run_eager(items, kv_base, logits_rows::last_token);
#endif
  }

  const rank_forward_options o_;
  const model::model_config& cfg_;
  const std::int64_t hidden_, head_dim_, q_heads_, kv_heads_, inter_, experts_, top_k_;
  const std::int64_t vocab_rows_, first_vocab_;
  const at::Device device_;
  const at::TensorOptions bf_, f32_, i64_;
  at::Tensor embed_, final_norm_, lm_head_;
  std::vector<layer_tensors> layers_;
  std::vector<float> inv_freq_;
  at::Tensor cos_, sin_;
  std::int64_t rope_positions_ = 0;
  at::Tensor expert_loads_;
  forward_counters counters_;
  bool graphs_enabled_ = false;
  bool fused_ = false;                  // the fused CUDA kernels (torch_kernels.cu)
  bool fused_decode_attention_ = false; // their decode attention supports this shape
#if defined(REFIT_TORCH_CUDA)
  std::optional<c10::cuda::CUDAStream> stream_;
  std::int64_t baseline_bytes_ = 0;
  std::map<std::pair<std::int64_t, std::int64_t>, std::unique_ptr<graph_entry>> graphs_;
#endif
};

} // namespace

rank_forward* create_fast_forward(const rank_forward_options& options) {
  return new fast_rank_forward(options);
}

} // namespace refit::inference
