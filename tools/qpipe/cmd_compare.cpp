// qpipe compare A B: are two checkpoint folders the same model? Tensor by tensor across all
// safetensors shards (so sharding does not matter), JSON files by value, other files by bytes.
// quant_report.json is skipped: it records timings, which differ between any two runs.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>

#include "commands.h"
#include "option_checks.h"
#include "qpipe/error.h"
#include "qpipe/input_file.h"
#include "qpipe/safetensors.h"

namespace qpipe::cli {

namespace {

namespace fs = std::filesystem;

struct CompareOptions {
  std::string left;
  std::string right;
  double tolerance = 0;
};

struct Folder {
  fs::path dir;
  std::set<std::string> files;  // names, safetensors shards and quant_report.json excluded
  std::map<std::string, std::shared_ptr<const safetensors::File>> tensors;  // tensor -> its shard
};

Folder scan(const std::string& path) {
  Folder folder{.dir = path};
  QPIPE_REQUIRE(fs::is_directory(folder.dir), ErrorCode::kInput, "'", path, "' is not a folder");
  for (const auto& entry : fs::directory_iterator(folder.dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    if (name == "quant_report.json") continue;
    if (entry.path().extension() != ".safetensors") {
      folder.files.insert(name);
      continue;
    }
    const auto file = safetensors::File::open(entry.path());
    for (const auto& info : file->tensors()) {
      QPIPE_REQUIRE(folder.tensors.emplace(info.name, file).second, ErrorCode::kInput, path, ": tensor ", info.name,
                    " is in two shards");
    }
  }
  // Two folders without weights would compare "equal": the wrong folders, not a checkpoint.
  QPIPE_REQUIRE(!folder.tensors.empty(), ErrorCode::kInput, "'", path, "' holds no tensors (no .safetensors file)");
  return folder;
}

// Index files name their shards, which is layout, not content: they compare equal when their
// weight maps list the same tensors.
bool sameFile(const fs::path& left, const fs::path& right) {
  const std::string a = readInputFile(left);
  const std::string b = readInputFile(right);
  if (left.extension() != ".json") return a == b;
  nlohmann::json x = nlohmann::json::parse(a, nullptr, false);
  nlohmann::json y = nlohmann::json::parse(b, nullptr, false);
  if (x.is_discarded() || y.is_discarded()) return a == b;
  if (left.filename().string().ends_with(".index.json")) {
    for (auto* index : {&x, &y}) {
      if (!index->contains("weight_map")) continue;
      for (auto& [tensor, shard] : (*index)["weight_map"].items()) shard = "";
      index->erase("metadata");
    }
  }
  return x == y;
}

std::string shapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// max |a - b| / max |a| over the tensor (floating point), or the fraction of elements that
// differ (integers: quantized values one rounding step apart, packed words).
double difference(const at::Tensor& a, const at::Tensor& b) {
  if (at::isFloatingType(a.scalar_type())) {
    const at::Tensor x = a.to(at::kDouble);
    const at::Tensor y = b.to(at::kDouble);
    const double scale = x.abs().max().item<double>();
    const double diff = (x - y).abs().max().item<double>();
    return scale > 0 ? diff / scale : diff;
  }
  return a.ne(b).to(at::kDouble).mean().item<double>();
}

void compare(const CompareOptions& options) {
  const Folder left = scan(options.left);
  const Folder right = scan(options.right);
  // Every difference: A's tensors in name order, then those only in B, then the other files. Those
  // of values are listed in the table, the others below the summary; the first is the error's.
  struct Problem {
    std::string text;
    bool inTable = false;
  };
  std::vector<Problem> problems;
  int64_t identical = 0, withinTolerance = 0, overTolerance = 0, otherLayout = 0, onlyLeft = 0, onlyRight = 0;
  const std::string tolerance = (std::ostringstream() << options.tolerance).str();
  std::ostringstream table;
  table << std::left << std::setw(56) << "tensor" << std::setw(10) << "dtype" << std::setw(20) << "shape"
        << std::setw(12) << "difference"
        << "--tolerance " << tolerance << "\n";

  for (const auto& [name, file] : left.tensors) {
    const auto other = right.tensors.find(name);
    if (other == right.tensors.end()) {
      ++onlyLeft;
      problems.push_back({"tensor " + name + " only in " + options.left});
      continue;
    }
    const safetensors::TensorInfo& a = *file->find(name);
    const safetensors::TensorInfo& b = *other->second->find(name);
    if (a.dtype != b.dtype || a.shape != b.shape) {
      ++otherLayout;
      problems.push_back(
          {"tensor " + name + ": " + a.dtype + shapeText(a.shape) + " vs " + b.dtype + shapeText(b.shape)});
      continue;
    }
    const at::Tensor x = file->tensor(name);
    const at::Tensor y = other->second->tensor(name);
    if (std::memcmp(x.data_ptr(), y.data_ptr(), a.end - a.begin) == 0) {
      ++identical;
      continue;
    }
    const double diff = difference(x, y);
    const bool within = diff <= options.tolerance;
    std::ostringstream value;
    value << std::setprecision(3) << diff;
    table << std::setw(56) << name << std::setw(10) << a.dtype << std::setw(20) << shapeText(a.shape) << std::setw(12)
          << value.str() << (within ? "within" : "over") << "\n";
    if (within) {
      ++withinTolerance;
    } else {
      ++overTolerance;
      problems.push_back(
          {"tensor " + name + " differs (" + value.str() + ", over --tolerance " + tolerance + ")", true});
    }
  }
  for (const auto& [name, file] : right.tensors) {
    if (left.tensors.contains(name)) continue;
    ++onlyRight;
    problems.push_back({"tensor " + name + " only in " + options.right});
  }
  int64_t sameFiles = 0;
  for (const std::string& name : left.files) {
    if (!right.files.contains(name)) {
      problems.push_back({"file " + name + " only in " + options.left});
    } else if (sameFile(left.dir / name, right.dir / name)) {
      ++sameFiles;
    } else {
      problems.push_back({"file " + name + " differs"});
    }
  }
  for (const std::string& name : right.files) {
    if (!left.files.contains(name)) problems.push_back({"file " + name + " only in " + options.right});
  }

  if (withinTolerance + overTolerance > 0) std::cout << table.str();
  const int64_t different = overTolerance + otherLayout + onlyLeft + onlyRight;
  std::cout << identical + withinTolerance + different << " tensors: " << identical << " byte-identical, "
            << withinTolerance << " within --tolerance " << tolerance << ", " << different << " different";
  if (different > 0) {
    std::cout << " (" << overTolerance << " over the tolerance, " << otherLayout << " of another dtype or shape, "
              << onlyLeft << " only in " << options.left << ", " << onlyRight << " only in " << options.right << ")";
  }
  std::cout << "; " << sameFiles << " other files equal (quant_report.json not compared)\n";
  for (const Problem& problem : problems) {
    if (!problem.inTable) std::cout << "  " << problem.text << "\n";
  }
  QPIPE_REQUIRE(problems.empty(), ErrorCode::kInput, options.left, " and ", options.right,
                " differ: ", problems.front().text, problems.size() > 1 ? " (and more, listed above)" : "");
}

}  // namespace

Subcommand setupCompare(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "compare", "Compare two checkpoint folders tensor by tensor (e.g. the outputs of 1 and N ranks)");
  auto options = std::make_shared<CompareOptions>();
  app->add_option("left", options->left, "First checkpoint folder")->required()->check(path());
  app->add_option("right", options->right, "Second checkpoint folder")->required()->check(path());
  app->add_option("--tolerance", options->tolerance,
                  "Largest difference accepted where tensors are not byte-identical: max|a-b|/max|a| for "
                  "floating point, the fraction of differing elements for integers")
      ->capture_default_str()
      ->check(number(0));
  return {app, [options] { compare(*options); }};
}

}  // namespace qpipe::cli
