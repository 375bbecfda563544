// Ranks on one host talk through a shared mapping for what the task scheduler does at every
// wave: the gathers of a few KiB (its agreement, its outcomes, the exchanges' views), its claims
// from the store's counters and its tensor exchanges. Over Gloo on loopback a gather costs
// 0.25 ms back to back and about 0.8 ms after work (a peer's thread must be woken), and a few MB
// move at about 1 GB/s; through the mapping, a rank's wait ends within microseconds of the last
// rank's arrival and the bytes move at memcpy's speed (docs/multirank.md).
//
// Every rank calls step() and gather() in the same order, gathers with parts of the same size, as
// the collectives' contract already requires, so no rank needs to know another's sequence number.
#pragma once

#include <poll.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace qpipe::dist {

struct GroupOptions;

class HostChannel {
 public:
  // The bytes a rank's slot carries in one step (256 KiB less its header); a larger gathered part
  // goes over Gloo.
  static constexpr int64_t kPartBytes = (int64_t{256} << 10) - 64;

  // Every rank's channel, or nullptr on every rank where some rank cannot share it: the ranks on
  // different hosts, QPIPE_DIST_SHM=0 on some rank, no /dev/shm, a world of one. The ranks agree
  // through the store, so no rank uses it alone.
  static std::unique_ptr<HostChannel> open(c10d::Store& store, const GroupOptions& options);
  ~HostChannel();
  HostChannel(const HostChannel&) = delete;
  HostChannel& operator=(const HostChannel&) = delete;

  // Called every few milliseconds while a rank waits; throws to stop the wait (a peer's reported
  // failure, the timeout).
  using Check = std::function<void(std::chrono::steady_clock::duration waited)>;

  // One round of `collective` on every rank: `fill` writes this rank's `bytes` (at most
  // kPartBytes) into its slot, and once every rank has, `read` sees each rank's data and byte
  // count, this rank's included. A rank in another collective (by name) is Error(kDistributed) on
  // every rank, not bytes of the wrong kind.
  void step(const char* collective, int64_t bytes, const std::function<void(char* data)>& fill,
            const std::function<void(int rank, const char* data, int64_t bytes)>& read, const Check& check);
  // Every rank's `bytes` bytes (at most kPartBytes), rank by rank, into `all`; a rank that passed
  // another size is Error(kDistributed) on every rank.
  void gather(const char* collective, const void* mine, int64_t bytes, void* all, const Check& check);
  // The counter's value after adding `delta`; nullopt for a key the table cannot hold (longer
  // than its slots, holding a NUL, or the table full), which then lives in the store on every
  // rank alike.
  std::optional<int64_t> counterAdd(const std::string& key, int64_t delta, const Check& check);
  // Wakes the ranks waiting in step(): this rank failed, and check() then finds its report.
  void markFailed() noexcept;
  // Why a peer will not arrive, if one will not: it marked itself failed, closed its group (this
  // class's destructor), or its process exited; a rank absent from the step this rank waits in
  // first. A peer that had arrived there and then went gave up waiting: the message then names
  // the ranks still absent.
  std::optional<std::string> peerGone() const;
  // The ranks that have not arrived at the step this rank waits in (empty outside step's wait).
  std::vector<int> absent() const;
  // "rank 2", "ranks 2, 5" or "ranks 1-99999, 100001": three or more in a row as a range, and
  // after 16 items the count of the rest (ranks ascending).
  static std::string describeRanks(const std::vector<int>& ranks);

 private:
  struct Layout;
  HostChannel(void* base, size_t size, int rank, int worldSize);

  void* base_;
  size_t size_;
  int rank_, worldSize_;
  int64_t steps_ = 0;       // this rank's steps so far: the same count on every rank
  int64_t waitingFor_ = 0;  // the step (counted from 1) whose wait step() is in; 0 outside one
  // Each rank's pidfd, readable once it exited: fd -1 for this rank, or where pidfd_open failed
  // and peerGone looks the pid up in /proc instead (poll skips negative descriptors).
  mutable std::vector<pollfd> pidfds_;
};

}  // namespace qpipe::dist
