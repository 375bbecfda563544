#include <CLI/CLI.hpp>

#include <iostream>

#include "commands.h"
#include "qpipe/device.h"
#include "qpipe/plugin.h"

namespace qpipe::cli {

Subcommand setupVersion(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand("version", "Print the qpipe version, plugin ABI and build fingerprint");
  return {app, [] {
            std::cout << "qpipe " << QPIPE_VERSION << "\n"
                      << "plugin ABI " << QPIPE_PLUGIN_ABI_MAJOR << "." << QPIPE_PLUGIN_ABI_MINOR << "\n"
                      << "build fingerprint " << QPIPE_BUILD_FINGERPRINT << "\n"
                      << "CUDA " << (cudaAvailable() ? "available" : "not available") << "\n";
          }};
}

}  // namespace qpipe::cli
