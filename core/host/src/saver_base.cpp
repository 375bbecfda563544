#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "qpipe/attention_quant.h"
#include "qpipe/error.h"
#include "qpipe/host/savers.h"
#include "qpipe/input_file.h"
#include "qpipe/json_input.h"
#include "qpipe/log.h"
#include "qpipe/quantized_checkpoint.h"
#include "saver_internal.h"

namespace qpipe {

namespace fs = std::filesystem;

namespace {

Schema saverSchema() {
  Schema schema;
  schema
      .add({.name = "part_file_size",
            .type = ValueType::kFloat,
            .help = "shard size in GB; 0 writes one file",
            .defaultValue = ConfigNode::number(4),
            .minimum = 0})
      .optional("ext", ValueType::kAny, ConfigNode::map(), "format-specific options (none are read yet)");
  return schema;
}

SaverFactory factoryFor(std::string format, bool segmentsOnly) {
  return [format, segmentsOnly](const ConfigNode& config, CausalLM& model, const fs::path& saveDir) {
    return createBuiltinSaver(
        {.format = format, .partFileSizeGb = config.at("part_file_size").asFloat(), .segmentsOnly = segmentsOnly},
        model, saveDir);
  };
}

}  // namespace

std::vector<SaverInfo> builtinSavers() {
  return {
      {kDefaultSaver, "compressed-tensors: what vLLM and transformers load", saverSchema(),
       factoryFor(kDefaultSaver, false), factoryFor(kDefaultSaver, true), detail::checkCompressedTensorsPlanned},
      {"ascendv1_saver", "msmodelslim's ascendv1 layout (vllm-ascend)", saverSchema(),
       factoryFor("ascendv1_saver", false), factoryFor("ascendv1_saver", true), detail::checkAscendV1Planned},
  };
}

std::unique_ptr<CheckpointSaver> createBuiltinSaver(const SaverOptions& options, CausalLM& model,
                                                    const fs::path& saveDir) {
  QPIPE_CHECK(options.partFileSizeGb >= 0, "part_file_size ", options.partFileSizeGb, " passed the schema");
  if (options.format == kDefaultSaver) return detail::makeCompressedTensorsSaver(options, model, saveDir);
  QPIPE_CHECK(options.format == "ascendv1_saver", "no built-in saver '", options.format, "'");
  return detail::makeAscendV1Saver(options, model, saveDir);
}

namespace detail {

namespace {

// msmodelslim counts part_file_size in GiB (save/utils/safetensors.py ONE_GB_FILE_BYTES).
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Side files of a model folder that travel with the weights (msmodelslim's copy_files rule:
// *.json, *.py, *.txt, *.jinja but no index; plus sentencepiece / tiktoken vocabularies).
bool isSideFile(const fs::path& file) {
  const std::string name = file.filename().string();
  const std::string ext = file.extension().string();
  const bool wanted =
      ext == ".json" || ext == ".py" || ext == ".txt" || ext == ".jinja" || ext == ".model" || ext == ".tiktoken";
  const bool weightsIndex = name.size() >= 10 && name.compare(name.size() - 10, 10, "index.json") == 0;
  return wanted && !weightsIndex && name != "config.json" && name != kAscendDescription;
}

// Whether lm_head is still the embedding of a tied model: a float Linear holding the embedding's
// weight (the tensor itself, or a copy of it in the compute dtype; CausalLM::prepareHead).
bool headIsEmbedding(Module& root) {
  auto* head = dynamic_cast<Linear*>(&root.getSubmodule("lm_head"));
  if (head == nullptr) return false;
  const at::Tensor& embedding = root.getSubmodule("model.embed_tokens").parameter("weight");
  const at::Tensor& weight = head->weight();
  if (weight.is_same(embedding)) return true;
  if (weight.sizes() != embedding.sizes()) return false;
  return at::equal(weight.to(embedding.device(), embedding.scalar_type()), embedding);
}

// An Attention's hook points (model.cpp), where fa3_quant puts its AttentionQuant modules.
constexpr std::array<const char*, 3> kHooks{"q_hook", "k_hook", "v_hook"};

std::optional<AttentionInputs> quantizedInputs(const Module& module) {
  if (module.findChild(kHooks[0]) == nullptr) return std::nullopt;
  const auto input = [&](const char* hook) { return dynamic_cast<AttentionQuant*>(module.findChild(hook)); };
  const AttentionInputs inputs{input(kHooks[0]), input(kHooks[1]), input(kHooks[2])};
  if (inputs.q == nullptr && inputs.k == nullptr && inputs.v == nullptr) return std::nullopt;
  return inputs;
}

// Room for a shard's header in front of its data (safetensors::WriterOptions::headerReserve), by
// the source's tensor count: a quantized Linear's weight becomes up to four tensors (weight,
// scale, zero point, input scale or shape) of about 120 header bytes each.
uint64_t headerReserve(const CausalLM& model) {
  constexpr uint64_t kPage = 4096;
  const uint64_t bytes = 16 * 1024 + 512 * static_cast<uint64_t>(model.checkpoint().names().size());
  return (bytes + kPage - 1) / kPage * kPage;
}

}  // namespace

std::string missingKvText(const AttentionInputs& inputs) {
  if (inputs.k == nullptr && inputs.v == nullptr) return "Q quantized but not K and V";
  return inputs.k == nullptr ? "V quantized but not K" : "K quantized but not V";
}

SaverBase::SaverBase(const SaverOptions& options, CausalLM& model, const fs::path& saveDir,
                     const std::string& weightsPrefix)
    : model_(model),
      writerOptions_{.filePrefix = weightsPrefix,
                     .maxShardBytes = static_cast<uint64_t>(options.partFileSizeGb * kGiB),
                     .headerReserve = headerReserve(model)},
      start_(std::chrono::steady_clock::now()),
      segmentsOnly_(options.segmentsOnly) {
  final_ = fs::absolute(saveDir).lexically_normal();
  if (final_.filename().empty()) final_ = final_.parent_path();  // "out/" names "out"
  // First: it refuses a name too long for the file system, which the calls below would throw on.
  temporary_ = CheckpointSaver::partialDir(final_);
  // A link stands for the folder it leads to: the finished checkpoint is renamed onto that folder
  // (renamed onto the link, it would fail after the whole run). A link to nothing fails now.
  if (fs::is_symlink(final_)) {
    std::error_code ec;
    const fs::path target = fs::canonical(final_, ec);
    QPIPE_REQUIRE(!ec, ErrorCode::kInput, "save path '", final_.string(), "' is a symbolic link to '",
                  fs::read_symlink(final_, ec).string(),
                  "', which does not exist; create that folder or choose another --save_path");
    final_ = target;
  }
  if (segmentsOnly_) return;  // rank 0's saver owns the folder
  std::error_code ec;
  if (fs::exists(final_)) {
    QPIPE_REQUIRE(fs::is_directory(final_), ErrorCode::kInput, "save path '", final_.string(),
                  "' exists and is not a folder; choose another --save_path");
    QPIPE_REQUIRE(fs::is_empty(final_), ErrorCode::kInput, "save folder '", final_.string(),
                  "' exists and is not empty; choose another --save_path or remove it");
  }
  const std::string busy =
      concat("another qpipe run is writing --save_path '", final_.string(), "' (its partial folder '",
             temporary_.string(), "'); wait for it or choose another --save_path");
  if (fs::exists(temporary_)) {
    // Removed under its lock, so that no run starting now takes it up meanwhile.
    const std::optional<int> stale = lockPartial(temporary_);
    QPIPE_REQUIRE(stale.has_value(), ErrorCode::kInput, busy);
    log::logger()->warn("removing '", temporary_.string(), "', left by an interrupted save");
    fs::remove_all(temporary_, ec);
    if (*stale >= 0) ::close(*stale);
    QPIPE_REQUIRE(!ec, ErrorCode::kIo, "cannot remove '", temporary_.string(), "': ", ec.message());
  }
  fs::create_directories(temporary_, ec);
  // The checkpoint is written beside the save path and renamed into place.
  QPIPE_REQUIRE(!ec, ErrorCode::kIo, "cannot write --save_path '", final_.string(), "': creating the folder '",
                temporary_.string(), "' beside it failed: ", ec.message());
  // Two runs that created it at once: one holds the lock, the other stops here, and so does one
  // whose lock is on a folder another run removed and made anew.
  const std::optional<int> lock = lockPartial(temporary_);
  QPIPE_REQUIRE(lock.has_value(), ErrorCode::kInput, busy);
  lock_ = *lock;
  struct stat locked {
  }, present{};
  QPIPE_REQUIRE(lock_ < 0 || (::fstat(lock_, &locked) == 0 && ::stat(temporary_.c_str(), &present) == 0 &&
                              locked.st_ino == present.st_ino && locked.st_dev == present.st_dev),
                ErrorCode::kInput, busy);
  writer_.emplace(temporary_, writerOptions_);
}

SaverBase::~SaverBase() {
  if (!finished_ && !segmentsOnly_) {
    writer_.reset();
    std::error_code ignored;
    fs::remove_all(temporary_, ignored);
  }
  if (lock_ >= 0) ::close(lock_);
}

void SaverBase::add(const std::string& name, const at::Tensor& tensor) {
  // A NaN scale would make a checkpoint that loads and computes NaN: nothing is saved instead. The
  // quantization parameters are checked always; the float weights unless the user allowed them.
  const bool parameter = name.ends_with("scale") || name.ends_with("offset") || name.ends_with("zero_point");
  if ((parameter || model_.options().checkFinite) && at::isFloatingType(tensor.scalar_type())) {
    QPIPE_REQUIRE(allFinite(tensor), ErrorCode::kInput, "tensor '", name,
                  "' to be saved holds NaN or Inf; nothing is saved");
  }
  if (collected_ != nullptr) {
    collected_->emplace_back(name, tensor.detach().to(at::kCPU).contiguous());
  } else {
    writer_->add(name, tensor);
  }
  bytesWritten_ += tensor.nbytes();
}

void SaverBase::writeFloat(const std::string& name, const at::Tensor& tensor) {
  const at::ScalarType dtype = model_.config().checkpointDtype;
  add(name, at::isFloatingType(tensor.scalar_type()) ? tensor.to(dtype) : tensor);
}

void SaverBase::writeModule(const std::string& prefix, Module& module, const std::string& skipPrefix) {
  const auto skipped = [&](const std::string& name) { return !skipPrefix.empty() && name.rfind(skipPrefix, 0) == 0; };
  std::set<std::string> quantized;
  for (auto& [name, child] : module.namedModules(prefix)) {
    if (skipped(name + ".")) continue;
    if (auto* linear = dynamic_cast<QuantLinear*>(child)) {
      writeQuantLinear(name, *linear);
      quantized.insert(name);
    } else if (dynamic_cast<Linear*>(child) != nullptr) {
      noteFloatLinear(name);
    } else if (dynamic_cast<RMSNorm*>(child) != nullptr && child->hasParameter("bias")) {
      noteNormBias(name);
    } else if (const std::optional<AttentionInputs> inputs = quantizedInputs(*child)) {
      writeAttentionQuant(name, *inputs);
      for (const char* hook : kHooks) {
        if (dynamic_cast<AttentionQuant*>(child->findChild(hook)) != nullptr) quantized.insert(name + "." + hook);
      }
    }
  }
  const bool dropTiedHead = model_.config().tieWordEmbeddings && !headUntied_ && skipsTiedHead();
  for (auto& [name, tensor] : module.namedParameters(prefix)) {
    const size_t dot = name.rfind('.');
    if (skipped(name) || quantized.count(dot == std::string::npos ? "" : name.substr(0, dot))) continue;
    if (dropTiedHead && name == "lm_head.weight") continue;
    writeFloat(name, *tensor);
  }
}

void SaverBase::writeUnit(int64_t index, const std::string& name, Module& module) {
  if (index != kNonLayer) {
    writeModule(name, module, "");
    return;
  }
  headUntied_ = model_.config().tieWordEmbeddings && !headIsEmbedding(module);
  nonLayerHeadUntied_ = headUntied_;
  writeModule("", module, "model.layers.");
}

void SaverBase::noteWritten(int64_t index) {
  QPIPE_CHECK(index != kNonLayer || layersWritten_.empty(), "the non-layer modules after a decoder layer");
  QPIPE_CHECK(layersWritten_.insert(index).second, "layer ", index, " written twice");
}

void SaverBase::writeLayer(int64_t index, const std::string& name, Module& layer) {
  QPIPE_CHECK(!finished_ && !segmentsOnly_, "writeLayer after finish or on a segment saver");
  noteWritten(index);
  writeUnit(index, name, layer);
}

std::string SaverBase::writeSegment(int64_t index, const std::string& name, Module& layer, const SegmentChain& chain) {
  QPIPE_CHECK(segmentsOnly_, "writeSegment(", index, ") on the saver that owns the folder");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  collected_ = &tensors;
  try {
    writeUnit(index, name, layer);
  } catch (...) {
    collected_ = nullptr;
    throw;
  }
  collected_ = nullptr;
  // The chain's texts: "<shard> <bytes>", empty for the start of the checkpoint.
  safetensors::Position start;
  const std::string after = chain.start();
  if (!after.empty()) {
    std::istringstream in(after);
    QPIPE_CHECK(static_cast<bool>(in >> start.shard >> start.bytes), "layer ", index, ": bad position '", after, "'");
  }
  const std::vector<safetensors::PlacedTensor> placed = safetensors::writePlaced(
      temporary_, writerOptions_, start, tensors,
      [&chain](safetensors::Position end) { chain.passOn(concat(end.shard, " ", end.bytes)); });
  nlohmann::json segment = {{"notes", takeNotes()}, {"tensors", nlohmann::json::array()}};
  for (const safetensors::PlacedTensor& tensor : placed) {
    segment["tensors"].push_back(
        {tensor.info.name, tensor.info.dtype, tensor.info.shape, tensor.shard, tensor.info.begin, tensor.info.end});
  }
  return segment.dump();
}

void SaverBase::adoptSegment(int64_t index, const std::string& segment) {
  QPIPE_CHECK(!finished_ && !segmentsOnly_, "adoptSegment after finish or on a segment saver");
  noteWritten(index);
  if (index == kNonLayer) {
    nonLayerHeadUntied_ = model_.config().tieWordEmbeddings && !headIsEmbedding(model_.root());
  }
  const nlohmann::json parsed = nlohmann::json::parse(segment);
  std::vector<safetensors::PlacedTensor> placed;
  for (const nlohmann::json& tensor : parsed.at("tensors")) {
    placed.push_back(
        {tensor.at(3).get<int64_t>(),
         {tensor.at(0).get<std::string>(), tensor.at(1).get<std::string>(), tensor.at(2).get<std::vector<int64_t>>(),
          tensor.at(4).get<uint64_t>(), tensor.at(5).get<uint64_t>()}});
    bytesWritten_ += placed.back().info.end - placed.back().info.begin;
  }
  writer_->adopt(placed);
  mergeNotes(parsed.at("notes").get<std::string>());
}

void SaverBase::addFile(const std::string& fileName, const std::string& content) {
  QPIPE_CHECK(!finished_, "addFile after finish");
  QPIPE_CHECK(!fileName.empty() && fileName.find('/') == std::string::npos && fileName != "." && fileName != "..",
              "addFile takes a plain file name, got '", fileName, "'");
  std::ofstream out(temporary_ / fileName, std::ios::binary | std::ios::trunc);
  out << content;
  QPIPE_REQUIRE(out.good(), ErrorCode::kIo, "cannot write '", (temporary_ / fileName).string(), "'");
}

nlohmann::ordered_json SaverBase::sourceConfig() const {
  const fs::path path = model_.directory() / "config.json";
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(readInputFile(path), jsonDepthLimit<nlohmann::ordered_json>(path.string()));
  if (headUntied_) config["tie_word_embeddings"] = false;
  return config;
}

void SaverBase::writeJson(const fs::path& path, const nlohmann::ordered_json& json) {
  std::ofstream out(path, std::ios::trunc);
  out << json.dump(2) << "\n";
  QPIPE_REQUIRE(out.good(), ErrorCode::kIo, "cannot write '", path.string(), "'");
}

void SaverBase::copySideFiles() const {
  for (const auto& entry : fs::directory_iterator(model_.directory())) {
    if (!entry.is_regular_file() || !isSideFile(entry.path())) continue;
    std::error_code ec;
    fs::copy_file(entry.path(), temporary_ / entry.path().filename(), fs::copy_options::overwrite_existing, ec);
    QPIPE_REQUIRE(!ec, ErrorCode::kIo, "cannot copy '", entry.path().string(), "': ", ec.message());
  }
}

void SaverBase::finish() {
  QPIPE_CHECK(!finished_, "finish called twice");
  const int64_t layers = model_.config().numLayers;
  for (int64_t i = 0; i < layers; ++i) QPIPE_CHECK(layersWritten_.count(i), "finish before layer ", i, " was written");
  headUntied_ = model_.config().tieWordEmbeddings && !headIsEmbedding(model_.root());
  // The decoder layers were written (and released) one by one; the rest of the model now, unless
  // it came first, when no step was to change it.
  if (!nonLayerHeadUntied_) {
    writeModule("", model_.root(), "model.layers.");
  } else {
    QPIPE_CHECK(*nonLayerHeadUntied_ == headUntied_, "lm_head changed after the non-layer modules were written first");
  }
  const size_t files = writer_->finish().size();
  copySideFiles();
  writeMetadata(temporary_);
  std::error_code ec;
  // rename(2) replaces an empty destination folder, and fails on a non-empty one.
  fs::rename(temporary_, final_, ec);
  QPIPE_REQUIRE(!ec, ErrorCode::kIo, "cannot rename '", temporary_.string(), "' to '", final_.string(),
                "': ", ec.message());
  finished_ = true;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  log::logger()->info("saved ", final_.string(), ": ", bytesWritten_ / 1e6, " MB of tensors (", files,
                      files == 1 ? " file" : " files with the index", ") in ", seconds, " s");
}

}  // namespace detail
}  // namespace qpipe
