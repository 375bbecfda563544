#include "launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <set>
#include <sstream>

#include "qpipe/device.h"
#include "qpipe/log.h"
#include "qpipe/process_group.h"
#include "qpipe/saver.h"

extern char** environ;

namespace qpipe::cli {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kRankErrorFileVar = "QPIPE_RANK_ERROR_FILE";

std::vector<std::string>& commandLine() {
  static std::vector<std::string> args;
  return args;
}

struct RankState {
  int rank = 0;
  int worldSize = 1;
  std::shared_ptr<ProcessGroup> group;  // once joined
};
RankState& rankState() {
  static RankState state;
  return state;
}

std::optional<int> parseInt(std::string_view text) {
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

int64_t monotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// MASTER_PORT when set, else a port the kernel reports free on 127.0.0.1.
int masterPort() {
  if (const char* port = std::getenv("MASTER_PORT"); port != nullptr && *port != '\0') {
    const std::optional<int> value = parseInt(port);
    QPIPE_REQUIRE(value && *value > 0 && *value < 65536, ErrorCode::kDistributed, "MASTER_PORT='", port,
                  "' is not an integer in [1, 65535]");
    return *value;
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  QPIPE_REQUIRE(fd >= 0, ErrorCode::kDistributed, "cannot open a socket to pick a free port: ", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  ::close(fd);
  QPIPE_REQUIRE(ok, ErrorCode::kDistributed, "cannot bind 127.0.0.1:0 to pick a free port: ", std::strerror(error),
                "; set MASTER_PORT");
  return ntohs(address.sin_port);
}

// Signals to the parent, seen by its wait loop through a self-pipe (a handler, not a blocked
// mask: threads that LibTorch or the CUDA driver started would otherwise take the signal).
std::atomic<int> gSignal{0};
std::atomic<int> gSignalCount{0};
int gWakeFd = -1;

extern "C" void onSignal(int signal) {
  const int saved = errno;
  if (signal != SIGCHLD) {
    gSignal.store(signal);
    gSignalCount.fetch_add(1);
  }
  const char byte = 0;
  [[maybe_unused]] const ssize_t n = ::write(gWakeFd, &byte, 1);
  errno = saved;
}

class SignalScope {
 public:
  SignalScope() {
    int fds[2];
    QPIPE_REQUIRE(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0, ErrorCode::kDistributed,
                  "cannot create a pipe: ", std::strerror(errno));
    readFd_ = fds[0];
    gWakeFd = fds[1];
    gSignal = 0;
    gSignalCount = 0;
    struct sigaction action {};
    action.sa_handler = onSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &action, &saved_[i]);
  }
  ~SignalScope() {
    for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &saved_[i], nullptr);
    ::close(readFd_);
    ::close(gWakeFd);
    gWakeFd = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  // Sleeps until a signal arrives or `timeout` passes.
  void wait(std::chrono::milliseconds timeout) const {
    pollfd fd{.fd = readFd_, .events = POLLIN, .revents = 0};
    ::poll(&fd, 1, static_cast<int>(std::max<int64_t>(0, timeout.count())));
    char buffer[64];
    while (::read(readFd_, buffer, sizeof(buffer)) > 0) {
    }
  }

 private:
  static constexpr int kSignals[3] = {SIGINT, SIGTERM, SIGCHLD};
  int readFd_ = -1;
  struct sigaction saved_[3];
};

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  bool killedByUs = false;
  int status = 0;
  int64_t exitNs = 0;
  fs::path errorFile;

  bool failed() const { return !running && !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }
};

std::string signalName(int signal) {
  const char* abbrev = ::sigabbrev_np(signal);
  return abbrev != nullptr ? "SIG" + std::string(abbrev) : "signal " + std::to_string(signal);
}

// Why a child failed, as the parent reports it; `priority` orders the candidates for the cause
// of the run's failure (a death by signal, then an error of the rank's own, then a distributed
// error, which usually only echoes a peer's failure), ties broken by time. `message` is the
// rank's error where `reported`, else what happened to it ("was killed by signal 9 (SIGKILL)").
struct Failure {
  int rank = 0;
  int priority = 0;
  int64_t timeNs = 0;
  ErrorCode code = ErrorCode::kDistributed;
  std::string message;
  bool reported = false;
};

Failure describe(const Child& child) {
  if (WIFSIGNALED(child.status)) {
    const int signal = WTERMSIG(child.status);
    return {child.rank, 0, child.exitNs, ErrorCode::kDistributed,
            "was killed by signal " + std::to_string(signal) + " (" + signalName(signal) + ")"};
  }
  const int exitCode = WEXITSTATUS(child.status);
  std::ifstream in(child.errorFile);
  int code = 0;
  int64_t timeNs = 0;
  std::string message;
  if (in >> code >> timeNs && in.ignore(1) && std::getline(in, message) && code >= 1 &&
      code <= static_cast<int>(ErrorCode::kDistributed)) {
    const auto errorCode = static_cast<ErrorCode>(code);
    return {child.rank, errorCode == ErrorCode::kDistributed ? 2 : 1, timeNs, errorCode, message, true};
  }
  const bool known = exitCode >= 1 && exitCode <= static_cast<int>(ErrorCode::kDistributed);
  return {child.rank, 1, child.exitNs, known ? static_cast<ErrorCode>(exitCode) : ErrorCode::kInternal,
          "exited with code " + std::to_string(exitCode)};
}

// "rank 1 failed: <error>", "ranks 0 and 1 failed: <error>" where they reported the same error (a
// task that fails on one rank fails every rank with its message, and "rank 1 failed: … failed
// on rank 0: …" misleads), or "rank 1 was killed by signal 9 (SIGKILL)". `failures`: every rank
// that failed by itself.
std::string failureLine(const Failure& cause, const std::vector<Failure>& failures) {
  std::vector<int> ranks;
  for (const Failure& f : failures) {
    if (cause.reported && f.reported && f.message == cause.message) ranks.push_back(f.rank);
  }
  if (ranks.empty()) ranks.push_back(cause.rank);
  std::string who = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    who += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  }
  return who + (cause.reported ? " failed: " : " ") + cause.message;
}

// `environ` without the variables the launcher sets, plus this rank's.
std::vector<std::string> rankEnvironment(const LaunchOptions& options, int rank, int port, const fs::path& errorFile) {
  static const std::set<std::string> kReplaced = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK",      "LOCAL_WORLD_SIZE",
                                                  "MASTER_ADDR", "MASTER_PORT", kRankErrorFileVar, "GROUP_RANK"};
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    if (!kReplaced.contains(std::string(text.substr(0, text.find('='))))) env.emplace_back(text);
  }
  const std::string world = std::to_string(options.worldSize);
  env.push_back("RANK=" + std::to_string(rank));
  env.push_back("LOCAL_RANK=" + std::to_string(rank));
  env.push_back("WORLD_SIZE=" + world);
  env.push_back("LOCAL_WORLD_SIZE=" + world);
  env.push_back("MASTER_ADDR=127.0.0.1");
  env.push_back("MASTER_PORT=" + std::to_string(port));
  env.push_back(std::string(kRankErrorFileVar) + "=" + errorFile.string());
  return env;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

fs::path makeErrorDir() {
  std::string pattern = (fs::temp_directory_path() / "qpipe-launch-XXXXXX").string();
  QPIPE_REQUIRE(::mkdtemp(pattern.data()) != nullptr, ErrorCode::kIo, "cannot create a temporary folder '", pattern,
                "': ", std::strerror(errno));
  return pattern;
}

// QPIPE_RANK_START=exec starts every rank as a fresh copy of the binary, as CUDA ranks are.
bool forkAllowed() {
  const char* start = std::getenv("QPIPE_RANK_START");
  if (start == nullptr || *start == '\0') return true;
  QPIPE_REQUIRE(std::string_view(start) == "fork" || std::string_view(start) == "exec", ErrorCode::kUsage,
                "QPIPE_RANK_START='", start, "' is not fork or exec");
  return std::string_view(start) == "fork";
}

bool singleThreaded() {
  std::error_code ec;
  const auto tasks = fs::directory_iterator("/proc/self/task", ec);
  return !ec && std::distance(fs::begin(tasks), fs::end(tasks)) == 1;
}

void signalAll(std::vector<Child>& children, int signal, bool ours) {
  for (Child& child : children) {
    if (!child.running) continue;
    ::kill(child.pid, signal);
    if (ours) child.killedByUs = true;
  }
}

}  // namespace

void setCommandLine(int argc, char** argv) {
  commandLine().assign(argv, argv + argc);
}

DeviceList parseDeviceList(const std::string& text) {
  DeviceList list{.text = text};
  const size_t colon = text.find(':');
  const std::string type = text.substr(0, colon);
  const std::string usage = "--device '" + text + "' is not cpu, cuda, cpu:0,1,… or cuda:N[,M,…]";
  QPIPE_REQUIRE(type == "cpu" || type == "cuda", ErrorCode::kUsage, usage);
  list.type = type == "cpu" ? c10::DeviceType::CPU : c10::DeviceType::CUDA;
  if (colon != std::string::npos) {
    std::string_view rest = std::string_view(text).substr(colon + 1);
    while (true) {
      const size_t comma = rest.find(',');
      const std::string_view part = rest.substr(0, comma);
      const std::optional<int> index = parseInt(part);
      // Written as the index prints: "01" reads as 1, and beside a 0 given once passed for a device.
      QPIPE_REQUIRE(index && *index >= 0 && std::to_string(*index) == part, ErrorCode::kUsage, usage);
      QPIPE_REQUIRE(std::find(list.indices.begin(), list.indices.end(), *index) == list.indices.end(),
                    ErrorCode::kUsage, "--device '", text, "' lists ", type, ":", *index,
                    " twice; give each device once (one rank per device)");
      list.indices.push_back(*index);
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
  }
  if (list.type == c10::DeviceType::CUDA) {
    if (list.indices.empty()) parseDevice("cuda");
    for (int index : list.indices) parseDevice("cuda:" + std::to_string(index));
  }
  return list;
}

bool launchRanks(const LaunchOptions& options) {
  const auto logger = log::logger();
  QPIPE_CHECK(options.worldSize > 1, "launching ", options.worldSize, " ranks");
  QPIPE_CHECK(!commandLine().empty(), "setCommandLine was not called");
  const int port = masterPort();

  std::vector<std::string> args = commandLine();
  std::error_code ec;
  if (const fs::path self = fs::read_symlink("/proc/self/exe", ec); !ec) args[0] = self.string();
  std::vector<char*> argv = pointers(args);

  // A bad QPIPE_RANK_START or --save_path is refused before anything exists to clean up.
  const bool forkable = forkAllowed();
  const fs::path partial = CheckpointSaver::partialDir(options.savePath);
  const fs::path errorDir = makeErrorDir();
  std::vector<Child> children(options.worldSize);
  std::vector<std::vector<std::string>> envs;
  std::vector<std::vector<char*>> envps;
  for (int rank = 0; rank < options.worldSize; ++rank) {
    children[rank].rank = rank;
    children[rank].errorFile = errorDir / ("rank-" + std::to_string(rank) + ".error");
    envs.push_back(rankEnvironment(options, rank, port, children[rank].errorFile));
  }
  for (auto& env : envs) envps.push_back(pointers(env));

  // A fork needs no second start of LibTorch (0.3–0.4 s of operator registration here), but only
  // a process with one thread can fork without exec safely: CUDA and thread pools start threads.
  const bool forkOnly = forkable && options.fork && singleThreaded();
  std::optional<int> forkedRank;
  std::optional<Failure> failure;
  bool interrupted = false;
  int interruptSignal = 0;
  {
    SignalScope signals;
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);  // a forked rank would write the buffers' contents again
    const pid_t parent = ::getpid();
    for (Child& child : children) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        // Only async-signal-safe calls until exec, or until this child knows it is a forked rank
        // (its parent had one thread). A parent that dies takes its ranks with it.
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != parent) ::_exit(127);
        if (forkOnly) {
          forkedRank = child.rank;
          break;
        }
        // This very binary, even if the file was replaced since it started.
        ::execve("/proc/self/exe", argv.data(), envps[child.rank].data());
        ::_exit(127);
      }
      if (pid < 0) {
        const int error = errno;
        signalAll(children, SIGKILL, true);
        for (Child& started : children) {
          if (started.running) ::waitpid(started.pid, nullptr, 0);
        }
        fs::remove_all(errorDir, ec);
        throw Error(ErrorCode::kDistributed,
                    concat("cannot start rank ", child.rank, ": fork failed: ", std::strerror(error)));
      }
      child.pid = pid;
      child.running = true;
    }
    if (forkedRank) {
      // A single-threaded parent leaves its child in a consistent state: the rank's environment
      // replaces the launcher's, and the scope's end restores the signal dispositions.
      ::clearenv();
      for (const std::string& entry : envs[*forkedRank]) {
        const size_t equals = entry.find('=');
        ::setenv(entry.substr(0, equals).c_str(), entry.substr(equals + 1).c_str(), 1);
      }
      return true;
    }
    logger->info("launched ", options.worldSize, " ranks (pids ", children.front().pid, "…", children.back().pid,
                 "), rendezvous on 127.0.0.1:", port, forkOnly ? ", forked" : "");

    // After the first failure the other ranks get `grace` to stop on their own (their
    // collectives fail once the failed rank is known), then SIGKILL.
    const auto grace = std::min<std::chrono::milliseconds>(std::chrono::seconds(5), options.timeout);
    std::optional<Clock::time_point> killAt;
    int running = options.worldSize;
    while (running > 0) {
      const auto now = Clock::now();
      const auto nap = killAt ? std::chrono::duration_cast<std::chrono::milliseconds>(*killAt - now)
                              : std::chrono::milliseconds(500);
      signals.wait(std::min(nap, std::chrono::milliseconds(500)));

      if (gSignal != 0 && !interrupted) {
        interrupted = true;
        interruptSignal = gSignal;
        logger->warn(signalName(gSignal), " received: stopping all ranks");
        signalAll(children, SIGTERM, true);
        killAt = Clock::now() + std::min<std::chrono::milliseconds>(std::chrono::seconds(2), grace);
      }
      if (gSignalCount >= 2) signalAll(children, SIGKILL, true);

      for (Child& child : children) {
        if (!child.running || ::waitpid(child.pid, &child.status, WNOHANG) != child.pid) continue;
        child.running = false;
        child.exitNs = monotonicNs();
        --running;
        if (child.failed() && !child.killedByUs && !failure && !interrupted) {
          failure = describe(child);
          const std::string how = WIFSIGNALED(child.status) ? signalName(WTERMSIG(child.status))
                                                            : "exit code " + std::to_string(WEXITSTATUS(child.status));
          logger->warn("rank ", child.rank, " ended (", how, "); the other ranks have ", grace.count() / 1000.0,
                       " s to stop before they are killed");
          killAt = Clock::now() + grace;
        }
      }
      if (killAt && Clock::now() >= *killAt && running > 0) {
        signalAll(children, SIGKILL, true);
        killAt.reset();
      }
    }
  }

  // The cause: among every rank that failed by itself, the most telling and then the earliest.
  std::vector<Failure> failures;
  if (failure) {
    for (const Child& child : children) {
      if (!child.failed() || child.killedByUs) continue;
      failures.push_back(describe(child));
      const Failure& candidate = failures.back();
      if (std::tie(candidate.priority, candidate.timeNs) < std::tie(failure->priority, failure->timeNs)) {
        failure = candidate;
      }
    }
  }
  fs::remove_all(errorDir, ec);
  if (interrupted || failure) {
    // A rank stopped by a signal cannot clean up; a complete --save_path is never touched.
    // Not another run's, in progress, to the same path (rank 0 refused to touch it).
    if (fs::exists(partial, ec)) {
      if (const std::optional<int> lock = CheckpointSaver::lockPartial(partial)) {
        fs::remove_all(partial, ec);
        if (*lock >= 0) ::close(*lock);
      }
    }
  }
  if (interrupted) {
    throw Error(ErrorCode::kInterrupted, signalName(interruptSignal) + " received; all ranks stopped");
  }
  if (failure) throw Error(failure->code, failureLine(*failure, failures));
  return false;
}

void markRank(int rank, int worldSize) {
  rankState().rank = rank;
  rankState().worldSize = worldSize;
}

void markGroup(std::shared_ptr<ProcessGroup> group) {
  rankState().group = std::move(group);
}

int reportFailure(ErrorCode code, const std::string& text) {
  const std::string message = shortened(text);
  if (message.size() < text.size()) log::logger()->debug("the whole error: ", text);
  const int exitCode = static_cast<int>(code);
  const RankState& state = rankState();
  const char* errorFile = std::getenv(kRankErrorFileVar);
  const bool launched = errorFile != nullptr && *errorFile != '\0';
  if (!launched && state.worldSize == 1) {
    log::shutdown();
    std::cerr << "qpipe: " << errorCodeName(code) << ": " << message << "\n";
    return exitCode;
  }
  if (launched) {
    // The parent writes the final `qpipe:` line, naming this rank. The error file is written
    // before the peers hear of the failure: its time stamp precedes every failure it causes.
    log::logger()->error(errorCodeName(code), ": ", message);
    std::ofstream(errorFile, std::ios::trunc) << exitCode << " " << monotonicNs() << "\n" << message << "\n";
  }
  if (state.group) state.group->reportFailure(message);
  log::shutdown();
  if (!launched) {
    std::cerr << "qpipe: " << errorCodeName(code) << ": [rank " << state.rank << "/" << state.worldSize << "] "
              << message << "\n";
  }
  // A rank leaves at once: its process group may be blocked in a collective that tearing it
  // down would wait for.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(exitCode);
}

}  // namespace qpipe::cli
