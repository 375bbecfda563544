#include "qpipe/host/registry.h"

#include <algorithm>

#include "qpipe/host/savers.h"

namespace qpipe {

namespace {

class GuardedProcessor final : public Processor {
 public:
  GuardedProcessor(std::unique_ptr<Processor> inner, std::string type, std::string plugin, std::string path,
                   ProcessorContext context, std::shared_ptr<const void> owner)
      : owner_(std::move(owner)),
        inner_(std::move(inner)),
        type_(std::move(type)),
        plugin_(std::move(plugin)),
        path_(std::move(path)),
        context_(std::move(context)) {}

  void preRun() override {
    guard("preRun", "", [&] { inner_->preRun(); });
  }
  void preprocess(LayerRequest& r) override {
    guard("preprocess", unitName(r), [&] { inner_->preprocess(r); });
  }
  void process(LayerRequest& r) override {
    guard("process", unitName(r), [&] { inner_->process(r); });
  }
  void postprocess(LayerRequest& r) override {
    guard("postprocess", unitName(r), [&] { inner_->postprocess(r); });
  }
  void postRun() override {
    guard("postRun", "", [&] { inner_->postRun(); });
    for (const auto& filter : *context_.filters) {
      for (const auto& pattern : filter->unmatchedPatterns()) {
        context_.logger->warn(type_, " (", path_, "): ", pattern, " matched no module");
      }
    }
  }
  bool supportDistributed() const override {
    return guard("supportDistributed", "", [&] { return inner_->supportDistributed(); });
  }
  bool layersIndependent() const override {
    return guard("layersIndependent", "", [&] { return inner_->layersIndependent(); });
  }
  bool isDataFree() const override {
    return guard("isDataFree", "", [&] { return inner_->isDataFree(); });
  }
  bool trains() const override {
    return guard("trains", "", [&] { return inner_->trains(); });
  }
  bool wholeModel() const override {
    return guard("wholeModel", "", [&] { return inner_->wholeModel(); });
  }
  bool actsOn(const LayerRequest& unit) const override {
    return guard("actsOn", unitName(unit), [&] { return inner_->actsOn(unit); });
  }
  PlannedOutputs plannedOutputs() const override {
    return guard("plannedOutputs", "", [&] { return inner_->plannedOutputs(); });
  }

 private:
  // What error messages call the unit: its HF name, or what the report calls the non-layer one.
  static std::string unitName(const LayerRequest& r) {
    if (r.wholeModel) return "whole model";
    return isNonLayerUnit(r) ? "non-layer modules" : r.name;
  }

  template <typename F>
  auto guard(const char* call, const std::string& layer, F&& body) const -> decltype(body()) {
    try {
      return body();
    } catch (const Error& e) {
      throw Error(e.code(), prefix(call, layer) + e.what());
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kPlugin, prefix(call, layer) + oneLine(e));
    } catch (...) {
      throw Error(ErrorCode::kPlugin, prefix(call, layer) + "unknown exception (not derived from std::exception)");
    }
  }

  std::string prefix(const char* call, const std::string& layer) const {
    return concat("processor '", type_, "' (plugin '", plugin_, "') failed in ", call,
                  layer.empty() ? "" : "(" + layer + ")", ": ");
  }

  std::shared_ptr<const void> owner_;  // outlives inner_: declared first, destroyed last
  std::unique_ptr<Processor> inner_;
  std::string type_;
  std::string plugin_;
  std::string path_;
  ProcessorContext context_;
};

// Runs `body`, turning what it throws into one line naming `where`, copied at once so that nothing
// thrown by plugin code outlives the call. A configuration error already names its file, line and
// field, and a saver's errors name the save path: with `passErrors` those keep their message.
template <typename F>
auto guardCall(const std::string& where, bool passErrors, F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const Error& e) {
    if (passErrors || e.code() == ErrorCode::kConfig) throw Error(e.code(), e.what());
    throw Error(e.code() == ErrorCode::kInternal ? ErrorCode::kPlugin : e.code(), where + e.what());
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kPlugin, where + oneLine(e));
  } catch (...) {
    throw Error(ErrorCode::kPlugin, where + "unknown exception (not derived from std::exception)");
  }
}

// A saver whose calls are guarded like a processor's, keeping its library loaded.
class GuardedSaver final : public CheckpointSaver {
 public:
  GuardedSaver(std::unique_ptr<CheckpointSaver> inner, std::string where, std::shared_ptr<const void> owner)
      : owner_(std::move(owner)), inner_(std::move(inner)), where_(std::move(where)) {}

  void writeLayer(int64_t index, const std::string& name, Module& layer) override {
    guardCall(where_ + "writeLayer(" + unitName(index, name) + "): ", true,
              [&] { inner_->writeLayer(index, name, layer); });
  }
  void addFile(const std::string& fileName, const std::string& content) override {
    guardCall(where_ + "addFile(" + fileName + "): ", true, [&] { inner_->addFile(fileName, content); });
  }
  void finish() override {
    guardCall(where_ + "finish: ", true, [&] { inner_->finish(); });
  }
  std::string writeSegment(int64_t index, const std::string& name, Module& layer, const SegmentChain& chain) override {
    return guardCall(where_ + "writeSegment(" + unitName(index, name) + "): ", true,
                     [&] { return inner_->writeSegment(index, name, layer, chain); });
  }
  void adoptSegment(int64_t index, const std::string& segment) override {
    guardCall(where_ + "adoptSegment(" + unitName(index, "layer " + std::to_string(index)) + "): ", true,
              [&] { inner_->adoptSegment(index, segment); });
  }
  bool writesNonLayerFirst() const override {
    return guardCall(where_ + "writesNonLayerFirst: ", true, [&] { return inner_->writesNonLayerFirst(); });
  }

 private:
  static std::string unitName(int64_t index, const std::string& name) {
    return index == kNonLayer ? "non-layer modules" : name;
  }

  std::shared_ptr<const void> owner_;  // outlives inner_: declared first, destroyed last
  std::unique_ptr<CheckpointSaver> inner_;
  std::string where_;
};

template <typename Entry>
const Entry* findIn(const std::vector<Entry>& entries, std::string_view type) {
  for (const auto& entry : entries) {
    if (entry.info.type == type) return &entry;
  }
  return nullptr;
}

// The checks of Registry::add for one kind of entry ("processor" or "saver").
template <typename Entry>
void checkNew(const std::vector<Entry>& existing, const std::vector<Entry>& added, const char* kind) {
  for (size_t i = 0; i < added.size(); ++i) {
    const std::string& type = added[i].info.type;
    const std::string& plugin = added[i].plugin;
    QPIPE_REQUIRE(!type.empty(), ErrorCode::kPlugin, "plugin '", plugin, "' registers a ", kind, " with an empty type");
    QPIPE_REQUIRE(static_cast<bool>(added[i].info.factory), ErrorCode::kPlugin, "plugin '", plugin, "' registers ",
                  kind, " type '", type, "' without a factory");
    if (const Entry* other = findIn(existing, type)) {
      throw Error(ErrorCode::kPlugin,
                  concat(kind, " type '", type, "' is registered by plugin '", plugin, "' (", added[i].origin,
                         ") and already by plugin '", other->plugin, "' (", other->origin, ")"));
    }
    for (size_t j = 0; j < i; ++j) {
      QPIPE_REQUIRE(added[j].info.type != type, ErrorCode::kPlugin, "plugin '", plugin, "' registers ", kind, " type '",
                    type, "' twice");
    }
  }
}

template <typename Entry>
std::vector<std::string> typesOf(const std::vector<Entry>& entries, std::vector<std::string> out) {
  for (const auto& entry : entries) out.push_back(entry.info.type);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

Registry::Registry() {
  for (SaverInfo& info : builtinSavers()) {
    savers_.push_back({{{}, "qpipe", "built-in"}, std::move(info)});
  }
}

const std::vector<std::string>& Registry::coreTypes() {
  static const std::vector<std::string> kTypes{"group"};
  return kTypes;
}

void Registry::add(std::vector<ProcessorEntry> processors, std::vector<SaverEntry> savers) {
  for (const auto& entry : processors) {
    const bool isCore = std::find(coreTypes().begin(), coreTypes().end(), entry.info.type) != coreTypes().end();
    QPIPE_REQUIRE(!isCore, ErrorCode::kPlugin, "plugin '", entry.plugin, "' registers processor type '",
                  entry.info.type, "', which is reserved by qpipe's core");
  }
  checkNew(processors_, processors, "processor");
  checkNew(savers_, savers, "saver");
  for (auto& entry : processors) processors_.push_back(std::move(entry));
  for (auto& entry : savers) savers_.push_back(std::move(entry));
}

const Registry::ProcessorEntry* Registry::findProcessor(std::string_view type) const {
  return findIn(processors_, type);
}

const Registry::SaverEntry* Registry::findSaver(std::string_view type) const {
  return findIn(savers_, type);
}

std::vector<std::string> Registry::processorTypes() const {
  return typesOf(processors_, coreTypes());
}

std::vector<std::string> Registry::saverTypes() const {
  return typesOf(savers_, {});
}

std::unique_ptr<Processor> Registry::createProcessor(std::string_view type, const ConfigNode& config,
                                                     std::string_view path, const ProcessorContext& context) const {
  const ProcessorEntry* entry = findProcessor(type);
  QPIPE_CHECK(entry != nullptr, "no factory for processor type '", type, "'");
  ProcessorContext scoped = context;
  scoped.configPath = path;
  if (!scoped.logger) scoped.logger = log::logger();
  scoped.filters = std::make_shared<std::vector<std::shared_ptr<ModuleFilter>>>();
  const std::string where = concat(config.location().str(), ": ", path, ": processor '", type, "' (plugin '",
                                   entry->plugin, "') could not be created: ");
  std::unique_ptr<Processor> created = guardCall(where, false, [&] { return entry->info.factory(config, scoped); });
  QPIPE_REQUIRE(created != nullptr, ErrorCode::kPlugin, where, "the factory returned no processor");
  return std::make_unique<GuardedProcessor>(std::move(created), std::string(type), entry->plugin, std::string(path),
                                            std::move(scoped), entry->owner);
}

std::unique_ptr<CheckpointSaver> Registry::createSaver(std::string_view type, const ConfigNode& config, CausalLM& model,
                                                       const std::filesystem::path& saveDir, bool segmentsOnly) const {
  const SaverEntry* entry = findSaver(type);
  QPIPE_CHECK(entry != nullptr, "no factory for saver type '", type, "'");
  const SaverFactory& factory = segmentsOnly ? entry->info.segmentFactory : entry->info.factory;
  if (!factory) return nullptr;
  const std::string where = concat("saver '", type, "' (plugin '", entry->plugin, "') ");
  std::unique_ptr<CheckpointSaver> created =
      guardCall(where + "could not be created: ", true, [&] { return factory(config, model, saveDir); });
  QPIPE_REQUIRE(created != nullptr, ErrorCode::kPlugin, where, "could not be created: the factory returned no saver");
  return std::make_unique<GuardedSaver>(std::move(created), where + "failed in ", entry->owner);
}

void Registry::checkPlanned(std::string_view type, const PlannedOutputs& planned) const {
  const SaverEntry* entry = findSaver(type);
  QPIPE_CHECK(entry != nullptr, "no saver type '", type, "'");
  if (!entry->info.checkPlanned) return;
  guardCall(concat("saver '", type, "' (plugin '", entry->plugin, "') failed in checkPlanned: "), false,
            [&] { entry->info.checkPlanned(planned); });
}

}  // namespace qpipe
