#include "host_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "qpipe/dist/process_group.h"
#include "qpipe/error.h"
#include "qpipe/hash.h"

namespace qpipe::dist {

using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kMagic = 0x71706970652d6832ULL;  // "qpipe-h2": the layout's version
constexpr int64_t kCounterSlots = 8192;
constexpr size_t kKeyBytes = 52;
// A waiting rank spins this long before it sleeps on the futex: a peer that arrives within it
// costs no system call on either side.
constexpr std::chrono::microseconds kSpin{50};
constexpr std::chrono::milliseconds kNap{5};

// A spinning core's hint that it waits (x86's pause, Arm's yield).
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A slot: its header (the bytes and the collective's tag that its rank put there), then the data.
constexpr int64_t kSlotBytes = int64_t{256} << 10;
constexpr int64_t kSlotHeader = 64;

static_assert(HostChannel::kPartBytes == kSlotBytes - kSlotHeader);

std::string readFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// This process's pid namespace ("pid:[4026531836]"), empty where /proc does not say.
std::string pidNamespace() {
  char ns[128] = {0};
  if (::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1) < 0) return "";
  return ns;
}

// What makes two processes able to share a mapping and see each other's pids: the machine (its
// name and boot), the pid namespace. Empty where the channel is switched off.
std::string identity() {
  if (!sharedMemoryAllowed()) return "";
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) return "";
  const std::string ns = pidNamespace();
  const std::string boot = readFirstLine("/proc/sys/kernel/random/boot_id");
  if (boot.empty() || ns.empty()) return "";
  return std::string(host) + "/" + boot + "/" + ns;
}

// The start of this pid namespace's segment names: "qpipe-<namespace inode>-", then rank 0's pid.
std::string segmentPrefix() {
  const std::string ns = pidNamespace();
  const size_t open = ns.find('['), close = ns.find(']');
  return "qpipe-" + (open < close && close != std::string::npos ? ns.substr(open + 1, close - open - 1) : "0") + "-";
}

// A rank 0 killed during the set-up (its name is removed only once every rank has mapped the
// segment) leaves a segment of (W + 1) · 512 KiB in /dev/shm until the host restarts: the next
// run's rank 0 removes those of this pid namespace whose rank 0 no longer runs. A segment whose
// run is live is left alone, also one in its set-up.
void removeStaleSegments() {
  const std::string prefix = segmentPrefix();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind(prefix, 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(file.c_str() + prefix.size(), &end, 10);
    if (pid <= 0 || end == nullptr || *end != '-') continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) ::shm_unlink(("/" + file).c_str());
  }
}

// Processes share these words through the mapping: only atomics that need no lock (a lock would
// live in one process) work there.
static_assert(std::atomic_ref<int64_t>::is_always_lock_free && std::atomic_ref<uint32_t>::is_always_lock_free &&
              std::atomic_ref<int32_t>::is_always_lock_free);

// A process that exited: gone, or a zombie its parent has not reaped (pidfds' fallback, which a
// reused pid fools).
bool exited(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  const std::string stat = readFirstLine(("/proc/" + std::to_string(pid) + "/stat").c_str());
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z';
}

void futexWait(uint32_t* word, uint32_t expected, std::chrono::milliseconds timeout) {
  timespec ts{0, static_cast<long>(std::chrono::nanoseconds(timeout).count())};
  ::syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(uint32_t* word) {
  ::syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

bool sharedMemoryAllowed() {
  const char* value = std::getenv("QPIPE_DIST_SHM");
  if (value == nullptr || std::string_view(value) == "1") return true;
  QPIPE_REQUIRE(std::string_view(value) == "0", ErrorCode::kUsage, "QPIPE_DIST_SHM='", value,
                "' is neither 0 (ranks on one host talk over Gloo) nor 1 (through shared memory, the default)");
  return false;
}

struct HostChannel::Layout {
  struct Header {
    uint64_t magic;
    int64_t worldSize;
    int64_t arrivals;  // Σ over gathers of the ranks that reached it: gather n is complete at world · (n + 1)
    uint32_t wake;     // the futex word: bumped when a step completes or a rank fails or leaves
    int32_t failed;    // 1 + the rank that marked itself failed; 0 while none has
  };
  static_assert(sizeof(Header) <= 64, "the pids follow the header at byte 64");
  struct alignas(64) Counter {
    uint32_t state;  // 0 free, 1 being claimed, 2 holds `key`
    char key[kKeyBytes];
    int64_t value;
  };
  static_assert(sizeof(Counter) == 64);

  static size_t pidsOffset() { return 64; }
  // Per rank: the number of steps it has arrived at, which names the ranks a wait lacks; then
  // whether its group was destroyed (1), one flag a rank so that none overwrites another's.
  static size_t arrivedOffset(int world) { return pidsOffset() + sizeof(int64_t) * world; }
  static size_t leftOffset(int world) { return arrivedOffset(world) + sizeof(int64_t) * world; }
  static size_t countersOffset(int world) { return (leftOffset(world) + sizeof(int64_t) * world + 63) / 64 * 64; }
  static size_t buffersOffset(int world) { return countersOffset(world) + sizeof(Counter) * kCounterSlots; }
  static size_t size(int world) { return buffersOffset(world) + 2 * static_cast<size_t>(world) * kSlotBytes; }

  static Header& header(void* base) { return *static_cast<Header*>(base); }
  static int64_t* pids(void* base) { return reinterpret_cast<int64_t*>(static_cast<char*>(base) + pidsOffset()); }
  static int64_t* arrived(void* base, int world) {
    return reinterpret_cast<int64_t*>(static_cast<char*>(base) + arrivedOffset(world));
  }
  static int64_t* left(void* base, int world) {
    return reinterpret_cast<int64_t*>(static_cast<char*>(base) + leftOffset(world));
  }
  static Counter* counters(void* base, int world) {
    return reinterpret_cast<Counter*>(static_cast<char*>(base) + countersOffset(world));
  }
  static char* slot(void* base, int world, int64_t step, int rank) {
    return static_cast<char*>(base) + buffersOffset(world) + ((step % 2) * world + rank) * kSlotBytes;
  }
};

std::unique_ptr<HostChannel> HostChannel::open(c10d::Store& store, const GroupOptions& options) {
  const int world = options.worldSize, rank = options.rank;
  if (world < 2) return nullptr;
  const auto text = [](const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); };
  const auto set = [&](const std::string& key, const std::string& value) {
    store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
  };
  const std::string hostKey = "qpipe/shm/host/";
  const size_t size = Layout::size(world);
  set(hostKey + std::to_string(rank), identity());

  void* base = nullptr;
  // A store call that throws (a peer gone during the set-up) leaves no mapping behind.
  struct Unmap {
    void*& base;
    size_t size;
    ~Unmap() {
      if (base != nullptr) ::munmap(base, size);
    }
  } unmap{base, size};
  const auto map = [&](int fd) {
    void* mapped = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    base = mapped == MAP_FAILED ? nullptr : mapped;
  };
  const auto announce = [&] { std::atomic_ref(Layout::pids(base)[rank]).store(::getpid(), std::memory_order_release); };
  std::string name;
  // Rank 0's segment name goes once every rank has mapped it, or when this set-up fails.
  struct Unlink {
    const std::string& name;
    bool owner;
    ~Unlink() {
      if (owner && !name.empty()) ::shm_unlink(name.c_str());
    }
  } unlink{name, rank == 0};
  if (rank == 0) {
    const std::string mine = text(store.get(hostKey + "0"));
    bool together = !mine.empty();
    for (int r = 1; r < world && together; ++r) together = text(store.get(hostKey + std::to_string(r))) == mine;
    if (together) {
      removeStaleSegments();
      name = "/" + segmentPrefix() + std::to_string(::getpid()) + "-" + std::to_string(options.masterPort) + "-" +
             std::to_string(Clock::now().time_since_epoch().count());
      const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      // The pages reserved now: a /dev/shm too small for them (a container's 64 MiB) is a fallback
      // to Gloo here, not a SIGBUS at the first gather that touches one.
      if (fd >= 0 && ::ftruncate(fd, static_cast<off_t>(size)) == 0 &&
          ::posix_fallocate(fd, 0, static_cast<off_t>(size)) == 0) {
        map(fd);
      } else if (fd >= 0) {
        ::close(fd);
      }
      if (base != nullptr) {
        Layout::Header& header = Layout::header(base);
        header.worldSize = world;
        std::atomic_ref(header.magic).store(kMagic, std::memory_order_release);
        announce();
      } else {
        if (fd >= 0) ::shm_unlink(name.c_str());
        name.clear();
      }
    }
    set("qpipe/shm/name", name);
  } else {
    name = text(store.get("qpipe/shm/name"));
    if (!name.empty()) {
      const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
      if (fd >= 0) map(fd);
      if (base != nullptr && (std::atomic_ref(Layout::header(base).magic).load(std::memory_order_acquire) != kMagic ||
                              Layout::header(base).worldSize != world)) {
        ::munmap(base, size);
        base = nullptr;
      }
      if (base != nullptr) announce();
      set("qpipe/shm/mapped/" + std::to_string(rank), base != nullptr ? "1" : "0");
    }
  }
  std::string use = "0";
  if (rank == 0) {
    if (!name.empty()) {
      use = "1";
      for (int r = 1; r < world; ++r) {
        if (text(store.get("qpipe/shm/mapped/" + std::to_string(r))) != "1") use = "0";
      }
      // Every rank that will map it has: the name goes (Unlink), the mapping lives as long as they do.
    }
    set("qpipe/shm/use", use);
  } else {
    use = text(store.get("qpipe/shm/use"));
  }
  if (use != "1") return nullptr;
  std::unique_ptr<HostChannel> channel(new HostChannel(base, size, rank, world));
  base = nullptr;  // the channel's now
  return channel;
}

// Every rank announced its pid before it reported the mapping, and rank 0 said "use" only after
// every report: the table is complete here.
HostChannel::HostChannel(void* base, size_t size, int rank, int worldSize)
    : base_(base),
      size_(size),
      rank_(rank),
      worldSize_(worldSize),
      pidfds_(static_cast<size_t>(worldSize), pollfd{-1, POLLIN, 0}) {
  const int64_t* pids = Layout::pids(base_);
  for (int r = 0; r < worldSize_; ++r) {
    const int64_t pid = std::atomic_ref(pids[r]).load(std::memory_order_acquire);
    if (r != rank_ && pid > 0) pidfds_[static_cast<size_t>(r)].fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  }
}

// A peer still waiting for this rank learns that it will not come (peerGone).
HostChannel::~HostChannel() {
  Layout::Header& header = Layout::header(base_);
  std::atomic_ref(Layout::left(base_, worldSize_)[rank_]).store(1, std::memory_order_release);
  std::atomic_ref(header.wake).fetch_add(1, std::memory_order_release);
  futexWakeAll(&header.wake);
  ::munmap(base_, size_);
  for (const pollfd& peer : pidfds_) {
    if (peer.fd >= 0) ::close(peer.fd);
  }
}

void HostChannel::step(const char* collective, int64_t bytes, const std::function<void(char* data)>& fill,
                       const std::function<void(int rank, const char* data, int64_t bytes)>& read, const Check& check) {
  QPIPE_CHECK(bytes >= 0 && bytes <= kPartBytes, collective, ": ", bytes, " bytes in a step of at most ", kPartBytes);
  const uint64_t tag = fnv1a(collective);
  char* mine = Layout::slot(base_, worldSize_, steps_, rank_);
  std::memcpy(mine, &bytes, sizeof(bytes));
  std::memcpy(mine + sizeof(bytes), &tag, sizeof(tag));
  fill(mine + kSlotHeader);
  // Two sets of slots in turn: a rank fills the next step's slot while a slower one still reads
  // this step's, and it cannot pass the next step before that one has arrived there, done reading.
  const int64_t step = steps_++;
  const int64_t target = worldSize_ * steps_;
  Layout::Header& header = Layout::header(base_);
  std::atomic_ref arrivals(header.arrivals);
  std::atomic_ref wake(header.wake);
  std::atomic_ref(Layout::arrived(base_, worldSize_)[rank_]).store(steps_, std::memory_order_release);
  if (arrivals.fetch_add(1, std::memory_order_acq_rel) + 1 == target) {
    wake.fetch_add(1, std::memory_order_release);
    futexWakeAll(&header.wake);
  } else {
    const auto start = Clock::now();
    auto lastCheck = start;
    waitingFor_ = steps_;
    struct Done {
      int64_t& waitingFor;
      ~Done() { waitingFor = 0; }
    } done{waitingFor_};
    while (arrivals.load(std::memory_order_acquire) < target) {
      const auto now = Clock::now();
      if (now - start < kSpin) {
        cpuRelax();
        continue;
      }
      if (now - lastCheck >= kNap) {
        try {
          check(now - start);
        } catch (...) {
          // The last rank may have arrived, then failed or left, since the loop looked: this step
          // is complete all the same.
          if (arrivals.load(std::memory_order_acquire) >= target) break;
          throw;
        }
        lastCheck = now;
      }
      const uint32_t seen = wake.load(std::memory_order_acquire);
      if (arrivals.load(std::memory_order_acquire) >= target) break;
      futexWait(&header.wake, seen, kNap);
    }
  }
  // Every rank reads every header, so a rank in another collective fails every rank alike.
  for (int r = 0; r < worldSize_; ++r) {
    const char* slot = Layout::slot(base_, worldSize_, step, r);
    uint64_t theirs = 0;
    std::memcpy(&theirs, slot + sizeof(int64_t), sizeof(theirs));
    QPIPE_REQUIRE(theirs == tag, ErrorCode::kDistributed, collective, ": rank ", r,
                  " is in another collective; every rank must call the collectives in the same order");
  }
  for (int r = 0; r < worldSize_; ++r) {
    const char* slot = Layout::slot(base_, worldSize_, step, r);
    int64_t theirs = 0;
    std::memcpy(&theirs, slot, sizeof(theirs));
    read(r, slot + kSlotHeader, theirs);
  }
}

// A size that differs fails every rank: each sees its own size among the others.
void HostChannel::gather(const char* collective, const void* mine, int64_t bytes, void* all, const Check& check) {
  const auto n = static_cast<size_t>(bytes);
  step(
      collective, bytes, [&](char* data) { std::memcpy(data, mine, n); },
      [&](int r, const char* data, int64_t theirs) {
        QPIPE_REQUIRE(theirs == bytes, ErrorCode::kDistributed, collective, ": rank ", r, " passed ", theirs,
                      " bytes and rank ", rank_, " ", bytes, "; every rank must pass the same size");
        std::memcpy(static_cast<char*>(all) + r * bytes, data, n);
      },
      check);
}

std::optional<int64_t> HostChannel::counterAdd(const std::string& key, int64_t delta, const Check& check) {
  if (key.size() >= kKeyBytes || key.find('\0') != std::string::npos) return std::nullopt;
  Layout::Counter* counters = Layout::counters(base_, worldSize_);
  const uint64_t hash = fnv1a(key);
  // Open addressing; slots are never freed, so a key absent from a full table stays absent on
  // every rank, and the store then holds it for all of them.
  for (int64_t probe = 0; probe < kCounterSlots; ++probe) {
    Layout::Counter& slot = counters[(hash + probe) % kCounterSlots];
    std::atomic_ref state(slot.state);
    uint32_t seen = state.load(std::memory_order_acquire);
    if (seen == 0) {
      if (state.compare_exchange_strong(seen, 1, std::memory_order_acq_rel)) {
        std::memcpy(slot.key, key.c_str(), key.size() + 1);
        state.store(2, std::memory_order_release);
        return std::atomic_ref(slot.value).fetch_add(delta, std::memory_order_acq_rel) + delta;
      }
    }
    // A peer is writing the key: microseconds, unless it was preempted (more ranks than cores) or
    // died there; past the spin this rank yields its core and looks at its peers every nap.
    const auto start = Clock::now();
    for (auto lastCheck = start; seen == 1; seen = state.load(std::memory_order_acquire)) {
      const auto now = Clock::now();
      if (now - start < kSpin) {
        cpuRelax();
        continue;
      }
      std::this_thread::yield();
      if (now - lastCheck >= kNap) {
        check(now - start);
        lastCheck = now;
      }
    }
    if (std::strcmp(slot.key, key.c_str()) == 0) {
      return std::atomic_ref(slot.value).fetch_add(delta, std::memory_order_acq_rel) + delta;
    }
  }
  return std::nullopt;
}

void HostChannel::markFailed() noexcept {
  Layout::Header& header = Layout::header(base_);
  std::atomic_ref(header.failed).store(rank_ + 1, std::memory_order_release);
  std::atomic_ref(header.wake).fetch_add(1, std::memory_order_release);
  futexWakeAll(&header.wake);
}

std::vector<int> HostChannel::absent() const {
  std::vector<int> ranks;
  if (waitingFor_ == 0) return ranks;
  const int64_t* arrived = Layout::arrived(base_, worldSize_);
  for (int r = 0; r < worldSize_; ++r) {
    if (std::atomic_ref(arrived[r]).load(std::memory_order_acquire) < waitingFor_) ranks.push_back(r);
  }
  return ranks;
}

std::string HostChannel::describeRanks(const std::vector<int>& ranks) {
  constexpr int kItems = 16;
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  int items = 0;
  for (size_t i = 0; i < ranks.size();) {
    if (items == kItems) return text + concat(" and ", ranks.size() - i, " more");
    size_t last = i;
    while (last + 1 < ranks.size() && ranks[last + 1] == ranks[last] + 1) ++last;
    if (last - i < 2) last = i;  // two in a row read better as a list
    text += concat(items > 0 ? ", " : "", ranks[i], last > i ? concat("-", ranks[last]) : "");
    ++items;
    i = last + 1;
  }
  return text;
}

std::optional<std::string> HostChannel::peerGone() const {
  Layout::Header& header = Layout::header(base_);
  const int failed = std::atomic_ref(header.failed).load(std::memory_order_acquire);
  if (failed > 0 && failed - 1 != rank_) return "rank " + std::to_string(failed - 1) + " failed";
  // Who went, and how: a group closed (this class's destructor) or a process exited.
  std::vector<std::pair<int, std::string>> gone;
  // One poll of every pidfd: a wait looks every nap, and /proc at 64 ranks cost a tenth of a core.
  const bool anyExited = ::poll(pidfds_.data(), pidfds_.size(), 0) > 0;
  const int64_t* pids = Layout::pids(base_);
  const int64_t* left = Layout::left(base_, worldSize_);
  for (int r = 0; r < worldSize_; ++r) {
    if (r == rank_) continue;
    const auto pid = static_cast<pid_t>(std::atomic_ref(pids[r]).load(std::memory_order_acquire));
    const pollfd& peer = pidfds_[static_cast<size_t>(r)];
    if (std::atomic_ref(left[r]).load(std::memory_order_acquire) != 0) {
      gone.emplace_back(r, "closed its process group");
    } else if (peer.fd >= 0 ? anyExited && peer.revents != 0 : pid > 0 && exited(pid)) {
      gone.emplace_back(r, "(pid " + std::to_string(pid) + ") exited");
    }
  }
  if (gone.empty()) return std::nullopt;
  // A rank that went before it reached this step is the cause. One that had reached it and went
  // waited with this rank and gave up (its timeout, most likely): the cause is then the ranks that
  // never came.
  const std::vector<int> missing = absent();
  for (const auto& [r, what] : gone) {
    if (std::find(missing.begin(), missing.end(), r) != missing.end()) return "rank " + std::to_string(r) + " " + what;
  }
  const auto& [first, what] = gone.front();
  if (missing.empty()) return "rank " + std::to_string(first) + " " + what;
  return describeRanks(missing) + " did not arrive; rank " + std::to_string(first) + ", which waited with this rank, " +
         what;
}

}  // namespace qpipe::dist
