#include "qpipe/host/report.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "qpipe/quant_linear.h"

namespace qpipe {
namespace {

nlohmann::json errorJson(double relativeMse) {
  return relativeMse >= 0 ? nlohmann::json(relativeMse) : nlohmann::json();
}

}  // namespace

std::string QuantReport::describe(Module& module) {
  auto* linear = dynamic_cast<QuantLinear*>(&module);
  if (linear == nullptr) return module.typeName();
  std::string text = "w " + linear->weightScheme().name();
  const auto& input = linear->inputQuant();
  if (!input || input->scheme.dtype == quant::QDtype::kFloat) return text + ", a float";
  return text + ", a " + input->scheme.name() + (input->isDynamic() ? " dynamic" : " static");
}

std::string QuantReport::toJson() const {
  nlohmann::json layersJson = nlohmann::json::array();
  for (const auto& layer : layers) {
    nlohmann::json modules = nlohmann::json::array();
    for (const auto& module : layer.modules) {
      modules.push_back(
          {{"name", module.name}, {"scheme", module.scheme}, {"relative_mse", errorJson(module.relativeMse)}});
    }
    nlohmann::json entry = {
        {"name", layer.name},
        {"seconds", layer.seconds},
        {"processor_seconds", layer.processorSeconds},
        {"sync", {{"collectives", layer.syncCollectives}, {"bytes", layer.syncBytes}, {"seconds", layer.syncSeconds}}},
        {"modules", modules}};
    entry["relative_mse"] = errorJson(layer.relativeMse);
    // What processors reported: {module: {key: value}}.
    if (!layer.values.empty()) {
      nlohmann::json values = nlohmann::json::object();
      for (const ReportValue& value : layer.values) values[value.module][value.key] = value.value;
      entry["values"] = std::move(values);
    }
    layersJson.push_back(std::move(entry));
  }
  const nlohmann::json json = {{"total_seconds", totalSeconds}, {"layers", layersJson}};
  return json.dump(2) + "\n";
}

std::string LayerReport::serialize() const {
  nlohmann::json modulesJson = nlohmann::json::array();
  for (const ModuleReport& module : modules) modulesJson.push_back({module.name, module.scheme, module.relativeMse});
  nlohmann::json valuesJson = nlohmann::json::array();
  for (const ReportValue& value : values) valuesJson.push_back({value.module, value.key, value.value});
  return nlohmann::json{{"name", name},
                        {"seconds", seconds},
                        {"processor_seconds", processorSeconds},
                        {"relative_mse", relativeMse},
                        {"modules", modulesJson},
                        {"sync", {syncCollectives, syncBytes, syncSeconds}},
                        {"values", valuesJson}}
      .dump();
}

LayerReport LayerReport::deserialize(const std::string& text) {
  const nlohmann::json json = nlohmann::json::parse(text);
  LayerReport report{.name = json["name"].get<std::string>(),
                     .seconds = json["seconds"].get<double>(),
                     .processorSeconds = json["processor_seconds"].get<std::vector<double>>(),
                     .relativeMse = json["relative_mse"].get<double>()};
  for (const auto& m : json["modules"]) {
    report.modules.push_back({m[0].get<std::string>(), m[1].get<std::string>(), m[2].get<double>()});
  }
  report.syncCollectives = json["sync"][0].get<int64_t>();
  report.syncBytes = json["sync"][1].get<int64_t>();
  report.syncSeconds = json["sync"][2].get<double>();
  for (const auto& v : json["values"]) {
    report.values.push_back({v[0].get<std::string>(), v[1].get<std::string>(), v[2].get<double>()});
  }
  return report;
}

namespace {

std::string format(const char* pattern, auto... values) {
  char buffer[256];
  std::snprintf(buffer, sizeof buffer, pattern, values...);
  return buffer;
}

}  // namespace

std::string QuantReport::summary(size_t worstModules) const {
  std::ostringstream out;
  out << format("%-24s %9s %8s %14s %14s\n", "layer", "seconds", "modules", "layer rel MSE", "worst module");
  const auto error = [](double relativeMse) {
    return relativeMse >= 0 ? format("%14.3e", relativeMse) : format("%14s", "-");
  };
  std::vector<const ModuleReport*> probed;
  size_t replaced = 0;
  for (const auto& layer : layers) {
    double worst = kNotProbed;
    for (const auto& module : layer.modules) {
      worst = std::max(worst, module.relativeMse);
      if (module.relativeMse >= 0) probed.push_back(&module);
    }
    replaced += layer.modules.size();
    out << format("%-24s %9.2f %8zu ", layer.name.c_str(), layer.seconds, layer.modules.size())
        << error(layer.relativeMse) << " " << error(worst) << "\n";
  }
  std::sort(probed.begin(), probed.end(), [](auto* a, auto* b) { return a->relativeMse > b->relativeMse; });
  if (!probed.empty()) out << "worst modules (relative MSE on the probe sample):\n";
  for (size_t i = 0; i < std::min(worstModules, probed.size()); ++i) {
    out << format("  %-40s %11.3e  %s\n", probed[i]->name.c_str(), probed[i]->relativeMse, probed[i]->scheme.c_str());
  }
  out << format("total: %zu units, %zu modules replaced, %.1f s\n", layers.size(), replaced, totalSeconds);
  return out.str();
}

}  // namespace qpipe
