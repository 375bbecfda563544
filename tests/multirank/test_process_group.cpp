// Real ranks over Gloo on loopback: each test launches qpipe_dist_worker once per rank with
// the torchrun variables and checks every rank's output (tests/multirank/dist_worker.cpp).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "host_channel.h"
#include "rank_launcher.h"

namespace qpipe::test {
namespace {

template <typename... Values>
std::string line(const std::string& name, const Values&... values) {
  std::ostringstream os;
  os << name << ":";
  ((os << " " << values), ...);
  os << "\n";
  return os.str();
}

// Every result below is worked out by hand from what each rank holds.
std::string expectedCollectives(int w) {
  const double s = w * (w + 1) / 2.0;
  double factorial = 1;
  for (int k = 2; k <= w; ++k) factorial *= k;
  std::string text;
  text += line("min", 1, 2, -w);
  text += line("max", w, 2 * w, -1);
  text += line("sum", s, 2 * s, -s);
  text += line("prod", factorial, (1 << w) * factorial, (w % 2 ? -1 : 1) * factorial);
  text += line("mean", s / w, 2 * s / w, -s / w);
  text += line("strided sum", s, 2 * s, -s);
  for (int r = 0; r < w; ++r) {
    std::ostringstream os;
    os << "gather " << r << ": " << r + 1 << "x2";
    for (int k = 0; k < 2 * (r + 1); ++k) os << " " << 10 * r + k;
    text += os.str() + "\n";
  }
  std::ostringstream equal;
  equal << "gather equal:";
  for (int r = 0; r < w; ++r) equal << " " << r << " " << r;
  text += equal.str() + "\n";
  std::ostringstream lists;
  lists << "lists:";
  for (int r = 0; r < w; ++r) {
    for (int i = 0; i < r; ++i) lists << " " << i + 1 << "=" << 100 * r + i;
  }
  text += lists.str() + "\n";
  text += "sample order: 1=0 2=1 3=2 1=3 2=4 3=5 1=6\n";
  text += line("broadcast", w + 9, w + 9, w + 9);
  std::ostringstream bytes;
  bytes << "bytes:";
  for (int r = 0; r < w; ++r) {
    bytes << " rank" << r;
    for (int k = 0; k < r; ++k) bytes << "\\0";
    bytes << "\\n";
  }
  text += bytes.str() + "\n";
  for (const int slot : {0, 6, 64}) {
    std::ostringstream within;
    within << "within " << slot << ":";
    for (int r = 0; r < w; ++r) within << " " << r << std::string(4 * r, 'x') << "\\0";
    text += within.str() + "\n";
  }
  return text + "done\n";
}

class Multirank : public ::testing::TestWithParam<int> {};

TEST_P(Multirank, CollectivesAndDistOps) {
  const int w = GetParam();
  const auto results = run(world("collectives", w));
  for (int r = 0; r < w; ++r) {
    EXPECT_EQ(results[r].exitCode, 0) << "rank " << r << ":\n" << results[r].out;
    EXPECT_EQ(results[r].out, connected(r, w) + expectedCollectives(w)) << "rank " << r;
  }
}

// Each part's small tensors in one message, the large ones each in their own, received in place
// or, where a slot is not contiguous, through a copy: every rank gets every part exactly.
void expectExchanged(int w, const std::vector<RankResult>& results) {
  std::string parts;
  for (int r = 0; r < w; ++r) {
    std::ostringstream os;
    os << "part " << r << ": " << r + 0.5 << " " << r + 0.5 << " " << r + 0.5 << " | " << 10 * r << " " << 10 * r
       << " | " << r + 1 << "x20000 " << (r + 1) * 20000 - 1 + 1000 * r << " | " << 19999 + r << " | ";
    for (int k = 0; k < 8; ++k) os << (k ? " " : "") << 100 * r + k;
    os << " | 1 1 1 1 1 1\n";
    parts += os.str();
  }
  for (int r = 0; r < w; ++r) {
    EXPECT_EQ(results[r].exitCode, 0) << "rank " << r << ":\n" << results[r].out;
    EXPECT_EQ(results[r].out, connected(r, w) + "in place: 1\n" + parts + "done\n") << "rank " << r;
  }
}

// `scenario` on `w` ranks through the host channel (true) and, with QPIPE_DIST_SHM=0, over Gloo
// and the store (false).
std::vector<std::pair<bool, Launch>> withAndWithoutSharedMemory(const std::string& scenario, int w) {
  Launch gloo = world(scenario, w);
  gloo.env.push_back("QPIPE_DIST_SHM=0");
  return {{true, world(scenario, w)}, {false, gloo}};
}

// Through the host channel (in rounds of its slot) and over Gloo.
TEST_P(Multirank, ExchangeInPlace) {
  for (const auto& [shared, launch] : withAndWithoutSharedMemory("exchange", GetParam())) {
    SCOPED_TRACE(shared ? "shared memory" : "QPIPE_DIST_SHM=0");
    expectExchanged(GetParam(), run(launch));
  }
}

TEST_P(Multirank, DistHelperSharedAndLocalOnly) {
  const int w = GetParam();
  const auto results = run(world("dist_helper", w));
  // The sorted shared names under the mlp: mlp, mlp.experts, mlp.experts.0, dealt [rank::w].
  const std::vector<std::string> names{"model.layers.0.mlp", "model.layers.0.mlp.experts",
                                       "model.layers.0.mlp.experts.0"};
  for (int r = 0; r < w; ++r) {
    const bool last = r == w - 1;
    std::string expected = connected(r, w);
    expected += "model.layers.0: shared 1 local 1 localOnly 0\n";
    expected += "model.layers.0.self_attn: shared 1 local 1 localOnly 0\n";
    expected += "model.layers.0.mlp.experts.0: shared 1 local 1 localOnly 0\n";
    expected +=
        std::string("model.layers.0.mlp.experts.1: shared 0 local ") + (last ? "1 localOnly 1\n" : "0 localOnly 0\n");
    expected += "model.layers.0.mlp.experts.2: shared 0 local 0 localOnly 0\n";
    expected += "slice:";
    for (size_t i = r; i < names.size(); i += w) expected += " " + names[i];
    expected += "\ndone\n";
    EXPECT_EQ(results[r].exitCode, 0) << "rank " << r;
    EXPECT_EQ(results[r].out, expected) << "rank " << r;
  }
}

// Ranks on one host share memory for the small gathers and the store's counters: thousands of
// gathers of parts of other sizes (some past the slot, some past the channel, over Gloo) arrive
// byte for byte, and concurrent claims hand out each value once, also for a key the channel's
// table cannot hold (the store's). QPIPE_DIST_SHM=0 turns the channel off: the same results.
TEST_P(Multirank, HostChannelGathersAndCounters) {
  const int w = GetParam();
  for (const auto& [shared, launch] : withAndWithoutSharedMemory("host_channel", w)) {
    SCOPED_TRACE(shared ? "shared memory" : "QPIPE_DIST_SHM=0");
    const auto results = run(launch);
    for (int r = 0; r < w; ++r) {
      EXPECT_EQ(results[r].exitCode, 0) << "rank " << r << ":\n" << results[r].out;
      EXPECT_EQ(results[r].out, connected(r, w) + "host channel: " + (shared ? "1" : "0") +
                                    "\ngathers: 2000 wrong 0\nclaims of a 6-byte key: each once 1\n"
                                    "claims of a 51-byte key: each once 1\nclaims of a 52-byte key: each once 1\n"
                                    "claims of a 80-byte key: each once 1\nclaims of a 3-byte key: each once 1\n"
                                    "done\n")
          << "rank " << r;
    }
  }
}

// A segment name of this pid namespace for a run whose rank 0 is `pid`, as host_channel.cpp
// names them: qpipe-<namespace inode>-<pid>-<port>-<clock>.
std::string segmentOf(pid_t pid) {
  char ns[128] = {0};
  EXPECT_GT(::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1), 0);
  const std::string text(ns);
  const size_t open = text.find('['), close = text.find(']');
  return "/dev/shm/qpipe-" + text.substr(open + 1, close - open - 1) + "-" + std::to_string(pid) + "-1-1";
}

// A run whose rank 0 was killed in the set-up left its segment's name behind: the next run on
// this host removes it, and leaves alone a segment whose rank 0 still runs (one in its set-up).
TEST(MultirankHostChannel, AKilledRunsSegmentIsRemovedByTheNextRun) {
  const pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  ASSERT_GT(gone, 0);
  ::waitpid(gone, nullptr, 0);
  const std::string stale = segmentOf(gone), live = segmentOf(::getpid());
  for (const std::string& path : {stale, live}) std::ofstream(path) << "segment";
  const auto results = run(world("connect", 2));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(results[r].exitCode, 0) << "rank " << r << ":\n" << results[r].out;
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(live));
  std::filesystem::remove(live);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Multirank, ::testing::Values(2, 3),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

// A socket listening on a free port of `host` (network order), which the kernel picks: -1 if
// none; `port` gets it. Connections complete in its backlog; nobody accepts them.
int listeningSocket(uint32_t host, int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = host;
  socklen_t length = sizeof(address);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return -1;
  }
  port = ntohs(address.sin_port);
  return fd;
}

TEST(MultirankErrors, PortInUse) {
  // The test holds the port, listening, as another run would.
  int port = 0;
  const int fd = listeningSocket(htonl(INADDR_ANY), port);
  ASSERT_GE(fd, 0);
  Launch launch{.scenario = "connect", .port = port, .ranks = {0}, .worldSizes = {2}};
  const auto results = run(launch);
  ::close(fd);
  EXPECT_EQ(results[0].exitCode, 7);
  EXPECT_EQ(results[0].out, "error: MASTER_PORT " + std::to_string(launch.port) +
                                " on 127.0.0.1 is in use (another run, or a stale process); choose a free port\n");
}

// Bounded by the timeout itself (c10d's own client would retry past it).
TEST(MultirankErrors, MasterUnreachable) {
  Launch launch{
      .scenario = "connect", .port = qpipe::test::freePort(), .ranks = {1}, .worldSizes = {2}, .timeoutSeconds = "2"};
  const auto results = run(launch);
  EXPECT_EQ(results[0].exitCode, 7);
  EXPECT_EQ(results[0].out, "error: cannot reach the master at 127.0.0.1:" + std::to_string(launch.port) +
                                " within 2 s (is rank 0 running there?)\n");
  EXPECT_LT(results[0].seconds, 4.0);
}

// Another program on MASTER_PORT that accepts the connection and never answers (an HTTP server
// waits for a whole request) holds c10d's client for ever: the rank gives up after the timeout.
TEST(MultirankErrors, AServerThatIsNotRankZeroIsAnErrorWithinTheTimeout) {
  int port = 0;
  const int fd = listeningSocket(htonl(INADDR_LOOPBACK), port);
  ASSERT_GE(fd, 0);
  Launch launch{.scenario = "connect", .port = port, .ranks = {1}, .worldSizes = {2}, .timeoutSeconds = "1"};
  const auto results = run(launch);
  ::close(fd);
  EXPECT_EQ(results[0].exitCode, 7);
  EXPECT_EQ(results[0].out, "error: the server at 127.0.0.1:" + std::to_string(launch.port) +
                                " accepted this rank but did not answer as rank 0's store within 1 s (another program "
                                "on MASTER_PORT?)\n");
  EXPECT_LT(results[0].seconds, 8.0);
}

// A MASTER_ADDR that names no host fails at once, on rank 0 (which would connect to its own
// server there) and on the others.
TEST(MultirankErrors, AMasterAddressThatNamesNoHost) {
  for (int rank : {0, 1}) {
    Launch launch{.scenario = "connect",
                  .port = qpipe::test::freePort(),
                  .ranks = {rank},
                  .worldSizes = {2},
                  .timeoutSeconds = "2"};
    launch.env.push_back("MASTER_ADDR=no-such-host.invalid");
    const auto results = run(launch);
    EXPECT_EQ(results[0].exitCode, 7);
    EXPECT_EQ(results[0].out,
              "error: MASTER_ADDR 'no-such-host.invalid' names no host this rank can resolve (Name or "
              "service not known); set it to rank 0's host name or address\n");
  }
}

TEST(MultirankErrors, WorldSizeMismatchFailsEveryRank) {
  Launch launch{.scenario = "connect", .port = qpipe::test::freePort(), .ranks = {0, 1}, .worldSizes = {2, 3}};
  const auto results = run(launch);
  const std::string mismatch = "WORLD_SIZE mismatch: rank 1 has 3, rank 0 has 2";
  EXPECT_EQ(results[0].exitCode, 7);
  EXPECT_EQ(results[0].out, "error: rank 1 failed: " + mismatch + "\n");
  EXPECT_EQ(results[1].exitCode, 7);
  EXPECT_EQ(results[1].out, "error: " + mismatch + "\n");
}

TEST(MultirankErrors, MissingRankFailsEveryRank) {
  Launch launch{.scenario = "connect",
                .port = qpipe::test::freePort(),
                .ranks = {0, 1},
                .worldSizes = {3, 3},
                .timeoutSeconds = "2"};
  const auto results = run(launch);
  const std::string message =
      "error: rank 2 did not join at 127.0.0.1:" + std::to_string(launch.port) + " within 2 s (WORLD_SIZE=3)\n";
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].exitCode, 7) << "rank " << r;
    EXPECT_EQ(results[r].out, message) << "rank " << r;
    EXPECT_LT(results[r].seconds, 5.0) << "rank " << r;
  }
}

// A world of 100,000 with rank 0 alone listed every other rank in one 689 KB line.
TEST(MultirankErrors, RanksInARowAreNamedAsARange) {
  using qpipe::dist::HostChannel;
  EXPECT_EQ(HostChannel::describeRanks({2}), "rank 2");
  EXPECT_EQ(HostChannel::describeRanks({1, 2}), "ranks 1, 2");
  EXPECT_EQ(HostChannel::describeRanks({1, 2, 3, 5, 7, 8, 9, 10}), "ranks 1-3, 5, 7-10");
  std::vector<int> all(99999);
  std::iota(all.begin(), all.end(), 1);
  EXPECT_EQ(HostChannel::describeRanks(all), "ranks 1-99999");
  std::vector<int> even;
  for (int r = 0; r < 40; r += 2) even.push_back(r);
  EXPECT_EQ(HostChannel::describeRanks(even),
            "ranks 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30 and 4 more");
}

// A stuck peer fails the others at the timeout (2 s), long before it wakes (20 s), and is named:
// Gloo says only that time ran out, the ranks' published step counts say who never came.
TEST(MultirankErrors, StuckPeerTimesOut) {
  Launch launch = world("peer_hangs", 2);
  launch.timeoutSeconds = "2";
  launch.killRestWhenOneExits = true;
  const auto results = run(launch);
  EXPECT_EQ(results[0].exitCode, 7);
  EXPECT_EQ(results[0].out, connected(0, 2) +
                                "error: lost contact with a peer rank during allReduce: rank 1 did not "
                                "arrive within 2 s (--dist_timeout)\n");
  EXPECT_LT(results[0].seconds, 10.0);
}

// Two ranks wait in a shared-memory gather for a third that does not come (it sleeps 6 s): rank 1
// names it at its timeout (2 s); rank 0, which came 1.5 s later, sees rank 1 go and names rank 2
// too, not rank 1.
TEST(MultirankErrors, StuckPeerInASharedMemoryGatherIsNamed) {
  Launch launch = world("peer_hangs_in_gather", 3);
  launch.timeoutSeconds = "2";
  const auto results = run(launch);
  const std::string prefix = "error: lost contact with a peer rank during allGatherBytesWithin: rank 2 did not arrive";
  EXPECT_EQ(results[1].exitCode, 7);
  EXPECT_EQ(results[1].out, connected(1, 3) + prefix + " within 2 s (--dist_timeout)\n");
  EXPECT_EQ(results[0].exitCode, 7);
  const std::string fellow = connected(0, 3) + prefix + "; rank 1, which waited with this rank, ";
  EXPECT_EQ(results[0].out.substr(0, fellow.size()), fellow) << results[0].out;
  EXPECT_EQ(std::count(results[0].out.begin(), results[0].out.end(), '\n'), 2) << results[0].out;
  for (int r = 0; r < 2; ++r) EXPECT_LT(results[r].seconds, 5.5) << "rank " << r;
  EXPECT_EQ(results[2].exitCode, 0);
}

// The timeout is 10 s: a rank that waits for it instead of seeing its peer go has failed.
TEST(MultirankErrors, PeerThatReportsIsNamed) {
  const auto results = run(world("peer_reports", 3));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].exitCode, 7) << "rank " << r;
    EXPECT_EQ(results[r].out, connected(r, 3) + "error: rank 2 failed: layer 3: calibration sample 7 is empty\n");
    EXPECT_LT(results[r].seconds, 10.0) << "rank " << r;
  }
  EXPECT_EQ(results[2].exitCode, 5);
  EXPECT_EQ(results[2].out, connected(2, 3) + "error: layer 3: calibration sample 7 is empty\n");
}

// Two ranks' views of a part's size differ: both fail with the same line, before any tensor
// moves (a point-to-point receive of the wrong size would fail on one rank only, or hang).
TEST(MultirankErrors, ExchangeViewsThatDifferFailEveryRank) {
  const std::string same = "; every rank must give each part the same tensors (dtypes and shapes)\n";
  for (const auto& [scenario, message] :
       {std::pair<std::string, std::string>{"exchange_mismatch", "rank 0 sends 12 bytes of tensors, rank 1 expects 8"},
        {"exchange_layout_mismatch",
         "rank 0 sends 16 bytes of tensors that rank 1 expects in other dtypes or shapes"}}) {
    const auto results = run(world(scenario, 2));
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(results[r].exitCode, 7) << "rank " << r;  // ErrorCode::kDistributed
      EXPECT_EQ(results[r].out, connected(r, 2) + "error: exchangeInPlace: " + message + same) << "rank " << r;
      EXPECT_LT(results[r].seconds, 10.0) << "rank " << r;
    }
  }
}

// A peer that fails while the others wait in a gather through shared memory: named when it
// reported itself, else found gone, long before the 10 s timeout.
TEST(MultirankErrors, PeerGoneDuringASharedMemoryGather) {
  const auto reported = run(world("peer_reports_in_gather", 3));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(reported[r].exitCode, 7) << "rank " << r;
    EXPECT_EQ(reported[r].out, connected(r, 3) + "error: rank 2 failed: layer 3: calibration sample 7 is empty\n");
    EXPECT_LT(reported[r].seconds, 5.0) << "rank " << r;
  }
  const auto killed = run(world("peer_killed_in_gather", 2));
  EXPECT_EQ(killed[1].exitCode, -1);
  EXPECT_EQ(killed[0].exitCode, 7);
  const std::string expected =
      connected(0, 2) + "error: lost contact with a peer rank during allGatherBytesWithin: rank 1 (pid ";
  EXPECT_EQ(killed[0].out.substr(0, expected.size()), expected) << killed[0].out;
  EXPECT_NE(killed[0].out.find(") exited\n"), std::string::npos) << killed[0].out;
  EXPECT_LT(killed[0].seconds, 5.0);
}

TEST(MultirankErrors, MasterThatReportsIsNamed) {
  const auto results = run(world("master_fails", 2));
  EXPECT_EQ(results[0].exitCode, 6);
  EXPECT_EQ(results[0].out, connected(0, 2) + "error: cannot write shard 2: disk full\n");
  EXPECT_EQ(results[1].exitCode, 7);
  EXPECT_EQ(results[1].out, connected(1, 2) + "error: rank 0 failed: cannot write shard 2: disk full\n");
  EXPECT_LT(results[1].seconds, 10.0);
}

TEST(MultirankErrors, KilledPeerIsLostContact) {
  const auto results = run(world("peer_killed", 2));
  EXPECT_EQ(results[1].exitCode, -1);
  EXPECT_EQ(results[0].exitCode, 7);
  const std::string expected = connected(0, 2) + "error: lost contact with a peer rank during allReduce: ";
  EXPECT_EQ(results[0].out.substr(0, expected.size()), expected) << results[0].out;
  EXPECT_EQ(std::count(results[0].out.begin(), results[0].out.end(), '\n'), 2) << results[0].out;
  EXPECT_LT(results[0].seconds, 10.0);
}

// Through shared memory, ranks whose collectives do not pair up fail together, each naming what
// differs (over Gloo, unequal parts abort the process in Gloo's own thread).
TEST(MultirankErrors, SharedMemoryCollectivesThatDoNotPairUpFailEveryRank) {
  const auto sizes = run(world("gather_sizes_differ", 2));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(sizes[r].exitCode, 7) << "rank " << r;
    EXPECT_EQ(sizes[r].out, connected(r, 2) + "error: allGatherBytesWithin: rank " + std::to_string(1 - r) +
                                " passed " + (r == 0 ? "72" : "16") + " bytes and rank " + std::to_string(r) + " " +
                                (r == 0 ? "16" : "72") + "; every rank must pass the same size\n");
  }
  const auto order = run(world("collectives_differ", 2));
  EXPECT_EQ(order[0].exitCode, 7);
  EXPECT_EQ(order[0].out, connected(0, 2) +
                              "error: allGatherBytesWithin: rank 1 is in another collective; every rank must call the "
                              "collectives in the same order\n");
  EXPECT_EQ(order[1].exitCode, 7);
  EXPECT_EQ(order[1].out, connected(1, 2) +
                              "error: allGather: rank 0 is in another collective; every rank must call the "
                              "collectives in the same order\n");
}

// Over Gloo, ranks in different collectives wait until their timeout (2 s), which Gloo reports in
// words that name neither: each rank publishes which operation it is in, and the first to time
// out names the others', as a cause; the rank it names then reports that cause.
TEST(MultirankErrors, GlooCollectivesThatDoNotPairUpAreNamed) {
  Launch launch = world("backend_collectives_differ", 2);
  launch.timeoutSeconds = "2";
  launch.env.push_back("QPIPE_DIST_SHM=0");
  const auto results = run(launch);
  const std::string cause = "allReduce: rank 1 is in broadcast; every rank must call the collectives in the same order";
  EXPECT_EQ(results[0].exitCode, 7);
  EXPECT_EQ(results[0].out, connected(0, 2) + "error: " + cause + "\n");
  EXPECT_EQ(results[1].exitCode, 7);
  EXPECT_EQ(results[1].out, connected(1, 2) + "error: rank 0 failed: " + cause + "\n");
  EXPECT_LT(results[1].seconds, 10.0);
}

// A rank that closes its group while a peer waits for it in shared memory: the peer fails at once.
TEST(MultirankErrors, PeerThatClosesItsGroupIsLostContact) {
  const auto results = run(world("peer_closes_group", 2));
  EXPECT_EQ(results[0].exitCode, 7);
  EXPECT_EQ(results[0].out, connected(0, 2) +
                                "error: lost contact with a peer rank during allGatherBytesWithin: rank 1 closed its "
                                "process group\n");
  EXPECT_LT(results[0].seconds, 4.0);
  EXPECT_EQ(results[1].exitCode, 0);
}

}  // namespace
}  // namespace qpipe::test
