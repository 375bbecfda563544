// The qpipe subcommands: each file adds one to the app and returns how to run it, so that
// main() runs it after parsing, with logging configured and errors reported in one place.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace qpipe::cli {

struct Subcommand {
  CLI::App* app;
  std::function<void()> run;
};

Subcommand setupVersion(CLI::App& parent);
Subcommand setupPlugins(CLI::App& parent);
Subcommand setupQuant(CLI::App& parent);
Subcommand setupCheck(CLI::App& parent);
Subcommand setupConvert(CLI::App& parent);
Subcommand setupEval(CLI::App& parent);
Subcommand setupCompare(CLI::App& parent);

}  // namespace qpipe::cli
