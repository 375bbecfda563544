// Bad input as a careless or hostile user gives it (issue 17): each is one line naming the problem,
// before work starts where it can be, and nothing at --save_path. Each test checks the whole line.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include "qpipe/safetensors.h"
#include "test_helpers.h"
#include "tiny_model.h"

namespace {

namespace fs = std::filesystem;
using qpipe::test::CommandResult;

fs::path textFile() {
  return qpipe::test::writeTempFile(
      "text.txt", "the quick brown fox jumps over the lazy dog, then the dog sleeps. he thinks the fox is there.\n");
}

CommandResult eval(const fs::path& model, const std::string& more = "") {
  return qpipe::test::runQpipe("eval --model_path " + model.string() + " --data " + textFile().string() +
                               " --seq_len 16 " + more);
}

std::string inputError(const std::string& message) {
  return "qpipe: input error: " + message + "\n";
}

// The last line of `err` (the error, after any log lines), with its newline.
std::string lastLine(const std::string& err) {
  const size_t start = err.rfind('\n', err.size() >= 2 ? err.size() - 2 : 0);
  return start == std::string::npos || err.size() < 2 ? err : err.substr(start + 1);
}

// The one weights file of a checkpoint folder: compressed-tensors' or msmodelslim's.
fs::path weightsFile(const fs::path& dir) {
  return fs::exists(dir / "model.safetensors") ? dir / "model.safetensors" : dir / "quant_model_weights.safetensors";
}

// Tensor `name` of dir's weights file replaced by `replacement`.
void replaceTensor(const fs::path& dir, const std::string& name, const at::Tensor& replacement) {
  const fs::path file = weightsFile(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  {
    const auto source = qpipe::safetensors::File::open(file);
    for (const auto& info : source->tensors()) {
      tensors.emplace_back(info.name, info.name == name ? replacement : source->tensor(info.name).clone());
    }
  }
  fs::remove(file);
  qpipe::safetensors::Writer writer(dir, {.filePrefix = file.stem().string()});
  for (const auto& [tensorName, tensor] : tensors) writer.add(tensorName, tensor);
  writer.finish();
}

// The tiny Llama with tensor `name` replaced by `replacement`.
fs::path withTensor(const std::string& dirName, const std::string& name, const at::Tensor& replacement) {
  const fs::path dir = qpipe::test::tinyLlama(dirName);
  replaceTensor(dir, name, replacement);
  return dir;
}

// The tiny Llama with config.json replaced.
fs::path withConfig(const std::string& dirName, const std::string& json) {
  const fs::path dir = qpipe::test::tinyLlama(dirName);
  std::ofstream(dir / "config.json", std::ios::trunc) << json;
  return dir;
}

// A tiny model (the Llama unless given) quantized by `quant <args>` into testDir()/name, where its
// files are edited.
fs::path quantizedTiny(const std::string& name, const std::string& args, fs::path model = {}) {
  const fs::path out = qpipe::test::testDir() / name;
  fs::remove_all(out);
  if (model.empty()) model = qpipe::test::tinyLlama("float");
  const CommandResult r =
      qpipe::test::runQpipe("quant --model_path " + model.string() + " " + args + " --save_path " + out.string());
  EXPECT_EQ(r.exitCode, 0) << r.err;
  return out;
}

// A pipeline, written to temporary file `file`: one linear_quant step with the `qconfig` entries
// (e.g. "weight: {...}") over every Linear but lm_head, saved by `saver`.
fs::path linearQuantPipeline(const std::string& file, const std::vector<std::string>& qconfig,
                             const std::string& saver) {
  std::string yaml = "apiversion: modelslim_v1\nspec:\n  process:\n    - type: linear_quant\n      qconfig:\n";
  for (const std::string& entry : qconfig) yaml += "        " + entry + "\n";
  yaml += "      include: [\"*\"]\n      exclude: [\"lm_head\"]\n  save:\n    - {type: " + saver + "}\n";
  return qpipe::test::writeTempFile(file, yaml);
}

// The JSON file `file` rewritten by `edit`.
void editJson(const fs::path& file, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json json = nlohmann::json::parse(qpipe::test::slurp(file));
  edit(json);
  std::ofstream(file, std::ios::trunc) << json.dump(2);
}

const std::string kConfigHead =
    R"({"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, )";

TEST(Validation, ConfigValuesAreCheckedBeforeAnyDivisionOrAllocation) {
  const struct {
    const char* name;
    std::string rest;
    std::string error;
  } cases[] = {
      {"zero_heads", R"("num_hidden_layers": 2, "num_attention_heads": 0})",
       "num_attention_heads must be at least 1 (found 0)"},
      {"float_layers", R"("num_hidden_layers": 2.5, "num_attention_heads": 4})",
       "field 'num_hidden_layers' has the wrong type (2.5)"},
      {"indivisible", R"("num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 3})",
       "hidden_size (16) is not a multiple of num_attention_heads (3) and no head_dim is given"},
      {"kv_heads", R"("num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3})",
       "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"},
      {"eps", R"("num_hidden_layers": 2, "num_attention_heads": 4, "rms_norm_eps": -1})",
       "rms_norm_eps must be a positive number (found -1)"},
      // transformers refuses both, so they do not fall back to the defaults.
      {"null_eps", R"("num_hidden_layers": 2, "num_attention_heads": 4, "rms_norm_eps": null})",
       "rms_norm_eps is null; give a number or leave the field out"},
      {"null_theta",
       R"("num_hidden_layers": 2, "num_attention_heads": 4, "rope_parameters": {"rope_type": "default", "rope_theta": null}})",
       "rope_parameters.rope_theta is null; give a number or leave the field out"},
      {"gelu", R"("num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "gelu"})",
       "hidden_act 'gelu' is not supported; qpipe's llama, qwen2 and qwen3 families compute silu"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path dir = withConfig(std::string("config_") + c.name, kConfigHead + c.rest);
    const CommandResult r = eval(dir);
    EXPECT_EQ(r.exitCode, 5) << r.err;
    EXPECT_EQ(r.err, inputError((dir / "config.json").string() + ": " + c.error));
  }
  // An absurd layer count fails at once, not after allocating the layers.
  const fs::path dir =
      withConfig("config_layers", kConfigHead + R"("num_hidden_layers": 1000000000000, "num_attention_heads": 4})");
  const CommandResult r = eval(dir);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(r.err, inputError("checkpoint " + dir.string() +
                              ": config.json has num_hidden_layers 1000000000000, but the checkpoint holds 2 layers"));
  // Fewer than the checkpoint holds (the first layers, for a quick try) runs, but says so.
  const fs::path fewer = qpipe::test::tinyLlama("config_fewer");
  const std::string config = qpipe::test::slurp(fewer / "config.json");
  std::ofstream(fewer / "config.json", std::ios::trunc)
      << std::regex_replace(config, std::regex(R"("num_hidden_layers": \d+)"), R"("num_hidden_layers": 1)");
  const CommandResult dropped = eval(fewer);
  EXPECT_EQ(dropped.exitCode, 0) << dropped.err;
  EXPECT_NE(dropped.err.find("[warning] checkpoint " + fewer.string() +
                             " holds 2 layers, config.json's num_hidden_layers 1: only model.layers.0 to 0 are used "
                             "(and saved)"),
            std::string::npos)
      << dropped.err;
}

TEST(Validation, TensorsMustHaveTheShapeAndDtypeConfigJsonImplies) {
  const std::string q = "model.layers.1.self_attn.q_proj.weight";
  const struct {
    const char* name;
    std::string tensor;
    at::Tensor value;
    std::string error;
  } cases[] = {
      {"transposed", "model.layers.1.mlp.down_proj.weight", at::zeros({24, 16}),
       "tensor 'model.layers.1.mlp.down_proj.weight' has shape [24, 16], but config.json implies [16, 24]"},
      {"extra_dim", q, at::zeros({1, 16, 16}),
       "tensor '" + q + "' has shape [1, 16, 16], but config.json implies [16, 16]"},
      {"integer", "model.layers.0.input_layernorm.weight", at::zeros({16}, at::kInt),
       "tensor 'model.layers.0.input_layernorm.weight' has dtype I32; expected a floating-point dtype"},
      // FP8 passes as floating point, but without a scheme its scale is lost.
      {"fp8_unclaimed", q, at::zeros({16, 16}).to(at::kFloat8_e4m3fn),
       "tensor '" + q + "' is F8_E4M3, but config.json has no quantization_config"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path dir = withTensor(std::string("tensor_") + c.name, c.tensor, c.value);
    const CommandResult r = eval(dir);
    EXPECT_EQ(r.exitCode, 5) << r.err;
    EXPECT_EQ(r.err, inputError("checkpoint " + dir.string() + ": " + c.error));
  }
  const fs::path dir = qpipe::test::tinyLlama("tensor_missing", {q});
  const CommandResult r = eval(dir);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(r.err, inputError("checkpoint " + dir.string() + ": missing tensor '" + q + "'"));
}

// A quantized checkpoint whose quantization_config lost its schemes (edited by hand): its int8
// weights are refused by name, not handed to a float GEMM.
TEST(Validation, AQuantizedWeightNoSchemeClaimsIsRefused) {
  const fs::path out = quantizedTiny("unclaimed_w8a8", "--quant_type w8a8");
  editJson(out / "config.json",
           [](nlohmann::json& config) { config["quantization_config"]["config_groups"] = nlohmann::json::object(); });
  const CommandResult r = eval(out);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + out.string() +
                                        ": tensor 'model.layers.0.self_attn.q_proj.weight' is I8, but the checkpoint's "
                                        "quantization description gives 'model.layers.0.self_attn.q_proj' no scheme"));
}

// A quantized weight is checked against config.json in its format's layout, from the headers at
// open, and once more as its format unpacks it (a pack-quantized weight_shape is data): a head_dim
// edited by hand was an internal reshape error in the first attention.
TEST(Validation, AQuantizedWeightMustHaveTheShapeConfigJsonImplies) {
  const std::string q = "model.layers.0.self_attn.q_proj";
  const fs::path int8 = quantizedTiny("reshaped_w8a8", "--quant_type w8a8");
  editJson(int8 / "config.json", [](nlohmann::json& config) { config["head_dim"] = 2; });
  CommandResult r = eval(int8);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + int8.string() + ": tensor '" + q +
                                        ".weight' has shape [16, 16], but config.json implies [8, 16]"));
  // W8A16 is pack-quantized: four codes to an int32 word.
  const fs::path packed = quantizedTiny("reshaped_w8a16", "--quant_type w8a16");
  const fs::path config = qpipe::test::testDir() / "reshaped_w8a16.json";
  fs::copy_file(packed / "config.json", config, fs::copy_options::overwrite_existing);
  editJson(packed / "config.json", [](nlohmann::json& config) { config["head_dim"] = 2; });
  r = eval(packed);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + packed.string() + ": tensor '" + q +
                                        ".weight_packed' has shape [16, 4], but config.json implies [8, 4] (4 codes a "
                                        "word)"));
  // A weight_shape that packs into the same words, but not the shape config.json implies.
  fs::copy_file(config, packed / "config.json", fs::copy_options::overwrite_existing);
  at::Tensor shape = qpipe::safetensors::File::open(weightsFile(packed))->tensor(q + ".weight_shape").clone();
  shape[1] = 13;
  replaceTensor(packed, q + ".weight_shape", shape);
  r = eval(packed);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + packed.string() + ": the quantized weight of '" + q +
                                        "' holds [16, 13], but config.json implies [16, 16]"));
}

// A scale read from a checkpoint is never negative, and an activation's (which divides) never
// zero: a hand-edited scale ran, its sign flipping the weights it scaled (perplexity 8,046).
TEST(Validation, QuantizationScalesAreNeverNegativeAndDivisorsNeverZero) {
  const fs::path out = quantizedTiny("rescaled_w8a8_static", std::string("--config_path ") + QPIPE_SOURCE_DIR +
                                                                 "/configs/default/w8a8_static.yaml --calib_samples 4 "
                                                                 "--seq_len 32");
  const fs::path original = qpipe::test::testDir() / "rescaled_original.safetensors";
  fs::copy_file(out / "model.safetensors", original, fs::copy_options::overwrite_existing);
  const std::string module = "model.layers.1.mlp.down_proj.";
  for (const auto& [tensor, value, error] :
       {std::tuple{"weight_scale", -0.01, "holds -0.01 (its least value); a quantization scale is never negative"},
        std::tuple{"input_scale", 0.0, "holds 0 (its least value); a quantization scale is positive"}}) {
    SCOPED_TRACE(tensor);
    fs::copy_file(original, out / "model.safetensors", fs::copy_options::overwrite_existing);
    const auto stored = qpipe::safetensors::File::open(out / "model.safetensors");
    const at::Tensor scale = stored->tensor(module + tensor).clone();
    replaceTensor(out, module + tensor, at::full_like(scale, value));
    const CommandResult r = eval(out);
    EXPECT_EQ(r.exitCode, 5) << r.err;
    EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + out.string() + ": '" + module + tensor + "' " + error));
  }
  // Nor an integer tensor, whose values were taken for scales.
  fs::copy_file(original, out / "model.safetensors", fs::copy_options::overwrite_existing);
  replaceTensor(out, module + "input_scale", at::ones({1}, at::kInt));
  const CommandResult r = eval(out);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + out.string() + ": '" + module +
                                        "input_scale' is Int; a quantization scale is floating point"));
}

// An asymmetric checkpoint relabelled symmetric: its zero points were dropped without a word
// (perplexity 1.5e8).
TEST(Validation, ZeroPointsOfASymmetricSchemeAreRefused) {
  const fs::path pipeline = linearQuantPipeline(
      "w8a16_asymmetric.yaml", {"weight: {dtype: int8, scope: per_channel, symmetric: False, method: minmax}"},
      "compressed_tensors");
  const fs::path out = quantizedTiny("relabelled_symmetric", "--config_path " + pipeline.string());
  ASSERT_EQ(eval(out).exitCode, 0);
  editJson(out / "config.json", [](nlohmann::json& config) {
    for (auto& group : config["quantization_config"]["config_groups"]) group["weights"]["symmetric"] = true;
  });
  const CommandResult r = eval(out);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + out.string() +
                                        ": 'model.layers.0.self_attn.q_proj.weight_zero_point' holds non-zero zero "
                                        "points, but quantization_config gives the weights symmetric: true"));
}

// Zero points and offsets are integers in the range of the codes they shift, where every quantizer
// clamps them: a Bool tensor, a uint8 255 that meant -1, or an offset of 1e9 was read as a number.
TEST(Validation, ZeroPointsAreIntegersInTheirCodesRange) {
  // Each edit of a checkpoint starts from its file as quantized, kept beside it.
  const auto keep = [](const fs::path& out) {
    fs::copy_file(weightsFile(out), qpipe::test::testDir() / (out.filename().string() + ".safetensors"),
                  fs::copy_options::overwrite_existing);
  };
  const auto refused = [](const fs::path& out, const std::string& tensor, const at::Tensor& value,
                          const std::string& error, const std::string& more = "") {
    SCOPED_TRACE(tensor);
    fs::copy_file(qpipe::test::testDir() / (out.filename().string() + ".safetensors"), weightsFile(out),
                  fs::copy_options::overwrite_existing);
    const at::Tensor stored = qpipe::safetensors::File::open(weightsFile(out))->tensor(tensor);
    replaceTensor(out, tensor, value.expand(stored.sizes()).contiguous());
    const CommandResult r = eval(out, more);
    EXPECT_EQ(r.exitCode, 5) << r.err;
    EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + out.string() + ": '" + tensor + "' " + error));
  };
  const fs::path pipeline =
      linearQuantPipeline("w8a8_asymmetric_input.yaml",
                          {"act: {dtype: int8, scope: per_tensor, symmetric: False, method: minmax}",
                           "weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}"},
                          "compressed_tensors");
  const fs::path ct =
      quantizedTiny("asymmetric_input", "--config_path " + pipeline.string() + " --calib_samples 4 --seq_len 32");
  keep(ct);
  const std::string zeroPoint = "model.layers.1.mlp.down_proj.input_zero_point";
  refused(ct, zeroPoint, at::ones({1}, at::kBool), "is Bool; a zero point is an integer");
  refused(ct, zeroPoint, at::full({1}, 255, at::kByte), "holds 255; a zero point of int8 codes is in [-128, 127]");
  const fs::path ascend = quantizedTiny("ascend_offsets", std::string("--config_path ") + QPIPE_SOURCE_DIR +
                                                              "/configs/default/w8a8c8_ascendv1.yaml --calib_samples 4 "
                                                              "--seq_len 32");
  keep(ascend);
  refused(ascend, "model.layers.0.mlp.up_proj.weight_offset", at::full({1}, 1e9),
          "holds 1e+09; a zero point of int8 codes is in [-128, 127]");
  refused(ascend, "model.layers.0.self_attn.k_proj.kv_cache_offset", at::full({1}, -300.0),
          "holds -300; a zero point of int8 codes is in [-128, 127]");
  // --allow_non_finite is about weights: quantization parameters are checked always.
  refused(ascend, "model.layers.0.self_attn.k_proj.kv_cache_offset", at::full({1}, std::nan("")),
          "holds NaN; a zero point of int8 codes is in [-128, 127]", "--allow_non_finite");
  // C8's scales are checked as every other scale is.
  refused(ascend, "model.layers.0.self_attn.v_proj.kv_cache_scale", at::full({1}, -0.5),
          "holds -0.5 (its least value); a quantization scale is positive");
}

// MXFP4's E8M0 block scales: 255 is NaN, and from 253 up a block's values are past fp32's range;
// both reached the forward and were named only by the loss.
TEST(Validation, MxBlockScalesAreFiniteForFp32) {
  // The tiny Qwen3: MXFP4's blocks of 32 divide its widths, not the Llama's.
  const fs::path out = quantizedTiny(
      "mxfp4_exponents", std::string("--config_path ") + QPIPE_SOURCE_DIR + "/configs/default/w4a16_mxfp4.yaml",
      qpipe::test::tinyQwen3("float"));
  const std::string tensor = "model.layers.0.mlp.gate_proj.weight_scale";
  const at::Tensor original = qpipe::safetensors::File::open(weightsFile(out))->tensor(tensor).clone();
  for (const auto& [byte, error] :
       {std::pair{255, "holds E8M0 byte 255, NaN in the OCP MX format"},
        std::pair{253, "holds E8M0 byte 253 (2^126), whose FP4 values overflow fp32 (at most byte 252)"}}) {
    at::Tensor edited = original.clone();
    edited.view({-1})[3] = byte;
    replaceTensor(out, tensor, edited);
    const CommandResult r = eval(out);
    EXPECT_EQ(r.exitCode, 5) << r.err;
    EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + out.string() + ": '" + tensor + "' " + error));
  }
}

// compressed-tensors' targets and ignore entries are names or "re:" patterns: one std::regex cannot
// read (Python's named groups) or one that is not a string is named at its place, not an internal
// error from the first match.
TEST(Validation, QuantizationConfigTargetsAreNamesOrPatternsQpipeReads) {
  const fs::path out = quantizedTiny("targets_w8a8", "--quant_type w8a8");
  const nlohmann::json original = nlohmann::json::parse(qpipe::test::slurp(out / "config.json"));
  const std::string field = (out / "config.json").string() + ": quantization_config.";
  for (const auto& [key, value, error] :
       {std::tuple{"targets", nlohmann::json::array({"re:(?P<proj>q_proj)"}),
                   field + "config_groups.group_0.targets[0] 're:(?P<proj>q_proj)' is not a pattern qpipe reads "
                           "(Invalid '(?...)' zero-width assertion in regular expression): ECMAScript syntax, without "
                           "Python's (?P<name>...) groups, (?i) flags and back-references"},
        std::tuple{"ignore", nlohmann::json::array({"re:(q)_\\1"}),
                   field + "ignore[0] 're:(q)_\\1' is not a pattern qpipe reads (Unexpected back-reference in "
                           "polynomial mode.): ECMAScript syntax, without Python's (?P<name>...) groups, (?i) flags "
                           "and back-references"},
        // Matching recurses a level per element of the pattern: 100,000 overflowed the stack.
        std::tuple{"targets", nlohmann::json::array({"re:" + std::string(5000, 'x')}),
                   field + "config_groups.group_0.targets[0] 're:" + std::string(37, 'x') +
                       "…' is a pattern of 5000 characters; qpipe reads patterns of up to 4096"},
        std::tuple{"ignore", nlohmann::json::array({"lm_head", 7}),
                   field + "ignore[1] is 7, not a module name or \"re:\" pattern"}}) {
    SCOPED_TRACE(key);
    nlohmann::json config = original;
    if (std::string(key) == "targets") {
      config["quantization_config"]["config_groups"]["group_0"]["targets"] = value;
    } else {
      config["quantization_config"]["ignore"] = value;
    }
    std::ofstream(out / "config.json", std::ios::trunc) << config.dump(2);
    const CommandResult r = eval(out);
    EXPECT_EQ(r.exitCode, 5) << r.err;
    EXPECT_EQ(lastLine(r.err), inputError(error));
  }
  // A pattern that backtracks exponentially (here on every module name) is matched in linear time:
  // this evaluation hung before.
  nlohmann::json config = original;
  config["quantization_config"]["ignore"] = nlohmann::json::array({"lm_head", "re:(.*)*z"});
  std::ofstream(out / "config.json", std::ios::trunc) << config.dump(2);
  const CommandResult r = eval(out);
  EXPECT_EQ(r.exitCode, 0) << r.err;
}

// A link loop where a model's file or folder should be is an I/O error naming the path and the
// system's reason (it was "internal error: filesystem error: status: …" from the folder's check).
TEST(Validation, ALinkLoopInAModelIsNamed) {
  const fs::path model = qpipe::test::tinyLlama("loop_model");
  for (const char* file : {"model.safetensors", "tokenizer.json"}) {
    SCOPED_TRACE(file);
    const fs::path dir = qpipe::test::testDir() / (std::string("loop_") + file);
    fs::remove_all(dir);
    fs::create_directories(dir);
    for (const auto& entry : fs::directory_iterator(model)) fs::copy(entry.path(), dir / entry.path().filename());
    fs::remove(dir / file);
    fs::create_symlink(file, dir / file);
    const CommandResult r = eval(dir);
    EXPECT_EQ(r.exitCode, 6) << r.err;
    EXPECT_EQ(lastLine(r.err),
              "qpipe: I/O error: cannot open '" + (dir / file).string() + "': Too many levels of symbolic links\n");
  }
  const fs::path loop = qpipe::test::testDir() / "loop_folder";
  fs::remove(loop);
  fs::create_symlink(loop.filename(), loop);
  const CommandResult r = eval(loop);
  EXPECT_EQ(r.exitCode, 6) << r.err;
  EXPECT_EQ(r.err, "qpipe: I/O error: " + loop.string() + ": Too many levels of symbolic links\n");
}

// int4 codes held one to a byte (compressed-tensors' int-quantized) must be int4's: an int8
// checkpoint whose num_bits was edited to 4 ran as before, its weights still int8.
TEST(Validation, AnInt4WeightHeldOneToAByteMustHoldInt4Codes) {
  const fs::path out = quantizedTiny("rebitted_w8a8", "--quant_type w8a8");
  editJson(out / "config.json", [](nlohmann::json& config) {
    for (auto& group : config["quantization_config"]["config_groups"]) group["weights"]["num_bits"] = 4;
  });
  const CommandResult r = eval(out);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + out.string() +
                                        ": 'model.layers.0.self_attn.q_proj.weight' holds codes from -127 to 127, "
                                        "outside int4's [-8, 7], but its quantization_config gives it num_bits 4"));
}

// The same for msmodelslim's W4A8_DYNAMIC held one code to a byte (a description without the
// version that packs two to a byte), where an int8 weight was relabelled.
TEST(Validation, AnUnpackedAscendInt4WeightMustHoldInt4Codes) {
  const fs::path pipeline =
      linearQuantPipeline("w8a8_dynamic_ascend.yaml",
                          {"act: {dtype: int8, scope: per_token, symmetric: True, method: minmax}",
                           "weight: {dtype: int8, scope: per_channel, symmetric: True, method: minmax}"},
                          "ascendv1_saver");
  const fs::path out = quantizedTiny("relabelled_ascend", "--config_path " + pipeline.string());
  const fs::path description = out / "quant_model_description.json";
  editJson(description, [](nlohmann::json& types) {
    types.erase("version");
    for (auto& [key, type] : types.items()) {
      if (type == "W8A8_DYNAMIC") type = "W4A8_DYNAMIC";
    }
  });
  const CommandResult r = eval(out);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("checkpoint " + out.string() +
                                        ": 'model.layers.0.self_attn.q_proj.weight' holds codes from -127 to 127, "
                                        "outside int4's [-8, 7], but " +
                                        description.string() + " gives it W4A8_DYNAMIC"));
}

// A --save_path that is a link to a folder saves into that folder (renaming the finished
// checkpoint onto the link would fail after the run); a link to nothing fails before the run.
TEST(Validation, ASavePathThatIsALinkSavesIntoItsFolderOrFailsAtOnce) {
  const fs::path dir = qpipe::test::testDir() / "linked_save";
  fs::remove_all(dir);
  fs::create_directories(dir / "real");
  fs::create_directory_symlink(dir / "real", dir / "link");
  fs::create_directory_symlink(dir / "nowhere", dir / "dangling");
  const auto quant = [&](const fs::path& out) {
    return qpipe::test::runQpipe("quant --model_path " + qpipe::test::tinyLlama("float").string() +
                                 " --quant_type w8a8 --save_path " + out.string());
  };
  CommandResult r = quant(dir / "link");
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_TRUE(fs::is_symlink(dir / "link"));
  EXPECT_TRUE(fs::exists(dir / "real" / "model.safetensors"));
  // Two ranks find rank 0's partial folder beside the link's folder, and split the layers.
  fs::remove_all(dir / "real");
  fs::create_directories(dir / "real");
  r = qpipe::test::runQpipe("quant --model_path " + qpipe::test::tinyLlama("float").string() +
                            " --quant_type w8a8 --device cpu:0,1 --save_path " + (dir / "link").string());
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("split over 2 ranks"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(dir / "real" / "model.safetensors"));
  r = quant(dir / "dangling");
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("save path '" + (dir / "dangling").string() + "' is a symbolic link to '" +
                                        (dir / "nowhere").string() +
                                        "', which does not exist; create that folder or choose another --save_path"));
  EXPECT_FALSE(fs::exists(dir / "nowhere"));
}

// The partial folder beside --save_path has a longer name: a name the file system takes, but not
// with 15 more bytes, is refused before the model loads, on one rank and on several (where the
// launcher checks it before starting any rank).
TEST(Validation, ASavePathNameTooLongForItsPartialFolderIsRefused) {
  const fs::path dir = qpipe::test::testDir() / "long_save";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const long limit = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  ASSERT_GT(limit, 20);
  // One the file system takes, and one it would refuse itself.
  for (const long length : {limit - 5, limit + 10}) {
    const std::string expected = inputError(
        "--save_path's folder name is " + std::to_string(length) +
        " bytes; the partial folder written beside it takes 15 more, over the file system's limit of " +
        std::to_string(limit) + " bytes a name; choose a name of at most " + std::to_string(limit - 15) + " bytes");
    for (const std::string device : {"cpu", "cpu:0,1"}) {
      const CommandResult r = qpipe::test::runQpipe("quant --model_path " + qpipe::test::tinyLlama("float").string() +
                                                    " --quant_type w8a8 --device " + device + " --save_path " +
                                                    (dir / std::string(length, 'a')).string());
      EXPECT_EQ(r.exitCode, 5) << r.err;
      EXPECT_EQ(lastLine(r.err), expected) << device << ", " << length << " bytes";
    }
  }
  EXPECT_TRUE(fs::is_empty(dir));
}

// A run's partial folder is locked while it writes: a second run given the same --save_path
// stops instead of removing it as an interrupted save's; once unlocked, it is one.
TEST(Validation, ASecondRunToTheSameSavePathLeavesTheFirstRunsFolderAlone) {
  const fs::path dir = qpipe::test::testDir() / "busy_save";
  fs::remove_all(dir);
  const fs::path out = dir / "out", partial = dir / ".out.qpipe-partial";
  fs::create_directories(partial);
  std::ofstream(partial / "layer.bin") << "the first run's bytes";
  const int lock = ::open(partial.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(lock, 0);
  ASSERT_EQ(::flock(lock, LOCK_EX | LOCK_NB), 0);
  const auto quant = [&] {
    return qpipe::test::runQpipe("quant --model_path " + qpipe::test::tinyLlama("float").string() +
                                 " --quant_type w8a8 --save_path " + out.string());
  };
  CommandResult r = quant();
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err),
            inputError("another qpipe run is writing --save_path '" + out.string() + "' (its partial folder '" +
                       partial.string() + "'); wait for it or choose another --save_path"));
  EXPECT_TRUE(fs::exists(partial / "layer.bin"));
  // Nor does the launcher of a multi-rank run remove it when its rank 0 stops there.
  r = qpipe::test::runQpipe("quant --model_path " + qpipe::test::tinyLlama("float").string() +
                            " --quant_type w8a8 --device cpu:0,1 --save_path " + out.string());
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(lastLine(r.err), inputError("rank 0 failed: another qpipe run is writing --save_path '" + out.string() +
                                        "' (its partial folder '" + partial.string() +
                                        "'); wait for it or choose another --save_path"));
  EXPECT_TRUE(fs::exists(partial / "layer.bin"));
  ::close(lock);
  r = quant();
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("removing '" + partial.string() + "', left by an interrupted save"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(partial));
}

TEST(Validation, ATensorInTwoShardsIsRefused) {
  const fs::path dir = qpipe::test::tinyLlama("two_shards");
  const auto whole = qpipe::safetensors::File::open(dir / "model.safetensors");
  // part-b holds the embeddings, which the index lists there, and model.norm.weight, which it
  // lists in part-a.
  const std::string embed = "model.embed_tokens.weight";
  std::string index = R"({"metadata": {}, "weight_map": {")" + embed + R"(": "part-b.safetensors", )";
  {
    qpipe::safetensors::Writer first(dir, {.filePrefix = "part-a"});
    for (const auto& info : whole->tensors()) {
      if (info.name == embed) continue;
      first.add(info.name, whole->tensor(info.name));
      index += "\"" + info.name + "\": \"part-a.safetensors\", ";
    }
    first.finish();
    qpipe::safetensors::Writer second(dir, {.filePrefix = "part-b"});
    second.add(embed, whole->tensor(embed));
    second.add("model.norm.weight", whole->tensor("model.norm.weight"));
    second.finish();
  }
  index.resize(index.size() - 2);
  std::ofstream(dir / "model.safetensors.index.json") << index << "}}";
  fs::remove(dir / "model.safetensors");
  const CommandResult r = eval(dir);
  EXPECT_EQ(r.exitCode, 5) << r.err;
  EXPECT_EQ(r.err,
            inputError((dir / "model.safetensors.index.json").string() +
                       ": tensor 'model.norm.weight' is in two shards, part-a.safetensors and part-b.safetensors"));
}

TEST(Validation, NonFiniteWeightsAreRefusedUnlessAllowedAndThenTheLossAndTheScalesAre) {
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  at::Tensor weight = at::randn({16, 16}) * 0.2;
  weight[3][5] = std::numeric_limits<float>::quiet_NaN();
  weight[4][1] = std::numeric_limits<float>::infinity();
  const fs::path dir = withTensor("nan_weight", q, weight);
  const CommandResult refused = eval(dir);
  EXPECT_EQ(refused.exitCode, 5) << refused.err;
  EXPECT_EQ(lastLine(refused.err), inputError("checkpoint " + dir.string() + ": tensor '" + q +
                                              "' holds NaN or Inf (1 NaN, 1 Inf); --allow_non_finite loads it anyway"));
  // A bf16 weight, widened to fp32 and checked in the same pass, is refused alike.
  const fs::path bf16Dir = withTensor("nan_weight_bf16", q, weight.to(at::kBFloat16));
  const CommandResult refusedBf16 = eval(bf16Dir);
  EXPECT_EQ(refusedBf16.exitCode, 5) << refusedBf16.err;
  EXPECT_EQ(lastLine(refusedBf16.err), inputError("checkpoint " + bf16Dir.string() + ": tensor '" + q +
                                                  "' holds NaN or Inf (1 NaN, 1 Inf); --allow_non_finite loads it "
                                                  "anyway"));
  const CommandResult allowedBf16 = eval(bf16Dir, "--allow_non_finite");
  EXPECT_EQ(allowedBf16.exitCode, 5) << allowedBf16.err;
  EXPECT_EQ(
      lastLine(allowedBf16.err),
      inputError("perplexity: window 0 (tokens 0 to 16) has a non-finite loss (nan): the model computes NaN or Inf"));
  const CommandResult allowed = eval(dir, "--allow_non_finite");
  EXPECT_EQ(allowed.exitCode, 5) << allowed.err;
  EXPECT_EQ(
      lastLine(allowed.err),
      inputError("perplexity: window 0 (tokens 0 to 16) has a non-finite loss (nan): the model computes NaN or Inf"));
  // Quantized, the NaN becomes a NaN scale: refused before anything is saved.
  const fs::path out = qpipe::test::testDir() / "nan_out";
  fs::remove_all(out);
  const CommandResult quant = qpipe::test::runQpipe(
      "quant --model_path " + dir.string() + " --save_path " + out.string() + " --quant_type w8a8 --calib_data " +
      textFile().string() + " --calib_samples 2 --seq_len 16 --allow_non_finite");
  EXPECT_EQ(quant.exitCode, 5) << quant.err;
  EXPECT_EQ(lastLine(quant.err),
            inputError("tensor 'model.layers.0.self_attn.q_proj.weight_scale' to be saved holds NaN or Inf; nothing is "
                       "saved"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors"));
}

// Finite weights whose activations overflow: an input_layernorm weight near float's maximum sends
// the normed inputs of q/k/v to ±Inf. Calibration statistics must not turn into a scale then.
TEST(Validation, CalibrationInputsHoldingInfAreAnErrorNamingTheModuleNotAScale) {
  const fs::path dir = withTensor("overflowing", "model.layers.0.input_layernorm.weight", at::full({16}, 3e38f));
  const fs::path configs = fs::path(QPIPE_SOURCE_DIR) / "configs" / "default";
  const fs::path out = qpipe::test::testDir() / "overflow_out";
  // Quantizes with `practice`, which must fail with `message` and save nothing.
  const auto refused = [&](const std::string& practice, const std::string& message) {
    fs::remove_all(out);
    const CommandResult r = qpipe::test::runQpipe(
        "quant --model_path " + dir.string() + " --save_path " + out.string() + " --config_path " +
        (configs / practice).string() + " --calib_data " + textFile().string() + " --calib_samples 2 --seq_len 16");
    EXPECT_EQ(r.exitCode, 5) << r.err;
    EXPECT_EQ(lastLine(r.err), inputError(message)) << practice;
    EXPECT_FALSE(fs::exists(out / "model.safetensors")) << practice;
  };
  const std::string overflow = " (does the float model overflow on the calibration data? `qpipe eval` shows it)";
  refused("w8a8_static.yaml",
          "processor 'linear_quant' (plugin 'linear_quant') failed in process(model.layers.0): "
          "model.layers.0.self_attn.q_proj: the inputs it saw in calibration hold NaN or Inf, so its static "
          "activation scale is not finite" +
              overflow);
  refused("w8a8_static_smooth_quant.yaml",
          "processor 'smooth_quant' (plugin 'smooth') failed in postprocess(model.layers.0): the calibration inputs "
          "of norm-linear model.layers.0.input_layernorm → self_attn.q_proj, self_attn.k_proj, self_attn.v_proj "
          "hold NaN or Inf, so it has no finite smoothing scale" +
              overflow);
}

TEST(Validation, DeepNestingIsAnErrorNotAStackOverflow) {
  const fs::path dir = withConfig("deep_config", std::string(100000, '[') + std::string(100000, ']'));
  const CommandResult json = eval(dir);
  EXPECT_EQ(json.exitCode, 5) << json.err;
  EXPECT_EQ(json.err, inputError((dir / "config.json").string() + ": JSON nested deeper than 100 levels"));

  const std::string yaml = std::string(5000, '[') + std::string(5000, ']');
  const fs::path pipeline = qpipe::test::writeTempFile("deep.yaml", yaml);
  const CommandResult deep = qpipe::test::runQpipe("check --config_path " + pipeline.string());
  EXPECT_EQ(deep.exitCode, 3) << deep.err;
  EXPECT_EQ(deep.err, "qpipe: configuration error: " + pipeline.string() + ":1:101: nested deeper than 100 levels\n");
}

// A group's steps share one calibration forward: a training step there would do nothing, so it is
// refused, before the model is opened.
TEST(Validation, AGroupRefusesAStepThatTrains) {
  const fs::path pipeline = qpipe::test::writeTempFile("qat_group.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - type: group
      configs:
        - type: linear_quant
          qconfig: {weight: {}}
          exclude: ["lm_head"]
        - type: learnable_scale_qat
          qconfig: {weight: {dtype: int4, scope: per_group, ext: {group_size: 8}}}
)");
  const fs::path out = qpipe::test::testDir() / "qat_group_out";
  const CommandResult r = qpipe::test::runQpipe("quant --model_path " + qpipe::test::tinyLlama("qat_group").string() +
                                                " --config_path " + pipeline.string() + " --save_path " + out.string());
  EXPECT_EQ(r.exitCode, 3) << r.err;
  EXPECT_EQ(r.err, "qpipe: configuration error: " + pipeline.string() +
                       ":9:11: spec.process[0].configs[1]: 'learnable_scale_qat' trains, which a group cannot run (its "
                       "steps share one calibration forward); make it a step of its own\n");
  EXPECT_FALSE(fs::exists(out));
}

// Two training steps would write the same artifacts beside --save_path: refused before any work.
TEST(Validation, APipelineTrainsInOneStep) {
  const fs::path pipeline = qpipe::test::writeTempFile("qat_twice.yaml", R"(apiversion: modelslim_v1
spec:
  process:
    - type: learnable_scale_qat
      qconfig: {weight: {dtype: int4, scope: per_group, ext: {group_size: 8}}}
    - type: learnable_scale_qat
      qconfig: {weight: {dtype: int4, scope: per_group, ext: {group_size: 8}}}
)");
  const CommandResult r = qpipe::test::runQpipe("check --config_path " + pipeline.string());
  EXPECT_EQ(r.exitCode, 3) << r.err;
  EXPECT_EQ(r.err, "qpipe: configuration error: " + pipeline.string() +
                       ":6:7: spec.process[1]: 'learnable_scale_qat' trains, and so does spec.process[0] "
                       "('learnable_scale_qat'); a pipeline trains in one step: merge them into one\n");
}

TEST(Validation, AFifoIsRefusedNotReadForever) {
  const fs::path fifo = qpipe::test::testDir() / "fifo.jsonl";
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const CommandResult data =
      qpipe::test::runQpipe("eval --model_path " + qpipe::test::tinyLlama("fifo_model").string() + " --data " +
                            fifo.string() + " --seq_len 16");
  EXPECT_EQ(data.exitCode, 5) << data.err;
  EXPECT_EQ(data.err, inputError("'" + fifo.string() + "' is not a regular file (a FIFO)"));
  const CommandResult pipeline = qpipe::test::runQpipe("check --config_path " + fifo.string());
  EXPECT_EQ(pipeline.exitCode, 5) << pipeline.err;
  EXPECT_EQ(pipeline.err, inputError("'" + fifo.string() + "' is not a regular file (a FIFO)"));
  const CommandResult device = qpipe::test::runQpipe("check --config_path /dev/zero");
  EXPECT_EQ(device.exitCode, 5) << device.err;
  EXPECT_EQ(device.err, inputError("'/dev/zero' is not a regular file (a character device)"));
}

}  // namespace
