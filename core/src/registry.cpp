#include "qpipe/registry.h"

#include <algorithm>

#include "qpipe/config_node.h"
#include "qpipe/error.h"

namespace qpipe {

namespace {

class GuardedProcessor final : public Processor {
 public:
  GuardedProcessor(std::unique_ptr<Processor> inner, std::string type, std::string plugin,
                   std::shared_ptr<const void> owner)
      : owner_(std::move(owner)), inner_(std::move(inner)), type_(std::move(type)), plugin_(std::move(plugin)) {}

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
  }
  bool supportDistributed() const override {
    return guard("supportDistributed", "", [&] { return inner_->supportDistributed(); });
  }
  bool isDataFree() const override {
    return guard("isDataFree", "", [&] { return inner_->isDataFree(); });
  }

 private:
  // What error messages call the unit: its HF name, or what the report calls the non-layer one.
  static std::string unitName(const LayerRequest& r) { return isNonLayerUnit(r) ? "non-layer modules" : r.name; }

  template <typename F>
  auto guard(const char* call, const std::string& layer, F&& body) const -> decltype(body()) {
    try {
      return body();
    } catch (const Error& e) {
      throw Error(e.code(), prefix(call, layer) + e.what());
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kPlugin, prefix(call, layer) + e.what());
    } catch (...) {
      throw Error(ErrorCode::kPlugin, prefix(call, layer) + "unknown exception (not derived from std::exception)");
    }
  }

  std::string prefix(const char* call, const std::string& layer) const {
    return detail::concat("processor '", type_, "' (plugin '", plugin_, "') failed in ", call,
                          layer.empty() ? "" : "(" + layer + ")", ": ");
  }

  std::shared_ptr<const void> owner_;  // outlives inner_: declared first, destroyed last
  std::unique_ptr<Processor> inner_;
  std::string type_;
  std::string plugin_;
};

}  // namespace

std::unique_ptr<Processor> guardProcessor(std::unique_ptr<Processor> inner, std::string type, std::string plugin,
                                          std::shared_ptr<const void> owner) {
  return std::make_unique<GuardedProcessor>(std::move(inner), std::move(type), std::move(plugin), std::move(owner));
}

const std::vector<std::string>& ProcessorRegistry::coreTypes() {
  static const std::vector<std::string> kTypes{"group"};
  return kTypes;
}

void ProcessorRegistry::add(std::vector<Entry> entries) {
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string& type = entries[i].info.type;
    const bool isCore = std::find(coreTypes().begin(), coreTypes().end(), type) != coreTypes().end();
    QPIPE_REQUIRE(!isCore, ErrorCode::kPlugin, "plugin '", entries[i].plugin, "' registers processor type '", type,
                  "', which is reserved by qpipe's core");
    QPIPE_REQUIRE(!type.empty(), ErrorCode::kPlugin, "plugin '", entries[i].plugin,
                  "' registers a processor with an empty type");
    QPIPE_REQUIRE(static_cast<bool>(entries[i].info.factory), ErrorCode::kPlugin, "plugin '", entries[i].plugin,
                  "' registers processor type '", type, "' without a factory");
    if (const Entry* existing = find(type)) {
      throw Error(ErrorCode::kPlugin,
                  detail::concat("processor type '", type, "' is registered by plugin '", entries[i].plugin, "' (",
                                 entries[i].origin, ") and already by plugin '", existing->plugin, "' (",
                                 existing->origin, ")"));
    }
    for (size_t j = 0; j < i; ++j) {
      QPIPE_REQUIRE(entries[j].info.type != type, ErrorCode::kPlugin, "plugin '", entries[i].plugin,
                    "' registers processor type '", type, "' twice");
    }
  }
  for (auto& entry : entries) entries_.push_back(std::move(entry));
}

const ProcessorRegistry::Entry* ProcessorRegistry::find(std::string_view type) const {
  for (const auto& entry : entries_) {
    if (entry.info.type == type) return &entry;
  }
  return nullptr;
}

std::vector<std::string> ProcessorRegistry::types() const {
  std::vector<std::string> out = coreTypes();
  for (const auto& entry : entries_) out.push_back(entry.info.type);
  std::sort(out.begin(), out.end());
  return out;
}

std::unique_ptr<Processor> ProcessorRegistry::create(std::string_view type, const ConfigNode& config,
                                                     std::string_view path, const ProcessorContext& context) const {
  const Entry* entry = find(type);
  QPIPE_CHECK(entry != nullptr, "no factory for processor type '", type, "'");
  const ConfigNode validated = entry->info.schema.validate(config, path);
  const std::string where = detail::concat(config.location().str(), ": ", path, ": processor '", type, "' (plugin '",
                                           entry->plugin, "') could not be created: ");
  ProcessorContext scoped = context;
  scoped.configPath = path;
  std::unique_ptr<Processor> created;
  try {
    created = entry->info.factory(validated, scoped);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kConfig) throw;  // already names the file, line and field
    throw Error(e.code() == ErrorCode::kInternal ? ErrorCode::kPlugin : e.code(), where + e.what());
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kPlugin, where + e.what());
  } catch (...) {
    throw Error(ErrorCode::kPlugin, where + "unknown exception (not derived from std::exception)");
  }
  QPIPE_REQUIRE(created != nullptr, ErrorCode::kPlugin, where, "the factory returned no processor");
  return guardProcessor(std::move(created), std::string(type), entry->plugin, entry->owner);
}

}  // namespace qpipe
