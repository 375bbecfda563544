#include "qpipe/host/quantize.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <sstream>

#include "qpipe/dataset.h"
#include "qpipe/error.h"
#include "qpipe/hash.h"
#include "qpipe/host/pipeline.h"
#include "qpipe/host/practice.h"
#include "qpipe/host/registry.h"
#include "qpipe/host/runner.h"
#include "qpipe/input_file.h"
#include "qpipe/log.h"
#include "qpipe/model.h"
#include "qpipe/sft.h"
#include "qpipe/tokenizer.h"

namespace qpipe {

namespace fs = std::filesystem;

namespace {

// The group processors are built with: its rank and world size hold from the start, its
// collectives reach the joined group (join()), which a multi-rank run joins only after every
// processor was built and accepted.
class JoinedLater final : public ProcessGroup {
 public:
  JoinedLater(int rank, int worldSize) : rank_(rank), worldSize_(worldSize) {}

  void join(std::shared_ptr<ProcessGroup> group) {
    QPIPE_CHECK(group->rank() == rank_ && group->worldSize() == worldSize_, "joined rank ", group->rank(), "/",
                group->worldSize(), " as rank ", rank_, "/", worldSize_);
    group_ = std::move(group);
  }

  int rank() const override { return rank_; }
  int worldSize() const override { return worldSize_; }
  void allReduce(at::Tensor& tensor, ReduceOp op) override { joined().allReduce(tensor, op); }
  std::vector<at::Tensor> allGather(const at::Tensor& tensor) override { return joined().allGather(tensor); }
  void broadcast(at::Tensor& tensor, int root) override { joined().broadcast(tensor, root); }
  void barrier() override { joined().barrier(); }
  std::vector<std::string> allGatherBytes(const std::string& bytes) override { return joined().allGatherBytes(bytes); }
  std::vector<std::string> allGatherBytesWithin(const std::string& bytes, int64_t slot) override {
    return joined().allGatherBytesWithin(bytes, slot);
  }
  bool exchangeInPlace(const std::vector<std::vector<at::Tensor>>& parts) override {
    return joined().exchangeInPlace(parts);
  }
  void reportFailure(const std::string& message) noexcept override {
    if (group_) group_->reportFailure(message);
  }
  Traffic traffic() const override { return group_ ? group_->traffic() : Traffic{}; }
  int64_t counterAdd(const std::string& key, int64_t delta) override { return joined().counterAdd(key, delta); }
  void storeSet(const std::string& key, const std::string& value) override { joined().storeSet(key, value); }
  std::string storeGet(const std::string& key) override { return joined().storeGet(key); }

 private:
  ProcessGroup& joined() const {
    QPIPE_CHECK(group_ != nullptr, "a collective before the ranks joined (processor factories must not call any)");
    return *group_;
  }

  int rank_;
  int worldSize_;
  std::shared_ptr<ProcessGroup> group_;
};

fs::path resolvePipeline(const QuantizeOptions& options) {
  if (!options.configPath.empty()) return options.configPath;
  const std::string ownType = ModelConfig::fromFile(modelFile(options.modelPath, "config.json")).modelType;
  const std::string modelType = options.modelType.empty() ? ownType : options.modelType;
  // Practice folders are looked up whatever the case.
  const auto caseless = [](unsigned char a, unsigned char b) { return std::tolower(a) == std::tolower(b); };
  if (!std::equal(modelType.begin(), modelType.end(), ownType.begin(), ownType.end(), caseless)) {
    log::logger()->warn("--model_type ", modelType, " picks the practice only; the model is read as its config.json's ",
                        ownType);
  }
  const PracticeMatch match = findPractice(options.practiceDir, modelType, parseQuantType(options.quantType));
  log::logger()->info("--quant_type ", options.quantType, ": practice ", match.file.string(), " (",
                      match.metadata.configId, ", score ", match.metadata.score, ")");
  return match.file;
}

// spec.runner on this many ranks (docs/pipeline.md): auto is dp_layer_wise on several ranks and
// layer_wise on one; layer_wise runs on one rank; model_wise keeps the whole model resident, on
// every rank of a multi-rank run (msmodelslim's practices name it, and must run on several).
RunnerMode runnerMode(const Pipeline& pipeline, int worldSize) {
  const std::string& runner = pipeline.runner;
  if (worldSize > 1 && runner == "layer_wise") {
    throw Error(ErrorCode::kUsage, concat(pipeline.runnerLocation.str(), ": spec.runner: ", runner,
                                          " runs on one device; use dp_layer_wise or auto for ", worldSize, " ranks"));
  }
  return runner == "model_wise" ? RunnerMode::kModelWise : RunnerMode::kLayerWise;
}

// A calibrating run on more ranks than samples: a rank without samples would never reach the
// settle points where the others wait for its observers.
std::string tooFewSamples(int64_t samples, int ranks) {
  return concat(samples, samples == 1 ? " calibration sample for " : " calibration samples for ", ranks,
                " ranks: every rank needs one; give --calib_samples ", ranks, " or more, or use fewer devices");
}

// What quantize() builds before it opens the model. The libraries stay loaded while a registry
// entry, processor or saver made from them is alive.
struct Prepared {
  Registry registry;
  PluginLoader loader{registry};
  Pipeline pipeline;
  std::shared_ptr<JoinedLater> group;
  std::vector<std::unique_ptr<Processor>> processors;
  std::vector<std::string> configWarnings;  // the pipeline's and ProcessorContext::warnIfSet's
  RunnerMode mode = RunnerMode::kLayerWise;
  fs::path pipelineFile;
  fs::path calibData;
  bool calibrates = false;  // a processor needs calibration data

  explicit Prepared(const QuantizeOptions& options) {
    QPIPE_REQUIRE(fs::is_directory(options.modelPath), ErrorCode::kInput, "--model_path '", options.modelPath.string(),
                  "' is not a folder");
    loadPlugins(loader, options.pluginPath);
    pipelineFile = resolvePipeline(options);
    pipeline = loadPipeline(pipelineFile, registry);
    mode = runnerMode(pipeline, options.worldSize);
    group = std::make_shared<JoinedLater>(options.rank, options.worldSize);
    const ProcessorContext context{.logger = log::logger(), .group = group, .savePath = options.savePath.string()};
    processors = buildProcessors(pipeline, registry, context);
    configWarnings = std::move(*context.configWarnings);
    try {
      checkPlannedOutputs(pipeline, processors, registry);
    } catch (const Error&) {
      // The run ends here, before the warnings' usual place: they may explain the refusal.
      for (const std::string& warning : configWarnings) log::logger()->warn(warning);
      throw;
    }
    calibrates = std::any_of(processors.begin(), processors.end(),
                             [](const auto& processor) { return needsCalibration(*processor); });
    if (options.worldSize > 1) {
      checkMultirank(pipeline, processors);
      // Known before any rank starts; a calibration set shorter than --calib_samples is found
      // once it is read.
      QPIPE_REQUIRE(!calibrates || options.calibSamples >= options.worldSize, ErrorCode::kUsage,
                    tooFewSamples(options.calibSamples, options.worldSize));
    }
    calibData = !options.calibData.empty()  ? options.calibData
                : !pipeline.dataset.empty() ? pipelineDataset(pipeline.dataset, pipelineFile)
                                            : options.defaultCalibData;
  }

  // spec.dataset as written, else next to the pipeline file. msmodelslim names sets of its
  // lab_calib folder (mix_calib.jsonl), which qpipe does not ship.
  static fs::path pipelineDataset(const std::string& dataset, const fs::path& pipelineFile) {
    const fs::path asWritten(dataset);
    if (fs::exists(asWritten)) return asWritten;
    const fs::path beside = pipelineFile.parent_path() / asWritten;
    QPIPE_REQUIRE(!asWritten.is_relative() || fs::exists(beside), ErrorCode::kIo, pipelineFile.string(),
                  ": spec.dataset '", dataset,
                  "' is neither a file here nor next to the pipeline (qpipe does not ship msmodelslim's lab_calib "
                  "sets); pass --calib_data FILE");
    return asWritten.is_relative() ? beside : asWritten;
  }
};

}  // namespace

// A file's name and the FNV-1a of its bytes (paths may differ between nodes, the contents not);
// for a file that may be large, its size instead of the hash.
std::string fileIdentity(const fs::path& file, bool contents) {
  if (!fs::is_regular_file(file)) return file.filename().string() + " (absent)";
  if (!contents) return file.filename().string() + " (" + std::to_string(fs::file_size(file)) + " bytes)";
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(fnv1a(readInputFile(file))));
  return file.filename().string() + " (content " + hash + ")";
}

// Launched ranks run the launcher's arguments, but ranks started another way (torchrun) are each
// given their own: ranks quantizing with other settings would each add their layers' or samples'
// share of another run. What decides the checkpoint is compared once every rank joined, in one
// gather, and every rank fails alike naming the first difference.
// The model's weights are not compared (reading them twice would cost a run's I/O), only its
// config.json; the calibration file only where the ranks calibrate on it.
void agreeOnTheRun(ProcessGroup& group, const QuantizeOptions& options, const Prepared& prepared, bool calibrates) {
  std::vector<std::pair<std::string, std::string>> items = {
      {"the pipeline", fileIdentity(prepared.pipelineFile, true)},
      {"the model's config.json", fileIdentity(options.modelPath / "config.json", true)},
      {"--calib_samples", std::to_string(options.calibSamples)},
      {"--seq_len", std::to_string(options.seqLen)},
      {"--probe_tokens", std::to_string(options.probeTokens)},
      {"--allow_non_finite", options.checkFinite ? "off" : "on"}};
  if (calibrates) items.emplace_back("the calibration data", fileIdentity(prepared.calibData, false));
  std::string mine;
  for (const auto& [what, value] : items) mine += value + '\n';
  const std::vector<std::string> all = group.allGatherBytes(mine);
  for (int r = 1; r < group.worldSize(); ++r) {
    if (all[static_cast<size_t>(r)] == all[0]) continue;
    std::istringstream ours(all[0]), theirs(all[static_cast<size_t>(r)]);
    for (const auto& item : items) {
      std::string a, b;
      std::getline(ours, a);
      std::getline(theirs, b);
      QPIPE_REQUIRE(a == b, ErrorCode::kUsage, "rank ", r, " was given ", item.first, " ", b, " and rank 0 ", a,
                    "; start every rank with the same arguments");
    }
  }
}

void checkQuantize(const QuantizeOptions& options) {
  const Prepared prepared(options);
}

QuantizeResult quantize(const QuantizeOptions& options) {
  const auto logger = log::logger();
  Prepared prepared(options);
  if (options.rank == 0) {
    for (const std::string& warning : prepared.configWarnings) logger->warn(warning);
  }
  // Inference mode skips autograd's bookkeeping, but its tensors cannot take part in a backward
  // pass: a pipeline that trains runs with gradients merely off (Processor::trains).
  const GradientScope gradients(anyTrains(prepared.processors));
  if (options.worldSize > 1) {
    QPIPE_CHECK(static_cast<bool>(options.joinGroup), "a run of ", options.worldSize, " ranks without joinGroup");
    const auto joining = std::chrono::steady_clock::now();
    prepared.group->join(options.joinGroup());
    logger->debug("joined ", options.worldSize, " ranks in ",
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - joining).count(), " s");
    agreeOnTheRun(*prepared.group, options, prepared, prepared.calibrates || anyWholeModel(prepared.processors));
  } else {
    prepared.group->join(ProcessGroup::single());
  }
  ProcessGroup& group = *prepared.group;
  const bool saves = group.rank() == 0;

  auto model = CausalLM::open(options.modelPath,
                              {.dtype = at::kFloat, .device = options.device, .checkFinite = options.checkFinite});
  const SaveStep& saving = prepared.pipeline.save.front();
  std::unique_ptr<CheckpointSaver> saver;
  if (saves) saver = prepared.registry.createSaver(saving.type, saving.config, *model, options.savePath);
  // A pipeline that trains the whole model on chat data trains on the chats (SFT); any other run
  // calibrates on windows of the text. A data-free run reads only the tokens of the report's probe,
  // on the rank that writes the report (rank 0), or none without the probe.
  const bool calibrates = prepared.calibrates;
  const bool wholeModel = anyWholeModel(prepared.processors);
  const bool probesOnly = !calibrates && !wholeModel && options.probeTokens > 0;
  const bool readsData = calibrates || wholeModel || (probesOnly && saves);
  const bool readsWindows = readsData && !probesOnly;
  const std::optional<Tokenizer> tokenizer =
      readsData ? std::optional(Tokenizer::fromFile(modelFile(options.modelPath, "tokenizer.json"))) : std::nullopt;
  std::vector<at::Tensor> samples, labels;
  std::vector<DataSample> records;
  if (wholeModel) records = loadDataset(prepared.calibData);
  if (probesOnly) {
    if (readsData) {
      const int64_t tokens = std::min(options.probeTokens, options.seqLen);
      samples.push_back(
          at::tensor(encodeDatasetPrefix(prepared.calibData, *tokenizer, tokens), at::kLong).unsqueeze(0));
      logger->info("calibration: none (a data-free pipeline); the report's probe reads the first ", tokens,
                   " tokens of ", prepared.calibData.string());
    }
  } else if (!readsData) {
    logger->info("calibration: none (a data-free pipeline, --probe_tokens 0)");
  } else if (std::any_of(records.begin(), records.end(),
                         [](const DataSample& record) { return !record.turns.empty(); })) {
    int64_t supervised = 0;
    for (SftSample& sample : sftSamples(records, *tokenizer, ChatFormat::fromModel(options.modelPath),
                                        options.calibSamples, options.seqLen)) {
      samples.push_back(std::move(sample.ids));
      labels.push_back(std::move(sample.labels));
      supervised += sample.supervised;
    }
    logger->info("training: ", samples.size(), " chats of at most ", options.seqLen, " tokens from ",
                 prepared.calibData.string(), ", their last assistant turns supervised (", supervised, " tokens)");
  } else {
    samples = calibrationWindows(encodeDataset(prepared.calibData, *tokenizer), prepared.calibData.string(),
                                 options.calibSamples, options.seqLen);
  }
  const std::vector<at::Tensor> share = rankShare(samples, group.rank(), group.worldSize());
  if (group.worldSize() > 1) {
    if (readsWindows) {
      logger->info("calibration: ", share.size(), " of ", samples.size(), " samples x ", options.seqLen,
                   " tokens from ", prepared.calibData.string());
    }
    // Every rank settles each observer at the same points of a staged forward (qpipe/staged.h),
    // which a rank without samples never reaches. All ranks see the same count and stop together.
    QPIPE_REQUIRE(!calibrates || !share.empty(), ErrorCode::kUsage,
                  tooFewSamples(static_cast<int64_t>(samples.size()), group.worldSize()));
  } else if (readsWindows && labels.empty()) {
    logger->info("calibration: ", samples.size(), " samples x ", options.seqLen, " tokens from ",
                 prepared.calibData.string());
  }

  QuantizeResult result{.saver = saving.type, .saved = saves};
  RunnerOptions runnerOptions{.group = prepared.group,
                              .mode = prepared.mode,
                              .report = saves ? &result.report : nullptr,
                              .probeTokens = options.probeTokens};
  runnerOptions.labels = rankShare(labels, group.rank(), group.worldSize());
  // Split layers (docs/scheduler.md): every rank writes the layers it executes straight into the
  // shards' data files in rank 0's partial folder, which must therefore be on a file system every
  // rank sees.
  std::unique_ptr<CheckpointSaver> segmentSaver;
  if (splitsLayers(prepared.processors, group.worldSize(), prepared.mode)) {
    segmentSaver = prepared.registry.createSaver(saving.type, saving.config, *model, options.savePath, true);
    const fs::path partial = CheckpointSaver::partialDir(options.savePath);
    group.barrier();  // rank 0's saver has made the folder
    const std::vector<std::string> seen =
        group.allGatherBytesWithin(segmentSaver && fs::is_directory(partial) ? "1" : "0", 1);
    const auto blind = std::find(seen.begin(), seen.end(), "0");
    if (blind == seen.end()) {
      runnerOptions.segments = LayerSegments{
          .write = [&segmentSaver](
                       int64_t index, const std::string& name, Module& layer,
                       const SegmentChain& chain) { return segmentSaver->writeSegment(index, name, layer, chain); },
          .adopt = [&saver](int64_t index, const std::string& segment) { saver->adoptSegment(index, segment); }};
    } else if (saves) {
      logger->info(segmentSaver ? concat("rank ", blind - seen.begin(), " does not see '", partial.string(),
                                         "': every rank runs every layer (to split them over the ranks, save to a "
                                         "file system they all share)")
                                : concat("saver '", saving.type, "' writes no segments: every rank runs every layer"));
    }
  }
  // Only where the layers can split: a calibrating run's other ranks would wait in layer 0's
  // collectives while rank 0 writes the embeddings and lm_head, which can take longer than
  // --dist_timeout on a large vocabulary.
  if (layersSplittable(prepared.processors, prepared.mode)) {
    if (runnerOptions.segments) {
      runnerOptions.nonLayerFirst = segmentSaver->writesNonLayerFirst();
      QPIPE_REQUIRE(!saver || saver->writesNonLayerFirst() == runnerOptions.nonLayerFirst, ErrorCode::kPlugin,
                    "saver '", saving.type,
                    "': its folder saver and its segment saver disagree on writesNonLayerFirst()");
    } else {
      runnerOptions.nonLayerFirst = saver && saver->writesNonLayerFirst();
    }
  }
  LayerWiseRunner runner(*model, prepared.processors, std::move(runnerOptions));
  runner.run(share, [&](int64_t index, const std::string& name, Module& layer) {
    if (saver) saver->writeLayer(index, name, layer);
  });
  if (saver) saver->addFile("quant_report.json", result.report.toJson());
  // The directory appears only once every rank got through every layer and the non-layer unit
  // (whose modules rank 0's saver writes at finish(), unless they came first).
  group.barrier();
  if (saver) saver->finish();
  return result;
}

}  // namespace qpipe
