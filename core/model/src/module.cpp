#include "qpipe/module.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "fused_rows.h"
#include "qpipe/error.h"
#include "small_gemm.h"

namespace qpipe {

Module::~Module() {
  for (auto& [name, child] : children_) {
    if (child->parent_ == this) child->parent_ = nullptr;
  }
}

namespace {

// The innermost module names the operation; the modules around it pass its Error on.
Error forwardError(const Module& module, std::string_view siblings, const at::Tensor& input, const c10::Error& e) {
  const std::string where = module.path();
  return Error(ErrorCode::kInternal,
               concat(where.empty() ? "" : where + " (", module.typeName(), where.empty() ? "" : ")", siblings,
                      " forward of ", input.sizes(), " ", input.scalar_type(), ": ", oneLine(e)));
}

}  // namespace

at::Tensor Module::operator()(const at::Tensor& input) {
  try {
    return call(input);
  } catch (const c10::Error& e) {
    throw forwardError(*this, "", input, e);
  }
}

std::vector<at::Tensor> forwardSharingInput(const at::Tensor& input, const std::vector<Module*>& modules) {
  const bool hooked = std::any_of(modules.begin(), modules.end(), [](const Module* m) { return m->hasHooks(); });
  if (auto* first = (modules.empty() || hooked) ? nullptr : dynamic_cast<InputSharing*>(modules.front())) {
    try {
      if (std::optional<std::vector<at::Tensor>> outputs = first->forwardSiblings(input, modules)) return *outputs;
    } catch (const c10::Error& e) {
      throw forwardError(*modules.front(), " with its siblings", input, e);
    }
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(modules.size());
  for (Module* module : modules) outputs.push_back((*module)(input));
  return outputs;
}

at::Tensor Module::call(const at::Tensor& input) {
  if (hooks_.empty()) return forward(input);
  at::Tensor x = input;
  for (auto& hook : hooks_) {
    if (!hook.pre) continue;
    at::Tensor changed = hook.pre(*this, x);
    if (changed.defined()) x = changed;
  }
  at::Tensor y = forward(x);
  for (auto& hook : hooks_) {
    if (!hook.post) continue;
    at::Tensor changed = hook.post(*this, x, y);
    if (changed.defined()) y = changed;
  }
  return y;
}

at::Tensor Module::forward(const at::Tensor&) {
  QPIPE_CHECK(false, "module type ", typeName_, " has no single-tensor forward");
  return {};
}

Module::HookHandle Module::addForwardPreHook(PreHook hook) {
  hooks_.push_back({nextHook_, std::move(hook), nullptr});
  return nextHook_++;
}

Module::HookHandle Module::addForwardHook(PostHook hook) {
  hooks_.push_back({nextHook_, nullptr, std::move(hook)});
  return nextHook_++;
}

void Module::removeHook(HookHandle handle) {
  std::erase_if(hooks_, [&](const Hook& hook) { return hook.handle == handle; });
}

size_t Module::addChild(std::string name, std::shared_ptr<Module> child) {
  QPIPE_CHECK(child != nullptr, "null child '", name, "'");
  child->parent_ = this;
  children_.emplace_back(std::move(name), std::move(child));
  return children_.size() - 1;
}

namespace {

// Splits "a.b.c" into "a" and "b.c".
std::pair<std::string_view, std::string_view> headAndRest(std::string_view path) {
  const size_t dot = path.find('.');
  if (dot == std::string_view::npos) return {path, {}};
  return {path.substr(0, dot), path.substr(dot + 1)};
}

}  // namespace

Module& Module::getSubmodule(std::string_view path) {
  Module* current = this;
  std::string_view rest = path;
  while (!rest.empty()) {
    const auto [head, tail] = headAndRest(rest);
    auto it = std::find_if(current->children_.begin(), current->children_.end(),
                           [&](const auto& entry) { return entry.first == head; });
    QPIPE_REQUIRE(it != current->children_.end(), ErrorCode::kInput, "no module '", path, "' (no child '", head,
                  "' in ", current->typeName_, ")");
    current = it->second.get();
    rest = tail;
  }
  return *current;
}

std::shared_ptr<Module> Module::replace(std::string_view path, std::shared_ptr<Module> replacement) {
  QPIPE_CHECK(replacement != nullptr, "replacing '", path, "' with null");
  const size_t dot = path.rfind('.');
  Module& parent = dot == std::string_view::npos ? *this : getSubmodule(path.substr(0, dot));
  const std::string_view name = dot == std::string_view::npos ? path : path.substr(dot + 1);
  for (auto& [childName, child] : parent.children_) {
    if (childName != name) continue;
    if (child->parent_ == &parent) child->parent_ = nullptr;
    replacement->parent_ = &parent;
    std::swap(child, replacement);
    return replacement;
  }
  throw Error(ErrorCode::kInput, concat("no module '", path, "'"));
}

std::string Module::path() const {
  std::vector<std::string_view> names;
  for (const Module* m = this; m->parent_ != nullptr; m = m->parent_) {
    const auto& siblings = m->parent_->children_;
    auto it =
        std::find_if(siblings.begin(), siblings.end(), [&](const auto& entry) { return entry.second.get() == m; });
    if (it == siblings.end()) break;
    names.push_back(it->first);
  }
  std::string out;
  for (auto name = names.rbegin(); name != names.rend(); ++name) out += (out.empty() ? "" : ".") + std::string(*name);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::namedModules(const std::string& prefix) {
  std::vector<std::pair<std::string, Module*>> out{{prefix, this}};
  for (auto& [name, child] : children_) {
    auto below = child->namedModules(prefix.empty() ? name : prefix + "." + name);
    out.insert(out.end(), below.begin(), below.end());
  }
  return out;
}

at::Tensor& Module::addParameter(std::string name, at::Tensor value) {
  parameters_.emplace_back(std::move(name), std::move(value));
  return parameters_.back().second;
}

at::Tensor& Module::addBuffer(std::string name, at::Tensor value) {
  buffers_.emplace_back(std::move(name), std::move(value));
  return buffers_.back().second;
}

at::Tensor& Module::parameter(std::string_view name) {
  for (auto& [key, value] : parameters_) {
    if (key == name) return value;
  }
  throw Error(ErrorCode::kInternal, concat(typeName_, " has no parameter '", name, "'"));
}

bool Module::hasParameter(std::string_view name) const {
  return std::any_of(parameters_.begin(), parameters_.end(), [&](const auto& entry) { return entry.first == name; });
}

namespace {

void collect(Module& module, const std::string& prefix, std::vector<std::pair<std::string, at::Tensor*>>& out,
             const std::function<std::vector<std::pair<std::string, at::Tensor>>&(Module&)>& select) {
  for (auto& [name, tensor] : select(module)) out.emplace_back(prefix.empty() ? name : prefix + "." + name, &tensor);
  for (auto& [name, child] : module.children()) {
    collect(*child, prefix.empty() ? name : prefix + "." + name, out, select);
  }
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor*>> Module::namedParameters(const std::string& prefix) {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  collect(
      *this, prefix, out, [](Module & m) -> auto& { return m.parameters_; });
  return out;
}

std::vector<std::pair<std::string, at::Tensor*>> Module::namedBuffers(const std::string& prefix) {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  collect(
      *this, prefix, out, [](Module & m) -> auto& { return m.buffers_; });
  return out;
}

void Module::to(at::Device device, std::optional<at::ScalarType> dtype) {
  const auto move = [&](at::Tensor& t) {
    if (!t.defined()) return;
    t = dtype && at::isFloatingType(t.scalar_type()) ? t.to(device, *dtype) : t.to(device);
  };
  for (auto& [name, t] : parameters_) move(t);
  for (auto& [name, t] : buffers_) move(t);
  for (auto& [name, child] : children_) child->to(device, dtype);
}

Linear::Linear(at::Tensor weight, at::Tensor bias) : Module("Linear") {
  QPIPE_CHECK(weight.dim() == 2, "Linear weight must be 2-D, got ", weight.sizes());
  addParameter("weight", std::move(weight));
  if (bias.defined()) addParameter("bias", std::move(bias));
}

at::Tensor Linear::bias() {
  return hasParameter("bias") ? parameter("bias") : at::Tensor();
}

namespace {
thread_local bool fewRowsGemm = false;
}  // namespace

FewRowsGemm::FewRowsGemm() : outer_(fewRowsGemm) {
  fewRowsGemm = true;
}
FewRowsGemm::~FewRowsGemm() {
  fewRowsGemm = outer_;
}
bool FewRowsGemm::active() {
  return fewRowsGemm;
}

at::Tensor Linear::forward(const at::Tensor& input) {
  if (std::optional<at::Tensor> y = detail::smallLinear(input, weight(), bias())) return *y;
  return at::linear(input, weight(), bias());
}

RMSNorm::RMSNorm(at::Tensor weight, double eps, at::Tensor bias) : Module("RMSNorm"), eps_(eps) {
  addParameter("weight", std::move(weight));
  if (bias.defined()) addParameter("bias", std::move(bias));
}

at::Tensor RMSNorm::forward(const at::Tensor& input) {
  if (std::optional<at::Tensor> y = detail::rmsNorm(input, parameter("weight"), eps_)) {
    return hasParameter("bias") ? *y + parameter("bias") : *y;
  }
  const at::Tensor x = input.to(at::kFloat);
  const at::Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  const at::Tensor scaled = parameter("weight") * normed.to(input.scalar_type());
  return hasParameter("bias") ? scaled + parameter("bias") : scaled;
}

Embedding::Embedding(at::Tensor weight) : Module("Embedding") {
  addParameter("weight", std::move(weight));
}

at::Tensor Embedding::forward(const at::Tensor& ids) {
  return at::embedding(parameter("weight"), ids);
}

}  // namespace qpipe
