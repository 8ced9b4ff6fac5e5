// The bf16 engine (torch_fast_forward.hpp): construction, the rank_forward API, step inputs,
// RoPE tables and the CUDA-graph runner. The layers are torch_fast_layers.cpp.
#include "runtime/inference/torch_fast_forward.hpp"

#include <algorithm>
#include <cstdlib>
#include <numeric>

#include "runtime/inference/rope.hpp"

namespace refit::inference {

namespace bf16 {

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

// A tuning knob from the environment (a count of `what`), or `fallback`. A value that is not a
// whole number in [0, max] is refused, naming the variable.
static std::int64_t count_knob(const char* name, std::int64_t fallback, const char* what,
                               std::int64_t max = 1000000) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0')
    return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (*end != '\0' || n < 0 || n > max)
    throw std::invalid_argument(std::string("bf16 engine: ") + name + "=" + v + " is not a count of "
                                + what + " in [0, " + std::to_string(max) + "]");
  return n;
}

// A knob that is one of `allowed` (whole numbers, listed in the error), or `fallback`.
static std::int64_t choice_knob(const char* name, const std::vector<std::string>& allowed,
                                std::int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0')
    return fallback;
  if (std::find(allowed.begin(), allowed.end(), v) != allowed.end())
    return std::stoll(v);
  std::string list;
  for (std::size_t i = 0; i < allowed.size(); ++i)
    list += (i == 0 ? "" : i + 1 == allowed.size() ? " or " : ", ") + allowed[i];
  throw std::invalid_argument(std::string("bf16 engine: ") + name + "=" + v + " is not " + list);
}

fast_rank_forward::fast_rank_forward(const rank_forward_options& o)
  : tp_rank_dims(o),
    o_(o),
    cfg_(o_.model),
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
  inv_freq_ = rope_inverse_frequencies(cfg_.rope_theta, head_dim_);
  expert_loads_ = at::zeros({2}, i64_); // [all forwards, decode forwards]
#if defined(REFIT_TORCH_CUDA)
  if (device_.is_cuda()) {
    stream_.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index()));
    c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
    baseline_bytes_ = allocated_bytes();
  }
#endif
  device_comm_ = device_.is_cuda() && o.tp > 1 && o.comm->on_device();
  graphs_enabled_ = device_.is_cuda() && (o.tp == 1 || device_comm_) && o.cuda_graphs;
#if defined(REFIT_TORCH_CUDA)
  graphs_epoch_ = o.comm->device_epoch();
#endif
#if defined(REFIT_TORCH_CUDA)
  fused_ = device_.is_cuda() && o.fused_kernels;
  fused_decode_attention_ = kernels::decode_attention_supported(
    static_cast<int>(head_dim_), static_cast<int>(q_heads_ / kv_heads_));
#endif
  gemv_max_copies_ = count_knob("REFIT_EXPERT_GEMV_MAX_COPIES", gemv_max_copies_, "routed copies");
  mma_max_copies_ = count_knob("REFIT_EXPERT_MMA_MAX_COPIES", mma_max_copies_, "routed copies");
  mma_ksplit_ = choice_knob("REFIT_EXPERT_MMA_KSPLIT", {"0", "1", "2", "4", "8"}, mma_ksplit_);
  mma_chunks_ = choice_knob("REFIT_EXPERT_MMA_CHUNKS", {"1", "2", "4"}, mma_chunks_);
  mma_evict_first_ = choice_knob("REFIT_EXPERT_MMA_EVICT_FIRST", {"0", "1"}, mma_evict_first_);
  mma_stages_ = choice_knob("REFIT_EXPERT_MMA_STAGES", {"0", "4", "8"}, mma_stages_);
  mma_early_ = choice_knob("REFIT_EXPERT_MMA_EARLY", {"0", "1"}, mma_early_);
  mma_persistent_ = choice_knob("REFIT_EXPERT_MMA_PERSISTENT", {"0", "1", "2"}, mma_persistent_);
  expert_self_sort_ = choice_knob("REFIT_EXPERT_SELF_SORT", {"0", "1"}, expert_self_sort_);
  mma_line_copies_ = choice_knob("REFIT_EXPERT_MMA_LINES", {"0", "1"}, mma_line_copies_);
  route_bucket_max_tokens_ = count_knob("REFIT_ROUTE_BUCKET_MAX_TOKENS", route_bucket_max_tokens_,
                                        "tokens", 256); // kernels::route_bucket_max_tokens
  fused_sampling_ = choice_knob("REFIT_FUSED_SAMPLING", {"0", "1"}, fused_sampling_);
  pipeline_decode_ = choice_knob("REFIT_PIPELINE_DECODE", {"0", "1"}, pipeline_decode_);
  router_split_ = choice_knob("REFIT_ROUTER_SPLIT", {"0", "1"}, router_split_);
  logits_fp32_ = choice_knob("REFIT_LOGITS_FP32", {"0", "1"}, logits_fp32_);
  residual_fp32_ = choice_knob("REFIT_RESIDUAL_FP32", {"0", "1"}, residual_fp32_);
  mix_early_ = choice_knob("REFIT_MIX_EARLY", {"0", "1"}, mix_early_);
  attention_mma_ = choice_knob("REFIT_ATTENTION_MMA", {"0", "1", "2"}, attention_mma_);
  attention_fused_qk_ = choice_knob("REFIT_ATTENTION_FUSED_QK", {"0", "1"}, attention_fused_qk_);
  attention_splits_ =
    count_knob("REFIT_ATTENTION_SPLITS", attention_splits_, "splits", 16); // max_attention_splits
  attention_warps_ = choice_knob("REFIT_ATTENTION_WARPS", {"0", "4", "6", "8"}, attention_warps_);
  dense_gemv_max_rows_ = count_knob("REFIT_DENSE_GEMV_MAX_ROWS", dense_gemv_max_rows_, "rows", 8);
  dense_mma_max_rows_ = count_knob("REFIT_DENSE_MMA_MAX_ROWS", dense_mma_max_rows_, "rows", 64);
  router_mma_max_rows_ =
    count_knob("REFIT_ROUTER_MMA_MAX_ROWS", router_mma_max_rows_, "rows", 128); // dense_mma_max_rows
  preload_gemm_ = choice_knob("REFIT_PRELOAD_GEMM", {"0", "1", "2"}, preload_gemm_);
  mix_trigger_early_ = choice_knob("REFIT_MIX_TRIGGER_EARLY", {"0", "1"}, mix_trigger_early_);
  [[maybe_unused]] const bool programmatic = choice_knob("REFIT_PDL", {"0", "1"}, 1) == 1;
#if defined(REFIT_TORCH_CUDA)
  if (device_.is_cuda())
    kernels::set_programmatic_launch(programmatic);
  if (fused_ && preload_gemm_ > 0) // its occupancy queries now, not while a graph is captured
    kernels::preload_gemm_prepare();
#endif
}

std::vector<float> fast_rank_forward::forward(const std::vector<forward_item>& items, std::byte* kv_base,
                           logits_rows rows) {
  scope s(*this);
  const at::Tensor logits = run_eager(items, kv_base, rows);
  wait_collectives();
  const at::Tensor host = logits.contiguous().cpu();
  const float* data = host.data_ptr<float>();
  return std::vector<float>(data, data + host.numel());
}

forward_counters fast_rank_forward::counters() const {
  forward_counters c = counters_;
  c.counts_experts = true;
  c.preload_gemms = preload_gemms_;
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

at::Tensor fast_rank_forward::step_and_draws(const std::vector<forward_item>& items,
                                             std::byte* kv_base, const sampling_config& params,
                                             const std::vector<sample_draw>& draws,
                                             const std::vector<double>& uniforms,
                                             const std::vector<std::int64_t>* feed) {
  // The draws' logits rows and uniforms go up before the step, without waiting on the stream,
  // so the sampling kernels are queued behind the step: no host round trip between the last
  // layer and the draws.
  std::vector<std::int64_t> rows;
  rows.reserve(draws.size());
  for (const auto& d : draws)
    rows.push_back(d.row);
  const at::Tensor row_index = upload_async(rows.data(), at::kLong, rows.size());
  const at::Tensor u = upload_async(uniforms.data(), at::kDouble, uniforms.size());
  const at::Tensor logits = is_decode(items) && graphs_enabled_
                              ? run_graph(items, kv_base, feed)
                              : run_eager(items, kv_base, logits_rows::last_token, feed);
  return sample_on_device_async(logits, params, row_index, u, fused_ && fused_sampling_ != 0);
}

namespace {

std::vector<sampled_token> sampled(const device_samples& drawn) {
  std::vector<sampled_token> out(drawn.tokens.size());
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = {drawn.tokens[i], drawn.logprobs[i]};
  return out;
}

} // namespace

std::vector<sampled_token> fast_rank_forward::forward_sample_device(const std::vector<forward_item>& items,
                                                 std::byte* kv_base,
                                                 const sampling_config& params,
                                                 const std::vector<sample_draw>& draws,
                                                 const std::vector<double>& uniforms) {
  if (!begun_.empty())
    throw std::logic_error("bf16 engine: forward_sample while " + std::to_string(begun_.size())
                           + " begun steps are not finished (finish_sample or drop_samples)");
  scope s(*this);
  const at::Tensor packed = step_and_draws(items, kv_base, params, draws, uniforms, nullptr);
  wait_collectives(); // before the host copy synchronizes with the stream
  return sampled(take_samples(packed));
}

void fast_rank_forward::begin_sample_device(const std::vector<forward_item>& items,
                                            std::byte* kv_base, const sampling_config& params,
                                            const std::vector<sample_draw>& draws,
                                            const std::vector<double>& uniforms,
                                            const std::vector<std::int64_t>& feed) {
  if (begun_.size() >= 2)
    throw std::logic_error("bf16 engine: begin_sample with two begun steps not finished");
  const bool fed = std::any_of(feed.begin(), feed.end(), [](std::int64_t f) { return f >= 0; });
  if (fed) {
    if (begun_.empty())
      throw std::logic_error("bf16 engine: begin_sample feeds draws, but no begun step is "
                             "waiting to be finished");
    const std::int64_t before = begun_.back().drawn.size(0);
    for (std::size_t i = 0; i < feed.size(); ++i)
      if (feed[i] >= before)
        throw std::out_of_range("begin_sample: feed[" + std::to_string(i) + "] = "
                                + std::to_string(feed[i]) + ", but the step begun before drew "
                                + std::to_string(before) + " tokens");
  }
  scope s(*this);
  const at::Tensor packed =
    step_and_draws(items, kv_base, params, draws, uniforms, fed ? &feed : nullptr);
  begun_step b;
  b.drawn = packed;
#if defined(REFIT_TORCH_CUDA)
  if (packed.is_cuda()) {
    b.host = at::empty(packed.sizes(),
                       at::TensorOptions().dtype(packed.scalar_type()).pinned_memory(true));
    b.host.copy_(packed, /*non_blocking=*/true);
    b.landed.emplace();
    b.landed->record(c10::cuda::getCurrentCUDAStream(device_.index()));
  }
#endif
  if (!b.host.defined())
    b.host = packed; // the CPU: computed already
  begun_.push_back(std::move(b));
}

std::vector<sampled_token> fast_rank_forward::finish_sample() {
  if (begun_.empty())
    throw std::logic_error("bf16 engine: finish_sample without a begun step");
  begun_step b = std::move(begun_.front());
  begun_.pop_front();
#if defined(REFIT_TORCH_CUDA)
  if (b.landed)
    b.landed->synchronize();
#endif
  return sampled(take_samples(b.host));
}

void fast_rank_forward::drop_samples() {
#if defined(REFIT_TORCH_CUDA)
  for (auto& b : begun_)
    if (b.landed)
      b.landed->synchronize();
#endif
  begun_.clear();
}

void fast_rank_forward::apply_feed(const at::Tensor& tokens, const std::vector<std::int64_t>& feed,
                                   std::int64_t rows) const {
  std::vector<std::int64_t> dst, src;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t f = feed[static_cast<std::size_t>(r) < feed.size() ? r : 0];
    if (f >= 0) {
      dst.push_back(r);
      src.push_back(f);
    }
  }
  if (dst.empty())
    return;
  const at::Tensor to = upload_async(dst.data(), at::kLong, dst.size());
  const at::Tensor from = upload_async(src.data(), at::kLong, src.size());
  tokens.index_copy_(0, to, begun_.back().drawn.select(1, 0).index_select(0, from).to(at::kLong));
}

void fast_rank_forward::bind() {
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

void fast_rank_forward::validate(const std::vector<forward_item>& items) const {
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

fast_rank_forward::host_inputs fast_rank_forward::gather_inputs(const std::vector<forward_item>& items, std::int64_t batch,
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
void fast_rank_forward::ensure_rope(std::int64_t positions) {
  if (rope_positions_ >= positions)
    return;
  const std::int64_t p = pow2_at_least(std::max<std::int64_t>(positions, 256));
  const std::int64_t half = head_dim_ / 2;
  at::Tensor c = at::empty({p, half}, at::kFloat);
  at::Tensor s = at::empty({p, half}, at::kFloat);
  std::vector<std::int64_t> positions_all(static_cast<std::size_t>(p));
  std::iota(positions_all.begin(), positions_all.end(), std::int64_t{0});
  rope_cos_sin(inv_freq_, positions_all.data(), p, c.data_ptr<float>(), s.data_ptr<float>());
#if defined(REFIT_TORCH_CUDA)
  graphs_.clear(); // captured graphs read the old tables
#endif
  cos_ = c.to(device_);
  sin_ = s.to(device_);
  rope_positions_ = p;
}

at::Tensor fast_rank_forward::run_eager(const std::vector<forward_item>& items, std::byte* kv_base,
                     logits_rows rows, const std::vector<std::int64_t>* feed) {
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
  if (feed != nullptr) // begin_sample checked: every fed item is one token, so item i is row i
    apply_feed(in.tokens, *feed, static_cast<std::int64_t>(items.size()));
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

at::Tensor fast_rank_forward::run_graph(const std::vector<forward_item>& items, std::byte* kv_base,
                                        const std::vector<std::int64_t>* feed) {
#if defined(REFIT_TORCH_CUDA)
  const auto real = static_cast<std::int64_t>(items.size());
  const std::int64_t batch = bucket_of(real);
  if (batch == 0) // beyond the largest bucket: an eager step (which validates)
    return run_eager(items, kv_base, logits_rows::last_token, feed);
  validate(items);
  std::int64_t blocks = 1;
  for (const auto& item : items)
    blocks = std::max<std::int64_t>(blocks, static_cast<std::int64_t>(item.block_count));
  const std::int64_t width = pow2_at_least(blocks);
  ensure_rope(width * o_.kv.block_size);
  const host_inputs h = gather_inputs(items, batch, width);
  if (graphs_epoch_ != o_.comm->device_epoch()) { // NCCL communicators re-created
    graphs_.clear();
    graphs_epoch_ = o_.comm->device_epoch();
  }
  const std::int64_t fields = 5 * batch + batch * width + batch;
  auto& slot = graphs_[{batch, width}];
  const bool fresh = !slot;
  if (fresh) {
    slot = std::make_unique<graph_entry>();
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
  // Staged in a pinned block of the caching host allocator, which keeps it until the copy has
  // run: with pipelined steps the host fills the next step's inputs while this copy may still
  // be queued.
  at::Tensor staged = at::empty({fields}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::int64_t* dst = staged.data_ptr<std::int64_t>();
  for (const auto* part : {&h.tokens, &h.positions, &h.write_block, &h.write_slot, &h.src_row,
                           &h.table, &h.lengths}) {
    std::copy(part->begin(), part->end(), dst);
    dst += part->size();
  }
  slot->device.copy_(staged, /*non_blocking=*/true);
  if (feed != nullptr) // before the warm-up and capture too: they read the same inputs
    apply_feed(slot->in.tokens, *feed, batch);
  ++counters_.forwards;
  if (fresh) {
    // Warm-up outside the graph (kernel selection, workspaces; it writes the same K/V the
    // replay writes and its expert counts are taken back), then capture and replay.
    const at::Tensor counted = expert_loads_.clone();
    model(slot->in, kv_base, nullptr, slot->picked, true);
    expert_loads_.copy_(counted);
    const std::uint64_t launched = preload_gemms_;
    slot->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      slot->logits = model(slot->in, kv_base, nullptr, slot->picked, true);
    } catch (...) {
      // A failed step (e.g. the TP group aborted): end the capture so the stream is usable,
      // and drop the half-captured graph.
      try {
        slot->graph.capture_end();
      } catch (...) {
      }
      graphs_.erase({batch, width});
      preload_gemms_ = launched;
      throw;
    }
    slot->graph.capture_end();
    ++counters_.graph_captures;
    slot->preload_gemms = preload_gemms_ - launched; // recorded, not run: counted at replays
    preload_gemms_ = launched;
  }
  slot->graph.replay();
  ++counters_.graph_replays;
  preload_gemms_ += slot->preload_gemms;
  return slot->logits.narrow(0, 0, real);
#else
  return run_eager(items, kv_base, logits_rows::last_token, feed);
#endif
}

} // namespace bf16

rank_forward* create_fast_forward(const rank_forward_options& options) {
  return new bf16::fast_rank_forward(options);
}

} // namespace refit::inference
