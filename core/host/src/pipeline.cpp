#include "qpipe/host/pipeline.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <tuple>

#include "qpipe/error.h"
#include "qpipe/host/registry.h"
#include "qpipe/host/savers.h"
#include "qpipe/schema.h"

namespace qpipe {

namespace {

constexpr const char* kGroupType = "group";

const Schema& documentSchema() {
  static const Schema kSchema = [] {
    Schema label;
    label.required("w_bit", ValueType::kInt, "weight bits")
        .required("a_bit", ValueType::kInt, "activation bits (16: not quantized)")
        .optional("is_sparse", ValueType::kBool, ConfigNode::boolean(false), "sparse weights")
        .optional("kv_cache", ValueType::kBool, ConfigNode::boolean(false), "KV cache quantized to int8 (c8)")
        .add({.name = "fa_bit", .type = ValueType::kInt, .help = "attention (FA3) bits"})
        .add({.name = "fa_quant", .type = ValueType::kBool, .help = "attention quantized (8 bits)"})
        .optional("fp8", ValueType::kBool, ConfigNode::boolean(false),
                  "weights (and activations) in fp8_e4m3 rather than int: --quant_type w8a8_fp8")
        .optional("nvfp4", ValueType::kBool, ConfigNode::boolean(false),
                  "weights (and activations) in NVFP4 rather than int: --quant_type w4a4_nvfp4")
        .optional("mxfp4", ValueType::kBool, ConfigNode::boolean(false),
                  "weights (and activations) in MXFP4 rather than int: --quant_type w4a4_mxfp4")
        .optional("static", ValueType::kBool, ConfigNode::boolean(false),
                  "activations with calibrated scales rather than dynamic per token: --quant_type w8a8_static");
    Schema metadata;
    metadata.optional("config_id", ValueType::kString, ConfigNode::string(""), "name of this practice")
        .optional("score", ValueType::kFloat, ConfigNode::number(100), "preference among matching practices")
        .nested("label", std::move(label), false, "what --quant_type matches")
        .optional("verified_model_types", ValueType::kStringList, ConfigNode::stringList({}),
                  "model types this practice was verified on")
        .add({.name = "verified_tags", .type = ValueType::kAny, .help = "scenario tags (kept, not used)"});
    Schema spec;
    spec.choice("runner", {"auto", "layer_wise", "model_wise", "dp_layer_wise"}, "auto", "how the model is iterated")
        .required("process", ValueType::kAny, "processors, in order")
        .optional("save", ValueType::kAny, ConfigNode::list(), "savers")
        .optional("dataset", ValueType::kString, ConfigNode::string(""), "calibration data file")
        .add({.name = "calib_dataset",
              .type = ValueType::kAny,
              .help = "in some msmodelslim practices; msmodelslim does not read it, nor does qpipe"});
    Schema document;
    document
        .add({.name = "apiversion",
              .type = ValueType::kString,
              .help = "schema version",
              .required = true,
              .allowed = {"modelslim_v1"}})
        .nested("metadata", std::move(metadata), false, "practice metadata")
        .nested("spec", std::move(spec), true, "what the pipeline does");
    return document;
  }();
  return kSchema;
}

const Schema& groupSchema() {
  static const Schema kSchema = [] {
    Schema schema;
    schema.required("configs", ValueType::kAny, "processors that share one calibration forward");
    return schema;
  }();
  return kSchema;
}

std::vector<ProcessStep> parseSteps(const ConfigNode& list, const std::string& path, const Registry& registry);

// A step's mapping without its `type`: what the type's schema validates.
ConfigNode withoutType(const ConfigNode& step) {
  ConfigNode config = ConfigNode::map({}, step.location());
  for (const auto& [key, value] : step.entries()) {
    if (key != "type") config.set(key, value);
  }
  return config;
}

// The step as the resolved document prints it: `type` first, then the validated fields.
ConfigNode withType(const std::string& type, const ConfigNode& config, const SourceLocation& location) {
  ConfigNode out = ConfigNode::map({}, location);
  out.set("type", ConfigNode::string(type));
  for (const auto& [key, value] : config.entries()) out.set(key, value);
  return out;
}

ProcessStep parseStep(const ConfigNode& node, const std::string& path, const Registry& registry) {
  if (!node.isMap())
    failAt(node, path, concat("expected a processor mapping with a 'type', got ", ConfigNode::kindName(node.kind())));
  const ConfigNode* typeNode = node.find("type");
  if (typeNode == nullptr) failAt(node, path, "missing required field 'type' (the processor to run)");
  if (typeNode->kind() != ConfigNode::Kind::kString) {
    failAt(*typeNode, path + ".type", concat("expected a string, got ", ConfigNode::kindName(typeNode->kind())));
  }
  ProcessStep step;
  step.type = typeNode->asString();
  step.path = path;
  step.location = node.location();

  const ConfigNode config = withoutType(node);
  if (step.type == kGroupType) {
    const ConfigNode validated = groupSchema().validate(config, path);
    step.children = parseSteps(validated.at("configs"), path + ".configs", registry);
    step.config = ConfigNode::map({}, node.location());
    return step;
  }
  const Registry::ProcessorEntry* entry = registry.findProcessor(step.type);
  if (entry == nullptr) {
    failAt(*typeNode, path + ".type",
           concat("unknown processor type '", step.type, "'; known types: ", joinNames(registry.processorTypes()),
                  " (plugins are searched in --plugin_dir, QPIPE_PLUGIN_PATH, "
                  "then the built-in folder; `qpipe plugins` lists them)"));
  }
  step.config = entry->info.schema.validate(config, path);
  return step;
}

std::vector<ProcessStep> parseSteps(const ConfigNode& list, const std::string& path, const Registry& registry) {
  if (!list.isList())
    failAt(list, path, concat("expected a list of processors, got ", ConfigNode::kindName(list.kind())));
  if (list.items().empty()) failAt(list, path, "the list of processors is empty");
  std::vector<ProcessStep> steps;
  for (size_t i = 0; i < list.items().size(); ++i) {
    steps.push_back(parseStep(list.items()[i], concat(path, "[", i, "]"), registry));
  }
  return steps;
}

ConfigNode resolvedStep(const ProcessStep& step) {
  ConfigNode out = withType(step.type, step.config, step.location);
  if (step.type == kGroupType) {
    ConfigNode children = ConfigNode::list();
    for (const auto& child : step.children) children.push(resolvedStep(child));
    out.set("configs", std::move(children));
  }
  return out;
}

// A spec.save step: its `type` names a registered saver, whose schema validates the rest.
SaveStep parseSaver(const ConfigNode& node, const std::string& path, const Registry& registry) {
  if (!node.isMap()) {
    failAt(node, path, concat("expected a saver mapping with a 'type', got ", ConfigNode::kindName(node.kind())));
  }
  const ConfigNode* type = node.find("type");
  if (type == nullptr) failAt(node, path, "missing required field 'type' (the saver to use)");
  if (type->kind() != ConfigNode::Kind::kString) {
    failAt(*type, path + ".type", concat("expected a string, got ", ConfigNode::kindName(type->kind())));
  }
  const Registry::SaverEntry* entry = registry.findSaver(type->asString());
  if (entry == nullptr) {
    failAt(*type, path + ".type",
           concat("unknown saver type '", type->asString(), "'; known types: ", joinNames(registry.saverTypes())));
  }
  return {type->asString(), entry->info.schema.validate(withoutType(node), path), node.location()};
}

std::vector<SaveStep> parseSavers(const ConfigNode& list, const Registry& registry) {
  const std::string path = "spec.save";
  if (!list.isList()) failAt(list, path, concat("expected a list of savers, got ", ConfigNode::kindName(list.kind())));
  if (list.items().size() > 1) {
    failAt(list, path, concat("lists ", list.items().size(), " savers; one per run is supported"));
  }
  if (list.items().empty()) {
    return {{kDefaultSaver, registry.findSaver(kDefaultSaver)->info.schema.validate(ConfigNode::map(), path + "[0]"),
             list.location()}};
  }
  return {parseSaver(list.items().front(), path + "[0]", registry)};
}

PipelineMetadata parseMetadata(const ConfigNode& metadata) {
  PipelineMetadata out;
  out.configId = metadata.at("config_id").asString();
  out.score = metadata.at("score").asFloat();
  out.verifiedModelTypes = metadata.at("verified_model_types").asStringList();
  const ConfigNode& label = metadata.at("label");
  if (!label.isNull()) {
    PipelineLabel parsed;
    parsed.wBit = static_cast<int>(label.at("w_bit").asInt());
    parsed.aBit = static_cast<int>(label.at("a_bit").asInt());
    parsed.isSparse = label.at("is_sparse").asBool();
    parsed.kvCache = label.at("kv_cache").asBool();
    parsed.fp8 = label.at("fp8").asBool();
    parsed.nvfp4 = label.at("nvfp4").asBool();
    parsed.mxfp4 = label.at("mxfp4").asBool();
    parsed.isStatic = label.at("static").asBool();
    if (!label.at("fa_bit").isNull()) {
      parsed.faBit = static_cast<int>(label.at("fa_bit").asInt());
    } else if (!label.at("fa_quant").isNull() && label.at("fa_quant").asBool()) {
      parsed.faBit = 8;
    }
    out.label = parsed;
  }
  return out;
}

// Processes the children of a `group` over one shared calibration forward (msmodelslim's
// container). Unlike msmodelslim, distributed support needs every child to support it.
class GroupProcessor final : public Processor {
 public:
  explicit GroupProcessor(std::vector<std::unique_ptr<Processor>> children) : children_(std::move(children)) {}

  void preRun() override {
    for (auto& child : children_) child->preRun();
  }
  void preprocess(LayerRequest& request) override {
    for (auto& child : children_) child->preprocess(request);
  }
  void postprocess(LayerRequest& request) override {
    for (auto& child : children_) child->postprocess(request);
  }
  void postRun() override {
    for (auto& child : children_) child->postRun();
  }
  bool supportDistributed() const override {
    return std::all_of(children_.begin(), children_.end(), [](const auto& c) { return c->supportDistributed(); });
  }
  bool isDataFree() const override {
    return std::all_of(children_.begin(), children_.end(), [](const auto& c) { return c->isDataFree(); });
  }
  bool layersIndependent() const override {
    return std::all_of(children_.begin(), children_.end(), [](const auto& c) { return c->layersIndependent(); });
  }
  bool actsOn(const LayerRequest& unit) const override {
    return std::any_of(children_.begin(), children_.end(), [&](const auto& c) { return c->actsOn(unit); });
  }
  const std::vector<std::unique_ptr<Processor>>& children() const { return children_; }

 private:
  std::vector<std::unique_ptr<Processor>> children_;
};

std::unique_ptr<Processor> buildStep(const ProcessStep& step, const Registry& registry,
                                     const ProcessorContext& context) {
  if (step.type == kGroupType) {
    std::vector<std::unique_ptr<Processor>> children;
    for (const auto& child : step.children) {
      children.push_back(buildStep(child, registry, context));
      // A group only observes: its children share one calibration forward per unit, so a step
      // that trains there would silently do nothing.
      const Processor& built = *children.back();
      if (built.trains() || built.wholeModel()) {
        throw Error(ErrorCode::kConfig,
                    concat(child.location.str(), ": ", child.path, ": '", child.type, "' ",
                           built.trains() ? "trains" : "works on the whole model",
                           ", which a group cannot run (its steps share one calibration forward); make it a step "
                           "of its own"));
      }
    }
    return std::make_unique<GroupProcessor>(std::move(children));
  }
  return registry.createProcessor(step.type, step.config, step.path, context);
}

// Reads `file` and checks it against the document schema; processor steps are checked later.
ConfigNode validateDocument(const std::filesystem::path& file) {
  const ConfigNode document = ConfigNode::loadYamlFile(file);
  if (!document.isMap()) {
    failAt(document, "document",
           concat("expected a pipeline mapping (apiversion, metadata, spec), got ",
                  document.isNull() ? std::string("an empty document (an empty file, only comments, or null)")
                                    : ConfigNode::kindName(document.kind())));
  }
  // Top-level keys outside the schema are allowed only as holders of YAML anchors, the way
  // msmodelslim's practice files define reusable qconfig blocks.
  ConfigNode known = ConfigNode::map({}, document.location());
  for (const auto& [key, value] : document.entries()) {
    if (documentSchema().find(key) != nullptr) {
      known.set(key, value);
    } else if (!value.hasAnchor()) {
      const std::string meant = documentSchema().closest(key);
      failAt(value, key,
             concat("unknown top-level field", meant.empty() ? "" : "; did you mean '" + meant + "'?",
                    "; expected apiversion, metadata, spec (other top-level keys may only define YAML anchors, e.g. "
                    "'w8a8: &w8a8 {...}')"));
    }
  }
  return documentSchema().validate(known, "");
}

}  // namespace

PipelineMetadata readPipelineMetadata(const std::filesystem::path& file) {
  return parseMetadata(validateDocument(file).at("metadata"));
}

Pipeline loadPipeline(const std::filesystem::path& file, const Registry& registry) {
  const ConfigNode validated = validateDocument(file);
  const ConfigNode& spec = validated.at("spec");

  Pipeline pipeline;
  pipeline.file = file;
  pipeline.apiVersion = validated.at("apiversion").asString();
  pipeline.metadata = parseMetadata(validated.at("metadata"));
  pipeline.runner = spec.at("runner").asString();
  pipeline.runnerLocation = spec.at("runner").location();
  pipeline.process = parseSteps(spec.at("process"), "spec.process", registry);
  pipeline.save = parseSavers(spec.at("save"), registry);
  pipeline.dataset = spec.at("dataset").asString();
  // msmodelslim's V1 service config has no such field, and pydantic drops the keys it does not
  // know: its run calibrates on its default set whatever the file says.
  if (const ConfigNode* ignored = spec.find("calib_dataset"); ignored != nullptr && !ignored->isNull()) {
    pipeline.warnings.push_back(concat(ignored->location().str(),
                                       ": spec.calib_dataset: msmodelslim does not read it, and neither does qpipe; "
                                       "name the calibration data with spec.dataset or --calib_data; ignored"));
  }

  ConfigNode resolvedSpec = ConfigNode::map({}, spec.location());
  resolvedSpec.set("runner", spec.at("runner"));
  ConfigNode steps = ConfigNode::list();
  for (const auto& step : pipeline.process) steps.push(resolvedStep(step));
  resolvedSpec.set("process", std::move(steps));
  ConfigNode savers = ConfigNode::list();
  for (const auto& saver : pipeline.save) savers.push(withType(saver.type, saver.config, saver.location));
  resolvedSpec.set("save", std::move(savers));
  resolvedSpec.set("dataset", spec.at("dataset"));
  pipeline.resolved = ConfigNode::map({}, validated.location());
  pipeline.resolved.set("apiversion", validated.at("apiversion"));
  pipeline.resolved.set("metadata", validated.at("metadata"));
  pipeline.resolved.set("spec", std::move(resolvedSpec));
  return pipeline;
}

std::vector<std::unique_ptr<Processor>> buildProcessors(const Pipeline& pipeline, const Registry& registry,
                                                        const ProcessorContext& context) {
  std::vector<std::string>& warnings = *context.configWarnings;
  const size_t first = warnings.size();
  warnings.insert(warnings.end(), pipeline.warnings.begin(), pipeline.warnings.end());
  std::vector<std::unique_ptr<Processor>> processors;
  const ProcessStep* training = nullptr;
  for (const auto& step : pipeline.process) {
    processors.push_back(buildStep(step, registry, context));
    if (!processors.back()->trains()) continue;
    // A second training step would train the first one's result again and write its artifacts
    // (scales, log, state beside --save_path) over the first one's.
    if (training != nullptr) {
      throw Error(ErrorCode::kConfig, concat(step.location.str(), ": ", step.path, ": '", step.type,
                                             "' trains, and so does ", training->path, " ('", training->type,
                                             "'); a pipeline trains in one step: merge them into one"));
    }
    training = &step;
  }
  // In the order of the file, whichever check found them; a warning that names no position in it
  // goes last.
  const std::string prefix = pipeline.file.string() + ":";
  constexpr int kNone = std::numeric_limits<int>::max();
  std::vector<std::tuple<int, int, std::string>> ordered;
  for (auto it = warnings.begin() + static_cast<std::ptrdiff_t>(first); it != warnings.end(); ++it) {
    int line = kNone, column = kNone;
    if (it->rfind(prefix, 0) == 0) {
      const char* end = it->data() + it->size();
      const auto [afterLine, lineError] = std::from_chars(it->data() + prefix.size(), end, line);
      if (lineError != std::errc() || afterLine == end || *afterLine != ':' ||
          std::from_chars(afterLine + 1, end, column).ec != std::errc()) {
        line = column = kNone;
      }
    }
    ordered.emplace_back(line, column, std::move(*it));
  }
  std::stable_sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a)) < std::tie(std::get<0>(b), std::get<1>(b));
  });
  warnings.resize(first);
  for (auto& [line, column, text] : ordered) warnings.push_back(std::move(text));
  return processors;
}

namespace {

// `processor` is built from `step`; a group's children are checked one by one, at their lines.
void checkPlanned(const ProcessStep& step, const Processor& processor, const std::string& saver,
                  const Registry& registry) {
  if (const auto* group = dynamic_cast<const GroupProcessor*>(&processor)) {
    QPIPE_CHECK(group->children().size() == step.children.size(), step.path, ": ", group->children().size(),
                " processors for ", step.children.size(), " children");
    for (size_t i = 0; i < step.children.size(); ++i) {
      checkPlanned(step.children[i], *group->children()[i], saver, registry);
    }
    return;
  }
  try {
    registry.checkPlanned(saver, processor.plannedOutputs());
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kConfig) throw;
    throw Error(ErrorCode::kConfig, concat(step.location.str(), ": ", step.path, " (", step.type, "): ", e.what()));
  }
}

// A step that cannot run on several ranks: a group's own child, not the group.
void checkMultirankStep(const ProcessStep& step, const Processor& processor) {
  if (const auto* group = dynamic_cast<const GroupProcessor*>(&processor)) {
    for (size_t i = 0; i < step.children.size(); ++i) checkMultirankStep(step.children[i], *group->children()[i]);
    return;
  }
  QPIPE_REQUIRE(processor.supportDistributed(), ErrorCode::kUsage, step.path, " (", step.type,
                ") does not support multi-rank runs; use one device");
}

}  // namespace

void checkMultirank(const Pipeline& pipeline, const std::vector<std::unique_ptr<Processor>>& processors) {
  for (size_t i = 0; i < processors.size(); ++i) checkMultirankStep(pipeline.process[i], *processors[i]);
}

void checkPlannedOutputs(const Pipeline& pipeline, const std::vector<std::unique_ptr<Processor>>& processors,
                         const Registry& registry) {
  QPIPE_CHECK(processors.size() == pipeline.process.size(), processors.size(), " processors for ",
              pipeline.process.size(), " steps");
  for (size_t i = 0; i < processors.size(); ++i) {
    checkPlanned(pipeline.process[i], *processors[i], pipeline.save.front().type, registry);
  }
}

}  // namespace qpipe
