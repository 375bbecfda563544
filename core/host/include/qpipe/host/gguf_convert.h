// A Llama-family GGUF (llama.cpp's convert_hf_to_gguf.py output, any supported quantisation) turned
// back into a Hugging Face model folder that transformers loads as LlamaForCausalLM:
//   config.json, generation_config.json, model.safetensors (dequantised weights, HF names,
//   q_proj/k_proj rows un-permuted), tokenizer.json, tokenizer_config.json (with the chat template).
//
// Tensors are dequantised and written one at a time, so memory stays at about one tensor. The
// folder is built under a hidden temporary name next to the output and renamed when complete:
// an interrupted run never leaves anything at the output path. Unsupported input (architecture,
// tokenizer model or pre-tokenizer, tensor, rope scaling) is Error(kInput) naming the file and
// the key or tensor, before anything is written.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace qpipe::gguf {

struct ConvertOptions {
  // float32 keeps every dequantised value exactly; bfloat16 / float16 halve the size and round.
  at::ScalarType dtype = at::kFloat;
  bool overwrite = false;  // replace an existing output folder (only once the new one is complete)
};

struct ConvertSummary {
  int64_t tensors = 0;
  int64_t parameters = 0;
  uint64_t weightBytes = 0;
  double seconds = 0;
};

ConvertSummary convertToHf(const std::filesystem::path& input, const std::filesystem::path& outputDir,
                           const ConvertOptions& options = {});

// "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight" (llama.cpp's tensor names,
// gguf-py constants.py MODEL_TENSORS for LLM_ARCH_LLAMA); an empty string for a name it does not know.
std::string hfTensorName(std::string_view ggufName);

// Inverse of convert_hf_to_gguf.py's LlamaModel.permute: llama.cpp stores the rows of each head of
// q_proj / k_proj with the two rotary halves interleaved; HF keeps them as halves. `weight` is
// [heads * headDim, ...] in PyTorch order.
at::Tensor unpermuteRotary(const at::Tensor& weight, int64_t heads);

}  // namespace qpipe::gguf
