// An in-process mutation fuzzer for every parser a user's file reaches (CONTRIBUTING.md, Fuzzing):
//   qpipe_fuzz TARGET SECONDS CORPUS_DIR [FINDINGS_DIR]
// TARGET is safetensors, gguf, tokenizer, config, yaml or data. Each execution mutates a corpus
// file (bit flips, byte edits, insertions and deletions of random or JSON/YAML-significant bytes,
// truncation, splices with another corpus file) and gives the result to the parser. qpipe::Error
// is the expected outcome of a bad file; anything else is a finding:
//   - another exception escaping the parser (a LibTorch or nlohmann error not translated);
//   - a crash (SIGSEGV, SIGFPE, SIGABRT, …) or an input that runs past 10 s (a hang).
// Before each execution the input is written to FINDINGS_DIR/current-TARGET, so a crash or a hang
// leaves it there; an escaped exception is saved as FINDINGS_DIR/finding-TARGET-N. Prints one line:
// target, executions, seconds, executions per second, findings. Exit status 1 on a finding.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "qpipe/config_node.h"
#include "qpipe/dataset.h"
#include "qpipe/error.h"
#include "qpipe/host/gguf.h"
#include "qpipe/log.h"
#include "qpipe/model.h"
#include "qpipe/safetensors.h"
#include "qpipe/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr unsigned kHangSeconds = 10;

std::string readBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void writeBytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Where the input of the running execution lies, for the signal handler.
std::string currentPath;

void onFatalSignal(int signal) {
  const char* name = signal == SIGALRM ? "hang (over 10 s)" : strsignal(signal);
  const std::string line = "finding: " + std::string(name) + "; the input is " + currentPath + "\n";
  [[maybe_unused]] const ssize_t written = ::write(2, line.data(), line.size());
  ::signal(signal == SIGALRM ? SIGABRT : signal, SIG_DFL);
  ::raise(signal == SIGALRM ? SIGABRT : signal);
}

// The parser under test, given a file that holds the input.
using Target = std::function<void(const fs::path& input, const fs::path& scratch)>;

std::map<std::string, Target> targets() {
  return {
      {"safetensors",
       [](const fs::path& input, const fs::path&) {
         const auto file = qpipe::safetensors::File::open(input);
         for (const auto& info : file->tensors()) file->tensor(info.name).sum();
       }},
      {"gguf",
       [](const fs::path& input, const fs::path&) {
         const auto file = qpipe::gguf::File::open(input);
         (void)file->tensors();
       }},
      {"tokenizer",
       [](const fs::path& input, const fs::path&) {
         const auto tokenizer = qpipe::Tokenizer::fromFile(input);
         tokenizer.encode("the quick brown fox, 12 dogs: héllo\n\tworld <|im_start|>", true);
       }},
      {"config", [](const fs::path& input, const fs::path&) { qpipe::ModelConfig::fromFile(input); }},
      {"yaml",
       [](const fs::path& input, const fs::path&) {
         const qpipe::ConfigNode node = qpipe::ConfigNode::loadYamlFile(input);
         (void)node.toYaml();
       }},
      {"data",
       [](const fs::path& input, const fs::path& scratch) {
         // The format follows the extension: the same bytes as JSON lines and as plain text.
         for (const char* extension : {".jsonl", ".txt"}) {
           const fs::path named = scratch / (std::string("data") + extension);
           fs::copy_file(input, named, fs::copy_options::overwrite_existing);
           qpipe::loadDataset(named);
         }
       }},
  };
}

// Bytes a parser of these formats treats specially.
const std::vector<std::string> kTokens = {"{",
                                          "}",
                                          "[",
                                          "]",
                                          "\"",
                                          ":",
                                          ",",
                                          "-",
                                          "0",
                                          "-1",
                                          "1e309",
                                          "NaN",
                                          "null",
                                          "true",
                                          "\\u0000",
                                          "\n",
                                          "- ",
                                          ": ",
                                          "&a",
                                          "*a",
                                          "<<",
                                          "18446744073709551615",
                                          "9223372036854775807",
                                          "\xff",
                                          "\x80"};

std::string mutate(std::string data, const std::vector<std::string>& corpus, std::mt19937_64& rng) {
  const auto below = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  const int edits = 1 + static_cast<int>(below(4));
  for (int e = 0; e < edits; ++e) {
    switch (below(8)) {
      case 0:
        if (!data.empty()) data[below(data.size())] ^= static_cast<char>(1 << below(8));
        break;
      case 1:
        if (!data.empty()) data[below(data.size())] = static_cast<char>(rng());
        break;
      case 2:
        data.insert(below(data.size() + 1), 1 + below(8), static_cast<char>(rng()));
        break;
      case 3:
        if (!data.empty()) {
          const size_t at = below(data.size());
          data.erase(at, 1 + below(std::min<size_t>(64, data.size() - at)));
        }
        break;
      case 4:
        data.insert(below(data.size() + 1), kTokens[below(kTokens.size())]);
        break;
      case 5:
        data.resize(below(data.size() + 1));
        break;
      case 6:
        if (!data.empty()) {  // repeat a piece: deeper nesting, longer runs
          const size_t at = below(data.size()), length = 1 + below(std::min<size_t>(32, data.size() - at));
          const std::string piece = data.substr(at, length);
          for (size_t i = 0, n = 1 + below(64); i < n; ++i) data.insert(at, piece);
        }
        break;
      default: {
        const std::string& other = corpus[below(corpus.size())];
        if (!other.empty()) {
          const size_t from = below(other.size());
          data.insert(below(data.size() + 1), other.substr(from, 1 + below(other.size() - from)));
        }
      }
    }
  }
  return data;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4 || argc > 5) {
    std::cerr << "usage: qpipe_fuzz TARGET SECONDS CORPUS_DIR [FINDINGS_DIR]\n";
    return 2;
  }
  const std::string name = argv[1];
  const double seconds = std::stod(argv[2]);
  const fs::path corpusDir = argv[3];
  const fs::path findings = argc == 5 ? fs::path(argv[4]) : fs::temp_directory_path() / "qpipe-fuzz";
  const std::map<std::string, Target> all = targets();
  const auto target = all.find(name);
  if (target == all.end()) {
    std::cerr << "qpipe_fuzz: unknown target '" << name << "' (safetensors, gguf, tokenizer, config, yaml, data)\n";
    return 2;
  }
  std::vector<std::string> corpus;
  for (const auto& entry : fs::directory_iterator(corpusDir)) {
    if (entry.is_regular_file()) corpus.push_back(readBytes(entry.path()));
  }
  if (corpus.empty()) {
    std::cerr << "qpipe_fuzz: no seed files in " << corpusDir << "\n";
    return 2;
  }
  qpipe::log::setLevel("off");
  const fs::path scratch = findings / ("scratch-" + name);
  fs::create_directories(scratch);
  const fs::path input = findings / ("current-" + name);
  currentPath = input.string();
  for (const int signal : {SIGSEGV, SIGFPE, SIGBUS, SIGILL, SIGABRT, SIGALRM}) ::signal(signal, onFatalSignal);

  std::mt19937_64 rng(0x5eed);
  int64_t executions = 0, found = 0;
  const auto start = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - start).count() < seconds) {
    // Half the executions start from a seed, half go on from a seed mutated twice over.
    std::string data = corpus[rng() % corpus.size()];
    data = mutate(std::move(data), corpus, rng);
    if (rng() % 2 == 0) data = mutate(std::move(data), corpus, rng);
    writeBytes(input, data);
    ::alarm(kHangSeconds);
    try {
      target->second(input, scratch);
    } catch (const qpipe::Error&) {
      // A bad file, reported as one: what the parser is for.
    } catch (const std::exception& e) {
      const fs::path saved = findings / ("finding-" + name + "-" + std::to_string(found));
      writeBytes(saved, data);
      std::cerr << "finding: " << qpipe::oneLine(e) << " escaped; the input is " << saved.string() << "\n";
      ++found;
    }
    ::alarm(0);
    ++executions;
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("%s executions=%lld seconds=%.1f per_second=%.0f findings=%lld\n", name.c_str(),
              static_cast<long long>(executions), elapsed, static_cast<double>(executions) / elapsed,
              static_cast<long long>(found));
  fs::remove(input);
  return found == 0 ? 0 : 1;
}
