// The real model, converted by tools/setup.sh into .cache/models/smollm2-135m, against
// transformers and tokenizers: tokenizer ids, greedy decoding, `qpipe eval`'s perplexity, and the
// SFT samples of data/sft.jsonl against the model's own chat template.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sstream>

#include "qpipe/dataset.h"
#include "qpipe/model.h"
#include "qpipe/safetensors.h"
#include "qpipe/sft.h"
#include "qpipe/tokenizer.h"
#include "test_helpers.h"

namespace qpipe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const fs::path kModel = fs::path(QPIPE_SOURCE_DIR) / ".cache/models/smollm2-135m";
const fs::path kData = fs::path(QPIPE_SOURCE_DIR) / "data";

class SmolLM2 : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(kModel / "config.json")) << kModel << " is missing: run tools/setup.sh";
  }
};

// A data-free run tokenizes only the start of its calibration file, for the report's probe: it
// must be the start of the stream a calibrating run cuts its windows from, also where a text's
// last token changes with the text after it ("hello  " ends in "ĠĠ" alone, "ĠĠĊ" before a blank line).
TEST_F(SmolLM2, ProbeTokensAreTheStartOfTheWholeStream) {
  const Tokenizer tokenizer = Tokenizer::fromFile(kModel / "tokenizer.json");
  const fs::path edges =
      test::writeTempFile("edges.jsonl", "{\"text\": \"hello  \"}\n{\"text\": \"x\\n\"}\n{\"text\": \"world\"}\n");
  for (const fs::path& data : {kData / "calib.jsonl", kData / "eval.jsonl", edges}) {
    const std::vector<int64_t> whole = encodeDataset(data, tokenizer).ids;
    for (const size_t count : {size_t{1}, size_t{2}, size_t{5}, size_t{32}, size_t{512}, whole.size()}) {
      if (count > whole.size()) continue;
      EXPECT_EQ(encodeDatasetPrefix(data, tokenizer, static_cast<int64_t>(count)),
                std::vector<int64_t>(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(count)))
          << data << ", " << count << " tokens";
    }
  }
  const size_t tokens = encodeDataset(edges, tokenizer).ids.size();
  EXPECT_EQ(test::errorOf([&] { encodeDatasetPrefix(edges, tokenizer, static_cast<int64_t>(tokens) + 1); },
                          ErrorCode::kInput),
            concat(edges.string(), ": ", tokens, " tokens, fewer than the ", tokens + 1,
                   " the report's probe reads (--probe_tokens)"));
}

TEST_F(SmolLM2, TokenizerMatchesHuggingFaceOnRealLines) {
  std::vector<std::string> lines;
  for (const char* file : {"eval.jsonl", "calib.jsonl"}) {
    for (const auto& sample : loadDataset(kData / file)) {
      std::string text = sample.text;
      for (size_t start = 0; start < text.size();) {  // every line, and every paragraph whole
        const size_t end = std::min(text.find('\n', start), text.size());
        if (end > start) lines.push_back(text.substr(start, end - start));
        start = end + 1;
      }
      lines.push_back(text);
    }
  }
  ASSERT_GE(lines.size(), 1000u);
  const fs::path linesFile = test::writeTempFile("lines.json", Json(lines).dump());
  const fs::path expectedFile = linesFile.parent_path() / "expected.json";
  test::runOracle("smollm2_oracle.py",
                  "encode " + kModel.string() + " " + linesFile.string() + " " + expectedFile.string());
  const Json expected = Json::parse(std::ifstream(expectedFile));
  const Tokenizer tokenizer = Tokenizer::fromFile(kModel / "tokenizer.json");
  size_t mismatches = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (tokenizer.encode(lines[i]) != expected[i].get<std::vector<int64_t>>()) {
      if (++mismatches <= 5) ADD_FAILURE() << "line " << i << " differs: " << lines[i];
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << lines.size() << " lines";
}

TEST_F(SmolLM2, SftSamplesAreTheChatTemplatesTokensWithTheLastAssistantTurnSupervised) {
  constexpr int64_t kCount = 24, kSeq = 384;  // some chats longer than kSeq: cut like the oracle's
  std::istringstream lines(test::runOracle(
      "sft_oracle.py", concat(kModel.string(), " ", (kData / "sft.jsonl").string(), " ", kCount, " ", kSeq)));
  const ChatFormat format = ChatFormat::fromModel(kModel);
  EXPECT_EQ(format.kind, ChatFormat::Kind::kChatMl);
  EXPECT_EQ(format.defaultSystem, "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  const std::vector<SftSample> samples = sftSamples(
      loadDataset(kData / "sft.jsonl"), Tokenizer::fromFile(kModel / "tokenizer.json"), format, kCount, kSeq);
  ASSERT_EQ(samples.size(), static_cast<size_t>(kCount));
  std::string line;
  int64_t cut = 0;
  for (const SftSample& sample : samples) {
    ASSERT_TRUE(std::getline(lines, line));
    const Json expected = Json::parse(line);
    const auto ids = expected["ids"].get<std::vector<int64_t>>();
    const auto labels = expected["labels"].get<std::vector<int64_t>>();
    SCOPED_TRACE(sample.origin);
    EXPECT_EQ(std::vector<int64_t>(sample.ids.data_ptr<int64_t>(), sample.ids.data_ptr<int64_t>() + sample.ids.numel()),
              ids);
    EXPECT_EQ(std::vector<int64_t>(sample.labels.data_ptr<int64_t>(),
                                   sample.labels.data_ptr<int64_t>() + sample.labels.numel()),
              labels);
    cut += sample.ids.size(1) == kSeq;
  }
  EXPECT_GT(cut, 0);
  EXPECT_LT(cut, kCount);
}

TEST_F(SmolLM2, LogitsMatchTransformers) {
  c10::InferenceMode inference;
  const Tokenizer tokenizer = Tokenizer::fromFile(kModel / "tokenizer.json");
  const std::string text = loadDataset(kData / "eval.jsonl", {.maxSamples = 1})[0].text;
  std::vector<int64_t> prefix = tokenizer.encode(text);
  prefix.resize(std::min<size_t>(prefix.size(), 96));
  const at::Tensor ids = at::tensor(prefix, at::kLong).unsqueeze(0);
  const fs::path dir = test::testDir();
  const auto save = [&](const std::string& name, const at::Tensor& t) {
    safetensors::Writer writer(dir, {.filePrefix = name});
    writer.add(name, t);
    writer.finish();
    return (dir / (name + ".safetensors")).string();
  };
  const std::string idsFile = save("ids", ids), maskFile = save("mask", at::ones_like(ids));
  test::runOracle("model_oracle.py", "logits " + kModel.string() + " " + idsFile + " " + maskFile + " " +
                                         (dir / "ref.safetensors").string());
  const at::Tensor reference = safetensors::File::open(dir / "ref.safetensors")->tensor("logits");
  const at::Tensor ours = CausalLM::open(kModel)->forward(ids);
  const double relative = (ours - reference).abs().max().item<double>() / reference.abs().max().item<double>();
  EXPECT_LE(relative, 1e-4);
}

TEST_F(SmolLM2, GreedyDecodingMatchesTransformersAndReadsWell) {
  c10::InferenceMode inference;
  const std::string prompt = "The capital of France is";
  const int newTokens = 8;
  const Json expected = Json::parse(test::runOracle(
      "smollm2_oracle.py", "greedy " + kModel.string() + " '" + prompt + "' " + std::to_string(newTokens)));
  const Tokenizer tokenizer = Tokenizer::fromFile(kModel / "tokenizer.json");
  auto model = CausalLM::open(kModel);
  std::vector<int64_t> ids = tokenizer.encode(prompt);
  for (int step = 0; step < newTokens; ++step) {
    const at::Tensor logits = model->forward(at::tensor(ids, at::kLong).unsqueeze(0));
    ids.push_back(logits[0][-1].argmax().item<int64_t>());
  }
  EXPECT_EQ(ids, expected.get<std::vector<int64_t>>());
  const std::string text = tokenizer.decode(ids);
  EXPECT_NE(text.find("Paris"), std::string::npos) << text;
}

TEST_F(SmolLM2, EvalPerplexityMatchesTransformersWithinATenthOfAPercent) {
  const fs::path json = test::writeTempFile("eval.json", "");
  const std::string data = (kData / "eval.jsonl").string();
  const std::string command = std::string(QPIPE_BINARY) + " eval --model_path " + kModel.string() + " --data " + data +
                              " --seq_len 256 --max_samples 24 --output_json " + json.string() + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const Json ours = Json::parse(std::ifstream(json));
  const Json reference =
      Json::parse(test::runOracle("smollm2_oracle.py", "ppl " + kModel.string() + " " + data + " 256 24"));
  EXPECT_EQ(ours["tokens"], reference["tokens"]);
  const double relative = std::abs(ours["perplexity"].get<double>() / reference["ppl"].get<double>() - 1);
  EXPECT_LT(relative, 1e-3) << "qpipe " << ours["perplexity"] << " vs transformers " << reference["ppl"];
}

}  // namespace
}  // namespace qpipe
