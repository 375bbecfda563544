// Launches qpipe_dist_worker (tests/multirank/dist_worker.cpp) once per rank, as torchrun would,
// with the torchrun variables on loopback Gloo, and collects every rank's exit code and output.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <string>
#include <thread>
#include <vector>

#include "free_port.h"
#include "test_helpers.h"

extern char** environ;

namespace qpipe::test {

using Clock = std::chrono::steady_clock;

struct RankResult {
  int exitCode = -1;  // -1: killed by a signal
  std::string out;
  double seconds = 0;  // from the launch to its exit
};

struct Launch {
  std::string scenario;
  int port = 0;
  std::vector<int> ranks;       // which ranks to start
  std::vector<int> worldSizes;  // WORLD_SIZE of each started rank
  std::string timeoutSeconds = "10";
  bool killRestWhenOneExits = false;  // for ranks that would otherwise sleep on
  std::vector<std::string> env;       // more NAME=value entries for every rank
};

// Starts the ranks, waits for all (killing them after 60 s) and returns their results.
inline std::vector<RankResult> run(const Launch& launch) {
  const auto dir = testDir();
  std::vector<std::string> inherited;
  for (char** variable = environ; *variable != nullptr; ++variable) {
    const std::string entry = *variable;
    const std::string name = entry.substr(0, entry.find('='));
    if (name != "RANK" && name != "WORLD_SIZE" && name != "MASTER_ADDR" && name != "MASTER_PORT" &&
        name != "QPIPE_DIST_TIMEOUT_S" && name != "OMP_NUM_THREADS" && name != "QPIPE_DIST_SHM") {
      inherited.push_back(entry);
    }
  }
  const auto start = Clock::now();
  std::vector<pid_t> pids;
  for (size_t i = 0; i < launch.ranks.size(); ++i) {
    // Launch.env first: getenv finds the first of two entries, so these override the defaults.
    std::vector<std::string> env = launch.env;
    env.insert(env.end(), inherited.begin(), inherited.end());
    env.push_back("RANK=" + std::to_string(launch.ranks[i]));
    env.push_back("WORLD_SIZE=" + std::to_string(launch.worldSizes[i]));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(launch.port));
    env.push_back("QPIPE_DIST_TIMEOUT_S=" + launch.timeoutSeconds);
    env.push_back("OMP_NUM_THREADS=1");
    std::vector<char*> envp;
    for (std::string& entry : env) envp.push_back(entry.data());
    envp.push_back(nullptr);
    std::string worker = QPIPE_DIST_WORKER;
    std::string scenario = launch.scenario;
    char* argv[] = {worker.data(), scenario.data(), nullptr};
    const std::string out = (dir / ("rank" + std::to_string(launch.ranks[i]) + ".out")).string();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, (out + ".err").c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    pid_t pid = 0;
    EXPECT_EQ(::posix_spawn(&pid, worker.c_str(), &actions, nullptr, argv, envp.data()), 0);
    posix_spawn_file_actions_destroy(&actions);
    pids.push_back(pid);
  }
  std::vector<RankResult> results(pids.size());
  std::vector<bool> done(pids.size(), false);
  for (size_t finished = 0; finished < pids.size();) {
    for (size_t i = 0; i < pids.size(); ++i) {
      int status = 0;
      if (done[i] || ::waitpid(pids[i], &status, WNOHANG) != pids[i]) continue;
      done[i] = true;
      ++finished;
      results[i].exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      results[i].seconds = std::chrono::duration<double>(Clock::now() - start).count();
      results[i].out = slurp(dir / ("rank" + std::to_string(launch.ranks[i]) + ".out"));
      if (launch.killRestWhenOneExits) {
        for (size_t j = 0; j < pids.size(); ++j) {
          if (!done[j]) ::kill(pids[j], SIGKILL);
        }
      }
    }
    if (Clock::now() - start > std::chrono::seconds(60)) {
      ADD_FAILURE() << "ranks still running after 60 s; killed";
      for (size_t i = 0; i < pids.size(); ++i) {
        if (!done[i]) ::kill(pids[i], SIGKILL);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return results;
}

inline Launch world(const std::string& scenario, int size) {
  Launch launch{.scenario = scenario, .port = qpipe::test::freePort()};
  for (int r = 0; r < size; ++r) {
    launch.ranks.push_back(r);
    launch.worldSizes.push_back(size);
  }
  return launch;
}

// The line dist_worker prints once it joined the group.
inline std::string connected(int rank, int size) {
  return "connected: rank " + std::to_string(rank) + " of " + std::to_string(size) + "\n";
}

}  // namespace qpipe::test
