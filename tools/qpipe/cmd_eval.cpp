#include <CLI/CLI.hpp>
#include <c10/core/InferenceMode.h>
#include <malloc.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>

#include "commands.h"
#include "option_checks.h"
#include "qpipe/dataset.h"
#include "qpipe/device.h"
#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/log.h"
#include "qpipe/model.h"
#include "qpipe/perplexity.h"
#include "qpipe/progress.h"
#include "qpipe/quantized_checkpoint.h"
#include "qpipe/tokenizer.h"

namespace qpipe::cli {

namespace {

struct EvalOptions {
  std::string modelPath;
  std::string data;
  int64_t seqLen = 512;
  int64_t maxSamples = 0;
  int64_t batchSize = 1;
  std::string outputJson;
  std::string device = "cpu";
  bool allowNonFinite = false;
};

void evaluate(const EvalOptions& options) {
  c10::InferenceMode inference;  // no autograd bookkeeping in any forward
  const auto logger = log::logger();
  const std::filesystem::path model = options.modelPath;
  QPIPE_REQUIRE(std::filesystem::is_directory(model), ErrorCode::kInput, "--model_path '", options.modelPath,
                "' is not a folder");
  const c10::Device device = parseDevice(options.device);
  if (!options.outputJson.empty()) {  // before the evaluation, not after it
    const std::filesystem::path out = std::filesystem::absolute(options.outputJson);
    QPIPE_REQUIRE(!std::filesystem::is_directory(out), ErrorCode::kIo, "--output_json '", options.outputJson,
                  "' is a folder; give a file name");
    QPIPE_REQUIRE(std::filesystem::is_directory(out.parent_path()), ErrorCode::kIo, "--output_json '",
                  options.outputJson, "': no folder '", out.parent_path().string(), "' to write it in");
    std::error_code ec;
    QPIPE_REQUIRE(!std::filesystem::equivalent(out, options.data, ec), ErrorCode::kUsage, "--output_json '",
                  options.outputJson, "' is the --data file; writing the results would overwrite the data");
    // The files of the model qpipe reads, wherever a link to one lives.
    const auto readByModel = [](const std::filesystem::path& file) {
      const std::string name = file.filename().string();
      return name == "config.json" || name == "tokenizer.json" || name == detail::kAscendDescription ||
             name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
    };
    if (std::filesystem::exists(out, ec)) {
      for (const auto& entry : std::filesystem::directory_iterator(model, ec)) {
        QPIPE_REQUIRE(!readByModel(entry.path()) || !std::filesystem::equivalent(entry.path(), out, ec),
                      ErrorCode::kUsage, "--output_json '", options.outputJson, "' is the model's ",
                      entry.path().filename().string(), "; writing the results would overwrite it");
      }
    }
  }
  auto lm = CausalLM::open(model, {.device = device,
                                   .checkFinite = !options.allowNonFinite,
                                   .inferenceOnly = true});  // first: a broken checkpoint fails before any tokenizing
  const Tokenizer tokenizer = Tokenizer::fromFile(modelFile(model, "tokenizer.json"));
  const TokenStream stream = encodeDataset(options.data, tokenizer, {.maxSamples = options.maxSamples});
  const std::vector<int64_t>& ids = stream.ids;
  logger->info(options.data, ": ", stream.texts, " texts, ", ids.size(), " tokens");

  const int64_t windows = perplexityWindows(static_cast<int64_t>(ids.size()), options.seqLen, 0);
  QPIPE_REQUIRE(windows > 0, ErrorCode::kInput, options.data, ": ", ids.size(),
                " tokens, fewer than one window of --seq_len ", options.seqLen,
                "; give more text or a smaller --seq_len");
  ProgressBar bar("eval", windows, "windows");
  PerplexityOptions ppl{.seqLen = options.seqLen, .batchSize = options.batchSize};
  ppl.progress = [&](int64_t done, int64_t, double perplexity) {
    bar.update(done, "ppl " + std::to_string(perplexity));
    // Hand glibc's freed heap back to the system, or the peak creeps up over many windows. The
    // window's large activations are not in it: they are kept for the next window
    // (qpipe/cpu_blocks.h).
    ::malloc_trim(0);
  };
  const auto start = std::chrono::steady_clock::now();
  const PerplexityResult result =
      computePerplexity(ids, ppl, [&](const at::Tensor& window) { return lm->forward(window.to(device)); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double tokensPerSecond = static_cast<double>(result.windows * options.seqLen) / seconds;

  std::cout << "perplexity: " << result.perplexity << "\n"
            << "tokens scored: " << result.tokens << " (" << result.windows << " windows of " << options.seqLen << ")\n"
            << "tokens/s: " << tokensPerSecond << "\n";
  if (!options.outputJson.empty()) {
    const nlohmann::json json = {
        {"model", options.modelPath},      {"data", options.data},       {"seq_len", options.seqLen},
        {"perplexity", result.perplexity}, {"mean_nll", result.meanNll}, {"tokens", result.tokens},
        {"windows", result.windows},       {"seconds", seconds},         {"tokens_per_second", tokensPerSecond}};
    std::ofstream out(options.outputJson);
    QPIPE_REQUIRE(out.good(), ErrorCode::kIo, "cannot write --output_json '", options.outputJson,
                  "': ", std::strerror(errno));
    out << json.dump(2) << "\n";
    // A full disk fails the flush at the close, not the write into the stream's buffer.
    out.close();
    QPIPE_REQUIRE(!out.fail(), ErrorCode::kIo, "writing --output_json '", options.outputJson,
                  "' failed: ", std::strerror(errno));
  }
}

}  // namespace

Subcommand setupEval(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand("eval", "Perplexity of a model on a text data set (docs/data.md)");
  auto options = std::make_shared<EvalOptions>();
  app->add_option("--model_path", options->modelPath, "Model folder (config.json, safetensors, tokenizer.json)")
      ->required()
      ->check(path());
  app->add_option("--data", options->data, "Evaluation texts: .jsonl, .json or .txt")->required()->check(path());
  app->add_option("--seq_len", options->seqLen, "Window length in tokens")
      ->capture_default_str()
      ->check(wholeNumber(2, int64_t{1} << 20));
  app->add_option("--max_samples", options->maxSamples, "Use only the first N texts (0: all)")
      ->capture_default_str()
      ->check(wholeNumber(0));
  app->add_option("--batch_size", options->batchSize, "Windows per forward")
      ->capture_default_str()
      ->check(wholeNumber(1));
  app->add_option("--output_json", options->outputJson, "Also write the results to this JSON file")->check(path());
  app->add_option("--device", options->device, "cpu, cuda or cuda:N")->capture_default_str();
  app->add_flag("--allow_non_finite", options->allowNonFinite, "Load weights holding NaN or Inf (refused by default)");
  return {app, [options] { evaluate(*options); }};
}

}  // namespace qpipe::cli
