// The bf16 engine's attention (torch_fast_forward.hpp): prefill and decode through ATen (SDPA
// or the matmul chain), and a decode layer's through the fused kernels.
#include "runtime/inference/torch_fast_forward.hpp"

namespace refit::inference::bf16 {

// softmax(q k^T / sqrt(d)) v over [B, heads, Lq, d] with a boolean mask (true: attend).
at::Tensor fast_rank_forward::attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
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
at::Tensor fast_rank_forward::decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
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
at::Tensor fast_rank_forward::prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
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

// Decode attention of one layer through the fused kernels: q/k norm + RoPE + the K/V
// writes, then attention over the paged cache.
at::Tensor fast_rank_forward::fused_decode_layer_attention(const at::Tensor& qkv, const layer_tensors& w,
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
  // q/k norm + RoPE + the K/V writes: by the attention kernel itself (mode 2 with
  // REFIT_ATTENTION_FUSED_QK), else by qk_norm_rope_write into q first.
  kernels::attention_qk qk;
  qk.qkv = qkv.data_ptr();
  qk.q_norm = w.q_norm.data_ptr();
  qk.k_norm = w.k_norm.data_ptr();
  qk.cos = cos_.data_ptr<float>();
  qk.sin = sin_.data_ptr<float>();
  qk.positions = in.positions.data_ptr<std::int64_t>();
  qk.src_row = in.src_row.data_ptr<std::int64_t>();
  qk.write_block = in.write_block.data_ptr<std::int64_t>();
  qk.write_slot = in.write_slot.data_ptr<std::int64_t>();
  qk.eps = static_cast<float>(cfg_.rms_norm_eps);
  const bool fuse_qk = attention_mma_ == 2 && attention_fused_qk_ != 0 && q_heads_ / kv_heads_ <= 8;
  at::Tensor q;
  if (!fuse_qk) {
    q = at::empty({n, q_heads_, head_dim_}, bf_);
    kernels::qk_norm_rope_write(qk.qkv, qk.q_norm, qk.k_norm, qk.cos, qk.sin, qk.positions,
                                qk.src_row, qk.write_block, qk.write_slot, q.data_ptr(), kv,
                                static_cast<int>(n), static_cast<int>(q_heads_),
                                static_cast<int>(kv_heads_), static_cast<int>(head_dim_), qk.eps,
                                stream());
  }
  at::Tensor out = at::empty({n, q_heads_ * head_dim_}, bf_);
  const int splits =
    attention_splits_ > 0
      ? static_cast<int>(attention_splits_)
      : kernels::decode_attention_splits(static_cast<int>(n), static_cast<int>(kv_heads_));
  at::Tensor partial;
  if (splits > 1)
    partial = at::empty({n, q_heads_, splits, head_dim_ + 2}, f32_);
  const int warps = kernels::decode_attention_warps( // REFIT_ATTENTION_WARPS, or from the grid
    static_cast<int>(n * kv_heads_) * splits, static_cast<int>(attention_mma_),
    static_cast<int>(q_heads_ / kv_heads_), static_cast<int>(attention_warps_));
  kernels::decode_attention(fuse_qk ? nullptr : q.data_ptr(), kv,
                            in.table.data_ptr<std::int64_t>(),
                            static_cast<int>(in.table.size(1)),
                            in.lengths.data_ptr<std::int64_t>(), out.data_ptr(),
                            splits > 1 ? partial.data_ptr<float>() : nullptr, splits,
                            static_cast<int>(n), static_cast<int>(q_heads_),
                            static_cast<int>(kv_heads_), static_cast<int>(head_dim_), stream(),
                            static_cast<int>(attention_mma_), fuse_qk ? &qk : nullptr, warps);
  return out;
#else
  (void)qkv, (void)w, (void)in, (void)kv_base, (void)layer;
  throw std::logic_error("bf16 engine: fused kernels need a CUDA build");
#endif
}

} // namespace refit::inference::bf16
