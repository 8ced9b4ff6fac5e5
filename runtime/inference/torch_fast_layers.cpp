// The bf16 engine's layers (torch_fast_forward.hpp): embedding, the layer loop, the routed
// experts and the lm_head of one step (attention: torch_fast_attention.cpp).
#include "runtime/inference/torch_fast_forward.hpp"

namespace refit::inference::bf16 {

at::Tensor fast_rank_forward::rms_norm(const at::Tensor& x, const at::Tensor& w) const {
  const at::Tensor variance = x.pow(2).mean(-1, /*keepdim=*/true);
  return x * at::rsqrt(variance + cfg_.rms_norm_eps) * w; // fp32 (w promoted)
}

at::Tensor fast_rank_forward::rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
  const std::int64_t half = head_dim_ / 2;
  const at::Tensor x1 = x.narrow(-1, 0, half);
  const at::Tensor x2 = x.narrow(-1, half, half);
  return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

void fast_rank_forward::all_reduce(at::Tensor& t) const {
  if (o_.tp == 1)
    return;
#if defined(REFIT_TORCH_CUDA)
  if (device_comm_) { // NCCL, in place on the engine's stream (capturable); no host copy
    if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kBFloat16)
      throw std::logic_error("bf16 engine: TP all-reduce of a tensor that is neither float32 "
                             "nor bfloat16");
    if (!t.is_contiguous())
      t = t.contiguous();
    o_.comm->all_reduce_sum_device(o_.rank, t.data_ptr(), static_cast<std::size_t>(t.numel()),
                                   t.scalar_type() == at::kFloat ? device_dtype::float32
                                                                 : device_dtype::bfloat16,
                                   stream());
    return;
  }
#endif
  at::Tensor host = t.to(at::kFloat).contiguous().cpu();
  o_.comm->all_reduce_sum(o_.rank, host.data_ptr<float>(), static_cast<std::size_t>(host.numel()));
  t = host.to(t.device()).to(t.scalar_type());
}

// The model over the step; returns logits [rows, vocab] fp32 on the device. `decode`: every
// item is one token and attention reads in.table / in.lengths; else `items` drive the
// prefill attention.
at::Tensor fast_rank_forward::model(const step_inputs& in, std::byte* kv_base, const std::vector<forward_item>* items,
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
  const std::int64_t q_cols = q_heads_ * head_dim_;
  const std::int64_t kv_cols = kv_heads_ * head_dim_;
  const bool fused_attention = decode && fused_ && fused_decode_attention_;
  // The ATen q/k RoPE's rows of the tables (the fused kernel reads the tables itself).
  at::Tensor cos, sin;
  if (!fused_attention) {
    cos = cos_.index_select(0, in.positions).unsqueeze(1);
    sin = sin_.index_select(0, in.positions).unsqueeze(1);
  }
  at::Tensor next; // the next layer's normed input, when the fused mix computed it
  for (std::uint32_t layer = 0; layer < cfg_.num_hidden_layers; ++layer) {
    const layer_tensors& w = layers_[layer];
    at::Tensor h = next.defined() ? next : norm_bf16(x, w.input_norm);
    const at::Tensor qkv = linear(h, w.qkv);
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
    const at::Tensor out = fp32_residual_inputs() ? linear_f32(attn, w.o) : linear(attn, w.o);
    at::Tensor router_in;
    h = add_norm_bf16(x, out, w.post_norm, &router_in);
    const bool last = layer + 1 == cfg_.num_hidden_layers;
    next = experts(w, h, decode, x, last ? nullptr : &layers_[layer + 1].input_norm, router_in);
  }

  const at::Tensor xf = norm_bf16(x.index_select(0, picked).contiguous(), final_norm_);
  at::Tensor local;
#if defined(REFIT_HAVE_MM_DTYPE)
  if (logits_fp32_ != 0 && xf.is_cuda() && xf.scalar_type() == at::kBFloat16)
    local = at::mm(xf, lm_head_.t(), at::kFloat); // fp32 from the accumulators
#endif
  if (!local.defined())
    local = at::matmul(xf, lm_head_.t()).to(at::kFloat);
  if (o_.tp == 1)
    return local.narrow(1, 0, std::int64_t{cfg_.vocab_size});
  const std::int64_t r = local.size(0);
#if defined(REFIT_TORCH_CUDA)
  if (device_comm_) { // NCCL all-gather into [tp, r, vocab_rows] on the device
    const at::Tensor mine = local.contiguous();
    at::Tensor all = at::empty({static_cast<std::int64_t>(o_.tp), r, vocab_rows_}, f32_);
    o_.comm->all_gather_device(o_.rank, mine.data_ptr(), static_cast<std::size_t>(mine.numel()),
                               device_dtype::float32, all.data_ptr(), stream());
    return all.permute({1, 0, 2})
      .reshape({r, static_cast<std::int64_t>(o_.tp) * vocab_rows_})
      .narrow(1, 0, std::int64_t{cfg_.vocab_size});
  }
#endif
  at::Tensor host = local.contiguous().cpu();
  at::Tensor gathered = at::empty({static_cast<std::int64_t>(o_.tp), r, vocab_rows_}, at::kFloat);
  o_.comm->all_gather(o_.rank, host.data_ptr<float>(), static_cast<std::size_t>(host.numel()),
                      gathered.data_ptr<float>());
  return gathered.permute({1, 0, 2})
    .reshape({r, static_cast<std::int64_t>(o_.tp) * vocab_rows_})
    .narrow(1, 0, std::int64_t{cfg_.vocab_size})
    .to(device_);
}

// x [M, K] (rows grouped by expert: counts) times w [E, N, K]^T per group -> [M, N].
at::Tensor fast_rank_forward::grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts,
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
at::Tensor fast_rank_forward::experts(const layer_tensors& w, const at::Tensor& h, bool decode,
                                      at::Tensor& x, const at::Tensor* next_norm,
                                      const at::Tensor& router_in) {
  const std::int64_t n = h.size(0);
  at::Tensor weights; // fp32 [n, k]
  at::Tensor chosen;  // int64 [n * k]
  [[maybe_unused]] const std::int64_t copies = n * top_k_;
  at::Tensor counts, offsets, order, src_token, inverse, active;
  // The router's logits: fp32 from router_in (bf16 [2n, H]: hi . W + lo . W, one GEMM over the
  // stacked rows; fp32 [n, H] on the ATen path), else bf16 from h.
  at::Tensor router_logits;
  bool two_parts = false;
  if (router_in.defined() && router_in.scalar_type() == at::kFloat) {
    router_logits = at::matmul(router_in, w.router.to(at::kFloat).t());
  } else if (router_in.defined()) {
    // Both parts into one sum on the preloading GEMM, else the 2n rows and the parts added by
    // the routing.
    if (2 * n > router_mma_max_rows_)
      router_logits = preload_linear(router_in, w.router, true, /*two_parts=*/true);
    if (!router_logits.defined()) {
      router_logits = linear_f32(router_in, w.router, router_mma_max_rows_).contiguous();
      two_parts = true;
    }
  } else {
    router_logits = linear(h, w.router);
  }
#if defined(REFIT_TORCH_CUDA)
  const int ni = static_cast<int>(n), ei = static_cast<int>(experts_), ki = static_cast<int>(top_k_);
  // The counting sort's outputs (the fused kernels): bucket's, or route_bucket's with routing.
  kernels::bucket_out b;
  const bool sort_on_device = fused_ && kernels::bucket_supported(static_cast<int>(copies), ei);
  if (sort_on_device) {
    counts = at::empty({experts_}, i64_);
    offsets = at::empty({experts_}, i64_.dtype(at::kInt));
    order = at::empty({copies}, i64_);
    src_token = at::empty({copies}, i64_);
    inverse = at::empty({copies}, i64_);
    active = at::empty({experts_ + 1}, i64_.dtype(at::kInt)); // the ids, then their number
    b.counts = counts.data_ptr<std::int64_t>();
    b.offsets = offsets.data_ptr<int>();
    b.order = order.data_ptr<std::int64_t>();
    b.src_token = src_token.data_ptr<std::int64_t>();
    b.inverse = inverse.data_ptr<std::int64_t>();
    b.active = active.data_ptr<int>();
    b.active_count = active.data_ptr<int>() + experts_;
    b.loads = expert_loads_.data_ptr<std::int64_t>();
    b.loads_n = decode ? 2 : 1;
  }
  bool sorted = false; // routed and sorted in one kernel
  if (fused_ && kernels::route_supported(ei, ki)) {
    at::Tensor ids = at::empty({n, top_k_}, i64_);
    weights = at::empty({n, top_k_}, f32_);
    if (router_logits.scalar_type() == at::kFloat) {
      const float* l = router_logits.data_ptr<float>();
      const float* lo = two_parts ? l + n * experts_ : nullptr;
      sorted = sort_on_device && n <= route_bucket_max_tokens_
               && kernels::route_bucket_supported(ni, ei, ki);
      if (sorted)
        kernels::route_bucket_f32(l, lo, ni, ei, ki, cfg_.norm_topk_prob,
                                  ids.data_ptr<std::int64_t>(), weights.data_ptr<float>(), b,
                                  stream());
      else
        kernels::route_f32(l, lo, ni, ei, ki, cfg_.norm_topk_prob, ids.data_ptr<std::int64_t>(),
                           weights.data_ptr<float>(), stream());
    } else {
      kernels::route(router_logits.data_ptr(), ni, ei, ki, cfg_.norm_topk_prob,
                     ids.data_ptr<std::int64_t>(), weights.data_ptr<float>(), stream());
    }
    chosen = ids.reshape({-1});
  }
#endif
  if (two_parts && !chosen.defined())
    router_logits = router_logits.narrow(0, 0, n) + router_logits.narrow(0, n, n);
  if (!chosen.defined()) {
    const at::Tensor probs = at::softmax(router_logits.to(at::kFloat), -1);
    auto ranked = at::sort(probs, /*stable=*/true, /*dim=*/-1, /*descending=*/true);
    weights = std::get<0>(ranked).narrow(1, 0, top_k_);
    chosen = std::get<1>(ranked).narrow(1, 0, top_k_).reshape({-1});
    if (cfg_.norm_topk_prob)
      weights = weights / weights.sum(-1, /*keepdim=*/true);
  }
  bool self_sort = false; // gate_up sorts the copies (bucket's counts, offsets, inverse)
#if defined(REFIT_TORCH_CUDA)
  self_sort = sort_on_device && !sorted && self_sort_fits(w, h, copies);
  if (sort_on_device && !sorted && !self_sort)
    kernels::bucket(chosen.data_ptr<std::int64_t>(), static_cast<int>(copies), ki, ei, b,
                    stream());
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
  const in_kernel_sort sort{&chosen, &inverse, decode};
  const at::Tensor ys = expert_projections(w, h, copies, chosen, counts, offsets, order,
                                           src_token, active, self_sort ? &sort : nullptr);
#if defined(REFIT_TORCH_CUDA)
  if (fused_ && o_.tp == 1) {
    // The mix may read the routing before its wait only when no kernel between the down
    // projection and it writes them (a kernel of the sort wrote inverse; weights need no copy).
    const bool early = mix_early_ != 0 && inverse.defined() && weights.is_contiguous();
    if (!inverse.defined())
      inverse = at::empty_like(order).index_copy_(0, order, at::arange(copies, i64_));
    at::Tensor normed;
    if (next_norm != nullptr)
      normed = at::empty({n, hidden_}, bf_);
    kernels::mix_experts(ys.data_ptr(), inverse.data_ptr<std::int64_t>(),
                         weights.contiguous().data_ptr<float>(), x.data_ptr<float>(),
                         static_cast<int>(n), static_cast<int>(top_k_),
                         static_cast<int>(hidden_),
                         next_norm != nullptr ? next_norm->data_ptr() : nullptr,
                         next_norm != nullptr ? normed.data_ptr() : nullptr,
                         static_cast<float>(cfg_.rms_norm_eps), stream(),
                         ys.scalar_type() == at::kFloat, early, mix_trigger_early_ != 0);
    return normed;
  }
#endif
  const at::Tensor y = at::empty_like(ys).index_copy_(0, order, ys); // back in token order
  at::Tensor moe = (y.view({n, top_k_, hidden_}).to(at::kFloat) * weights.unsqueeze(-1)).sum(1);
  all_reduce(moe);
  x.add_(moe);
  (void)next_norm;
  return {};
}

#if defined(REFIT_TORCH_CUDA)
bool fast_rank_forward::expert_mma_plan(const layer_tensors& w, const at::Tensor& h,
                                        std::int64_t copies, kernels::expert_mma_args& up,
                                        kernels::expert_mma_args& down, int& ks_up,
                                        int& ks_down) const {
  if (!fused_ || copies > mma_max_copies_ || copies <= gemv_max_copies_ || !streamable(h)
      || !streamable(w.w13) || !streamable(w.w2))
    return false;
  up = tuned_mma_args();
  down = up;
  up.rows = static_cast<int>(w.w13.size(1));
  up.k = static_cast<int>(w.w13.size(2));
  up.glu = true;
  down.rows = static_cast<int>(w.w2.size(1));
  down.k = static_cast<int>(w.w2.size(2));
  // By expert id once nearly every expert is routed (4 copies an expert: ~2% empty).
  up.early = down.early = up.early && copies >= 4 * experts_;
  const int c = static_cast<int>(copies), e = static_cast<int>(experts_);
  const int wanted = static_cast<int>(mma_ksplit_);
  ks_up = kernels::expert_mma_ksplit(up, c, e, wanted); // 0: the shape does not fit
  ks_down = kernels::expert_mma_ksplit(down, c, e, wanted);
  if (ks_up == 0 || ks_down == 0)
    return false;
  // Resident warps where nearly every expert is routed (by id): H200 batch 64 17.75 vs 18.21
  // ms a step; at batch 16 (a block per non-empty expert) they lost, 14.26 vs 13.01.
  up.persistent = mma_persistent_ == 1 && ks_up == 1 && up.early;
  down.persistent = mma_persistent_ != 0 && ks_down == 1 && down.early;
  return true;
}

bool fast_rank_forward::self_sort_fits(const layer_tensors& w, const at::Tensor& h,
                                       std::int64_t copies) const {
  if (expert_self_sort_ == 0 || o_.tp != 1 || copies / top_k_ > kernels::expert_sort_max_tokens)
    return false;
  kernels::expert_mma_args up, down;
  int ks_up = 0, ks_down = 0;
  return expert_mma_plan(w, h, copies, up, down, ks_up, ks_down) && up.early && up.stages != 0
         && (!up.persistent || experts_ <= kernels::expert_stream_sort_max_experts);
}
#endif

// The routed copies through the experts, in sorted order: ys bf16 [copies, hidden]. The
// tensor-core kernel (gate_up fused with SiLU, then down), the expert GEMV (very few copies) or
// the grouped GEMM, by the number of copies.
at::Tensor fast_rank_forward::expert_projections(const layer_tensors& w, const at::Tensor& h,
                                                 std::int64_t copies, const at::Tensor& chosen,
                                                 const at::Tensor& counts,
                                                 const at::Tensor& offsets,
                                                 const at::Tensor& order,
                                                 const at::Tensor& src_token,
                                                 const at::Tensor& active,
                                                 const in_kernel_sort* sort) const {
#if defined(REFIT_TORCH_CUDA)
  kernels::expert_mma_args up, down;
  int ks_up = 0, ks_down = 0;
  if (active.defined() && expert_mma_plan(w, h, copies, up, down, ks_up, ks_down)) {
    const int c = static_cast<int>(copies);
    const int e = static_cast<int>(experts_);
    up.x = h.data_ptr();
    up.x_rows = src_token.data_ptr<std::int64_t>();
    up.w = w.w13.data_ptr();
    down.w = w.w2.data_ptr();
    for (kernels::expert_mma_args* a : {&up, &down}) {
      a->active = active.data_ptr<int>();
      a->active_count = active.data_ptr<int>() + experts_;
      a->counts = counts.data_ptr<std::int64_t>();
      a->offsets = offsets.data_ptr<int>();
    }
    if (sort != nullptr) { // bucket did not run: gate_up sorts and writes its outputs
      up.sort.ids = sort->ids->data_ptr<std::int64_t>();
      up.sort.copies = c;
      up.sort.top_k = static_cast<int>(top_k_);
      up.sort.out.counts = counts.data_ptr<std::int64_t>();
      up.sort.out.offsets = offsets.data_ptr<int>();
      up.sort.out.inverse = sort->inverse->data_ptr<std::int64_t>();
      up.sort.out.loads = expert_loads_.data_ptr<std::int64_t>();
      up.sort.out.loads_n = sort->decode ? 2 : 1;
    }
    down.y_f32 = fp32_residual_inputs(); // the fused mix adds it into the residual
    at::Tensor act = at::empty({copies, inter_}, bf_);
    at::Tensor ys = at::empty({copies, w.w2.size(1)}, down.y_f32 ? f32_ : bf_);
    up.y = act.data_ptr();
    down.x = act.data_ptr();
    down.y = ys.data_ptr();
    kernels::expert_mma(up, c, e, ks_up, stream());
    kernels::expert_mma(down, c, e, ks_down, stream());
    return ys;
  }
#endif
  if (sort != nullptr) // self_sort_fits promised the path above
    throw std::logic_error("bf16 engine: the in-kernel sort was planned but the tensor-core "
                           "expert path did not run");
  (void)active;
  // The expert GEMV (few copies per expert) or the grouped GEMM over the sorted copies.
  [[maybe_unused]] const auto gemv = [&](const at::Tensor& in, const at::Tensor* rows,
                                         const at::Tensor& weight) {
    at::Tensor out = at::empty({copies, weight.size(1)}, bf_);
#if defined(REFIT_TORCH_CUDA)
    kernels::gemv_args a;
    a.x = in.data_ptr();
    a.x_rows = rows != nullptr ? rows->data_ptr<std::int64_t>() : nullptr;
    a.w = weight.data_ptr();
    a.ids = chosen.data_ptr<std::int64_t>();
    a.order = order.data_ptr<std::int64_t>();
    a.counts = counts.data_ptr<std::int64_t>();
    a.offsets = offsets.data_ptr<int>();
    a.y = out.data_ptr();
    a.copies = static_cast<int>(copies);
    a.n = static_cast<int>(weight.size(1));
    a.k = static_cast<int>(weight.size(2));
    kernels::expert_gemv(a, stream());
#endif
    return out;
  };
  bool gemv_up = false, gemv_down = false;
#if defined(REFIT_TORCH_CUDA)
  gemv_up = fused_ && kernels::expert_gemv_supported(copies, w.w13.size(2), gemv_max_copies_);
  gemv_down = fused_ && kernels::expert_gemv_supported(copies, w.w2.size(2), gemv_max_copies_);
#endif
  // gate_up: the GEMV reads the token rows of h itself; the grouped GEMM takes them gathered.
  const at::Tensor gate_up = gemv_up ? gemv(h, &src_token, w.w13)
                                     : grouped(h.index_select(0, src_token), w.w13, counts, offsets);
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
  return gemv_down ? gemv(act, nullptr, w.w2) : grouped(act, w.w2, counts, offsets);
}

// x (fp32, contiguous) += the all-reduced bf16 `out`.
void fast_rank_forward::add_residual(at::Tensor& x, const at::Tensor& out) {
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
at::Tensor fast_rank_forward::norm_bf16(const at::Tensor& x, const at::Tensor& w) const {
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

at::Tensor fast_rank_forward::add_norm_bf16(at::Tensor& x, const at::Tensor& out, const at::Tensor& w,
                                            at::Tensor* split) {
#if defined(REFIT_TORCH_CUDA)
  if (fused_ && o_.tp == 1) {
    const std::int64_t n = x.size(0);
    const bool two = split != nullptr && router_split_ != 0;
    at::Tensor parts = at::empty({two ? 2 * n : n, x.size(1)}, bf_); // hi rows, then lo rows
    const at::Tensor normed = parts.narrow(0, 0, n);
    kernels::add_rms_norm(x.data_ptr<float>(), out.data_ptr(), w.data_ptr(), normed.data_ptr(),
                          static_cast<int>(n), static_cast<int>(x.size(1)),
                          static_cast<float>(cfg_.rms_norm_eps), stream(),
                          two ? parts.narrow(0, n, n).data_ptr() : nullptr,
                          out.scalar_type() == at::kFloat);
    if (two)
      *split = parts;
    return normed;
  }
#endif
  add_residual(x, out);
  if (split != nullptr && router_split_ != 0) { // the router takes the fp32 norm itself
    *split = rms_norm(x, w);
    return split->to(at::kBFloat16);
  }
  return norm_bf16(x, w);
}

} // namespace refit::inference::bf16
