#include "qpipe/dist/process_group.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <sstream>
#include <thread>

#include "host_channel.h"
#include "nccl_abi.h"
#include "qpipe/error.h"
#include "qpipe/hash.h"

namespace qpipe::dist {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kWorldSizeKey = "qpipe/world_size";
constexpr const char* kReadyKey = "qpipe/ready";
constexpr const char* kReadyValue = "ok";
constexpr const char* kReadyReadKey = "qpipe/ready_read";
constexpr const char* kFailureSeenKey = "qpipe/failure_seen";
// ProcessGroup::counterAdd keys live under this prefix, apart from the keys above.
constexpr const char* kCounterPrefix = "qpipe/counter/";
constexpr const char* kValuePrefix = "qpipe/value/";  // ProcessGroup::storeSet keys
// How long a rank whose collective failed looks for the failed peer's report: the peer writes
// it before its sockets close, so it is normally there at once.
constexpr milliseconds kFailureLookup{1000};
// How long rank 0, which hosts the store, stays up after reporting its failure so that the
// peers can read the report.
constexpr milliseconds kReportGrace{3000};
constexpr milliseconds kPollInterval{20};

// The start-up polls (the master's port, the ranks' check-in) sleep 1 ms, then twice as long each
// time up to `cap`: ranks that start together meet within a millisecond or two, where a fixed
// interval made every run wait for it (a rank that tried the port before rank 0 listened slept
// 100 ms), and a slow peer costs no more wakeups than polling at the cap.
class Backoff {
 public:
  explicit Backoff(milliseconds cap) : cap_(cap) {}
  void wait() {
    std::this_thread::sleep_for(next_);
    next_ = std::min(cap_, next_ * 2);
  }

 private:
  milliseconds cap_;
  milliseconds next_{1};
};

std::string joinedKey(int rank) {
  return "qpipe/joined/" + std::to_string(rank);
}
std::string failedKey(int rank) {
  return "qpipe/failed/" + std::to_string(rank);
}
// How many backend operations (Gloo or NCCL collectives, exchanges) the rank has started: a rank
// whose count is short of a waiter's never reached the operation the waiter is stuck in.
std::string backendStepKey(int rank) {
  return "qpipe/backend_step/" + std::to_string(rank);
}

std::string seconds(milliseconds timeout) {
  std::ostringstream os;
  os << static_cast<double>(timeout.count()) / 1000.0 << " s";
  return os.str();
}

std::string text(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}
std::vector<uint8_t> bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

bool isLoopback(const std::string& address) {
  return address == "localhost" || address.rfind("127.", 0) == 0 || address == "::1";
}

c10d::ReduceOp toC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceOp::kMax:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::kSum:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::kProd:
      return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
  }
  QPIPE_CHECK(false, "unknown ReduceOp ", static_cast<int>(op));
}

// The NCCL backend factory from libqpipe_dist_nccl.so, beside libqpipe_core.so; opened once.
detail::CreateNcclBackend ncclFactory() {
#ifdef QPIPE_HAS_NCCL
  static detail::CreateNcclBackend factory = nullptr;
  static std::string loadError;
  static std::once_flag once;
  std::call_once(once, [] {
    Dl_info info{};
    QPIPE_CHECK(::dladdr(reinterpret_cast<void*>(&ncclFactory), &info) != 0 && info.dli_fname != nullptr,
                "cannot locate libqpipe_core");
    const auto path = std::filesystem::path(info.dli_fname).parent_path() / detail::kNcclLibrary;
    void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      loadError = ::dlerror();
      return;
    }
    factory = reinterpret_cast<detail::CreateNcclBackend>(::dlsym(library, detail::kCreateNcclBackendSymbol));
    if (factory == nullptr) loadError = ::dlerror();
  });
  QPIPE_REQUIRE(factory != nullptr, ErrorCode::kDistributed, "collectives on CUDA tensors need ", detail::kNcclLibrary,
                ", which did not load: ", loadError);
  return factory;
#else
  throw Error(ErrorCode::kDistributed,
              "collectives on CUDA tensors need NCCL, and this qpipe was built against a LibTorch without it");
#endif
}

class C10dGroup final : public ProcessGroup {
 public:
  C10dGroup(const GroupOptions& options, c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> gloo,
            std::unique_ptr<HostChannel> channel)
      : options_(options), store_(std::move(store)), gloo_(std::move(gloo)), channel_(std::move(channel)) {}

  int rank() const override { return options_.rank; }
  int worldSize() const override { return options_.worldSize; }
  bool sharesHostMemory() const { return channel_ != nullptr; }

  void allReduce(at::Tensor& tensor, ReduceOp op) override {
    ParallelTaskScope::check("allReduce");
    timed(static_cast<int64_t>(tensor.nbytes()), [&] {
      at::Tensor buffer = tensor.contiguous();
      std::vector<at::Tensor> tensors{buffer};
      c10d::AllreduceOptions opts;
      opts.reduceOp = toC10d(op);
      opts.timeout = options_.timeout;
      run("allReduce", [&] { return backendFor(buffer, "allReduce").allreduce(tensors, opts); });
      if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    });
  }

  std::vector<at::Tensor> allGather(const at::Tensor& tensor) override {
    ParallelTaskScope::check("allGather");
    std::vector<at::Tensor> result;
    timed(static_cast<int64_t>(tensor.nbytes()), [&] { result = gatherVariable(tensor.contiguous(), "allGather"); });
    return result;
  }

  void broadcast(at::Tensor& tensor, int root) override {
    ParallelTaskScope::check("broadcast");
    QPIPE_CHECK(root >= 0 && root < worldSize(), "broadcast from rank ", root, " of ", worldSize());
    timed(static_cast<int64_t>(tensor.nbytes()), [&] {
      at::Tensor buffer = tensor.contiguous();
      std::vector<at::Tensor> tensors{buffer};
      c10d::BroadcastOptions opts;
      opts.rootRank = root;
      opts.timeout = options_.timeout;
      run("broadcast", [&] { return backendFor(buffer, "broadcast").broadcast(tensors, opts); });
      if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    });
  }

  void barrier() override {
    ParallelTaskScope::check("barrier");
    timed(0, [&] {
      c10d::BarrierOptions opts;
      opts.timeout = options_.timeout;
      run("barrier", [&] { return gloo().barrier(opts); });
    });
  }

  std::vector<std::string> allGatherBytes(const std::string& bytes) override {
    ParallelTaskScope::check("allGatherBytes");
    at::Tensor local = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    if (!bytes.empty()) std::memcpy(local.data_ptr(), bytes.data(), bytes.size());
    std::vector<std::string> result;
    timed(static_cast<int64_t>(bytes.size()), [&] {
      for (const at::Tensor& part : gatherVariable(local, "allGatherBytes")) {
        result.emplace_back(static_cast<const char*>(part.data_ptr()), static_cast<size_t>(part.numel()));
      }
    });
    return result;
  }

  // One gather of equal parts: each rank's size, then its first `slot` bytes; a second of the
  // overflow, padded to the longest, only where a rank passed more. Unequal slots are unequal
  // parts, which Gloo aborts on in its own thread: the callers derive the slot from what every
  // rank saw alike.
  std::vector<std::string> allGatherBytesWithin(const std::string& bytes, int64_t slot) override {
    ParallelTaskScope::check("allGatherBytesWithin");
    QPIPE_CHECK(slot >= 0, "allGatherBytesWithin: negative slot ", slot);
    constexpr int64_t kHead = sizeof(int64_t);
    const auto size = static_cast<int64_t>(bytes.size());
    std::vector<std::string> result(static_cast<size_t>(worldSize()));
    timed(size, [&] {
      at::Tensor local = at::empty({kHead + slot}, at::kByte);
      auto* data = static_cast<char*>(local.data_ptr());
      std::memcpy(data, &size, kHead);
      std::memcpy(data + kHead, bytes.data(), static_cast<size_t>(std::min(size, slot)));
      const std::vector<at::Tensor> parts = gatherEqual(local, "allGatherBytesWithin");
      std::vector<int64_t> sizes(result.size());
      int64_t overflow = 0;
      for (size_t r = 0; r < result.size(); ++r) {
        const auto* part = static_cast<const char*>(parts[r].data_ptr());
        std::memcpy(&sizes[r], part, kHead);
        result[r].assign(part + kHead, static_cast<size_t>(std::min(sizes[r], slot)));
        overflow = std::max(overflow, sizes[r] - slot);
      }
      if (overflow == 0) return;
      at::Tensor rest = at::zeros({overflow}, at::kByte);
      if (size > slot) std::memcpy(rest.data_ptr(), bytes.data() + slot, static_cast<size_t>(size - slot));
      const std::vector<at::Tensor> more = gatherEqual(rest, "allGatherBytesWithin");
      for (size_t r = 0; r < result.size(); ++r) {
        if (sizes[r] > slot) {
          result[r].append(static_cast<const char*>(more[r].data_ptr()), static_cast<size_t>(sizes[r] - slot));
        }
      }
    });
    return result;
  }

  // One gather of every rank's view (each part's bytes, and whether all its tensors are on the
  // CPU), then Gloo send/recv between every pair: a part's tensors of kOwnMessage bytes or more
  // travel as their own messages, straight from and into the tensors; the smaller ones packed in
  // one message. Both sides derive that plan from the sizes alone. The all-gather this replaces
  // staged every byte three times on each side and padded every part to the largest.
  bool exchangeInPlace(const std::vector<std::vector<at::Tensor>>& parts) override {
    ParallelTaskScope::check("exchangeInPlace");
    const int world = worldSize();
    QPIPE_CHECK(static_cast<int>(parts.size()) == world, "exchangeInPlace: ", parts.size(), " parts for ", world,
                " ranks");
    // Each part's bytes, whether every tensor is on the CPU, and each part's layout (its tensors'
    // dtypes and shapes, hashed in order): equal totals split otherwise would pair up messages of
    // other sizes, or fill a tensor with another dtype's bytes.
    at::Tensor view = at::empty({2 * world + 1}, at::kLong);
    auto* mine = view.data_ptr<int64_t>();
    bool cpu = true;
    for (int r = 0; r < world; ++r) {
      mine[r] = 0;
      uint64_t layout = kFnv1aBasis;
      const auto mix = [&layout](int64_t value) { layout = fnv1aBytes(&value, sizeof value, layout); };
      for (const at::Tensor& t : parts[static_cast<size_t>(r)]) {
        mine[r] += static_cast<int64_t>(t.nbytes());
        cpu = cpu && t.is_cpu();
        mix(static_cast<int64_t>(t.scalar_type()));
        mix(t.dim());
        for (const int64_t size : t.sizes()) mix(size);
      }
      mine[world + 1 + r] = static_cast<int64_t>(layout);
    }
    mine[world] = cpu ? 1 : 0;
    bool everyCpu = true;
    timed(0, [&] {
      const std::vector<at::Tensor> views = gatherEqual(view, "exchangeInPlace");
      constexpr const char* kSame = "; every rank must give each part the same tensors (dtypes and shapes)";
      for (int r = 0; r < world; ++r) {
        const int64_t* sender = views[static_cast<size_t>(r)].const_data_ptr<int64_t>();
        for (int q = 0; q < world; ++q) {
          const int64_t* receiver = views[static_cast<size_t>(q)].const_data_ptr<int64_t>();
          QPIPE_REQUIRE(receiver[r] == sender[r], ErrorCode::kDistributed, "exchangeInPlace: rank ", r, " sends ",
                        sender[r], " bytes of tensors, rank ", q, " expects ", receiver[r], kSame);
          QPIPE_REQUIRE(receiver[world + 1 + r] == sender[world + 1 + r], ErrorCode::kDistributed,
                        "exchangeInPlace: rank ", r, " sends ", sender[r], " bytes of tensors that rank ", q,
                        " expects in other dtypes or shapes", kSame);
        }
      }
      for (const at::Tensor& v : views) everyCpu = everyCpu && v.const_data_ptr<int64_t>()[world] == 1;
    });
    if (!everyCpu) return false;
    timed(mine[rank()], [&] {
      if (channel_) {
        exchangeThroughHost(parts);
      } else {
        sendAndReceive(parts);
      }
    });
    return true;
  }

  void reportFailure(const std::string& message) noexcept override {
    try {
      // A rank that failed because a peer did is not a cause: its report would hide the peer's.
      if (!peerLost_) {
        // First the peers waiting in shared memory, which a store that fails or stalls would delay.
        if (channel_) channel_->markFailed();
        store_->set(failedKey(rank()), bytes(firstLine(message)));
        // Closing the connections now makes the peers' pending collectives fail at once rather
        // than at their timeout; the group is unusable after a failure anyway.
        gloo_.reset();
        nccl_.reset();
      }
      // Rank 0 hosts the store: it stays until the peers have read the report they look for.
      if (rank() == 0 && (!peerLost_ || peerNamed_)) waitForReaders();
    } catch (...) {
      // Best effort: the peers then report lost contact instead of this rank's message.
    }
  }

 private:
  // Smaller tensors of a part share one message: a message costs a rendezvous between the pair.
  static constexpr int64_t kOwnMessage = int64_t{64} << 10;

  // A part's messages, alike on its sender and its receivers: the small tensors packed (message
  // 0, where they hold any byte), then each large one (the next messages, in part order).
  struct Plan {
    std::vector<size_t> packed, own;
    int64_t packedBytes = 0;
    int ownTag(size_t i) const { return static_cast<int>(i) + (packedBytes > 0 ? 1 : 0); }
  };
  static Plan planOf(const std::vector<at::Tensor>& part) {
    Plan plan;
    for (size_t i = 0; i < part.size(); ++i) {
      const auto n = static_cast<int64_t>(part[i].nbytes());
      if (n >= kOwnMessage) {
        plan.own.push_back(i);
      } else {
        plan.packed.push_back(i);
        plan.packedBytes += n;
      }
    }
    return plan;
  }
  static at::Tensor bytesOf(const at::Tensor& contiguous) { return contiguous.reshape({-1}).view(at::kByte); }

  // What a wait in the host channel checks: a peer that failed or exited, the timeout.
  HostChannel::Check hostCheck(const char* collective) {
    return [this, collective](Clock::duration waited) {
      if (const std::optional<std::string> gone = channel_->peerGone()) {
        peerLost_ = true;
        throw Error(ErrorCode::kDistributed, peerFailure(collective, *gone));
      }
      if (waited >= options_.timeout) {
        peerLost_ = true;
        const std::vector<int> absent = channel_->absent();
        throw Error(ErrorCode::kDistributed,
                    concat("lost contact with a peer rank during ", collective, ": ",
                           absent.empty() ? "no answer" : HostChannel::describeRanks(absent) + " did not arrive",
                           " within ", seconds(options_.timeout), " (--dist_timeout)"));
      }
    };
  }

  // exchangeInPlace through the host channel: every rank's part as one run of bytes (its tensors
  // in order), a slot's worth a round, copied by its sender into the shared slot and by every
  // other rank out of it into the part's tensors (through a staging copy where one is not
  // contiguous): a memcpy each way instead of Gloo's loopback sockets.
  void exchangeThroughHost(const std::vector<std::vector<at::Tensor>>& parts) {
    struct Piece {
      char* data;
      int64_t bytes;
    };
    const int world = worldSize(), me = rank();
    std::vector<std::vector<Piece>> pieces(static_cast<size_t>(world));
    std::vector<at::Tensor> held;  // this rank's tensors that were not contiguous, made so
    std::vector<std::pair<at::Tensor, const at::Tensor*>> staged;
    std::vector<int64_t> totals(static_cast<size_t>(world), 0);
    for (int r = 0; r < world; ++r) {
      int64_t& total = totals[static_cast<size_t>(r)];
      for (const at::Tensor& t : parts[static_cast<size_t>(r)]) {
        at::Tensor bytes = t;
        if (!t.is_contiguous()) {
          bytes = r == me ? held.emplace_back(t.contiguous())
                          : staged.emplace_back(at::empty(t.sizes(), t.options()), &t).first;
        }
        pieces[static_cast<size_t>(r)].push_back(
            {static_cast<char*>(bytes.data_ptr()), static_cast<int64_t>(t.nbytes())});
        total += static_cast<int64_t>(t.nbytes());
      }
    }
    const int64_t largest = *std::max_element(totals.begin(), totals.end());
    // Rank r's bytes in the round at `offset`.
    const auto inRound = [&totals](int r, int64_t offset) {
      return std::clamp<int64_t>(totals[static_cast<size_t>(r)] - offset, 0, HostChannel::kPartBytes);
    };
    // copy(piece bytes, count, offset in the slot) for the bytes [offset, offset + kPartBytes) of a part.
    const auto within = [](const std::vector<Piece>& part, int64_t offset, const auto& copy) {
      int64_t start = 0;
      for (const Piece& piece : part) {
        const int64_t from = std::max(offset, start);
        const int64_t to = std::min(offset + HostChannel::kPartBytes, start + piece.bytes);
        if (from < to) copy(piece.data + (from - start), static_cast<size_t>(to - from), from - offset);
        start += piece.bytes;
      }
    };
    const HostChannel::Check check = hostCheck("exchangeInPlace");
    for (int64_t offset = 0; offset < largest; offset += HostChannel::kPartBytes) {
      channel_->step(
          "exchangeInPlace", inRound(me, offset),
          [&](char* slot) {
            within(pieces[static_cast<size_t>(me)], offset,
                   [slot](const char* data, size_t n, int64_t at) { std::memcpy(slot + at, data, n); });
          },
          [&](int r, const char* slot, int64_t bytes) {
            QPIPE_CHECK(bytes == inRound(r, offset), "exchangeInPlace: rank ", r, " sent ", bytes,
                        " bytes in a round where its part's size gives ", inRound(r, offset));
            if (r == me) return;
            within(pieces[static_cast<size_t>(r)], offset,
                   [slot](char* data, size_t n, int64_t at) { std::memcpy(data, slot + at, n); });
          },
          check);
    }
    for (const auto& [buffer, slot] : staged) slot->copy_(buffer);
  }

  void sendAndReceive(const std::vector<std::vector<at::Tensor>>& parts) {
    announceBackendStep("exchangeInPlace");
    const int world = worldSize(), me = rank();
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    const auto post = [&](at::Tensor message, int peer, int tag, bool send) {
      std::vector<at::Tensor> one{std::move(message)};
      backendCall("exchangeInPlace",
                  [&] { works.push_back(send ? gloo().send(one, peer, tag) : gloo().recv(one, peer, tag)); });
    };
    const std::vector<at::Tensor>& mine = parts[static_cast<size_t>(me)];
    const Plan sending = planOf(mine);
    std::vector<at::Tensor> outgoing;
    if (sending.packedBytes > 0) {
      at::Tensor packed = at::empty({sending.packedBytes}, at::kByte);
      int64_t offset = 0;
      for (const size_t i : sending.packed) {
        const at::Tensor t = mine[i].contiguous();
        std::memcpy(packed.data_ptr<uint8_t>() + offset, t.const_data_ptr(), t.nbytes());
        offset += static_cast<int64_t>(t.nbytes());
      }
      outgoing.push_back(packed);
    }
    for (const size_t i : sending.own) outgoing.push_back(bytesOf(mine[i].contiguous()));
    // Received into: a peer's packed message (with the part's small tensors), and the large slots
    // that are not contiguous.
    std::vector<std::pair<at::Tensor, std::vector<const at::Tensor*>>> packedFrom;
    std::vector<std::pair<at::Tensor, const at::Tensor*>> staged;
    for (int p = 0; p < world; ++p) {
      if (p == me) continue;
      for (size_t m = 0; m < outgoing.size(); ++m) post(outgoing[m], p, static_cast<int>(m), true);
      const std::vector<at::Tensor>& theirs = parts[static_cast<size_t>(p)];
      const Plan receiving = planOf(theirs);
      if (receiving.packedBytes > 0) {
        std::vector<const at::Tensor*> slots;
        for (const size_t i : receiving.packed) slots.push_back(&theirs[i]);
        packedFrom.emplace_back(at::empty({receiving.packedBytes}, at::kByte), std::move(slots));
        post(packedFrom.back().first, p, 0, false);
      }
      for (size_t k = 0; k < receiving.own.size(); ++k) {
        const at::Tensor& slot = theirs[receiving.own[k]];
        if (slot.is_contiguous()) {
          post(bytesOf(slot), p, receiving.ownTag(k), false);
        } else {
          staged.emplace_back(at::empty(slot.sizes(), slot.options()), &slot);
          post(bytesOf(staged.back().first), p, receiving.ownTag(k), false);
        }
      }
    }
    backendCall("exchangeInPlace", [&] {
      for (const auto& work : works) work->wait(options_.timeout);
    });
    for (const auto& [buffer, slots] : packedFrom) {
      int64_t offset = 0;
      for (const at::Tensor* packed : slots) {
        const at::Tensor& slot = *packed;
        const size_t n = slot.nbytes();
        const uint8_t* from = buffer.const_data_ptr<uint8_t>() + offset;
        if (slot.is_contiguous()) {
          std::memcpy(slot.data_ptr(), from, n);
        } else {
          at::Tensor received = at::empty(slot.sizes(), slot.options());
          std::memcpy(received.data_ptr(), from, n);
          slot.copy_(received);
        }
        offset += static_cast<int64_t>(n);
      }
    }
    for (const auto& [buffer, slot] : staged) slot->copy_(buffer);
  }

  // Every rank but rank 0 and the failed ones reads one report and counts itself in kFailureSeenKey.
  void waitForReaders() {
    const auto deadline = Clock::now() + std::min(kReportGrace, options_.timeout);
    while (Clock::now() < deadline) {
      int failed = 0;
      for (int r = 1; r < worldSize(); ++r) failed += store_->check({failedKey(r)}) ? 1 : 0;
      if (store_->add(kFailureSeenKey, 0) >= worldSize() - 1 - failed) return;
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  c10d::Backend& gloo() {
    QPIPE_REQUIRE(gloo_, ErrorCode::kDistributed, "the process group was closed after rank ", rank(), " failed");
    return *gloo_;
  }

  c10d::Backend& backendFor(const at::Tensor& tensor, const char* collective) {
    if (tensor.is_cpu()) return gloo();
    QPIPE_REQUIRE(tensor.is_cuda(), ErrorCode::kDistributed, collective, ": tensors on ", tensor.device(),
                  " are not supported (cpu and cuda are)");
    if (!nccl_) {
      const detail::CreateNcclBackend create = ncclFactory();
      char error[512] = {0};
      auto ncclStore = c10::make_intrusive<c10d::PrefixStore>("nccl", store_);
      c10d::Backend* backend =
          create(ncclStore.get(), rank(), worldSize(), options_.timeout.count(), error, sizeof(error));
      QPIPE_REQUIRE(backend != nullptr, ErrorCode::kDistributed, "cannot create the NCCL backend: ", error);
      nccl_ = c10::intrusive_ptr<c10d::Backend>::reclaim(backend);
    }
    return *nccl_;
  }

  // Starts one backend operation and waits for it. What c10d throws there is a peer's doing (gone,
  // stuck, failed): it becomes one line that names the failed rank when it reported itself. Errors
  // of this rank's own tensor work happen outside and pass through as they are.
  void run(const char* collective, const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
    announceBackendStep(collective);
    backendCall(collective, [&] { start()->wait(options_.timeout); });
  }
  // Published before each backend operation, its count and name ("12 allReduce"), for a waiter's
  // timeout to name who never came, or who came to another operation: the backends say only that
  // time ran out. One store write (the client does not wait for a reply), against a collective's
  // socket round trips; the host channel counts its own steps in its segment. Best effort: a
  // store that fails here fails no collective, and ends the naming.
  void announceBackendStep(const char* collective) {
    ++backendSteps_;
    if (!stepsPublished_) return;
    try {
      store_->set(backendStepKey(rank()), bytes(concat(backendSteps_, " ", collective)));
    } catch (const std::exception&) {
      stepsPublished_ = false;
    }
  }
  // Where the peers are against this rank's latest backend operation, as far as the store tells
  // (nothing where it does not answer: rank 0, its host, is gone).
  struct PeerSteps {
    std::vector<int> behind;                             // not yet started it
    std::vector<std::pair<int, std::string>> elsewhere;  // in another operation (rank, its name)
  };
  PeerSteps peerSteps(const char* collective) {
    PeerSteps steps;
    if (!stepsPublished_) return steps;
    try {
      for (int r = 0; r < worldSize(); ++r) {
        const std::string key = backendStepKey(r);
        if (r == rank()) continue;
        if (!store_->check({key})) {
          steps.behind.push_back(r);
          continue;
        }
        const std::string published = text(store_->get(key));
        const size_t space = published.find(' ');
        const int64_t count = std::stoll(published.substr(0, space));
        const std::string name = space == std::string::npos ? "" : published.substr(space + 1);
        if (count < backendSteps_) {
          steps.behind.push_back(r);
        } else if (count > backendSteps_ || name != collective) {
          steps.elsewhere.emplace_back(r, name);
        }
      }
    } catch (const std::exception&) {
      return {};
    }
    return steps;
  }
  // The same for backend calls that start or wait on operations of their own.
  void backendCall(const char* collective, const std::function<void()>& call) {
    try {
      call();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& error) {
      // Gloo's own words for a wait that ran out ("Operation timed out!") name no setting.
      std::string cause = oneLine(error);
      std::string lower = cause;
      std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
      if (lower.find("timed out") != std::string::npos) {
        const PeerSteps steps = peerSteps(collective);
        cause =
            concat(steps.behind.empty() ? "no answer" : HostChannel::describeRanks(steps.behind) + " did not arrive",
                   " within ", seconds(options_.timeout), " (--dist_timeout)");
        // Ranks in another operation: this rank is a cause of the failure, not a rank that lost a
        // peer, and reports it as such (the host channel's words for the same).
        if (!steps.elsewhere.empty()) {
          std::string where;
          for (const auto& [peer, name] : steps.elsewhere) {
            where += concat(where.empty() ? "" : ", ", "rank ", peer, " is in ", name);
          }
          throw Error(ErrorCode::kDistributed,
                      concat(collective, ": ", where, "; every rank must call the collectives in the same order",
                             steps.behind.empty() ? "" : concat(" (", cause, ")")));
        }
      }
      peerLost_ = true;
      throw Error(ErrorCode::kDistributed, peerFailure(collective, cause));
    }
  }

  // Every rank's tensor with equal shapes (what the backends support). Small CPU parts go through
  // the host channel where the ranks share one: every rank decides alike, the shapes being equal.
  std::vector<at::Tensor> gatherEqual(const at::Tensor& tensor, const char* collective) {
    if (channel_ && tensor.is_cpu() && static_cast<int64_t>(tensor.nbytes()) <= HostChannel::kPartBytes) {
      const at::Tensor part = tensor.contiguous();
      at::Tensor all = at::empty({worldSize(), part.numel()}, part.options());
      channel_->gather(collective, part.const_data_ptr(), static_cast<int64_t>(part.nbytes()), all.mutable_data_ptr(),
                       hostCheck(collective));
      std::vector<at::Tensor> parts;
      for (int r = 0; r < worldSize(); ++r) parts.push_back(all[r].view(part.sizes()));
      return parts;
    }
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < worldSize(); ++r) outputs[0].push_back(at::empty_like(tensor));
    std::vector<at::Tensor> inputs{tensor};
    c10d::AllgatherOptions opts;
    opts.timeout = options_.timeout;
    run(collective, [&] { return backendFor(tensor, collective).allgather(outputs, inputs, opts); });
    return outputs[0];
  }

  // Shapes may differ: gather dtype, rank and sizes (in the same collective up to kInlineDims
  // dimensions, else in a second), then the data padded to the largest size, and cut each rank's
  // part back out.
  std::vector<at::Tensor> gatherVariable(const at::Tensor& tensor, const char* collective) {
    constexpr int64_t kInlineDims = 8;
    const auto longs = at::TensorOptions().dtype(at::kLong).device(tensor.device());
    at::Tensor header = at::zeros({2 + kInlineDims}, at::kLong);
    auto* fields = header.data_ptr<int64_t>();
    fields[0] = static_cast<int64_t>(tensor.scalar_type());
    fields[1] = tensor.dim();
    for (int64_t d = 0; d < std::min<int64_t>(tensor.dim(), kInlineDims); ++d) fields[2 + d] = tensor.size(d);
    const at::Tensor headers = at::stack(gatherEqual(header.to(longs.device()), collective)).cpu();
    int64_t maxDim = 0;
    for (int r = 0; r < worldSize(); ++r) {
      const auto dtype = static_cast<at::ScalarType>(headers[r][0].item<int64_t>());
      QPIPE_REQUIRE(dtype == tensor.scalar_type(), ErrorCode::kDistributed, "allGather: rank ", r, " passed ", dtype,
                    " and rank ", rank(), " ", tensor.scalar_type(), "; every rank must pass the same dtype");
      maxDim = std::max(maxDim, headers[r][1].item<int64_t>());
    }
    at::Tensor allSizes = headers.narrow(1, 2, kInlineDims);
    if (maxDim > kInlineDims) {
      at::Tensor sizes = at::zeros({maxDim}, at::kLong);
      for (int64_t d = 0; d < tensor.dim(); ++d) sizes[d] = tensor.size(d);
      allSizes = at::stack(gatherEqual(sizes.to(longs.device()), collective)).cpu();
    }
    std::vector<std::vector<int64_t>> shapes(worldSize());
    int64_t maxNumel = 0;
    bool equal = true;
    for (int r = 0; r < worldSize(); ++r) {
      const int64_t dims = headers[r][1].item<int64_t>();
      int64_t numel = 1;
      for (int64_t d = 0; d < dims; ++d) {
        shapes[r].push_back(allSizes[r][d].item<int64_t>());
        numel *= shapes[r].back();
      }
      maxNumel = std::max(maxNumel, numel);
      equal = equal && shapes[r] == shapes[0];
    }
    if (equal && tensor.numel() > 0) return gatherEqual(tensor, collective);

    std::vector<at::Tensor> result;
    if (maxNumel == 0) {
      for (const auto& shape : shapes) result.push_back(at::empty(shape, tensor.options()));
      return result;
    }
    at::Tensor padded = at::zeros({maxNumel}, tensor.options());
    padded.narrow(0, 0, tensor.numel()).copy_(tensor.reshape({-1}));
    const std::vector<at::Tensor> parts = gatherEqual(padded, collective);
    for (int r = 0; r < worldSize(); ++r) {
      const int64_t numel = c10::multiply_integers(shapes[r]);
      result.push_back(parts[r].narrow(0, 0, numel).view(shapes[r]));
    }
    return result;
  }

  Traffic traffic() const override { return traffic_; }

  int64_t counterAdd(const std::string& key, int64_t delta) override {
    if (channel_) {
      if (const std::optional<int64_t> value = channel_->counterAdd(key, delta, hostCheck("counterAdd"))) return *value;
    }
    try {
      return store_->add(kCounterPrefix + key, delta);
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kDistributed, concat("rank ", rank(), ": the store did not answer counter '", key, "' (",
                                                  firstLine(e.what()), "); rank 0, which hosts it, may be gone"));
    }
  }

  void storeSet(const std::string& key, const std::string& value) override {
    try {
      store_->set(kValuePrefix + key, bytes(value));
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kDistributed, concat("rank ", rank(), ": the store did not take '", key, "' (",
                                                  firstLine(e.what()), "); rank 0, which hosts it, may be gone"));
    }
  }

  std::string storeGet(const std::string& key) override {
    const std::string stored = kValuePrefix + key;
    const auto deadline = Clock::now() + options_.timeout;
    // Polled with check(), not wait(): c10d logs a warning for every wait() that times out. The
    // interval grows from 0.25 ms to 2 ms, so a value set soon is seen soon.
    std::chrono::microseconds interval{250};
    try {
      while (true) {
        if (store_->check({stored})) return text(store_->get(stored));
        for (int r = 0; r < worldSize(); ++r) {
          if (r != rank() && store_->check({failedKey(r)})) {
            throw Error(ErrorCode::kDistributed, concat("rank ", rank(), " waited for '", key, "', but rank ", r,
                                                        " failed: ", text(store_->get(failedKey(r)))));
          }
        }
        QPIPE_REQUIRE(Clock::now() < deadline, ErrorCode::kDistributed, "rank ", rank(), " waited ",
                      seconds(options_.timeout), " for '", key, "', which no rank set");
        std::this_thread::sleep_for(interval);
        interval = std::min(interval * 2, std::chrono::microseconds{2000});
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kDistributed, concat("rank ", rank(), ": the store did not answer '", key, "' (",
                                                  firstLine(e.what()), "); rank 0, which hosts it, may be gone"));
    }
  }

  // Runs one collective and counts it in traffic().
  void timed(int64_t bytes, const std::function<void()>& body) {
    const auto start = Clock::now();
    body();
    ++traffic_.collectives;
    traffic_.bytes += bytes;
    traffic_.seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }

  std::string peerFailure(const char* collective, const std::string& cause) {
    const auto deadline = Clock::now() + std::min(kFailureLookup, options_.timeout);
    try {
      do {
        for (int r = 0; r < worldSize(); ++r) {
          if (r == rank() || !store_->check({failedKey(r)})) continue;
          const std::string message = text(store_->get(failedKey(r)));
          peerNamed_ = true;
          // Rank 0 waits for the others' counts (waitForReaders); its own would end the wait
          // before another rank had read the report, whose store leaves with rank 0.
          if (rank() != 0) store_->add(kFailureSeenKey, 1);
          return "rank " + std::to_string(r) + " failed: " + message;
        }
        std::this_thread::sleep_for(kPollInterval);
      } while (Clock::now() < deadline);
    } catch (const std::exception&) {
      // The store is gone with rank 0: nothing names the rank.
    }
    return std::string("lost contact with a peer rank during ") + collective + ": " + cause;
  }

  GroupOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> nccl_;
  std::unique_ptr<HostChannel> channel_;  // null unless every rank is on this host
  Traffic traffic_;
  int64_t backendSteps_ = 0;    // backend operations started (backendStepKey)
  bool stepsPublished_ = true;  // ... and each written to the store
  bool peerLost_ = false;     // a collective failed because of a peer
  bool peerNamed_ = false;  // ... which had reported its failure
};

std::string masterName(const GroupOptions& options) {
  return options.masterAddr + ":" + std::to_string(options.masterPort);
}

// Why MASTER_ADDR names no host, if it does not: c10d's client would retry until the timeout and
// then report a socket timeout, with a backtrace per attempt.
std::optional<std::string> unresolved(const GroupOptions& options) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int status = ::getaddrinfo(options.masterAddr.c_str(), nullptr, &hints, &found);
  if (found != nullptr) ::freeaddrinfo(found);
  if (status == 0) return std::nullopt;
  return concat("MASTER_ADDR '", options.masterAddr, "' names no host this rank can resolve (", ::gai_strerror(status),
                "); set it to rank 0's host name or address");
}

// Waits until rank 0's store accepts connections. c10d's client retries past its timeout and
// logs every failed attempt with a backtrace; this bounds the wait by the timeout, quietly.
void waitForMaster(const GroupOptions& options) {
  const auto deadline = Clock::now() + options.timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(options.masterPort);
  Backoff backoff(kPollInterval * 5);
  for (;;) {
    addrinfo* found = nullptr;
    if (::getaddrinfo(options.masterAddr.c_str(), port.c_str(), &hints, &found) == 0) {
      bool reached = false;
      for (addrinfo* address = found; address != nullptr && !reached; address = address->ai_next) {
        const int fd =
            ::socket(address->ai_family, address->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, address->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, address->ai_addr, address->ai_addrlen) == 0) {
          reached = true;
        } else if (errno == EINPROGRESS) {
          const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
          pollfd waiting{.fd = fd, .events = POLLOUT};
          int error = 0;
          socklen_t length = sizeof(error);
          reached = ::poll(&waiting, 1, static_cast<int>(std::max<int64_t>(left, 0))) == 1 &&
                    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
        }
        ::close(fd);
      }
      ::freeaddrinfo(found);
      if (reached) return;
    }
    if (Clock::now() >= deadline) {
      if (const std::optional<std::string> why = unresolved(options)) throw Error(ErrorCode::kDistributed, *why);
      throw Error(ErrorCode::kDistributed, concat("cannot reach the master at ", masterName(options), " within ",
                                                  seconds(options.timeout), " (is rank 0 running there?)"));
    }
    backoff.wait();
  }
}

// c10d's client waits for the server's answer to its first message with no timeout: another
// program on MASTER_PORT that reads a whole request before it answers (an HTTP server) would hold
// this rank for ever. The client is made on a thread of its own, and past the timeout the rank
// gives up on it (that thread stays blocked until the process exits).
c10::intrusive_ptr<c10d::TCPStore> connectWithin(const GroupOptions& options,
                                                 const c10d::TCPStoreOptions& storeOptions) {
  auto made = std::make_shared<std::promise<c10::intrusive_ptr<c10d::TCPStore>>>();
  std::future<c10::intrusive_ptr<c10d::TCPStore>> store = made->get_future();
  std::thread([made, host = options.masterAddr, storeOptions] {
    try {
      made->set_value(c10::make_intrusive<c10d::TCPStore>(host, storeOptions));
    } catch (...) {
      made->set_exception(std::current_exception());
    }
  }).detach();
  QPIPE_REQUIRE(store.wait_for(options.timeout + kReportGrace) == std::future_status::ready, ErrorCode::kDistributed,
                "the server at ", masterName(options),
                " accepted this rank but did not answer as rank 0's store within ", seconds(options.timeout),
                " (another program on MASTER_PORT?)");
  return store.get();
}

c10::intrusive_ptr<c10d::TCPStore> openStore(const GroupOptions& options) {
  if (options.rank == 0) {
    if (const std::optional<std::string> why = unresolved(options)) throw Error(ErrorCode::kDistributed, *why);
  } else {
    waitForMaster(options);
  }
  c10d::TCPStoreOptions storeOptions;
  storeOptions.port = static_cast<uint16_t>(options.masterPort);
  storeOptions.isServer = options.rank == 0;
  // The ranks check in through qpipe's own keys (rendezvous below), which also compares the
  // world sizes; c10d's worker count would only time out.
  storeOptions.waitWorkers = false;
  storeOptions.timeout = options.timeout;
  try {
    if (options.rank != 0) return connectWithin(options, storeOptions);
    return c10::make_intrusive<c10d::TCPStore>(options.masterAddr, storeOptions);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& error) {
    const std::string cause = oneLine(error);
    if (options.rank == 0) {
      QPIPE_REQUIRE(
          cause.find("EADDRINUSE") == std::string::npos && cause.find("ddress already in use") == std::string::npos,
          ErrorCode::kDistributed, "MASTER_PORT ", options.masterPort, " on ", options.masterAddr,
          " is in use (another run, or a stale process); choose a free port");
      throw Error(ErrorCode::kDistributed,
                  "cannot start the rendezvous server on " + masterName(options) + ": " + cause);
    }
    // c10d's check of the server's first answer ("Ping failed, invalid value returned").
    QPIPE_REQUIRE(cause.find("Ping failed") == std::string::npos, ErrorCode::kDistributed, "the server at ",
                  masterName(options),
                  " is not rank 0's store: it answered something else (another program on "
                  "MASTER_PORT?)");
    throw Error(ErrorCode::kDistributed, "cannot reach the master at " + masterName(options) + " within " +
                                             seconds(options.timeout) + " (is rank 0 running there?)");
  }
}

// Rank 0 publishes its world size (the one that counts); the others compare theirs and check
// in; rank 0 answers once all have, or with the first failure, so every rank fails alike.
void rendezvous(c10d::Store& store, const GroupOptions& options) {
  const auto deadline = Clock::now() + options.timeout;
  if (options.rank == 0) {
    // Rank 0 hosts the store: it stays until the ranks that joined have read why it failed.
    const auto fail = [&](const std::string& message) {
      store.set(kReadyKey, bytes(message));
      int joined = 0;
      for (int r = 1; r < options.worldSize; ++r) joined += store.check({joinedKey(r)}) ? 1 : 0;
      const auto graceEnd = Clock::now() + std::min(kReportGrace, options.timeout);
      while (store.add(kReadyReadKey, 0) < joined && Clock::now() < graceEnd)
        std::this_thread::sleep_for(kPollInterval);
      throw Error(ErrorCode::kDistributed, message);
    };
    store.set(kWorldSizeKey, bytes(std::to_string(options.worldSize)));
    std::vector<int> missing;
    for (int r = 1; r < options.worldSize; ++r) missing.push_back(r);
    Backoff backoff(kPollInterval);
    while (!missing.empty()) {
      for (int r = 1; r < options.worldSize; ++r) {
        if (store.check({failedKey(r)}))
          fail("rank " + std::to_string(r) + " failed: " + text(store.get(failedKey(r))));
      }
      std::erase_if(missing, [&](int r) { return store.check({joinedKey(r)}); });
      if (missing.empty()) break;
      if (Clock::now() >= deadline) {
        fail(concat(HostChannel::describeRanks(missing), " did not join at ", masterName(options), " within ",
                    seconds(options.timeout), " (WORLD_SIZE=", options.worldSize, ")"));
      }
      backoff.wait();
    }
    store.set(kReadyKey, bytes(kReadyValue));
    return;
  }
  std::string ready;
  try {
    const std::string masterWorld = text(store.get(kWorldSizeKey));
    if (masterWorld != std::to_string(options.worldSize)) {
      const std::string message = "WORLD_SIZE mismatch: rank " + std::to_string(options.rank) + " has " +
                                  std::to_string(options.worldSize) + ", rank 0 has " + masterWorld;
      store.set(failedKey(options.rank), bytes(message));
      throw Error(ErrorCode::kDistributed, message);
    }
    store.set(joinedKey(options.rank), bytes(kReadyValue));
    // Rank 0 decides, within the timeout from its own start; the margin keeps this rank from
    // giving up just before its verdict arrives.
    store.wait({kReadyKey}, options.timeout + kReportGrace);
    ready = text(store.get(kReadyKey));
    store.add(kReadyReadKey, 1);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& error) {
    throw Error(ErrorCode::kDistributed, "rendezvous at " + masterName(options) + " did not complete within " +
                                             seconds(options.timeout) + ": " + oneLine(error));
  }
  QPIPE_REQUIRE(ready == kReadyValue, ErrorCode::kDistributed, ready);
}

std::shared_ptr<::gloo::transport::Device> glooDevice(const std::string& masterAddr) {
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME"); interface != nullptr && *interface != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  }
  // Every rank is on this host: loopback works even where the host name resolves to nothing
  // reachable (a machine with only `lo`).
  if (isLoopback(masterAddr)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// A whole-string integer in [min, max], or Error naming the variable.
int64_t parseInteger(const char* name, const std::string& value, int64_t min, int64_t max) {
  int64_t parsed = 0;
  const auto [end, status] = std::from_chars(value.data(), value.data() + value.size(), parsed);
  QPIPE_REQUIRE(status == std::errc() && end == value.data() + value.size() && parsed >= min && parsed <= max,
                ErrorCode::kDistributed, name, "='", value, "' is not an integer in [", min, ", ", max, "]");
  return parsed;
}

std::optional<std::string> environment(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

}  // namespace

std::optional<std::chrono::milliseconds> timeoutFromEnvironment() {
  const auto timeout = environment("QPIPE_DIST_TIMEOUT_S");
  if (!timeout) return std::nullopt;
  char* end = nullptr;
  const double secondsValue = std::strtod(timeout->c_str(), &end);
  QPIPE_REQUIRE(
      !timeout->empty() && end == timeout->c_str() + timeout->size() && secondsValue > 0 && secondsValue <= 86400.0 * 7,
      ErrorCode::kUsage, "QPIPE_DIST_TIMEOUT_S='", *timeout,
      "' is not a number of seconds in (0, 604800]; fix it, unset it or pass --dist_timeout");
  return milliseconds(static_cast<int64_t>(secondsValue * 1000.0 + 0.5));
}

std::optional<GroupOptions> optionsFromEnvironment(std::optional<std::chrono::milliseconds> timeout) {
  const auto rank = environment("RANK");
  const auto worldSize = environment("WORLD_SIZE");
  if (!rank && !worldSize) return std::nullopt;
  QPIPE_REQUIRE(rank, ErrorCode::kDistributed, "WORLD_SIZE is set but RANK is not; set both or neither");
  QPIPE_REQUIRE(worldSize, ErrorCode::kDistributed, "RANK is set but WORLD_SIZE is not; set both or neither");
  GroupOptions options;
  options.worldSize = static_cast<int>(parseInteger("WORLD_SIZE", *worldSize, 1, 1 << 20));
  options.rank = static_cast<int>(parseInteger("RANK", *rank, 0, 1 << 20));
  QPIPE_REQUIRE(options.rank < options.worldSize, ErrorCode::kDistributed, "RANK=", options.rank,
                " is not below WORLD_SIZE=", options.worldSize);
  if (const auto addr = environment("MASTER_ADDR")) {
    QPIPE_REQUIRE(!addr->empty(), ErrorCode::kDistributed, "MASTER_ADDR is empty; set it to rank 0's host");
    options.masterAddr = *addr;
  }
  if (const auto port = environment("MASTER_PORT")) {
    options.masterPort = static_cast<int>(parseInteger("MASTER_PORT", *port, 1, 65535));
  }
  if (!timeout) timeout = timeoutFromEnvironment();
  if (timeout) options.timeout = *timeout;
  // The ranks on this host: torchrun and our launcher set both; otherwise every rank.
  const auto localRank = environment("LOCAL_RANK");
  options.localRank = static_cast<int>(localRank ? parseInteger("LOCAL_RANK", *localRank, 0, 1 << 20) : options.rank);
  QPIPE_REQUIRE(options.localRank < options.worldSize, ErrorCode::kDistributed, "LOCAL_RANK=", options.localRank,
                " is not below WORLD_SIZE=", options.worldSize);
  if (const auto local = environment("LOCAL_WORLD_SIZE")) {
    options.localWorldSize = static_cast<int>(parseInteger("LOCAL_WORLD_SIZE", *local, 1, 1 << 20));
    QPIPE_REQUIRE(*options.localWorldSize <= options.worldSize, ErrorCode::kDistributed,
                  "LOCAL_WORLD_SIZE=", *options.localWorldSize, " is above WORLD_SIZE=", options.worldSize,
                  ": one host cannot hold more ranks than the world");
    QPIPE_REQUIRE(!localRank || options.localRank < *options.localWorldSize, ErrorCode::kDistributed,
                  "LOCAL_RANK=", options.localRank, " is not below LOCAL_WORLD_SIZE=", *options.localWorldSize);
  }
  // Checked with the rest, before this rank joins: a bad value would otherwise fail it inside the
  // rendezvous, where its peers would wait for it until the timeout.
  sharedMemoryAllowed();
  return options;
}

std::shared_ptr<ProcessGroup> connect(const GroupOptions& options) {
  QPIPE_REQUIRE(options.worldSize >= 1 && options.rank >= 0 && options.rank < options.worldSize,
                ErrorCode::kDistributed, "rank ", options.rank, " is not in a world of ", options.worldSize);
  QPIPE_REQUIRE(options.masterPort >= 1 && options.masterPort <= 65535, ErrorCode::kDistributed, "MASTER_PORT ",
                options.masterPort, " is not in [1, 65535]");
  // A peer that fails closes its sockets; a write to one must fail with EPIPE, which the group
  // turns into "lost contact" or the peer's report, not kill this rank with SIGPIPE (the default
  // action outside Python, which ignores it). 1 run in 20 of a peer failing 3 ranks died so.
  ::signal(SIGPIPE, SIG_IGN);
  c10::intrusive_ptr<c10d::Store> store = openStore(options);
  rendezvous(*store, options);
  c10::intrusive_ptr<c10d::Backend> gloo;
  try {
    auto glooOptions = c10d::ProcessGroupGloo::Options::create(options.timeout);
    glooOptions->devices.push_back(glooDevice(options.masterAddr));
    gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo", store),
                                                       options.rank, options.worldSize, glooOptions);
    // A rank's side of the mesh can be complete while a peer still handshakes with it: without
    // this barrier a rank that fails at once would close its sockets under that handshake, and the
    // peer would report a broken connection instead of the rank's error.
    gloo->barrier()->wait();
  } catch (const std::exception& error) {
    throw Error(ErrorCode::kDistributed,
                "rank " + std::to_string(options.rank) + " cannot connect to its peers over Gloo: " + oneLine(error));
  }
  std::unique_ptr<HostChannel> channel;
  try {
    channel = HostChannel::open(*store, options);
  } catch (const std::exception& error) {
    throw Error(ErrorCode::kDistributed,
                "rank " + std::to_string(options.rank) +
                    " cannot agree with its peers on a shared-memory channel: " + oneLine(error));
  }
  return std::make_shared<C10dGroup>(options, std::move(store), std::move(gloo), std::move(channel));
}

bool sharesHostMemory(const ProcessGroup& group) {
  const auto* c10d = dynamic_cast<const C10dGroup*>(&group);
  return c10d != nullptr && c10d->sharesHostMemory();
}

}  // namespace qpipe::dist
