// qpipe convert gguf: a llama.cpp GGUF back to a Hugging Face model folder (docs/convert.md).
#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "commands.h"
#include "option_checks.h"
#include "qpipe/host/gguf_convert.h"

namespace qpipe::cli {

namespace {

struct ConvertGgufOptions {
  std::string input;
  std::string output;
  std::string dtype = "float32";
  bool overwrite = false;
};

void convertGguf(const ConvertGgufOptions& options) {
  gguf::ConvertOptions convert;
  // The choices are enforced by CLI11; the mapping mirrors them.
  convert.dtype = options.dtype == "bfloat16" ? at::kBFloat16 : options.dtype == "float16" ? at::kHalf : at::kFloat;
  convert.overwrite = options.overwrite;
  gguf::convertToHf(options.input, options.output, convert);
}

}  // namespace

Subcommand setupConvert(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand("convert", "Convert a model from another format into a Hugging Face folder");
  app->require_subcommand(1);
  CLI::App* gguf = app->add_subcommand(
      "gguf",
      "A llama.cpp GGUF (Llama architecture, byte-level BPE tokenizer) to config.json, model.safetensors "
      "and tokenizer files");
  auto options = std::make_shared<ConvertGgufOptions>();
  gguf->add_option("--input", options->input, "GGUF file to read")->required()->check(path());
  gguf->add_option("--output", options->output, "Folder to create (written under a temporary name, then renamed)")
      ->required()
      ->check(path());
  gguf->add_option("--dtype", options->dtype,
                   "Weight dtype: float32 (exact dequantised values), bfloat16 or float16 (half the size, rounded)")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}))
      ->capture_default_str();
  gguf->add_flag("--overwrite", options->overwrite, "Replace an existing output folder once the new one is complete");
  return {app, [options] { convertGguf(*options); }};
}

}  // namespace qpipe::cli
