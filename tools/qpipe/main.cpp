// qpipe: the command-line front door. Every failure ends as one line on stderr and an exit
// code from qpipe::ErrorCode (docs/cli.md).
#include <CLI/CLI.hpp>
#include <malloc.h>
#include <stdlib.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <regex>
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

// The deepest subcommand the parse reached: `app` itself, `quant`, or `convert gguf`.
CLI::App& reached(CLI::App& app) {
  CLI::App* at = &app;
  while (!at->get_subcommands().empty()) at = at->get_subcommands().front();
  return *at;
}

// The command whose --help lists what `at` takes: "qpipe", "qpipe quant", "qpipe convert gguf".
std::string commandOf(const CLI::App& at) {
  return at.get_parent() == nullptr ? at.get_name() : commandOf(*at.get_parent()) + " " + at.get_name();
}

// " (did you mean '--model_path'?)" for an option that `at` knows spelled with '-' for '_', without
// '_' or in another case; "; it is an option of 'qpipe quant', given before it" where it is spelled
// right; or " (did you mean the subcommand 'version'?)".
std::string suggestion(const CLI::App& at, const std::string& given) {
  const std::string typed = given.substr(0, given.find('='));
  const auto key = [](const std::string& name) {
    std::string out;
    const size_t start = name.find_first_not_of('-');
    for (const char c : name.substr(start == std::string::npos ? name.size() : start)) {
      if (c != '-' && c != '_') out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    return out;
  };
  const std::string wanted = key(typed);
  for (const CLI::App* scope = &at; scope != nullptr; scope = scope->get_parent()) {
    for (const CLI::Option* option : scope->get_options()) {
      for (const std::string& name : option->get_lnames()) {
        if ("--" + name == typed) return "; it is an option of '" + commandOf(*scope) + "', given before it";
        if (key(name) == wanted) return " (did you mean '--" + name + "'?)";
      }
    }
  }
  for (const CLI::App* sub : at.get_subcommands({})) {
    if (key(sub->get_name()) == wanted) return " (did you mean the subcommand '" + sub->get_name() + "'?)";
  }
  return "";
}

// What went wrong, in the user's terms. CLI11 reports a missing required option before an
// unknown one (so `--model-path` read as "--model_path is required") and an unknown subcommand
// as a missing one, and lists unexpected arguments last first ("1 --bogus"): the message names
// the unknown subcommand where one was due (its options are then unknown too: `qpipe quantize
// --model_path m` names 'quantize'), else the first unknown option, else the first stray argument.
std::string usageMessage(CLI::App& app, const CLI::ParseError& e) {
  const std::vector<std::string> extras = app.remaining(/*recurse=*/true);
  CLI::App& at = reached(app);
  const std::vector<CLI::App*> subs = at.get_subcommands({});
  std::string names;
  for (const CLI::App* sub : subs) names += (names.empty() ? "" : ", ") + sub->get_name();
  // Only a word right after the command is one (`qpipe --model_path m` misses the subcommand).
  if (!subs.empty() && !extras.empty() && !extras.front().starts_with("-")) {
    return "unknown subcommand '" + extras.front() + "'" + (&at == &app ? "" : " of '" + commandOf(at) + "'") +
           "; use one of: " + names;
  }
  // A negative number is a stray argument, not an option.
  const auto option = std::find_if(extras.begin(), extras.end(), [](const std::string& a) {
    return a.starts_with("-") &&
           !(a.size() > 1 && (std::isdigit(static_cast<unsigned char>(a[1])) != 0 || a[1] == '.'));
  });
  if (option != extras.end()) return "unknown option '" + *option + "'" + suggestion(at, *option);
  if (!subs.empty() && dynamic_cast<const CLI::RequiredError*>(&e) != nullptr) {
    return "'" + commandOf(at) + "' needs a subcommand: " + names;
  }
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr && !extras.empty()) {
    return "unexpected argument '" + extras.front() + "'";
  }
  // CLI11's "--model_path: At Most 1 required but received 2", "--model_path: 1 required TEXT
  // missing" and a flag's "Could not convert: --allow_non_finite = maybe", in plain words.
  const std::string what = e.what();
  static const std::regex kFlagValue(R"(Could not convert: (--\w+) = (.*))");
  std::smatch flag;
  if (dynamic_cast<const CLI::ConversionError*>(&e) != nullptr && std::regex_match(what, flag, kFlagValue)) {
    const CLI::Option* option = at.get_option_no_throw(flag[1].str());
    if (option != nullptr && option->get_expected_min() == 0) {
      return flag[1].str() + ": a flag takes true or false (or no value), got '" + flag[2].str() + "'";
    }
  }
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) != nullptr && what.find(": ") != std::string::npos) {
    const std::string option = what.substr(0, what.find(": "));
    if (what.find("At Most") != std::string::npos) return option + " is given more than once; give it once";
    if (what.find("missing") != std::string::npos) return option + " needs a value";
  }
  return what;
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

  // `qpipe [--log_level L] help [command…] [options]` is `qpipe [command…] --help`, whatever the
  // options.
  std::vector<std::string> args(argv + 1, argv + argc);
  auto help = args.begin();
  while (help != args.end() && help->starts_with("--log_level")) {
    help += help->find('=') == std::string::npos && help + 1 != args.end() ? 2 : 1;
  }
  if (help != args.end() && *help == "help") {
    const auto options = std::find_if(help + 1, args.end(), [](const std::string& a) { return a.starts_with("-"); });
    args.erase(options, args.end());
    args.erase(help);
    args.emplace_back("--help");
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes them last first
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "qpipe: usage error: " << shortened(usageMessage(app, e)) << " (see '" << commandOf(reached(app))
              << " --help')\n";
    return static_cast<int>(ErrorCode::kUsage);
  }

  try {
    log::setLevel(logLevel);
    for (const auto& subcommand : subcommands) {
      if (subcommand.app->parsed()) subcommand.run();
    }
  } catch (const Error& e) {
    return cli::reportFailure(e.code(), e.what());
  } catch (const std::filesystem::filesystem_error& e) {
    // A path the checks before the work could not look at (a link loop, a folder without
    // permission): the path and the system's reason, not the library's "filesystem error: status:".
    const std::string path = e.path1().empty() ? std::string() : e.path1().string() + ": ";
    return cli::reportFailure(ErrorCode::kIo, path + e.code().message());
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
