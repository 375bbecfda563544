// Supervised fine-tuning samples for training processors (docs/data.md): each chat record rendered
// in the model's chat format and tokenized, its labels -100 everywhere but on the last assistant
// turn (that turn's content and its end-of-turn token), as HF trainers mask an SFT sample.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "qpipe/dataset.h"

namespace qpipe {

class Tokenizer;

// How a model renders a chat, read from its tokenizer_config.json `chat_template`:
//   kChatMl  "<|im_start|>{role}\n{content}<|im_end|>\n" per turn (SmolLM2, Qwen2/2.5/3): a
//            template that adds a default system turn when the chat has none (its literal
//            '<|im_start|>system\n…<|im_end|>') keeps doing so;
//   kPlain   no chat template: renderPlainChat's "{role}: {content}\n", the turn's end the newline.
// Another template is Error(kInput): qpipe renders no Jinja, and a guess would train on a format the
// model never sees.
struct ChatFormat {
  enum class Kind { kPlain, kChatMl };
  Kind kind = Kind::kPlain;
  std::string defaultSystem;  // kChatMl: the system turn's content added to chats without one

  static ChatFormat fromModel(const std::filesystem::path& modelDir);
};

struct SftSample {
  at::Tensor ids;     // [1, seq] int64
  at::Tensor labels;  // [1, seq] int64: the ids on the supervised tokens, -100 elsewhere
  int64_t supervised = 0;
  std::string origin;
};

// The first `count` records (all when 0), each cut to `maxTokens`. Every record must be a chat whose
// last turn is the assistant's, with a token of it within `maxTokens`: else Error(kInput) naming
// the record.
std::vector<SftSample> sftSamples(const std::vector<DataSample>& records, const Tokenizer& tokenizer,
                                  const ChatFormat& format, int64_t count, int64_t maxTokens);

}  // namespace qpipe
