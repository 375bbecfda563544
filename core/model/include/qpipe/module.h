// The module tree: HF module names (`model.layers.3.self_attn.q_proj`), parameters and buffers
// by name, replaceable children, and forward hooks — what processors inspect and rewrite.
//
// A module holds its children in named slots; a parent reaches a child through its slot on
// every forward, so `replace()` takes effect at once (a processor swaps a Linear for a
// fake-quant one). Single-tensor modules (Linear, norms, hook points) run through
// `operator()`, which applies the hooks; layers with several inputs have typed forwards.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Type.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qpipe/error.h"

namespace qpipe {

class Module {
 public:
  // Returns the input to use (an undefined tensor keeps it unchanged).
  using PreHook = std::function<at::Tensor(Module& module, const at::Tensor& input)>;
  // Returns the output to use (an undefined tensor keeps it unchanged).
  using PostHook = std::function<at::Tensor(Module& module, const at::Tensor& input, const at::Tensor& output)>;
  using HookHandle = uint64_t;

  explicit Module(std::string typeName) : typeName_(std::move(typeName)) {}
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& typeName() const { return typeName_; }

  // This module as a T (its dynamic type); Error(kConfig) naming `name`, its type and T
  // otherwise (e.g. a module that an earlier processor of the pipeline replaced).
  template <typename T>
  T& as(std::string_view name) {
    if (auto* typed = dynamic_cast<T*>(this)) return *typed;
    throw Error(ErrorCode::kConfig, concat("module '", name, "' is a ", typeName_, ", not a ", c10::demangle_type<T>(),
                                           " (did an earlier processor of the pipeline replace it?)"));
  }

  // Runs pre-hooks, forward, post-hooks. A LibTorch error inside becomes Error(kInternal) naming
  // the module (its path and type) and its input, in one line.
  at::Tensor operator()(const at::Tensor& input);
  // Single-tensor forward; modules with other signatures do not override it (Error(kInternal)).
  virtual at::Tensor forward(const at::Tensor& input);

  HookHandle addForwardPreHook(PreHook hook);
  HookHandle addForwardHook(PostHook hook);
  void removeHook(HookHandle handle);
  bool hasHooks() const { return !hooks_.empty(); }

  // Children, in registration order.
  size_t addChild(std::string name, std::shared_ptr<Module> child);
  Module& child(size_t slot) const { return *children_[slot].second; }
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const { return children_; }
  // The direct child named `name`, or nullptr.
  Module* findChild(std::string_view name) const {
    for (const auto& [childName, child] : children_) {
      if (childName == name) return child.get();
    }
    return nullptr;
  }
  // Dotted path below this module ("" is this module); Error(kInput) naming the path if absent.
  Module& getSubmodule(std::string_view path);
  // Puts `replacement` where `path` is; the old module is returned (and dropped by the caller).
  std::shared_ptr<Module> replace(std::string_view path, std::shared_ptr<Module> replacement);
  // The dotted path from the root of the tree this module is in ("model.layers.3.mlp"); empty
  // for a root or a module in no tree. For messages: it walks up and searches each parent.
  std::string path() const;
  // This module and every descendant, depth first, with full names under `prefix`.
  std::vector<std::pair<std::string, Module*>> namedModules(const std::string& prefix = "");

  // Parameters and buffers, by their local name.
  at::Tensor& addParameter(std::string name, at::Tensor value);
  at::Tensor& addBuffer(std::string name, at::Tensor value);
  at::Tensor& parameter(std::string_view name);
  bool hasParameter(std::string_view name) const;
  // This module's own parameters and buffers (not its children's), in registration order.
  std::vector<std::pair<std::string, at::Tensor>>& ownParameters() { return parameters_; }
  std::vector<std::pair<std::string, at::Tensor>>& ownBuffers() { return buffers_; }
  // Recursive, full names ("model.layers.0.mlp.up_proj.weight").
  std::vector<std::pair<std::string, at::Tensor*>> namedParameters(const std::string& prefix = "");
  std::vector<std::pair<std::string, at::Tensor*>> namedBuffers(const std::string& prefix = "");

  // Moves every parameter and buffer (recursively); `dtype` applies to floating-point ones only.
  void to(at::Device device, std::optional<at::ScalarType> dtype = std::nullopt);

 private:
  at::Tensor call(const at::Tensor& input);  // operator() without the translation
  struct Hook {
    HookHandle handle;
    PreHook pre;
    PostHook post;
  };

  std::string typeName_;
  Module* parent_ = nullptr;  // the module whose slot holds this one; cleared when it lets go
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::vector<std::pair<std::string, at::Tensor>> parameters_;
  std::vector<std::pair<std::string, at::Tensor>> buffers_;
  std::vector<Hook> hooks_;
  HookHandle nextHook_ = 1;
};

// A module that can compute itself and its siblings, modules reading the same input side by side
// (q/k/v, gate/up), in one go: one quantization of the input and one GEMM where they could
// share them. vLLM fuses the same groups (QKVParallelLinear, MergedColumnParallelLinear).
class InputSharing {
 public:
  virtual ~InputSharing() = default;
  // The outputs of `siblings` (this module first; none with hooks), each what its forward(input)
  // gives (bit for bit where the arithmetic allows; SharedInputGemm says where), or nothing when they cannot share the
  // work (other module types or schemes): the caller then runs each. Declining after a side effect is allowed only
  // where each module's own forward then repeats none of it and gives the same output.
  virtual std::optional<std::vector<at::Tensor>> forwardSiblings(const at::Tensor& input,
                                                                 const std::vector<Module*>& siblings) = 0;
};

// Each module's operator()(input), in order; by the first one's InputSharing where it has one
// and no module has hooks (a hook sees its own module's input and output, so hooked modules run
// one by one). A LibTorch error inside becomes one Error(kInternal) line, as operator() makes.
std::vector<at::Tensor> forwardSharingInput(const at::Tensor& input, const std::vector<Module*>& modules);

// y = x Wᵀ + b, W of shape [out, in] as in torch.nn.Linear.
class Linear : public Module {
 public:
  Linear(at::Tensor weight, at::Tensor bias = {});
  at::Tensor forward(const at::Tensor& input) override;
  at::Tensor& weight() { return parameter("weight"); }
  // Undefined when the layer has no bias.
  at::Tensor bias();
  int64_t inFeatures() { return weight().size(1); }
  int64_t outFeatures() { return weight().size(0); }
};

// While one lives on this thread, a float Linear (and a QuantLinear's fp32 path) multiplies an
// input of at most 64 rows by qpipe's own GEMM on CPUs with AVX-512, which reads the weight in place
// where MKL would first pack all of it (docs/quantization.md, "The fp32 GEMM of few rows"). Its
// bits differ from at::linear's, so only what measures runs under it: the report's probe. The
// calibration and every forward that makes a checkpoint stay with at::linear, whose bits are the
// same whether or not autograd records them (QAT at learning rate 0 writes the PTQ checkpoint).
class FewRowsGemm {
 public:
  FewRowsGemm();
  ~FewRowsGemm();
  FewRowsGemm(const FewRowsGemm&) = delete;
  FewRowsGemm& operator=(const FewRowsGemm&) = delete;
  static bool active();

 private:
  bool outer_;
};

// Returns its input. Marks a point in the data path (e.g. attention's Q after RoPE) where a
// processor can observe or replace the tensor with hooks, or swap the module.
class HookPoint : public Module {
 public:
  HookPoint() : Module("HookPoint") {}
  at::Tensor forward(const at::Tensor& input) override { return input; }
};

// Llama/Qwen RMSNorm: normalised in fp32, scaled by the weight in the input's dtype (as HF). An
// optional bias is added after the scaling: HF's RMSNorm has none, but msmodelslim's asymmetric
// smoothing gives the norm one (docs/smoothing.md).
class RMSNorm : public Module {
 public:
  RMSNorm(at::Tensor weight, double eps, at::Tensor bias = {});
  at::Tensor forward(const at::Tensor& input) override;

 private:
  double eps_;
};

class Embedding : public Module {
 public:
  explicit Embedding(at::Tensor weight);
  at::Tensor forward(const at::Tensor& ids) override;
};

}  // namespace qpipe
