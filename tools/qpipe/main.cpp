// qpipe: the command-line front door. Every failure ends as one line on stderr and an exit
// code from qpipe::ErrorCode (docs/cli.md).
#include <CLI/CLI.hpp>
#include <malloc.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "commands.h"
#include "cpu_load.h"
#include "launch.h"
#include "qpipe/cpu_blocks.h"
#include "qpipe/error.h"
#include "qpipe/log.h"
#include "qpipe/quant.h"

namespace {

// CLI11 reports an unknown subcommand as a missing one, and lists unexpected arguments last
// first ("1 --bogus"); name the subcommand or the first unknown option instead.
std::string usageMessage(CLI::App& app, const CLI::ParseError& e) {
  const std::vector<std::string> extras = app.remaining(/*recurse=*/true);
  if (!extras.empty() && !extras.front().starts_with("-") && app.get_subcommands().empty()) {
    std::string names;
    for (const CLI::App* sub : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + sub->get_name();
    return "unknown subcommand '" + extras.front() + "'; use one of: " + names;
  }
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr && !extras.empty()) {
    const auto option =
        std::find_if(extras.begin(), extras.end(), [](const std::string& a) { return a.starts_with("-"); });
    return option != extras.end() ? "unknown option '" + *option + "'" : "unexpected argument '" + extras.front() + "'";
  }
  return e.what();
}

// glibc serves an allocation above its mmap threshold (128 KiB, raised dynamically up to 32 MiB)
// with fresh pages, and trims the top of the heap on free: each activation-sized tensor then costs
// page faults and zeroing on every use. A flex_smooth_quant + static W8A8 run of SmolLM2 spent 12 %
// of its CPU time in page faults and took 58 s; with both thresholds raised, 49 s
// (docs/benchmarks.md). LibTorch's own tensors of that size now bypass glibc (qpipe/cpu_blocks.h);
// the thresholds still serve the buffers qpipe allocates itself. A user's GLIBC_TUNABLES or
// MALLOC_* settings win.
//
// The cores' CPU time is read here too, so that by the time a command picks its thread count the
// interval since (loading LibTorch: 0.1-0.2 s) shows what other processes keep busy.
void preferProcessDefaults(int, char**, char**) {
  qpipe::cli::sampleCpuLoadAtStart();
  if (std::getenv("GLIBC_TUNABLES") == nullptr && std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr &&
      std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr) {
    ::mallopt(M_MMAP_THRESHOLD, 512 << 20);
    ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
}
[[gnu::section(".preinit_array"), gnu::used]] void (*const preferDefaults)(int, char**, char**) = preferProcessDefaults;

int run(int argc, char** argv) {
  using namespace qpipe;
  // MKL's fp32 GEMM splits a long sum among its threads, so its bits depend on the thread count
  // (seen on an Intel Xeon host for K >= 576 with M up to 512, e.g. 128 x 1536 x 576), and each
  // rank runs cores / ranks threads: w8a8_iter_smooth and w4a8_flex_awq checkpoints of one rank
  // differed from those of two. In strict mode its GEMMs ran as fast there (docs/multirank.md).
  if (std::getenv("MKL_CBWR") == nullptr) quant::threadInvariantBlas();
  // A layer's activation-sized tensors are reused by the next layer instead of faulted in afresh
  // (qpipe/cpu_blocks.h).
  reuseLargeCpuBlocks();
  cli::setCommandLine(argc, argv);
  CLI::App app{"qpipe: compress large language models with pipelines of processor plugins", "qpipe"};
  app.require_subcommand(1);
  app.fallthrough();
  std::string logLevel = "info";
  app.add_option("--log_level", logLevel, "Log verbosity: trace, debug, info, warn, error, off")->capture_default_str();

  const std::vector<cli::Subcommand> subcommands{
      cli::setupCheck(app),   cli::setupCompare(app), cli::setupConvert(app), cli::setupEval(app),
      cli::setupPlugins(app), cli::setupQuant(app),   cli::setupVersion(app),
  };

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "qpipe: usage error: " << usageMessage(app, e) << " (see 'qpipe --help')\n";
    return static_cast<int>(ErrorCode::kUsage);
  }

  try {
    log::setLevel(logLevel);
    for (const auto& subcommand : subcommands) {
      if (subcommand.app->parsed()) subcommand.run();
    }
  } catch (const Error& e) {
    return cli::reportFailure(e.code(), e.what());
  } catch (const std::exception& e) {
    return cli::reportFailure(ErrorCode::kInternal, oneLine(e));
  }
  log::shutdown();
  return 0;
}

}  // namespace

// LibTorch's static destructors deregister its thousands of operators one by one: 0.18 s at the
// end of every process on a 2-core VM, paid twice in a row by a multi-rank run (rank 0, then the
// launcher waiting for it; docs/benchmarks.md). Everything qpipe writes is closed by the time a
// command returns, so the process flushes its streams and leaves without them.
int main(int argc, char** argv) {
  const int code = run(argc, argv);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}
