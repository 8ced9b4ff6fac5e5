// The LibTorch (ATen) fp32 reference implementation of rank_forward, and the module's entry
// point (the bf16 engine is torch_fast_forward.cpp). Built into the shared module
// librefit_torch_forward.so (see forward.hpp) with torch_fast_forward.cpp and
// torch_device_sampling.cpp, the only LibTorch translation units of refit. Uses only
// ATen APIs that LibTorch 1.13 and 2.x both have; computes in fp32 (bf16/fp16 residents are
// converted on the fly; with cache_fp32_weights the conversion is kept for the lifetime of
// the rank_forward object, i.e. one request).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/inference/forward.hpp"
#include "runtime/inference/rope.hpp"

namespace refit::inference {

rank_forward* create_fast_forward(const rank_forward_options& options); // torch_fast_forward.cpp

namespace {

std::int64_t element_size(model::dtype dt) {
  return dt == model::dtype::float32 ? 4 : 2;
}

at::ScalarType scalar_type_of(model::dtype dt) {
  switch (dt) {
    case model::dtype::bfloat16: return at::kBFloat16;
    case model::dtype::float16: return at::kHalf;
    case model::dtype::float32: return at::kFloat;
  }
  throw std::invalid_argument("torch_forward: unknown dtype");
}

class torch_rank_forward final : public rank_forward, private tp_rank_dims {
public:
  explicit torch_rank_forward(const rank_forward_options& o)
    : tp_rank_dims(o),
      o_(o),
      cfg_(o_.model),
      elem_(element_size(o.weights.dt)),
      scalar_(scalar_type_of(o.weights.dt)),
      device_(o.cuda_device >= 0 ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(o.cuda_device))
                                 : at::Device(at::kCPU)),
      f32_(at::TensorOptions().dtype(at::kFloat).device(device_)) {
    if (o.compute_dtype != model::dtype::float32)
      throw std::invalid_argument("torch_forward: compute dtype "
                                  + std::to_string(static_cast<int>(o.compute_dtype))
                                  + " (model::dtype) is not supported: this forward computes "
                                    "in float32 only");
    if (head_dim_ % 2 != 0)
      throw std::invalid_argument("torch_forward: head_dim " + std::to_string(head_dim_)
                                  + " must be even for RoPE");
    if (o.kv.layers != cfg_.num_hidden_layers || o.kv.kv_heads != kv_heads_
        || o.kv.head_dim != cfg_.head_dim || o.kv.block_size == 0)
      throw std::invalid_argument("torch_forward: KV geometry does not match the model");
    inv_freq_ = rope_inverse_frequencies(cfg_.rope_theta, head_dim_);
  }

  std::vector<float> forward(const std::vector<forward_item>& items, std::byte* kv_base,
                             logits_rows rows) override {
    configure_threads();
    c10::InferenceMode inference_mode;
    c10::DeviceGuard device_guard(device_);
    if (items.empty())
      throw std::invalid_argument("forward: no items");

    // Flatten the items' tokens.
    std::vector<std::int64_t> offsets;
    std::vector<std::int32_t> tokens;
    std::vector<std::int64_t> positions;
    for (const auto& item : items) {
      if (item.count == 0)
        throw std::invalid_argument("forward: an item without tokens");
      const std::uint64_t end = std::uint64_t{item.position} + item.count;
      if (item.block_count * std::uint64_t{o_.kv.block_size} < end)
        throw std::invalid_argument("forward: " + std::to_string(item.block_count)
                                    + " KV blocks do not cover " + std::to_string(end)
                                    + " positions");
      offsets.push_back(static_cast<std::int64_t>(tokens.size()));
      for (std::uint32_t t = 0; t < item.count; ++t) {
        const std::int32_t id = item.tokens[t];
        if (id < 0 || static_cast<std::uint32_t>(id) >= cfg_.vocab_size)
          throw std::out_of_range("forward: token id " + std::to_string(id)
                                  + " is outside the vocabulary of "
                                  + std::to_string(cfg_.vocab_size));
        tokens.push_back(id);
        positions.push_back(std::int64_t{item.position} + t);
      }
    }
    const auto n = static_cast<std::int64_t>(tokens.size());

    decode_ = std::all_of(items.begin(), items.end(),
                          [](const forward_item& i) { return i.count == 1; });
    ++counters_.forwards;
    at::Tensor x = embed(tokens);
    const auto [cos, sin] = rope_tables(positions);

    for (std::uint32_t layer = 0; layer < cfg_.num_hidden_layers; ++layer) {
      const layer_weights& lw = o_.weights.layers[layer];
      // ---- attention
      at::Tensor h = rms_norm(x, weight(lw.input_norm, {hidden_}));
      at::Tensor qkv = at::matmul(h, weight(lw.qkv, {(q_heads_ + 2 * kv_heads_) * head_dim_,
                                                     hidden_}).t());
      at::Tensor q = qkv.narrow(1, 0, q_heads_ * head_dim_).reshape({n, q_heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_heads_ * head_dim_, kv_heads_ * head_dim_)
                       .reshape({n, kv_heads_, head_dim_});
      at::Tensor v = qkv.narrow(1, (q_heads_ + kv_heads_) * head_dim_, kv_heads_ * head_dim_)
                       .reshape({n, kv_heads_, head_dim_})
                       .contiguous();
      q = rope(rms_norm(q, weight(lw.q_norm, {head_dim_})), cos, sin);
      k = rope(rms_norm(k, weight(lw.k_norm, {head_dim_})), cos, sin).contiguous();
      write_kv(items, offsets, kv_base, layer, k, v);

      at::Tensor attn = at::empty({n, q_heads_ * head_dim_}, f32_);
      for (std::size_t i = 0; i < items.size(); ++i)
        attend(items[i], kv_base, layer, q.narrow(0, offsets[i], items[i].count),
               attn.narrow(0, offsets[i], items[i].count));
      at::Tensor out = at::matmul(attn, weight(lw.o, {hidden_, q_heads_ * head_dim_}).t())
                         .contiguous();
      all_reduce(out);
      x = x + out;

      // ---- mixture of experts
      h = rms_norm(x, weight(lw.post_attention_norm, {hidden_}));
      at::Tensor moe = experts(lw, h);
      all_reduce(moe);
      x = x + moe;
    }

    // ---- logits
    std::vector<std::int64_t> picked;
    if (rows == logits_rows::last_token) {
      for (std::size_t i = 0; i < items.size(); ++i)
        picked.push_back(offsets[i] + items[i].count - 1);
    } else {
      for (std::int64_t t = 0; t < n; ++t)
        picked.push_back(t);
    }
    const auto r = static_cast<std::int64_t>(picked.size());
    at::Tensor index = at::from_blob(picked.data(), {r}, at::kLong).to(device_);
    at::Tensor xf = rms_norm(x.index_select(0, index), weight(o_.weights.final_norm, {hidden_}));
    at::Tensor local = at::matmul(xf, weight(o_.weights.lm_head, {vocab_rows_, hidden_}).t())
                         .contiguous()
                         .cpu(); // the TP all-gather and sampling run on the host
    at::Tensor gathered = at::empty({static_cast<std::int64_t>(o_.tp), r, vocab_rows_}, at::kFloat);
    o_.comm->all_gather(o_.rank, local.data_ptr<float>(), static_cast<std::size_t>(local.numel()),
                        gathered.data_ptr<float>());
    at::Tensor logits = gathered.permute({1, 0, 2})
                          .reshape({r, static_cast<std::int64_t>(o_.tp) * vocab_rows_})
                          .narrow(1, 0, std::int64_t{cfg_.vocab_size}) // drop padded rows
                          .contiguous();
    const float* data = logits.data_ptr<float>();
    return std::vector<float>(data, data + logits.numel());
  }

  forward_counters counters() const override { return counters_; }

private:
  void configure_threads() const {
    thread_local int configured = 0;
    if (o_.compute_threads > 0 && configured != o_.compute_threads) {
      at::set_num_threads(o_.compute_threads);
      configured = o_.compute_threads;
    }
  }

  // In-place sum over the TP group of a contiguous fp32 tensor (through host memory when the
  // tensor is on a GPU: tp_comm connects the worker threads of one process).
  void all_reduce(at::Tensor& t) const {
    if (!t.is_cuda()) {
      o_.comm->all_reduce_sum(o_.rank, t.data_ptr<float>(), static_cast<std::size_t>(t.numel()));
      return;
    }
    at::Tensor host = t.cpu();
    o_.comm->all_reduce_sum(o_.rank, host.data_ptr<float>(), static_cast<std::size_t>(host.numel()));
    t.copy_(host);
  }

  // fp32 view or conversion of a resident tensor (or a slice of one).
  at::Tensor weight(const std::byte* p, at::IntArrayRef shape) {
    auto* data = const_cast<std::byte*>(p); // never written
    if (scalar_ == at::kFloat)
      return at::from_blob(data, shape, f32_);
    if (o_.cache_fp32_weights) {
      auto found = cache_.find(p);
      if (found != cache_.end())
        return found->second;
    }
    at::Tensor converted
      = at::from_blob(data, shape, at::TensorOptions().dtype(scalar_).device(device_)).to(at::kFloat);
    if (o_.cache_fp32_weights)
      cache_.emplace(p, converted);
    return converted;
  }

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const {
    const at::Tensor variance = x.pow(2).mean(-1, /*keepdim=*/true);
    return x * at::rsqrt(variance + cfg_.rms_norm_eps) * w;
  }

  // Vocab-split lookup: rows of this rank, zeros elsewhere, summed over ranks.
  at::Tensor embed(const std::vector<std::int32_t>& tokens) {
    const auto n = static_cast<std::int64_t>(tokens.size());
    at::Tensor x = at::zeros({n, hidden_}, f32_);
    for (std::int64_t t = 0; t < n; ++t) {
      const std::int64_t row = tokens[static_cast<std::size_t>(t)] - first_vocab_;
      if (row < 0 || row >= vocab_rows_)
        continue;
      auto* src = const_cast<std::byte*>(o_.weights.embed) + row * hidden_ * elem_;
      x[t].copy_(at::from_blob(src, {hidden_}, at::TensorOptions().dtype(scalar_).device(device_)));
    }
    all_reduce(x);
    return x;
  }

  // cos / sin of position * inv_freq, [n, 1, head_dim / 2].
  std::pair<at::Tensor, at::Tensor> rope_tables(const std::vector<std::int64_t>& positions) const {
    const auto n = static_cast<std::int64_t>(positions.size());
    const std::int64_t half = head_dim_ / 2;
    at::Tensor cos = at::empty({n, 1, half}, at::kFloat);
    at::Tensor sin = at::empty({n, 1, half}, at::kFloat);
    rope_cos_sin(inv_freq_, positions.data(), n, cos.data_ptr<float>(), sin.data_ptr<float>());
    return {cos.to(device_), sin.to(device_)};
  }

  // HF rotate_half: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin].
  at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
    const std::int64_t half = head_dim_ / 2;
    const at::Tensor x1 = x.narrow(-1, 0, half);
    const at::Tensor x2 = x.narrow(-1, half, half);
    return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
  }

  float* kv_slot(std::byte* kv_base, const forward_item& item, std::uint32_t layer,
                 std::uint32_t kind, std::int64_t position, std::int64_t head) const {
    const std::uint64_t block = item.block_table[position / o_.kv.block_size];
    const std::uint64_t slot = static_cast<std::uint64_t>(position) % o_.kv.block_size;
    std::byte* base = kv_base + block * o_.kv.block_bytes() + o_.kv.part_offset(layer, kind);
    return reinterpret_cast<float*>(base)
           + (static_cast<std::uint64_t>(head) * o_.kv.block_size + slot) * head_dim_;
  }

  void write_kv(const std::vector<forward_item>& items, const std::vector<std::int64_t>& offsets,
                std::byte* kv_base, std::uint32_t layer, const at::Tensor& k,
                const at::Tensor& v) const {
    // One slot per (token, head): a memcpy on the host, a device copy into a view of the arena
    // on a GPU.
    const bool on_device = k.is_cuda();
    const float* kd = on_device ? nullptr : k.data_ptr<float>();
    const float* vd = on_device ? nullptr : v.data_ptr<float>();
    const std::size_t bytes = static_cast<std::size_t>(head_dim_) * sizeof(float);
    for (std::size_t i = 0; i < items.size(); ++i) {
      const forward_item& item = items[i];
      for (std::uint32_t t = 0; t < item.count; ++t) {
        const std::int64_t row = offsets[i] + t;
        const std::int64_t position = std::int64_t{item.position} + t;
        for (std::int64_t head = 0; head < kv_heads_; ++head) {
          float* k_slot = kv_slot(kv_base, item, layer, 0, position, head);
          float* v_slot = kv_slot(kv_base, item, layer, 1, position, head);
          if (on_device) {
            at::from_blob(k_slot, {head_dim_}, f32_).copy_(k[row][head]);
            at::from_blob(v_slot, {head_dim_}, f32_).copy_(v[row][head]);
            continue;
          }
          const std::int64_t src = (row * kv_heads_ + head) * head_dim_;
          std::memcpy(k_slot, kd + src, bytes);
          std::memcpy(v_slot, vd + src, bytes);
        }
      }
    }
  }

  // K or V of positions [0, length) of `item`: [kv_heads, length, head_dim].
  at::Tensor gather_kv(const forward_item& item, std::byte* kv_base, std::uint32_t layer,
                       std::uint32_t kind, std::int64_t length) const {
    const std::int64_t block_size = o_.kv.block_size;
    const std::int64_t blocks = (length + block_size - 1) / block_size;
    std::vector<at::Tensor> parts;
    parts.reserve(static_cast<std::size_t>(blocks));
    for (std::int64_t b = 0; b < blocks; ++b) {
      std::byte* base = kv_base + std::uint64_t{item.block_table[b]} * o_.kv.block_bytes()
                        + o_.kv.part_offset(layer, kind);
      parts.push_back(at::from_blob(base, {kv_heads_, block_size, head_dim_}, f32_));
    }
    return at::cat(parts, 1).narrow(1, 0, length);
  }

  // Causal grouped-query attention of one item's new tokens; writes `out` [count, q*hd].
  void attend(const forward_item& item, std::byte* kv_base, std::uint32_t layer,
              const at::Tensor& q, at::Tensor out) const {
    const std::int64_t count = item.count;
    const std::int64_t length = std::int64_t{item.position} + count;
    at::Tensor keys = gather_kv(item, kv_base, layer, 0, length);
    at::Tensor values = gather_kv(item, kv_base, layer, 1, length);
    const std::int64_t group = q_heads_ / kv_heads_;
    if (group > 1) {
      keys = keys.repeat_interleave(group, 0);
      values = values.repeat_interleave(group, 0);
    }
    const at::Tensor queries = q.transpose(0, 1); // [q_heads, count, hd]
    at::Tensor scores = at::matmul(queries, keys.transpose(1, 2))
                        * (1.0 / std::sqrt(static_cast<double>(head_dim_)));
    if (count > 1) {
      const auto longs = at::TensorOptions().dtype(at::kLong).device(device_);
      const at::Tensor key_pos = at::arange(length, longs).view({1, length});
      const at::Tensor query_pos =
        at::arange(std::int64_t{item.position}, length, longs).view({count, 1});
      scores.masked_fill_(key_pos > query_pos, -std::numeric_limits<float>::infinity());
    }
    const at::Tensor probs = at::softmax(scores, -1);
    const at::Tensor context = at::matmul(probs, values); // [q_heads, count, hd]
    out.copy_(context.transpose(0, 1).reshape({count, q_heads_ * head_dim_}));
  }

  // Routed experts of this rank's I/tp slice; the caller all-reduces the partial sums.
  at::Tensor experts(const layer_weights& lw, const at::Tensor& h) {
    const std::int64_t n = h.size(0);
    const std::int64_t top_k = cfg_.num_experts_per_tok;
    const at::Tensor router_logits = at::matmul(h, weight(lw.router, {experts_, hidden_}).t());
    const at::Tensor router_probs = at::softmax(router_logits, -1);
    auto top = at::topk(router_probs, top_k, -1);
    at::Tensor top_weights = std::get<0>(top);
    const at::Tensor top_index = std::get<1>(top).contiguous().cpu(); // routing on the host
    if (cfg_.norm_topk_prob)
      top_weights = top_weights / top_weights.sum(-1, /*keepdim=*/true);
    top_weights = top_weights.contiguous().cpu();

    std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(experts_));
    std::vector<std::vector<float>> scales(static_cast<std::size_t>(experts_));
    const std::int64_t* idx = top_index.data_ptr<std::int64_t>();
    const float* wts = top_weights.data_ptr<float>();
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t j = 0; j < top_k; ++j) {
        const auto e = static_cast<std::size_t>(idx[t * top_k + j]);
        rows[e].push_back(t);
        scales[e].push_back(wts[t * top_k + j]);
      }

    at::Tensor out = at::zeros({n, hidden_}, f32_);
    const std::int64_t w13_bytes = 2 * inter_ * hidden_ * elem_;
    const std::int64_t w2_bytes = hidden_ * inter_ * elem_;
    for (std::int64_t e = 0; e < experts_; ++e) {
      auto& r = rows[static_cast<std::size_t>(e)];
      if (r.empty())
        continue;
      ++counters_.expert_loads;
      if (decode_)
        ++counters_.decode_expert_loads;
      const auto m = static_cast<std::int64_t>(r.size());
      const at::Tensor index = at::from_blob(r.data(), {m}, at::kLong).to(device_);
      const at::Tensor scale =
        at::from_blob(scales[static_cast<std::size_t>(e)].data(), {m, 1}, at::kFloat).to(device_);
      const at::Tensor xe = h.index_select(0, index);
      const at::Tensor gate_up =
        at::matmul(xe, weight(lw.w13 + e * w13_bytes, {2 * inter_, hidden_}).t());
      const at::Tensor act =
        at::silu(gate_up.narrow(1, 0, inter_)) * gate_up.narrow(1, inter_, inter_);
      const at::Tensor ye = at::matmul(act, weight(lw.w2 + e * w2_bytes, {hidden_, inter_}).t());
      out.index_add_(0, index, ye * scale);
    }
    return out;
  }

  const rank_forward_options o_;
  const model::model_config& cfg_;
  const std::int64_t elem_;
  const at::ScalarType scalar_;
  const at::Device device_;
  const at::TensorOptions f32_; // fp32 on device_
  std::vector<float> inv_freq_;
  std::unordered_map<const std::byte*, at::Tensor> cache_;
  forward_counters counters_ = [] { // by name: a field added to the struct cannot shift it
    forward_counters c;
    c.counts_experts = true;
    return c;
  }();
  bool decode_ = false; // the current forward feeds one token per item
};

rank_forward* create(const rank_forward_options& options) {
  if (options.compute_dtype == model::dtype::bfloat16)
    return create_fast_forward(options);
  return new torch_rank_forward(options);
}

const backend_entry entry{backend_abi_version, sizeof(rank_forward_options), &create};

} // namespace

} // namespace refit::inference

extern "C" __attribute__((visibility("default"))) const refit::inference::backend_entry*
refit_torch_forward_entry() {
  return &refit::inference::entry;
}
