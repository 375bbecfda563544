// Calibration and evaluation text, read from files in msmodelslim's styles (docs/data.md).
//
//   .jsonl  one JSON object per line (blank lines are skipped)
//   .json   an array of such objects, or an object with a single member holding that array
//   .txt    one sample per paragraph; paragraphs are separated by blank lines
//
// A JSON record holds exactly one of these shapes (other members are ignored):
//   {"text": "..."}                                             plain text
//   {"messages": [{"role": "user", "content": "..."}, ...]}     chat
//   {"conversations": [{"from": "human", "value": "..."}, ...]} ShareGPT chat; human -> user,
//                                                               gpt -> assistant, others as written
//   {"instruction": "...", "input": "...", "output": "..."}     a pair: instruction and input (either
//                                                               may be missing or empty, not both)
//                                                               make the user turn, output (optional)
//                                                               the assistant turn
// Chats and pairs keep their turns, so that a model's own chat template can render them later;
// their `text` is the plain template, one line per turn: "<role>: <content>\n".
//
// Loading is strict: a malformed line, a missing field, a wrong type, an empty value or a file
// without samples is Error(kInput) naming the file and the line (.jsonl), the record (.json) or
// the paragraph (.txt). A file that cannot be read is Error(kIo).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace qpipe {

struct ChatTurn {
  std::string role;
  std::string content;
};

struct DataSample {
  std::string text;             // plain text, or the turns in the plain template
  std::vector<ChatTurn> turns;  // empty for plain text
  std::string origin;           // where it was read: "calib.jsonl:17", "calib.json: record 3"
};

struct DatasetOptions {
  int64_t maxSamples = 0;  // the first N samples of the file; 0 = all
};

std::vector<DataSample> loadDataset(const std::filesystem::path& path, const DatasetOptions& options = {});

class Tokenizer;

// The token stream of a data file, the one path of `qpipe eval` and of calibration (docs/data.md):
// the samples' texts joined with blank lines (joinEvalTexts), tokenized once without special
// tokens.
struct TokenStream {
  std::vector<int64_t> ids;
  size_t texts = 0;  // samples read
};
TokenStream encodeDataset(const std::filesystem::path& path, const Tokenizer& tokenizer,
                          const DatasetOptions& options = {});

// The first `count` tokens of encodeDataset's stream, tokenizing only the texts that hold them and
// the one after (a text's last tokens can depend on what follows it; its first ones do not): what
// a run reads that only probes. Error(kInput) naming the file when the whole stream is shorter.
std::vector<int64_t> encodeDatasetPrefix(const std::filesystem::path& path, const Tokenizer& tokenizer, int64_t count);

// Calibration samples: the first `count` windows of `seqLen` tokens of the stream, each [1, seqLen]
// int64, non-overlapping from the start (as perplexity windows are cut). Fewer, with a warning naming `origin`, when
// the stream is short; Error(kInput) naming `origin` when not one window fits.
std::vector<at::Tensor> calibrationWindows(const TokenStream& stream, const std::string& origin, int64_t count,
                                           int64_t seqLen);

// The plain chat template: "<role>: <content>\n" for each turn, concatenated.
std::string renderPlainChat(const std::vector<ChatTurn>& turns);

}  // namespace qpipe
