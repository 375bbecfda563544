// learnable_scale_qat: scale-only quantization-aware training (docs/qat.md), AngelSlim's QAT with
// learnable scales, with the weights frozen, in one of two modes.
//
// end2end (AngelSlim's End2EndTrainer, mcore_qad): on the runner's whole-model unit, every matched
// Linear of the decoder layers is calibrated as linear_quant would (static activations observed on
// the first lazy_init_samples samples, float activations flowing), becomes a QatLinear, and the
// model trains on its logits: the LM loss on the samples and a distillation loss (losses.h) to the
// teacher, the same model with its quantizers bypassed under no-grad, so no second copy exists.
// The learned scales are baked into QuantLinear modules, which the savers write. Memory: the whole
// model, plus one sample's activations for the backward pass and one chunk of positions' logits of
// each side (the loss applies the lm_head itself, a chunk at a time).
//
// blockwise (AngelSlim's BlockwiseTrainer, EfficientQAT's Block-AP), per decoder layer:
//   1. the targets: the float layer's outputs on the float stream (the layer inputs of the
//      unquantized model, carried by this processor from layer to layer), or with `target: layer`
//      on the quantized inputs;
//   2. the PTQ start: every matched Linear calibrated exactly as linear_quant does with the same
//      qconfig, its scales handed to a QatLinear (fake_quant.h);
//   3. AdamW on those scales, minimising the MSE between the layer's output on its quantized inputs
//      (the runner's stream) and the targets;
//   4. the learned scales baked into QuantLinear modules, what the savers write and qpipe eval runs;
//      their outputs go on to the next layer.
// One layer is in memory at a time, as in every qpipe run, plus the float stream (one hidden state
// per calibration sample).
//
// On several ranks each rank trains on its share of the samples: a sample's gradient is taken on
// the rank that holds it, and every rank sums a step's gradients in the run's sample order, so the
// scales are the one-rank run's bit for bit (Samples, StepGradients; docs/qat.md).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fake_quant.h"
#include "losses.h"
#include "qpipe/dist/observer_sync.h"
#include "qpipe/linear_quantizer.h"
#include "qpipe/plugin.h"
#include "qpipe/progress.h"
#include "qpipe/qconfig.h"
#include "qpipe/quantized_checkpoint.h"
#include "qpipe/safetensors.h"
#include "trainer.h"

namespace qpipe::qat {
namespace {

using Clock = std::chrono::steady_clock;

struct TrainingSettings {
  double learningRate = 0;
  double lwcLearningRate = 0;
  double weightDecay = 0;
  int64_t batchSize = 1;
  int64_t accumulation = 1;
  int64_t maxSteps = -1;
  double epochs = 1;
  double warmupRatio = 0;
  Schedule schedule = Schedule::kCosine;
  double maxGradNorm = 1;
  int64_t seed = 42;
  int64_t loggingSteps = 0;
  bool bf16 = false;
};

// What one sample adds to a step: the loss it minimises, and the values logged of it (the step
// logs their mean over its samples), in a fixed order.
struct SampleLoss {
  at::Tensor loss;
  std::vector<std::pair<std::string, double>> logged;
};
using SampleLossFn = std::function<SampleLoss(size_t local)>;

// The unit's samples over every rank. Each rank holds its share (request.sampleIds says which);
// training, evaluation and the logs combine the ranks' values in the run's sample order, so N
// ranks compute what one does, bit for bit (docs/qat.md).
class Samples {
 public:
  Samples(const std::vector<int64_t>& ids, ProcessGroup& group) : group_(group) {
    at::Tensor count = at::full({1}, static_cast<int64_t>(ids.size()), at::kLong);
    if (group_.worldSize() > 1) group_.allReduce(count, ReduceOp::kSum);
    count_ = count.item<int64_t>();
    for (size_t i = 0; i < ids.size(); ++i) local_[ids[i]] = i;
  }

  // Over every rank.
  int64_t count() const { return count_; }
  // This rank's index of sample `id`, if it holds it.
  std::optional<size_t> local(int64_t id) const {
    const auto found = local_.find(id);
    return found == local_.end() ? std::nullopt : std::optional<size_t>(found->second);
  }
  // The mean of value(local index) over every sample, summed in sample order.
  double mean(const std::function<double(size_t)>& value) const {
    at::Tensor values = at::zeros({count_}, at::kDouble);
    for (const auto& [id, index] : local_) values[id] = value(index);
    combine(values);
    const double* v = values.const_data_ptr<double>();
    double sum = 0;
    for (int64_t i = 0; i < count_; ++i) sum += v[i];
    return sum / static_cast<double>(count_);
  }
  // Each row filled on the one rank that holds its sample, zeros elsewhere: the sum over ranks is
  // every rank's rows, exactly (x + 0 = x).
  void combine(at::Tensor& rows) const {
    if (group_.worldSize() > 1) group_.allReduce(rows, ReduceOp::kSum);
  }

 private:
  ProcessGroup& group_;
  int64_t count_ = 0;
  std::map<int64_t, size_t> local_;  // sample id -> this rank's index
};

// One optimizer step's gradients: a row per sample of the step (zeros where another rank holds
// the sample) of every trainable tensor's gradient, and whether the sample reached each tensor.
class StepGradients {
 public:
  StepGradients(std::vector<at::Tensor> params, int64_t samples) : params_(std::move(params)) {
    for (const at::Tensor& p : params_) width_ += p.numel();
    rows_ = at::zeros({samples, width_ + static_cast<int64_t>(params_.size())}, at::kFloat);
  }

  // Before a sample's backward pass: no gradient anywhere.
  void clear() {
    for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
  }

  // After it: the gradients it left, as row k.
  void record(int64_t k) {
    at::Tensor row = rows_[k];
    int64_t offset = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& grad = params_[i].grad();
      if (grad.defined()) {
        row.narrow(0, offset, params_[i].numel()).copy_(grad.reshape({-1}));
        row[width_ + static_cast<int64_t>(i)] = 1;
      }
      offset += params_[i].numel();
    }
  }

  // Every rank's rows combined; each tensor's gradient is then the sum of the rows in the step's
  // order, or none where no sample reached it (as after backward passes that never touched it,
  // which AdamW skips). The rows are zeroed for the next step.
  void sum(const Samples& samples) {
    samples.combine(rows_);
    at::Tensor total = rows_[0].clone();
    for (int64_t k = 1; k < rows_.size(0); ++k) total.add_(rows_[k]);
    const float* reached = total.const_data_ptr<float>() + width_;
    int64_t offset = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t n = params_[i].numel();
      params_[i].mutable_grad() =
          reached[i] > 0 ? total.narrow(0, offset, n).view_as(params_[i]).clone() : at::Tensor();
      offset += n;
    }
    rows_.zero_();
  }

 private:
  std::vector<at::Tensor> params_;
  int64_t width_ = 0;
  at::Tensor rows_;
};

std::string scientific(double value) {
  std::ostringstream out;
  out.precision(3);
  out << std::scientific << value;
  return out.str();
}

// "w int4_per_group_sym (group 64), a float": how errors name a module's quantization.
std::string describe(const QuantLinear& linear) {
  const quant::QScheme& weight = linear.weightScheme();
  return concat("w ", weight.name(), weight.groupSize > 0 ? concat(" (group ", weight.groupSize, ")") : "", ", a ",
                linear.inputQuant() ? linear.inputQuant()->scheme.name() : "float");
}

// The same for a qconfig.
std::string describe(const quant::LinearQConfig& config) {
  const quant::QScheme& weight = config.weight.scheme;
  return concat("w ", weight.name(), weight.groupSize > 0 ? concat(" (group ", weight.groupSize, ")") : "", ", a ",
                config.act.enabled() ? config.act.scheme.name() : "float");
}

double meanSquaredError(const at::Tensor& value, const at::Tensor& target) {
  return at::mse_loss(value.to(at::kFloat), target.to(at::kFloat)).item<double>();
}

// from_ptq_ckpt: the quantized Linear modules of a checkpoint qpipe wrote (compressed-tensors or
// ascendv1), read as `qpipe eval` reads them, found by module name or by a suffix of it (a
// checkpoint saved with or without a leading "model." or another wrapper's prefix).
class PtqCheckpoint {
 public:
  explicit PtqCheckpoint(const std::filesystem::path& dir) : dir_(dir.string()) {
    format_ = detail::QuantizedCheckpoint::detect(dir);
    QPIPE_REQUIRE(format_ != nullptr, ErrorCode::kInput, "from_ptq_ckpt '", dir_,
                  "' is not a quantized checkpoint (no quantization_config in its config.json, no ",
                  detail::kAscendDescription, ")");
    weights_ = safetensors::Checkpoint::open(dir, format_->weightsPrefix());
    for (const std::string& name : weights_.names()) {
      for (const std::string_view suffix : {".weight_packed", ".weight"}) {
        if (name.ends_with(suffix)) {
          stored_.push_back(name.substr(0, name.size() - suffix.size()));
          break;
        }
      }
    }
  }

  const std::string& dir() const { return dir_; }

  // Module `name`'s PTQ module, or nullptr where the checkpoint has none or keeps it in float.
  std::shared_ptr<QuantLinear> linear(const std::string& name, bool hasBias) const {
    const std::string* stored = find(name);
    if (stored == nullptr) return nullptr;
    return format_->linear(
        *stored, hasBias, [this](const std::string& tensor) { return weights_.tensor(tensor); },
        [this](const std::string& tensor) { return weights_.contains(tensor); }, at::kFloat);
  }

  // The quantization of attention `name`'s input 'q', 'k' or 'v' (`heads` heads), or nullptr where
  // the checkpoint keeps it in float; the attention is found by its k_proj.
  std::shared_ptr<AttentionQuant> attention(const std::string& name, char input, int64_t heads) const {
    constexpr std::string_view kProj = ".k_proj";
    const std::string* stored = find(name + std::string(kProj));
    if (stored == nullptr) return nullptr;
    return format_->attentionInput(stored->substr(0, stored->size() - kProj.size()), input, heads,
                                   [this](const std::string& tensor) { return weights_.tensor(tensor); });
  }

 private:
  // The stored name of module `name`: itself, or one that is a suffix of it or it of.
  const std::string* find(const std::string& name) const {
    const std::string* stored = nullptr;
    for (const std::string& candidate : stored_) {
      if (candidate == name) return &candidate;
      if (name.ends_with("." + candidate) || candidate.ends_with("." + name)) stored = &candidate;
    }
    return stored;
  }

  std::string dir_;
  std::unique_ptr<detail::QuantizedCheckpoint> format_;
  safetensors::Checkpoint weights_;
  std::vector<std::string> stored_;  // module names with a weight
};

// The scales artifact: every trained module's state (QatLinear::state, "<module>.<tensor>") in one
// safetensors file beside the checkpoint, with the qconfig it was trained for in its metadata. A
// run given it as resume_from starts from those scales (and clip factors) instead of calibrating,
// and with max_steps 0 exports them again without training.
//
// A training state (save_steps) is such a file saved in the middle of training: the finished
// units' trained state, the current unit's start state under the same names, its trainable tensors
// after `step` steps ("train.<i>") and AdamW's state ("optimizer.<name>"), with the unit, the step,
// the finished units and the settings in its metadata. A run resuming from it skips the finished
// units' training, continues the current unit at its step, and so ends where the saving run would.
constexpr std::string_view kQconfigKey = "qpipe.qat.qconfig";
constexpr std::string_view kStateUnitKey = "qpipe.qat.state.unit";
constexpr std::string_view kStateStepKey = "qpipe.qat.state.step";
constexpr std::string_view kStateSamplesKey = "qpipe.qat.state.samples";
constexpr std::string_view kStateFinishedKey = "qpipe.qat.state.finished";
constexpr std::string_view kStateSettingsKey = "qpipe.qat.state.settings";

class ScalesArtifact {
 public:
  // `settings`: the run's settings that decide the training (settingsOf), which a training state's
  // must equal.
  ScalesArtifact(const std::filesystem::path& path, const std::string& qconfig, const std::string& settings)
      : file_(safetensors::File::open(path)) {
    const auto stored = file_->metadata().find(std::string(kQconfigKey));
    QPIPE_REQUIRE(stored != file_->metadata().end(), ErrorCode::kInput, "resume_from '", path.string(),
                  "' is not a scales artifact of learnable_scale_qat (no ", kQconfigKey, " in its metadata)");
    QPIPE_REQUIRE(stored->second == qconfig, ErrorCode::kConfig, "resume_from '", path.string(),
                  "' holds scales trained for ", stored->second, ", but the qconfig asks for ", qconfig);
    if (!metadata(kStateUnitKey)) return;
    unit_ = *metadata(kStateUnitKey);
    step_ = std::stoll(required(kStateStepKey));
    samples_ = std::stoll(required(kStateSamplesKey));
    std::istringstream finished(required(kStateFinishedKey));
    for (std::string unit; std::getline(finished, unit, ',');) finished_.push_back(unit);
    std::istringstream saved(required(kStateSettingsKey)), ours(settings);
    for (std::string a, b;; a.clear(), b.clear()) {
      const bool savedLine = static_cast<bool>(std::getline(saved, a));
      if (!static_cast<bool>(std::getline(ours, b)) && !savedLine) break;
      QPIPE_REQUIRE(a == b, ErrorCode::kConfig, "resume_from '", path.string(), "' is a training state saved with '", a,
                    "', but this run has '", b, "': continuing it needs the settings it was saved with");
    }
  }

  const std::string path() const { return file_->path().string(); }
  // Tensor `name` (a copy), or undefined when the artifact lacks it.
  at::Tensor tensor(const std::string& name) const {
    return file_->find(name) != nullptr ? file_->tensor(name).clone() : at::Tensor();
  }

  // A training state: true when it was saved after `unit` finished training.
  bool finished(const std::string& unit) const {
    return std::find(finished_.begin(), finished_.end(), unit) != finished_.end();
  }
  // A training state saved while `unit` trained, `samples` samples a step: the steps it had taken.
  std::optional<int64_t> stepsOf(const std::string& unit, int64_t samples) const {
    if (!unit_ || *unit_ != unit) return std::nullopt;
    QPIPE_REQUIRE(samples == samples_, ErrorCode::kConfig, "resume_from '", path(), "' is a training state of ",
                  samples_, " samples, but this run trains on ", samples);
    return step_;
  }

 private:
  std::optional<std::string> metadata(std::string_view key) const {
    const auto found = file_->metadata().find(std::string(key));
    return found == file_->metadata().end() ? std::nullopt : std::optional<std::string>(found->second);
  }
  std::string required(std::string_view key) const {
    const std::optional<std::string> value = metadata(key);
    QPIPE_REQUIRE(value.has_value(), ErrorCode::kInput, "resume_from '", path(), "' is a training state without ", key);
    return *value;
  }

  std::shared_ptr<const safetensors::File> file_;
  std::optional<std::string> unit_;  // set on a training state
  int64_t step_ = 0, samples_ = 0;
  std::vector<std::string> finished_;
};

// The settings that decide a training's course, one "key: value" line each: the processor's
// configuration without the keys that only say where things are written or whence it resumes.
std::string settingsOf(const ConfigNode& config) {
  std::string lines;
  for (const auto& [key, value] : config.entries()) {
    if (key == "resume_from" || key == "save_steps" || key == "logging_steps" || key == "logging_file") continue;
    std::string yaml = value.toYaml();
    while (!yaml.empty() && std::isspace(static_cast<unsigned char>(yaml.back()))) yaml.pop_back();
    std::replace(yaml.begin(), yaml.end(), '\n', ' ');
    lines += key + ": " + yaml + "\n";
  }
  return lines;
}

// While it lives, the model's lm_head is a HookPoint, so the model's forward ends at the final
// norm; head() is the real lm_head for the loss to apply a chunk of positions at a time (losses.h).
class DetachedHead {
 public:
  explicit DetachedHead(Module& model)
      : model_(model),
        vocab_(model.getSubmodule("model.embed_tokens").parameter("weight").size(0)),
        lmHead_(model.replace("lm_head", std::make_shared<HookPoint>())) {}
  ~DetachedHead() { model_.replace("lm_head", lmHead_); }
  DetachedHead(const DetachedHead&) = delete;
  DetachedHead& operator=(const DetachedHead&) = delete;

  Module& lmHead() const { return *lmHead_; }

  Head head() const {
    return {.apply =
                [lmHead = lmHead_](const at::Tensor& rows) {
                  // A float head may still hold the checkpoint's dtype (the model converts it on
                  // its first use, which this forward skips).
                  if (auto* linear = dynamic_cast<Linear*>(lmHead.get());
                      linear != nullptr && linear->weight().scalar_type() != rows.scalar_type()) {
                    linear->weight() = linear->weight().to(rows.scalar_type());
                  }
                  return (*lmHead)(rows);
                },
            .vocab = vocab_};
  }

 private:
  Module& model_;
  int64_t vocab_;
  std::shared_ptr<Module> lmHead_;
};

class LearnableScaleQat final : public Processor {
 public:
  LearnableScaleQat(const ConfigNode& config, const ProcessorContext& context)
      : context_(context),
        qconfig_(quant::parseLinearQConfig(config.at("qconfig"), context.fieldPath("qconfig"),
                                           context.configWarnings.get())),
        filter_(context.moduleFilter(config)) {
    end2end_ = config.at("training_mode").asString() == "end2end";
    try {
      loss_ = parseLoss(config.at("loss_type").asString(), config.at("loss_topk").asInt());
    } catch (const Error& error) {
      throw context.configError(config, "loss_type", error.what());
    }
    loss_.temperature = config.at("kd_temperature").asFloat();
    loss_.lmWeight = config.at("lm_loss_weight").asFloat();
    loss_.kdWeight = config.at("kd_loss_weight").asFloat();
    if (end2end_ && loss_.lmWeight <= 0 && !loss_.distills()) {
      throw context.configError(config, "lm_loss_weight",
                                loss_.type == LossType::kOrigin
                                    ? "nothing to minimise: it is 0, and loss_type origin has no distillation term"
                                    : "nothing to minimise: lm_loss_weight and kd_loss_weight are both 0");
    }
    lazyInitSamples_ = config.at("lazy_init_samples").asInt();
    activationInit_ = config.at("activation_scale_init_value").asFloat();
    for (const auto* side : {&qconfig_.weight, &qconfig_.act}) {
      if (side->enabled() && !side->scheme.symmetric) {
        throw context.configError(config, "qconfig", "learnable scales take symmetric schemes (symmetric: True)");
      }
    }
    if (activationInit_ > 0 && quant::isFp4(qconfig_.act.scheme.dtype)) {
      throw context.configError(config, "activation_scale_init_value",
                                "applies to int8 and fp8_e4m3 static activations; " +
                                    std::string(quant::qdtypeName(qconfig_.act.scheme.dtype)) +
                                    " activations have no input scale");
    }
    const ConfigNode& learnable = config.at("plugin_config").at("quant_config").at("learnable");
    trainKv_ = learnable.at("kv_scale").asBool();
    trainNorms_ = learnable.at("norm").asBool();
    options_.learnable = {.weightScale = learnable.at("weight_scale").asBool(),
                          .actScale = learnable.at("act_scale").asBool(),
                          .lwc = learnable.at("lwc").asBool()};
    if (options_.learnable.lwc && qconfig_.weight.scheme.scope == quant::QScope::kPerTensor) {
      throw context.configError(config, "plugin_config.quant_config.learnable.lwc",
                                "learnable weight clipping takes per_channel or per_group weights");
    }
    if (options_.learnable.lwc && quant::isFp4(qconfig_.weight.scheme.dtype)) {
      throw context.configError(config, "plugin_config.quant_config.learnable.lwc",
                                "learnable weight clipping takes int and fp8_e4m3 weights; nvfp4 and mxfp4 train "
                                "their block scales (weight_scale)");
    }
    const bool staticActs = qconfig_.act.enabled() && !qconfig_.act.isDynamic();
    if (!options_.learnable.weightScale && !options_.learnable.lwc && !(options_.learnable.actScale && staticActs) &&
        !trainKv_) {
      throw context.configError(
          config, "plugin_config.quant_config.learnable",
          "nothing to train: enable weight_scale, lwc, kv_scale, or act_scale with static activations");
    }
    options_.ste = config.at("ste").asString() == "lsq" ? Ste::kLsq : Ste::kAngelSlim;
    options_.param =
        config.at("scale_parametrization").asString() == "absolute" ? ScaleParam::kAbsolute : ScaleParam::kRelative;
    options_.lwcInit = config.at("lwc_init_value").asFloat();
    training_ = {.learningRate = config.at("learning_rate").asFloat(),
                 .lwcLearningRate = config.at("lwc_lr").asFloat(),
                 .weightDecay = config.at("weight_decay").asFloat(),
                 .batchSize = config.at("per_device_train_batch_size").asInt(),
                 .accumulation = config.at("gradient_accumulation_steps").asInt(),
                 .maxSteps = config.at("max_steps").asInt(),
                 .epochs = config.at("num_train_epochs").asFloat(),
                 .warmupRatio = config.at("warmup_ratio").asFloat(),
                 .schedule = parseSchedule(config.at("lr_scheduler_type").asString()),
                 .maxGradNorm = config.at("max_grad_norm").asFloat(),
                 .seed = config.at("seed").asInt(),
                 .loggingSteps = config.at("logging_steps").asInt(),
                 .bf16 = config.at("bf16").asBool()};
    if (const std::string& resume = config.at("resume_from").asString(); !resume.empty()) {
      if (!std::filesystem::is_regular_file(resume)) {
        throw context.configError(config, "resume_from", concat("'", resume, "' is not a file"));
      }
      resume_.emplace(resume, qconfig_.describe(), settingsOf(config));
    }
    const bool exportOnly = resume_ && training_.maxSteps == 0;
    if (!exportOnly && training_.maxSteps <= 0 && training_.epochs <= 0) {
      throw context.configError(config, "num_train_epochs",
                                "no training: set num_train_epochs > 0 or max_steps > 0 (max_steps 0 with resume_from "
                                "exports the artifact's scales)");
    }
    floatStreamTarget_ = config.at("target").asString() == "float_stream";
    warnOfNoEffect(config, context, staticActs);
    if (const std::string& ptq = config.at("from_ptq_ckpt").asString(); !ptq.empty()) {
      if (!std::filesystem::is_directory(ptq)) {
        throw context.configError(config, "from_ptq_ckpt", concat("'", ptq, "' is not a folder"));
      }
      ptqCheckpoint_.emplace(ptq);
    }
    logPath_ = config.at("logging_file").asString();
    if (!context.savePath.empty()) {
      std::filesystem::path save = std::filesystem::absolute(context.savePath);  // a relative one has no parent
      if (save.filename().empty()) save = save.parent_path();
      if (logPath_.empty()) logPath_ = save.string() + ".qat_log.jsonl";
      scalesPath_ = save.string() + ".qat_scales.safetensors";
      statePath_ = save.string() + ".qat_state.safetensors";
    }
    saveSteps_ = config.at("save_steps").asInt();
    // Raised when a run starts, not here: `qpipe check` builds the step without a save path.
    if (saveSteps_ > 0 && context.savePath.empty()) {
      noSavePath_ = context.configError(config, "save_steps", "a training state is saved beside --save_path; give one");
    }
    settings_ = settingsOf(config);
  }

  // Fields of the other training mode, or of what this qconfig and learnable set leave out: a
  // pipeline that sets them expects something this run does not do.
  void warnOfNoEffect(const ConfigNode& config, const ProcessorContext& context, bool staticActs) const {
    const char* mode = end2end_ ? "end2end" : "blockwise";
    const auto otherMode = [&](std::initializer_list<const char*> fields) {
      for (const char* field : fields) {
        context.warnIfSet(config.at(field), field,
                          concat("has no effect in ", mode,
                                 " training (training_mode: ", end2end_ ? "blockwise" : "end2end", " uses it)"));
      }
    };
    if (end2end_) {
      otherMode({"target"});
    } else {
      otherMode({"loss_type", "loss_topk", "kd_temperature", "lm_loss_weight", "kd_loss_weight", "lazy_init_samples"});
    }
    if (end2end_ && loss_.type != LossType::kKd) {
      context.warnIfSet(config.at("kd_temperature"), "kd_temperature",
                        concat("has no effect with loss_type ", loss_.name, " (loss_type kd uses it)"));
    }
    const ConfigNode& learnable = config.at("plugin_config").at("quant_config").at("learnable");
    if (!staticActs) {
      context.warnIfSet(learnable.at("act_scale"), "plugin_config.quant_config.learnable.act_scale",
                        "has no effect: the qconfig has no static activations, so there is no input scale to train");
    }
    if (!options_.learnable.lwc) {
      for (const char* field : {"lwc_lr", "lwc_init_value"}) {
        context.warnIfSet(config.at(field), field, "has no effect without plugin_config.quant_config.learnable.lwc");
      }
    }
  }

  void preRun() override {
    if (noSavePath_) throw *noSavePath_;
    if (context_.group->rank() != 0) return;  // rank 0 writes the artifact and the log
    if (!scalesPath_.empty()) {
      const std::filesystem::path path(scalesPath_);
      scales_ = std::make_unique<safetensors::Writer>(
          path.parent_path(),
          safetensors::WriterOptions{
              .filePrefix = path.filename().string().substr(0, path.filename().string().size() - 12),
              .metadata = {{std::string(kQconfigKey), qconfig_.describe()},
                           {"qpipe.qat.training_mode", end2end_ ? "end2end" : "blockwise"}}});
    }
    if (!logPath_.empty()) {
      log_.open(logPath_, std::ios::trunc);
      QPIPE_REQUIRE(log_.good(), ErrorCode::kIo, "learnable_scale_qat: cannot write its training log '", logPath_, "'");
      log_.precision(9);
    }
  }

  void process(LayerRequest& request) override {
    if (request.wholeModel) {
      trainModel(request);
      return;
    }
    if (isNonLayerUnit(request)) return;  // blockwise trains decoder layers (docs/qat.md)
    const auto start = Clock::now();
    device_ = request.inputs.front().front().device().type();
    startFromPtq(request, [&request] { request.forward(request); });
    startAttention(request);
    startNorms(request);
    std::vector<TensorList> floatInputs = request.inputs;
    if (floatStreamTarget_ && !floatStream_.empty()) {
      QPIPE_CHECK(floatStream_.size() == floatInputs.size(), "float stream of ", floatStream_.size(), " samples for ",
                  floatInputs.size());
      for (size_t s = 0; s < floatInputs.size(); ++s) floatInputs[s][0] = floatStream_[s];
    }
    std::vector<at::Tensor> targets;
    {
      const Bypass bypass(*this);  // the float layer, including what earlier steps quantized
      targets = forwardAll(request, std::move(floatInputs));
    }
    if (entries_.empty() && trainedAttentions() == 0) {
      deploy(request);
      request.forward(request);
    } else {
      const Samples samples(request.sampleIds, *context_.group);
      const double before = meanError(samples, forwardAll(request, request.inputs), targets);
      const int64_t steps = train(request.name, samples, {"loss"}, [&](size_t sample) -> SampleLoss {
        const at::Tensor loss = at::mse_loss(forwardOne(request, request.inputs[sample]).to(at::kFloat),
                                             targets[sample].to(at::kFloat));
        return {loss, {{"loss", loss.item<double>()}}};
      });
      const int64_t trainedKv = trainedAttentions();
      saveScales(request.name);
      deploy(request);
      request.forward(request);  // the deployed modules' outputs: the next layer's inputs
      std::vector<at::Tensor> outputs;
      for (const TensorList& output : request.outputs) outputs.push_back(output[0]);
      const double after = meanError(samples, outputs, targets);
      request.report(request.name, "qat:mse_ptq", before);
      request.report(request.name, "qat:mse_qat", after);
      request.report(request.name, "qat:steps", static_cast<double>(steps));
      context_.logger->info("learnable_scale_qat: ", request.name, ": ", entries_.size(), " Linear",
                            trainKv_ ? concat(", ", trainedKv, " K/V scales") : "", ", ", steps, " steps, output mse ",
                            scientific(before), " (PTQ) -> ", scientific(after), " (QAT, ",
                            before > 0 ? static_cast<int>(std::lround(100 * (after - before) / before)) : 0, "%), ",
                            std::chrono::duration<double>(Clock::now() - start).count(), " s");
      totalSteps_ += steps;
      trained_ += static_cast<int64_t>(entries_.size());
      trainedKv_ += trainedKv;
      sumBefore_ += before;
      sumAfter_ += after;
    }
    entries_.clear();
    if (floatStreamTarget_) floatStream_ = std::move(targets);
  }

  void postRun() override {
    if (scales_) {
      scales_->finish();
      scales_.reset();
    }
    if (resume_) {
      context_.logger->info("learnable_scale_qat: ", resumed_, " modules start from the scales in '", resume_->path(),
                            "'",
                            calibratedNames_.empty() ? std::string()
                                                     : concat("; ", calibratedNames_.size(), " it lacks were calibrated"));
    }
    if (ptqCheckpoint_) {
      std::string missing;
      for (size_t i = 0; i < calibratedNames_.size() && i < 3; ++i) missing += (i ? ", " : "") + calibratedNames_[i];
      if (calibratedNames_.size() > 3) missing += ", …";
      context_.logger->info("learnable_scale_qat: ", loaded_, " modules start from the scales in '",
                            ptqCheckpoint_->dir(), "'",
                            calibratedNames_.empty()
                                ? std::string()
                                : concat("; ", calibratedNames_.size(), " it lacks were calibrated (", missing, ")"));
    }
    if (!initializedNames_.empty()) {
      context_.logger->info("learnable_scale_qat: ", initializedNames_.size(),
                            " modules no calibration sample reached start from activation_scale_init_value ",
                            activationInit_, " (", initializedNames_.front(), initializedNames_.size() > 1 ? ", …" : "",
                            ")");
      initializedNames_.clear();
    }
    context_.logger->info("learnable_scale_qat: ", trained_, " Linear modules",
                          trainKv_ ? concat(" and ", trainedKv_, " K/V scales") : "", " trained in ", totalSteps_,
                          " steps (", qconfig_.describe(), "); ", end2end_ ? "total loss " : "summed layer output mse ",
                          scientific(sumBefore_), " (PTQ) -> ", scientific(sumAfter_), " (QAT)",
                          logPath_.empty() ? "" : "; steps in ", logPath_, scalesPath_.empty() ? "" : "; scales in ",
                          scalesPath_);
    floatStream_.clear();
  }

  bool trains() const override { return true; }
  // Every rank trains on its samples, and the steps combine them in the run's order (Samples).
  bool supportDistributed() const override { return true; }
  PlannedOutputs plannedOutputs() const override {
    return {.linears = {{qconfig_.weight.scheme, PlannedOutputs::quantized(qconfig_.act.scheme)}}};
  }
  bool wholeModel() const override { return end2end_; }

 private:
  struct Entry {
    std::string path;
    std::string name;
    std::shared_ptr<QatLinear> qat;
  };

  // An AttentionQuant of the unit (fa3_quant's) under QAT: `name` is its checkpoint name,
  // <attention>.k_scale, and `trains` whether its scale does (learnable.kv_scale, K and V).
  struct AttentionEntry {
    std::string path;
    std::string name;
    std::shared_ptr<QatAttentionQuant> qat;
    bool trains;
  };

  // learnable.norm: an RMSNorm weight of the unit that trains with the scales, and its start.
  struct NormEntry {
    std::string name;
    RMSNorm* module;
    at::Tensor initial;
  };

  // While it lives, the unit is the float model: every QatLinear computes the float Linear's
  // output, every QatAttentionQuant passes its input through, and every trained norm has its start back.
  class Bypass {
   public:
    explicit Bypass(LearnableScaleQat& qat) : qat_(qat) { set(true); }
    ~Bypass() { set(false); }
    Bypass(const Bypass&) = delete;
    Bypass& operator=(const Bypass&) = delete;

   private:
    void set(bool bypassed) {
      for (Entry& entry : qat_.entries_) entry.qat->setBypassed(bypassed);
      for (AttentionEntry& entry : qat_.attentions_) entry.qat->setBypassed(bypassed);
      for (size_t i = 0; i < qat_.norms_.size(); ++i) {
        at::Tensor& weight = qat_.norms_[i].module->parameter("weight");
        if (bypassed) {
          trained_.push_back(std::exchange(weight, qat_.norms_[i].initial));
        } else {
          weight = trained_[i];
        }
      }
    }

    LearnableScaleQat& qat_;
    std::vector<at::Tensor> trained_;
  };

  int64_t trainedAttentions() const {
    return std::count_if(attentions_.begin(), attentions_.end(), [](const AttentionEntry& e) { return e.trains; });
  }

  // Every AttentionQuant of the decoder layers in the unit (an earlier fa3_quant step's) becomes a
  // QatAttentionQuant: rounding has a zero gradient, so without the straight-through estimator
  // nothing before K and V would learn. With kv_scale, the static K and V ones the filter matches
  // (as <attention>.fa_k, fa_v) train, from resume_from's or from_ptq_ckpt's scales where they have them.
  void startAttention(LayerRequest& request) {
    std::vector<std::pair<std::string, AttentionQuant*>> found;
    for (auto& [path, module] : request.module->namedModules()) {
      if (auto* quant = dynamic_cast<AttentionQuant*>(module); quant != nullptr) found.emplace_back(path, quant);
    }
    for (const auto& [path, quant] : found) {
      const std::string hook = moduleName(request, path);  // model.layers.0.self_attn.k_hook
      const std::string attention = hook.substr(0, hook.rfind('.'));
      const char input = hook[attention.size() + 1];
      const std::string name = concat(attention, ".", input, "_scale");
      QPIPE_REQUIRE(quant->scheme().symmetric, ErrorCode::kConfig, "learnable_scale_qat: ", attention, ".fa_", input,
                    " is quantized as ", quant->scheme().name(), " by an earlier step; QAT takes symmetric schemes");
      const bool trains =
          trainKv_ && input != 'q' && !quant->isDynamic() && filter_->matches(concat(attention, ".fa_", input));
      std::shared_ptr<AttentionQuant> start;
      if (trains) start = attentionStart(attention, input, name, *quant);
      attentions_.push_back(
          {path, name, std::make_shared<QatAttentionQuant>(start ? *start : *quant, options_, trains), trains});
      request.module->replace(path, attentions_.back().qat);
    }
    QPIPE_REQUIRE(!trainKv_ || trainedAttentions() > 0, ErrorCode::kConfig, "learnable_scale_qat: kv_scale is on, but ",
                  request.wholeModel ? "the model" : request.name,
                  " has no static K/V quantization to train; put fa3_quant (details fa_k and fa_v, per_head or "
                  "per_tensor) before this step");
  }

  // The start of a trained K/V scale: resume_from's, else from_ptq_ckpt's, else `calibrated`
  // (nullptr: keep it).
  std::shared_ptr<AttentionQuant> attentionStart(const std::string& attention, char input, const std::string& name,
                                                 AttentionQuant& calibrated) {
    const at::Tensor scale = calibrated.params().scale;
    if (resume_) {
      const at::Tensor resumed = resume_->tensor(name);
      if (resumed.defined()) {
        QPIPE_REQUIRE(resumed.sizes() == scale.sizes(), ErrorCode::kInput, "resume_from '", resume_->path(),
                      "': ", name, " has shape ", resumed.sizes(), ", this model's ", scale.sizes());
        ++resumed_;
        return std::make_shared<AttentionQuant>(
            calibrated.scheme(), quant::QParams{resumed, at::zeros_like(resumed, resumed.options().dtype(at::kInt))});
      }
    } else if (ptqCheckpoint_) {
      const int64_t heads = scale.dim() == 4 ? scale.size(1) : 1;
      std::shared_ptr<AttentionQuant> stored = ptqCheckpoint_->attention(attention, input, heads);
      if (stored != nullptr) {
        QPIPE_REQUIRE(stored->scheme().name() == calibrated.scheme().name(), ErrorCode::kConfig, "from_ptq_ckpt '",
                      ptqCheckpoint_->dir(), "': ", name, " is quantized there as ", stored->scheme().name(),
                      ", but the earlier fa3_quant step as ", calibrated.scheme().name());
        ++loaded_;
        return stored;
      }
    }
    if (resume_ || ptqCheckpoint_) calibratedNames_.push_back(name);
    return nullptr;
  }

  // After training: the deployed QuantLinear and AttentionQuant modules in place of the QAT ones,
  // once the ranks are seen to agree on what they trained.
  void deploy(LayerRequest& request) {
    checkReplicasAgree();
    finishNorms();
    for (const Entry& e : entries_) request.module->replace(e.path, e.qat->deploy());
    for (const AttentionEntry& e : attentions_) request.module->replace(e.path, e.qat->deploy());
    attentions_.clear();
  }

  // On several ranks, every rank's trained tensors (scales, clip factors, K/V scales, norms) must be
  // rank 0's bit for bit: a difference is an error on every rank, never ranks that write different
  // checkpoints or a rank 0 that writes its own.
  void checkReplicasAgree() {
    std::vector<std::string> names;
    std::vector<at::Tensor> tensors;
    for (const Entry& e : entries_) {
      for (const auto& [key, tensor] : e.qat->state()) {
        names.push_back(e.name + "." + key);
        tensors.push_back(tensor);
      }
    }
    for (const AttentionEntry& e : attentions_) {
      if (!e.trains) continue;
      names.push_back(e.name);
      tensors.push_back(e.qat->scale());
    }
    for (const NormEntry& norm : norms_) {
      names.push_back(norm.name + ".weight");
      tensors.push_back(norm.module->parameter("weight"));
    }
    const int64_t index = firstReplicaDifference(tensors, *context_.group);
    QPIPE_REQUIRE(index < 0, ErrorCode::kInternal, "learnable_scale_qat: the trained ",
                  index < 0 ? "" : names[static_cast<size_t>(index)],
                  " differs between ranks (rank 0's against another's): data-parallel training diverged; "
                  "please report it with the pipeline");
  }

  // learnable.norm: every RMSNorm of the unit (of the decoder layers and model.norm, for the whole
  // model) trains from now on, from the scales artifact's value where it has one (norms_).
  void startNorms(LayerRequest& request) {
    if (!trainNorms_) return;
    for (auto& [path, module] : request.module->namedModules()) {
      auto* norm = dynamic_cast<RMSNorm*>(module);
      if (norm == nullptr) continue;
      const std::string name = moduleName(request, path);
      at::Tensor& weight = norm->parameter("weight");
      at::Tensor start = resume_ ? resume_->tensor(name + ".weight") : at::Tensor();
      norms_.push_back({name, norm, weight});
      weight = start.defined() ? start.to(weight.dtype()) : weight.detach().clone();
      weight.set_requires_grad(true);
    }
  }

  // After training: the norms keep what they learned, as plain tensors.
  void finishNorms() {
    for (NormEntry& norm : norms_) norm.module->parameter("weight") = norm.module->parameter("weight").detach();
    norms_.clear();
  }

  // end2end on the whole-model unit: the PTQ start, training on the logits, the baked modules.
  void trainModel(LayerRequest& request) {
    const auto start = Clock::now();
    device_ = request.inputs.front().front().device().type();
    const Samples samples(request.sampleIds, *context_.group);
    const DetachedHead detached(*request.module);
    const Head head = detached.head();
    startFromPtq(request, [&] {  // the run's first lazy_init_samples samples, wherever they are
      for (size_t s = 0; s < request.inputs.size(); ++s) {
        if (request.sampleIds[s] < lazyInitSamples_) forwardOne(request, request.inputs[s]);
      }
    });
    QPIPE_REQUIRE(!entries_.empty(), ErrorCode::kConfig,
                  "learnable_scale_qat: no Linear of the decoder layers matches its include/exclude; nothing to train");
    startAttention(request);
    startNorms(request);
    // Rounding an activation has a zero gradient (and an int8 GEMM none): a module quantized that
    // way which this step does not train would stop the gradient of everything before it.
    std::vector<std::pair<std::string, Module*>> modules = request.module->namedModules();
    modules.emplace_back("lm_head", &detached.lmHead());
    for (auto& [name, module] : modules) {
      const auto* quantized = dynamic_cast<QuantLinear*>(module);
      QPIPE_REQUIRE(quantized == nullptr || !quantized->inputQuant(), ErrorCode::kConfig, "learnable_scale_qat: ", name,
                    " is quantized with its activations (", describe(*quantized),
                    ") and not trained here, so no gradient passes it; keep it float in the earlier step (exclude) "
                    "or match it here");
    }
    const auto lossOf = [&](size_t s) -> SampleLoss {
      const TensorList& input = request.inputs[s];
      const at::Tensor teacher = loss_.distills() ? teacherHidden(request, input) : at::Tensor();
      LossTerms terms = computeLoss(forwardOne(request, input), teacher, input[1], loss_, head);
      SampleLoss sample{.loss = terms.total};
      if (terms.lm.defined()) sample.logged.emplace_back("lm_loss", terms.lm.item<double>());
      if (terms.kd.defined()) {
        sample.logged.emplace_back("kd/" + loss_.name, terms.kd.item<double>());
        sample.logged.emplace_back("kd/forward_kl", terms.forwardKl.item<double>());
        sample.logged.emplace_back("kd/backward_kl", terms.backwardKl.item<double>());
      }
      sample.logged.emplace_back("total_loss", terms.total.item<double>());
      return sample;
    };
    // The mean total loss over every sample, without gradients.
    const auto evaluate = [&] {
      at::NoGradGuard noGrad;
      const Bf16Autocast autocast(training_.bf16, device_);
      return samples.mean([&](size_t s) { return lossOf(s).loss.item<double>(); });
    };
    const double before = evaluate();
    const int64_t steps = train("", samples, loggedKeys(), lossOf);
    const double after = evaluate();
    const int64_t trainedKv = trainedAttentions();
    saveScales("");
    deploy(request);
    request.report("", "qat:total_loss_ptq", before);
    request.report("", "qat:total_loss_qat", after);
    request.report("", "qat:steps", static_cast<double>(steps));
    context_.logger->info("learnable_scale_qat: end2end: ", entries_.size(), " Linear",
                          trainKv_ ? concat(", ", trainedKv, " K/V scales") : "", ", ", steps, " steps, ",
                          loss_.lmWeight, "·lm", loss_.distills() ? concat(" + ", loss_.kdWeight, "·", loss_.name) : "",
                          " ", scientific(before), " (PTQ) -> ", scientific(after), " (QAT), ",
                          std::chrono::duration<double>(Clock::now() - start).count(), " s");
    totalSteps_ = steps;
    trained_ = static_cast<int64_t>(entries_.size());
    trainedKv_ = trainedKv;
    sumBefore_ = before;
    sumAfter_ = after;
    entries_.clear();
  }

  // What an end2end sample logs, in lossOf's order: the terms the loss has.
  std::vector<std::string> loggedKeys() const {
    std::vector<std::string> keys;
    if (loss_.lmWeight > 0) keys.emplace_back("lm_loss");
    if (loss_.distills()) {
      for (const std::string& key : {"kd/" + loss_.name, std::string("kd/forward_kl"), std::string("kd/backward_kl")}) {
        keys.push_back(key);
      }
    }
    keys.emplace_back("total_loss");
    return keys;
  }

  // The teacher's final hidden states: the same model with every QatLinear bypassed (float), no
  // gradients.
  at::Tensor teacherHidden(LayerRequest& request, const TensorList& input) {
    const Bypass bypass(*this);
    at::NoGradGuard noGrad;
    return forwardOne(request, input);
  }

  // The layer's output for each of `inputs` (no gradients).
  static std::vector<at::Tensor> forwardAll(LayerRequest& request, std::vector<TensorList> inputs) {
    LayerRequest batch{.inputs = std::move(inputs)};
    request.forward(batch);
    std::vector<at::Tensor> outputs;
    for (TensorList& output : batch.outputs) outputs.push_back(std::move(output[0]));
    return outputs;
  }

  static at::Tensor forwardOne(LayerRequest& request, const TensorList& input) {
    LayerRequest one{.inputs = {input}};
    request.forward(one);
    return one.outputs[0][0];
  }

  // The mean over samples of each output's MSE to its target.
  static double meanError(const Samples& samples, const std::vector<at::Tensor>& outputs,
                          const std::vector<at::Tensor>& targets) {
    return samples.mean([&](size_t s) { return meanSquaredError(outputs[s], targets[s]); });
  }

  // Makes a QatLinear of every matched Linear of the decoder layers (entries_). A float Linear
  // starts from the scales linear_quant would calibrate (`observe` runs the observing forward: one
  // staged forward of a layer, or the first samples of the whole model; then freeze). A QuantLinear
  // an earlier step of the pipeline deployed starts from its scales, with the float weights of a
  // fresh copy of its layer. resume_from and from_ptq_ckpt replace either start where they can.
  void startFromPtq(LayerRequest& request, const std::function<void()>& observe) {
    std::vector<std::shared_ptr<LinearQuantizer>> quantizers;
    std::vector<std::pair<std::string, LinearQuantizer*>> named;
    std::vector<std::pair<at::Tensor, at::Tensor>> floats;  // weight and bias, kept past the quantizer
    forEach<Linear>(request, *filter_, [&](const std::string& path, const std::string& name, Linear& linear) {
      if (request.wholeModel && !name.starts_with("model.layers.")) return;  // embeddings and lm_head stay
      qconfig_.checkFits(name, linear.inFeatures());
      floats.emplace_back(linear.weight(), linear.bias());
      auto quantizer = std::make_shared<LinearQuantizer>(linear, qconfig_, LinearQuantizer::Weights::kDeferred);
      named.emplace_back(name, quantizer.get());
      if (request.staged) {
        quantizer->settleInForward([this](LinearQuantizer& q) { dist::synchronize(*context_.group, q); });
      }
      entries_.push_back({path, name, nullptr});
      quantizers.push_back(quantizer);
      request.module->replace(path, quantizer);
    });
    // As linear_quant solves them: NVFP4's fused shards share one global scale.
    shareFusedNvfp4GlobalScales(named);
    for (const auto& quantizer : quantizers) quantizer->solveWeights();
    if (!quantizers.empty() && !qconfig_.isDataFree()) {
      observe();
      for (const auto& quantizer : quantizers) dist::synchronize(*context_.group, *quantizer);
    }
    std::vector<std::shared_ptr<QuantLinear>> starts;
    for (size_t i = 0; i < quantizers.size(); ++i) {
      starts.push_back(calibratedStart(*quantizers[i], entries_[i].name, floats[i].first, floats[i].second));
    }
    constexpr std::string_view kLayers = "model.layers.";
    std::map<std::string, std::shared_ptr<Module>> floatLayers;
    forEach<QuantLinear>(
        request, *filter_, [&](const std::string& path, const std::string& name, QuantLinear& quantized) {
          if (!name.starts_with(kLayers)) return;
          QPIPE_REQUIRE(describe(quantized) == describe(qconfig_), ErrorCode::kConfig, "learnable_scale_qat: ", name,
                        " is quantized by an earlier step as ", describe(quantized), ", but the qconfig asks for ",
                        describe(qconfig_));
          const std::string layer = name.substr(0, name.find('.', kLayers.size()));
          std::shared_ptr<Module>& copy = floatLayers[layer];
          if (copy == nullptr) copy = request.loadFloatLayer(layer);
          auto* linear = dynamic_cast<Linear*>(&copy->getSubmodule(name.substr(layer.size() + 1)));
          QPIPE_REQUIRE(linear != nullptr, ErrorCode::kInput, "learnable_scale_qat: ", name,
                        " is quantized in the model's checkpoint; QAT needs its float weights (give the float model)");
          floats.emplace_back(linear->weight(), linear->bias());
          starts.push_back(withScales(linear->weight(), linear->bias(), quantized, quantized.weightParams(),
                                      quantized.inputQuant()));
          entries_.push_back({path, name, nullptr});
        });
    for (size_t i = 0; i < entries_.size(); ++i) {
      const std::string& name = entries_[i].name;
      const auto& [weight, bias] = floats[i];
      std::shared_ptr<QuantLinear> ptq = std::move(starts[i]);
      const at::Tensor resumed = resume_ ? resume_->tensor(name + ".weight_scale") : at::Tensor();
      if (resumed.defined()) {
        ptq = resumedStart(name, weight, bias, resumed, ptq);
      } else if (ptqCheckpoint_) {
        ptq = loadedStart(name, weight, bias, ptq);
      } else if (resume_) {
        calibratedNames_.push_back(name);
      }
      entries_[i].qat = std::make_shared<QatLinear>(weight, bias, *ptq, options_);
      if (resumed.defined() && options_.learnable.lwc) {
        const at::Tensor clipMax = resume_->tensor(name + ".clip_max"), clipMin = resume_->tensor(name + ".clip_min");
        QPIPE_REQUIRE(clipMax.defined() && clipMin.defined(), ErrorCode::kInput, "resume_from '", resume_->path(),
                      "': ", name, " has no clip factors (clip_max, clip_min), and lwc is on");
        entries_[i].qat->restoreClip(clipMax, clipMin);
      }
      request.module->replace(entries_[i].path, entries_[i].qat);
    }
  }

  // The PTQ start of a module that calibrated. One no calibration sample reached (an MoE expert
  // no token was routed to) starts its static input scale at activation_scale_init_value where
  // that is set, as AngelSlim's quantizer without samples; else deploy() says what is missing.
  std::shared_ptr<QuantLinear> calibratedStart(LinearQuantizer& quantizer, const std::string& name,
                                               const at::Tensor& weight, const at::Tensor& bias) {
    if (quantizer.calibrated() || activationInit_ <= 0) return quantizer.deploy(name);
    quant::LinearQConfig weightOnly = qconfig_;
    weightOnly.act = {.scheme = {.dtype = quant::QDtype::kFloat}, .method = quant::QMethod::kNone};
    Linear linear(weight, bias);
    const std::shared_ptr<QuantLinear> weights = LinearQuantizer(linear, weightOnly).deploy(name);
    const at::Tensor scale = at::full({1}, activationInit_, weight.options().dtype(at::kFloat));
    initializedNames_.push_back(name);
    return withScales(weight, bias, *weights, weights->weightParams(),
                      ActivationQuant{qconfig_.act.scheme, {scale, at::zeros({1}, scale.options().dtype(at::kInt))}});
  }

  // The start of module `name` with the scales of the PTQ checkpoint where it has them, else
  // `calibrated`; a module the checkpoint quantizes with another scheme is an error.
  std::shared_ptr<QuantLinear> loadedStart(const std::string& name, const at::Tensor& weight, const at::Tensor& bias,
                                           const std::shared_ptr<QuantLinear>& calibrated) {
    const std::shared_ptr<QuantLinear> stored = ptqCheckpoint_->linear(name, bias.defined());
    if (stored == nullptr) {
      calibratedNames_.push_back(name);
      return calibrated;
    }
    QPIPE_REQUIRE(describe(*stored) == describe(*calibrated), ErrorCode::kConfig, "from_ptq_ckpt '",
                  ptqCheckpoint_->dir(), "': ", name, " is quantized there as ", describe(*stored),
                  ", but the qconfig asks for ", describe(*calibrated));
    std::optional<ActivationQuant> input = calibrated->inputQuant();
    if (input && !input->isDynamic()) input->params = stored->inputQuant()->params;
    ++loaded_;
    return withScales(weight, bias, *calibrated, stored->weightParams(), std::move(input));
  }

  // The start of module `name` from the scales artifact (its weight_scale `scale`, and its
  // input_scale where the activations are static).
  std::shared_ptr<QuantLinear> resumedStart(const std::string& name, const at::Tensor& weight, const at::Tensor& bias,
                                            const at::Tensor& scale, const std::shared_ptr<QuantLinear>& calibrated) {
    const quant::QParams calibratedParams = calibrated->weightParams();
    QPIPE_REQUIRE(scale.sizes() == calibratedParams.scale.sizes(), ErrorCode::kInput, "resume_from '",
                  resume_->path(), "': ", name, ".weight_scale has shape ", scale.sizes(), ", this model's ",
                  calibratedParams.scale.sizes());
    std::optional<ActivationQuant> input = calibrated->inputQuant();
    // NVFP4's static input parameter, the global scale, does not train: the calibrated one stands.
    if (input && !input->isDynamic() && input->scheme.dtype != quant::QDtype::kFloat &&
        !quant::isFp4(input->scheme.dtype)) {
      const at::Tensor inputScale = resume_->tensor(name + ".input_scale");
      QPIPE_REQUIRE(inputScale.defined(), ErrorCode::kInput, "resume_from '", resume_->path(), "': ", name,
                    " has no input_scale, and its activations are static");
      input->params = {inputScale, at::zeros_like(inputScale, inputScale.options().dtype(at::kInt))};
    }
    ++resumed_;
    return withScales(weight, bias, *calibrated,
                      {scale, at::zeros_like(scale, scale.options().dtype(at::kInt)), calibratedParams.globalScale},
                      std::move(input));
  }

  // A PTQ module of `like`'s schemes with these scales.
  static std::shared_ptr<QuantLinear> withScales(const at::Tensor& weight, const at::Tensor& bias, QuantLinear& like,
                                                 const quant::QParams& params, std::optional<ActivationQuant> input) {
    const quant::QScheme& scheme = like.weightScheme();
    return std::make_shared<QuantLinear>(quant::quantize(weight, params, scheme), params, scheme, std::move(input),
                                         bias, weight.scalar_type());
  }

  // The state of the unit's trained modules, as the scales artifact names it.
  std::vector<std::pair<std::string, at::Tensor>> unitState() const {
    std::vector<std::pair<std::string, at::Tensor>> state;
    for (const Entry& e : entries_) {
      for (const auto& [key, tensor] : e.qat->state()) state.emplace_back(e.name + "." + key, tensor);
    }
    for (const AttentionEntry& e : attentions_) {
      if (e.trains) state.emplace_back(e.name, e.qat->scale());
    }
    for (const NormEntry& norm : norms_)
      state.emplace_back(norm.name + ".weight", norm.module->parameter("weight").detach());
    return state;
  }

  // Adds the trained modules' state to the scales artifact (and keeps it for the training states).
  void saveScales(const std::string& unit) {
    if (!scales_) return;
    for (auto& [name, tensor] : unitState()) {
      scales_->add(name, tensor);
      if (saveSteps_ > 0) finishedState_.emplace_back(std::move(name), tensor.clone());
    }
    finishedUnits_ += (finishedUnits_.empty() ? "" : ",") + unit;
  }

  // Rank 0 writes the training state after `step` steps of `unit` (ScalesArtifact): `start` is the
  // unit's state before training, `params` its trainable tensors.
  void saveState(const std::string& unit, int64_t step, int64_t samples,
                 const std::vector<std::pair<std::string, at::Tensor>>& start, const std::vector<at::Tensor>& params,
                 const Optimizer& optimizer) const {
    if (!scales_) return;
    const std::filesystem::path path(statePath_);
    safetensors::Writer writer(path.parent_path(),
                               {.filePrefix = path.stem().string(),
                                .metadata = {{std::string(kQconfigKey), qconfig_.describe()},
                                             {"qpipe.qat.training_mode", end2end_ ? "end2end" : "blockwise"},
                                             {std::string(kStateUnitKey), unit},
                                             {std::string(kStateStepKey), std::to_string(step)},
                                             {std::string(kStateSamplesKey), std::to_string(samples)},
                                             {std::string(kStateFinishedKey), finishedUnits_},
                                             {std::string(kStateSettingsKey), settings_}}});
    for (const auto& [name, tensor] : finishedState_) writer.add(name, tensor);
    for (const auto& [name, tensor] : start) writer.add(name, tensor);
    for (size_t i = 0; i < params.size(); ++i) writer.add("train." + std::to_string(i), params[i].detach());
    for (const auto& [name, tensor] : optimizer.state()) writer.add("optimizer." + name, tensor);
    writer.finish();
  }

  // Trains the scales of entries_ on the unit's samples, each step on the losses lossOf gives for
  // batch × accumulation of them, drawn in the run's sample order; returns the steps. `unit` names
  // a blockwise layer ("" for end2end); `keys` are what each sample logs, in lossOf's order.
  //
  // Each sample's gradient is taken alone, on the rank that holds the sample, and the step's
  // gradient is their sum in the step's sample order, on every rank: what one rank's accumulation
  // of the backward passes computes, so the scales do not depend on the number of ranks.
  int64_t train(const std::string& unit, const Samples& samples, const std::vector<std::string>& keys,
                const SampleLossFn& lossOf) {
    if (resume_ && (training_.maxSteps == 0 || resume_->finished(unit))) return 0;  // the artifact's scales
    const int64_t count = samples.count();
    const int64_t perStep = training_.batchSize * training_.accumulation;
    const int64_t stepsPerEpoch = (count + perStep - 1) / perStep;
    const int64_t total =
        training_.maxSteps > 0
            ? training_.maxSteps
            : std::max<int64_t>(1,
                                static_cast<int64_t>(std::ceil(training_.epochs * static_cast<double>(stepsPerEpoch))));
    ParamGroup scales{.learningRate = training_.learningRate};
    ParamGroup clips{.learningRate = training_.lwcLearningRate};
    for (const Entry& e : entries_) {
      for (const auto& [name, tensor] : e.qat->trainable()) {
        (e.qat->isClipFactor(name) ? clips : scales).params.push_back(tensor);
      }
    }
    for (const AttentionEntry& e : attentions_) {
      for (const at::Tensor& tensor : e.qat->trainable()) scales.params.push_back(tensor);
    }
    for (const NormEntry& norm : norms_) scales.params.push_back(norm.module->parameter("weight"));
    std::vector<at::Tensor> params = scales.params;
    params.insert(params.end(), clips.params.begin(), clips.params.end());
    Optimizer optimizer(
        {scales, clips},
        {.weightDecay = training_.weightDecay,
         .maxGradNorm = training_.maxGradNorm,
         .schedule = training_.schedule,
         .totalSteps = total,
         .warmupSteps = static_cast<int64_t>(std::ceil(training_.warmupRatio * static_cast<double>(total)))});
    const std::vector<std::pair<std::string, at::Tensor>> start =
        saveSteps_ > 0 ? unitState() : std::vector<std::pair<std::string, at::Tensor>>();
    int64_t first = 0;  // the step training starts at: a training state's, else 0
    if (const std::optional<int64_t> saved = resume_ ? resume_->stepsOf(unit, count) : std::nullopt) {
      first = *saved;
      const at::NoGradGuard noGrad;
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor value = resume_->tensor("train." + std::to_string(i));
        QPIPE_REQUIRE(value.defined() && value.sizes() == params[i].sizes(), ErrorCode::kInput, "resume_from '",
                      resume_->path(), "': trainable tensor ", i, " of ", unit.empty() ? "end2end" : unit,
                      value.defined() ? concat(" has shape ", value.sizes(), ", this model's ", params[i].sizes())
                                      : std::string(" is missing"));
        params[i].copy_(value);
      }
      optimizer.loadState([&](const std::string& name) { return resume_->tensor("optimizer." + name); });
    }
    StepGradients gradients(params, perStep);
    std::optional<ProgressBar> bar;
    if (context_.group->rank() == 0) bar.emplace(unit.empty() ? "qat end2end" : "qat " + unit, total, "steps");
    int64_t epoch = 0, position = 0;
    std::vector<int64_t> order = epochOrder(count, training_.seed, epoch);
    const auto nextSample = [&] {
      if (position == count) {
        order = epochOrder(count, training_.seed, ++epoch);
        position = 0;
      }
      return order[static_cast<size_t>(position++)];
    };
    for (int64_t drawn = 0; drawn < first * perStep; ++drawn) nextSample();
    at::AutoGradMode withGradients(true);
    const Bf16Autocast autocast(training_.bf16, device_);
    for (int64_t step = first; step < total; ++step) {
      at::Tensor values = at::zeros({perStep, static_cast<int64_t>(keys.size())}, at::kDouble);
      for (int64_t k = 0; k < perStep; ++k) {
        const std::optional<size_t> local = samples.local(nextSample());
        if (!local) continue;
        gradients.clear();
        SampleLoss sample = lossOf(*local);
        (sample.loss / static_cast<double>(perStep)).backward();
        gradients.record(k);
        QPIPE_CHECK(sample.logged.size() == keys.size(), "a sample logged ", sample.logged.size(), " values for ",
                    keys.size(), " keys");
        for (size_t i = 0; i < keys.size(); ++i) values[k][static_cast<int64_t>(i)] = sample.logged[i].second;
      }
      gradients.sum(samples);
      samples.combine(values);
      std::vector<std::pair<std::string, double>> logged;  // the step's means
      const double* v = values.const_data_ptr<double>();
      for (size_t i = 0; i < keys.size(); ++i) {
        double mean = 0;
        for (int64_t k = 0; k < perStep; ++k) mean += v[k * static_cast<int64_t>(keys.size()) + static_cast<int64_t>(i)] / static_cast<double>(perStep);
        logged.emplace_back(keys[i], mean);
      }
    const StepStats stats = optimizer.step();
      for (const Entry& e : entries_) e.qat->project();
      for (const AttentionEntry& e : attentions_) e.qat->project();
      if (saveSteps_ > 0 && (step + 1) % saveSteps_ == 0 && step + 1 < total) {
        saveState(unit, step + 1, count, start, params, optimizer);
      }
      const double epochs = static_cast<double>(epoch) + static_cast<double>(position) / static_cast<double>(count);
      std::string losses;  // "lm_loss 2.1e+00, total_loss 2.2e+00"
      for (const auto& [key, value] : logged) losses += concat(losses.empty() ? "" : ", ", key, " ", scientific(value));
      if (log_.is_open()) {
        log_ << "{";
        if (!unit.empty()) log_ << "\"layer\": \"" << unit << "\", ";
        log_ << "\"step\": " << step + 1 << ", \"epoch\": " << epochs;
        for (const auto& [key, value] : logged) log_ << ", \"" << key << "\": " << value;
        log_ << ", \"grad_norm\": " << stats.gradNorm << ", \"lr\": " << stats.learningRate << "}\n";
        log_.flush();
      }
      if (training_.loggingSteps > 0 && (step + 1) % training_.loggingSteps == 0) {
        context_.logger->info("learnable_scale_qat: ", unit.empty() ? "end2end" : unit, " step ", step + 1, "/", total,
                              ": ", losses, ", grad_norm ", scientific(stats.gradNorm), ", lr ",
                              scientific(stats.learningRate));
      }
      if (bar) bar->update(step + 1, losses);
    }
    return total;
  }

  ProcessorContext context_;
  quant::LinearQConfig qconfig_;
  std::shared_ptr<ModuleFilter> filter_;
  QatOptions options_;
  TrainingSettings training_;
  bool end2end_ = false;
  bool trainNorms_ = false;
  bool trainKv_ = false;
  at::DeviceType device_ = at::kCPU;        // where the unit computes (bf16 autocast)
  std::vector<AttentionEntry> attentions_;  // the unit's attention quantizers
  std::vector<NormEntry> norms_;  // the unit's trained norms (learnable.norm)
  LossSpec loss_;
  int64_t lazyInitSamples_ = 10;
  double activationInit_ = 0;                  // activation_scale_init_value; 0: none
  std::vector<std::string> initializedNames_;  // modules that started from it
  std::string logPath_;
  std::ofstream log_;
  std::optional<PtqCheckpoint> ptqCheckpoint_;
  std::optional<ScalesArtifact> resume_;
  int64_t resumed_ = 0;  // modules that started from resume_
  std::string scalesPath_;
  std::string statePath_;  // where save_steps writes the training state
  int64_t saveSteps_ = 0;
  std::optional<Error> noSavePath_;  // save_steps without a save path (see the constructor)
  std::string settings_;       // settingsOf the configuration
  std::string finishedUnits_;  // the units trained to the end, comma-separated (rank 0)
  std::vector<std::pair<std::string, at::Tensor>> finishedState_;  // their state, with save_steps (rank 0)
  std::unique_ptr<safetensors::Writer> scales_;
  int64_t loaded_ = 0;                        // modules that started from ptqCheckpoint_
  std::vector<std::string> calibratedNames_;  // modules it lacks, calibrated instead
  std::vector<Entry> entries_;                // the layer being trained
  bool floatStreamTarget_ = true;
  std::vector<at::Tensor> floatStream_;  // the next layer's float inputs, one per sample (float_stream)
  int64_t totalSteps_ = 0, trained_ = 0, trainedKv_ = 0;
  double sumBefore_ = 0, sumAfter_ = 0;
};

Schema learnableSchema() {
  Schema schema;
  schema.optional("weight_scale", ValueType::kBool, ConfigNode::boolean(true), "train the weight scales")
      .optional("act_scale", ValueType::kBool, ConfigNode::boolean(false), "train static activations' input scales")
      .optional("lwc", ValueType::kBool, ConfigNode::boolean(false),
                "learnable weight clipping (OmniQuant): train σ(c)·range in place of the weight scales")
      .optional("kv_scale", ValueType::kBool, ConfigNode::boolean(false),
                "train the static K/V scales of an earlier fa3_quant step")
      .optional("norm", ValueType::kBool, ConfigNode::boolean(false), "train the RMSNorm weights too");
  return schema;
}

// An int or float field (the default's kind decides which) with a lower bound.
FieldSpec bounded(std::string name, ConfigNode value, double minimum, std::string help) {
  const ValueType type = value.kind() == ConfigNode::Kind::kInt ? ValueType::kInt : ValueType::kFloat;
  return {.name = std::move(name),
          .type = type,
          .help = std::move(help),
          .defaultValue = std::move(value),
          .minimum = minimum};
}

void registerProcessors(PluginRegistrar& registrar) {
  Schema quantConfig;
  quantConfig.nested("learnable", learnableSchema(), false, "what trains");
  Schema pluginConfig;
  pluginConfig.nested("quant_config", std::move(quantConfig), false, "AngelSlim's quant_config");
  Schema schema;
  schema
      .choice("training_mode", {"blockwise", "end2end"}, "blockwise",
              "blockwise: per decoder layer, MSE to float; end2end: the whole model's logits, LM + KD loss")
      .nested("qconfig", quant::linearQConfigSchema(), true, "the quantization trained (linear_quant's qconfig)")
      .choice("target", {"float_stream", "layer"}, "float_stream",
              "blockwise targets: the float model's layer outputs (float_stream), or the float layer on the "
              "quantized inputs (layer)")
      .nested("plugin_config", std::move(pluginConfig), false, "AngelSlim's plugin_config")
      .choice("ste", {"angelslim", "lsq"}, "angelslim", "straight-through estimator of round and clamp")
      .choice("scale_parametrization", {"relative", "absolute"}, "relative",
              "relative: s = s0·α, α trained (learning rates are relative steps); absolute: s itself (AngelSlim)")
      .optional("from_ptq_ckpt", ValueType::kString, ConfigNode::string(""),
                "a qpipe checkpoint (compressed-tensors or ascendv1) whose scales the training starts from")
      .optional("resume_from", ValueType::kString, ConfigNode::string(""),
                "a scales artifact (<save_path>.qat_scales.safetensors) to start from, with max_steps 0 exported; or a "
                "training state (<save_path>.qat_state.safetensors) to continue")
      .add(bounded("save_steps", ConfigNode::integer(0), 0,
                   "every this many steps (of a blockwise layer, or of end2end) rank 0 saves the training state; 0: "
                   "never"))
      .add(bounded("lazy_init_samples", ConfigNode::integer(10), 1,
                   "end2end: samples the static activation scales are calibrated on"))
      .add(bounded("activation_scale_init_value", ConfigNode::number(0.0), 0,
                   "input scale of a static module no calibration sample reached; 0: such a module is an error"))
      .optional("loss_type", ValueType::kString, ConfigNode::string("origin"),
                "end2end: origin, kl, rkl, mse, kd, cakld, kl_top[_K], r_kl_top[_K]")
      .add(bounded("loss_topk", ConfigNode::integer(0), 0, "K of the top-K losses; 0: the name's, else 1000"))
      .add(bounded("kd_temperature", ConfigNode::number(1.0), 1e-6, "temperature T of loss_type kd"))
      .add(bounded("lm_loss_weight", ConfigNode::number(1.0), 0, "end2end: weight of the LM loss"))
      .add(bounded("kd_loss_weight", ConfigNode::number(1.0), 0, "end2end: weight of the distillation loss"))
      .add(bounded("lwc_init_value", ConfigNode::number(4.0), -1e9, "clip factors' initial logit"))
      .add(bounded("learning_rate", ConfigNode::number(1e-3), 0, "AdamW learning rate of the scales"))
      .add(bounded("lwc_lr", ConfigNode::number(1e-2), 0, "AdamW learning rate of the clip factors"))
      .add(bounded("weight_decay", ConfigNode::number(0), 0, "AdamW weight decay"))
      .add(bounded("per_device_train_batch_size", ConfigNode::integer(1), 1, "samples per micro-batch"))
      .add(bounded("gradient_accumulation_steps", ConfigNode::integer(1), 1, "micro-batches per optimizer step"))
      .add(bounded("max_steps", ConfigNode::integer(-1), -1,
                   "optimizer steps per layer; > 0 overrides num_train_epochs"))
      .add(bounded("num_train_epochs", ConfigNode::number(2), 0, "passes over the calibration samples per layer"))
      .add([] {
        FieldSpec ratio = bounded("warmup_ratio", ConfigNode::number(0), 0, "fraction of the steps warming up");
        ratio.maximum = 1;
        return ratio;
      }())
      .choice("lr_scheduler_type", {"constant", "constant_with_warmup", "linear", "cosine"}, "cosine",
              "learning rate schedule (HF's)")
      .add(bounded("max_grad_norm", ConfigNode::number(1.0), 0, "gradient clipping; 0: none"))
      .add(bounded("seed", ConfigNode::integer(42), 0, "the sample order's seed"))
      .optional("bf16", ValueType::kBool, ConfigNode::boolean(false),
                "train in bf16 autocast (HF's bf16): matrix products in bf16, scales and losses fp32")
      .add(bounded("logging_steps", ConfigNode::integer(0), 0, "an info line every N steps; 0: one per layer"))
      .optional("logging_file", ValueType::kString, ConfigNode::string(""),
                "per-step JSON lines; default <save_path>.qat_log.jsonl")
      .includeExclude();
  registrar.addProcessor({
      .type = "learnable_scale_qat",
      .description = "scale-only QAT: trains the quantizers' scales with the weights frozen, exports real checkpoints",
      .schema = std::move(schema),
      .factory = [](const ConfigNode& config,
                    const ProcessorContext& context) { return std::make_unique<LearnableScaleQat>(config, context); },
  });
}

}  // namespace
}  // namespace qpipe::qat

QPIPE_PLUGIN("qat", "1.0.0", "learnable_scale_qat: scale-only quantization-aware training (end2end, blockwise)",
             qpipe::qat::registerProcessors)
