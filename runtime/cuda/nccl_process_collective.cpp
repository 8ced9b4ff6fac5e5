#include "runtime/cuda/nccl_process_collective.hpp"

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <cuda_runtime.h>
#include <nccl.h>

#include "runtime/cuda/cuda.hpp"

namespace refit::cuda {

namespace {

using publication::collective_status;
using publication::gather_item;
using clock_type = std::chrono::steady_clock;

constexpr const char* prefix = "nccl:";

std::string nccl_text(ncclResult_t r) { return ncclGetErrorString(r); }

ncclUniqueId decode_unique_id(const std::string& text) {
  ncclUniqueId id;
  const std::size_t n = std::strlen(prefix);
  if (text.compare(0, n, prefix) != 0 || text.size() != n + 2 * sizeof(id.internal))
    throw error("communicator id '" + text.substr(0, 40) + "': not nccl:<"
                + std::to_string(2 * sizeof(id.internal)) + " hex digits>");
  auto nibble = [&](char c) -> int {
    if (c >= '0' && c <= '9')
      return c - '0';
    if (c >= 'a' && c <= 'f')
      return c - 'a' + 10;
    throw error("communicator id: '" + std::string(1, c) + "' is not a lower-case hex digit");
  };
  for (std::size_t i = 0; i < sizeof(id.internal); ++i)
    id.internal[i] = static_cast<char>(nibble(text[n + 2 * i]) * 16 + nibble(text[n + 2 * i + 1]));
  return id;
}

// The process's communicator, kept across publications while healthy.
struct comm_state {
  int ordinal = 0;
  std::uint32_t rank = 0;
  std::uint32_t world = 1;
  ncclComm_t comm = nullptr;
  std::string token;               // the id it was created from
  std::atomic<bool> usable{false}; // false after an abort or a failure: replace it
  std::unique_ptr<stream> s;

  ~comm_state() { drop(); }

  void drop() {
    if (comm != nullptr) {
      cudaSetDevice(ordinal);
      if (usable)
        ncclCommDestroy(comm);
      else
        ncclCommAbort(comm);
    }
    comm = nullptr;
    token.clear();
    usable = false;
    s.reset();
  }
};

class process_collective final : public publication::collective {
public:
  process_collective(std::shared_ptr<comm_state> st, std::string publication_id,
                     id_exchange exchange)
    : st_(std::move(st)), publication_id_(std::move(publication_id)),
      exchange_(std::move(exchange)) {}

  std::uint32_t world() const override { return st_->world; }

  collective_status prepare(std::uint32_t rank, clock_type::time_point deadline) override {
    if (rank != st_->rank)
      return {false, "rank " + std::to_string(rank) + " in the process of rank "
                       + std::to_string(st_->rank)};
    if (prepared_)
      return {};
    if (!error_.empty())
      return {false, error_};
    try {
      std::string offered;
      if (st_->rank == 0)
        offered = st_->comm != nullptr && st_->usable ? st_->token : new_unique_id_text();
      const std::string token = exchange_(publication_id_, offered, deadline);
      if (token != st_->token || st_->comm == nullptr) {
        st_->drop();
        init(token, deadline);
      } else if (!st_->usable) {
        throw error("this rank's NCCL communicator was aborted, and rank 0 still offers it "
                    "(the next publication agrees on a fresh one)");
      }
      prepared_ = true;
      return {};
    } catch (const std::exception& e) {
      error_ = std::string("NCCL communicator of rank ") + std::to_string(st_->rank) + " on cuda:"
               + std::to_string(st_->ordinal) + ": " + e.what();
      st_->usable = false;
      return {false, error_};
    }
  }

  collective_status all_gather(std::uint32_t rank, const std::vector<gather_item>& items,
                               clock_type::time_point deadline) override {
    if (auto s = prepare(rank, deadline); !s.ok)
      return s;
    if (aborted_)
      return {false, "collective aborted: " + reason()};
    if (!st_->usable)
      return {false, "this rank's NCCL communicator was aborted earlier"};
    for (const auto& item : items)
      if (!item.pieces.empty()
          && (item.pieces.size() != st_->world || item.pieces[rank].bytes != item.shard_bytes))
        return {false, "a gather item with " + std::to_string(item.pieces.size())
                         + " pieces (or a shard size other than its own piece's) for world "
                         + std::to_string(st_->world)};
    try {
      if (cudaSetDevice(st_->ordinal) != cudaSuccess)
        return fail("cudaSetDevice(" + std::to_string(st_->ordinal) + ") failed");
      auto* s = static_cast<cudaStream_t>(st_->s->native());
      ncclResult_t r = ncclGroupStart();
      auto ok = [&] { return r == ncclSuccess || r == ncclInProgress; };
      for (const auto& item : items) {
        if (!ok())
          break;
        if (item.pieces.empty()) {
          r = ncclAllGather(item.shard, item.out, item.shard_bytes, ncclUint8, st_->comm, s);
          continue;
        }
        for (std::uint32_t q = 0; q < st_->world && ok(); ++q) {
          const auto& piece = item.pieces[q];
          if (piece.bytes == 0)
            continue;
          std::byte* dst = item.out + piece.offset;
          const void* src = q == rank ? static_cast<const void*>(item.shard) : dst;
          r = ncclBroadcast(src, dst, piece.bytes, ncclUint8, static_cast<int>(q), st_->comm, s);
        }
      }
      ncclResult_t end = ncclGroupEnd();
      if (!ok())
        return fail("ncclAllGather / ncclBroadcast: " + nccl_text(r));
      if (end != ncclSuccess && end != ncclInProgress)
        return fail("ncclGroupEnd: " + nccl_text(end));
      if (auto st = wait_async(deadline, "NCCL to enqueue the gather"); !st.ok)
        return st;
      st_->s->record();
      while (!st_->s->done()) {
        if (auto st = check_waiting(deadline, "the gather to complete"); !st.ok)
          return st;
        std::this_thread::yield();
      }
      return {};
    } catch (const std::exception& e) {
      return fail(e.what());
    }
  }

  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> guard(reason_mtx_);
      if (!aborted_)
        reason_ = why;
    }
    aborted_ = true;
    // Peers may have given up on this communicator: the next publication replaces it.
    st_->usable = false;
  }

  void reset() override {}

private:
  std::string reason() {
    std::lock_guard<std::mutex> guard(reason_mtx_);
    return reason_;
  }

  void init(const std::string& token, clock_type::time_point deadline) {
    ncclUniqueId id = decode_unique_id(token);
    if (cudaSetDevice(st_->ordinal) != cudaSuccess)
      throw error("cudaSetDevice(" + std::to_string(st_->ordinal) + ") failed");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, static_cast<int>(st_->world), id,
                                            static_cast<int>(st_->rank), &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm != nullptr)
        ncclCommAbort(comm);
      throw error("ncclCommInitRankConfig: " + nccl_text(r));
    }
    for (;;) {
      ncclResult_t st = ncclInProgress;
      if (ncclCommGetAsyncError(comm, &st) != ncclSuccess)
        st = ncclInternalError;
      if (st == ncclSuccess)
        break;
      if (st != ncclInProgress || aborted_ || clock_type::now() > deadline) {
        ncclCommAbort(comm);
        throw error(st != ncclInProgress ? "init: " + nccl_text(st)
                    : aborted_ ? "aborted during init: " + reason()
                               : std::string("init not done before the deadline (a peer rank "
                                             "did not arrive)"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    st_->comm = comm;
    st_->token = token;
    st_->usable = true;
    st_->s = std::make_unique<stream>(st_->ordinal);
  }

  collective_status check_waiting(clock_type::time_point deadline, const std::string& what) {
    if (aborted_)
      return fail("aborted while waiting for " + what + ": " + reason());
    if (clock_type::now() > deadline)
      return fail("deadline passed while waiting for " + what + " (a peer rank did not arrive)");
    return {};
  }

  collective_status wait_async(clock_type::time_point deadline, const std::string& what) {
    for (;;) {
      ncclResult_t st = ncclSuccess;
      if (auto r = ncclCommGetAsyncError(st_->comm, &st); r != ncclSuccess)
        return fail("ncclCommGetAsyncError: " + nccl_text(r));
      if (st == ncclSuccess)
        return {};
      if (st != ncclInProgress)
        return fail("NCCL: " + nccl_text(st));
      if (auto s = check_waiting(deadline, what); !s.ok)
        return s;
      std::this_thread::yield();
    }
  }

  // Aborts this process's communicator (wakes its kernels) and reports `what`.
  collective_status fail(const std::string& what) {
    st_->usable = false;
    if (st_->comm != nullptr) {
      cudaSetDevice(st_->ordinal);
      ncclCommAbort(st_->comm);
      st_->comm = nullptr;
      st_->token.clear();
      st_->s.reset();
    }
    return {false, "NCCL gather of rank " + std::to_string(st_->rank) + " on cuda:"
                     + std::to_string(st_->ordinal) + ": " + what};
  }

  std::shared_ptr<comm_state> st_;
  const std::string publication_id_;
  id_exchange exchange_;
  bool prepared_ = false; // the worker thread only
  std::string error_;
  std::atomic<bool> aborted_{false};
  std::mutex reason_mtx_;
  std::string reason_;
};

class process_registry final : public publication::collective_registry {
public:
  process_registry(int ordinal, std::uint32_t rank, std::uint32_t world, id_exchange exchange)
    : st_(std::make_shared<comm_state>()), exchange_(std::move(exchange)) {
    st_->ordinal = ordinal;
    st_->rank = rank;
    st_->world = world;
  }

  std::shared_ptr<publication::collective> for_publication(const std::string& id) override {
    std::lock_guard<std::mutex> guard(mtx_);
    for (auto it = live_.begin(); it != live_.end();)
      it = it->second.expired() ? live_.erase(it) : std::next(it);
    if (auto existing = live_[id].lock())
      return existing;
    auto fresh = std::make_shared<process_collective>(st_, id, exchange_);
    live_[id] = fresh;
    return fresh;
  }

private:
  std::shared_ptr<comm_state> st_;
  id_exchange exchange_;
  std::mutex mtx_;
  std::map<std::string, std::weak_ptr<publication::collective>> live_;
};

} // namespace

std::string new_unique_id_text() {
  ncclUniqueId id;
  if (auto r = ncclGetUniqueId(&id); r != ncclSuccess)
    throw error("ncclGetUniqueId: " + nccl_text(r));
  static const char* hex = "0123456789abcdef";
  std::string out = prefix;
  for (char c : id.internal) {
    const auto b = static_cast<unsigned char>(c);
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

std::shared_ptr<publication::collective_registry> make_nccl_process_registry(
  int ordinal, std::uint32_t rank, std::uint32_t world, id_exchange exchange) {
  return std::make_shared<process_registry>(ordinal, rank, world, std::move(exchange));
}

} // namespace refit::cuda
