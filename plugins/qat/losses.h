// The training losses of end2end QAT (docs/qat.md): the LM loss and the knowledge-distillation
// losses of AngelSlim's DistillLoss, between the student (the fake-quantized model) and the teacher
// (the same model with its quantizers bypassed). Everything is computed in fp32 on the positions
// that predict a supervised token: logits[:, :-1] against labels[:, 1:] != -100 (N tokens), each
// loss a mean over those N.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>

namespace qpipe::qat {

// KL(P‖Q) = Σ_v P_v (log P_v − log Q_v) per token, p_t and p_s the softmaxes at T = 1:
//   kOrigin   no distillation (the LM loss alone)
//   kKl       KL(p_t‖p_s)                       kRkl      KL(p_s‖p_t)
//   kMse      mean squared logit difference over the N·V elements
//   kKd       T² · KL(softmax(t/T)‖softmax(s/T))
//   kCakld    c·KL(p_s‖p_t) + (1 − c)·KL(p_t‖p_s), c = p_t[label]
//   kKlTopK   KL over the teacher's top-K logits, both renormalised over those K
//   kRklTopK  reverse KL over the student's top-K logits, both renormalised over those K
enum class LossType { kOrigin, kKl, kRkl, kMse, kKd, kCakld, kKlTopK, kRklTopK };

struct LossSpec {
  LossType type = LossType::kOrigin;
  std::string name;  // as configured: "cakld", "kl_top_100"
  int64_t topK = 1000;
  double temperature = 1;
  double lmWeight = 1;
  double kdWeight = 0;

  bool distills() const { return kdWeight > 0 && type != LossType::kOrigin; }
};

// AngelSlim's spellings: origin, kl, rkl, mse, kd, cakld, kl_top[_K], r_kl_top[_K] (and rkl_top[_K]).
// K is `topK` where it is > 0, else the name's suffix, else 1000. Error(kConfig) "'<name>' is not a
// loss (…)" for another name.
LossSpec parseLoss(const std::string& name, int64_t topK);

struct LossTerms {
  at::Tensor total;  // lmWeight·lm + kdWeight·kd: what is minimised
  at::Tensor lm;     // cross entropy of the student on the labels (undefined without lmWeight)
  at::Tensor kd;     // the distillation loss (undefined unless distills())
  // Diagnostics at T = 1, detached (undefined unless distills()): KL(p_t‖p_s) and KL(p_s‖p_t).
  at::Tensor forwardKl, backwardKl;
  int64_t tokens = 0;  // N
};

// The lm_head as the loss applies it: rows of final hidden states [n, hidden] to logits [n, vocab].
struct Head {
  std::function<at::Tensor(const at::Tensor&)> apply;
  int64_t vocab = 0;
};

// `student` and `teacher` [batch, seq, width] (teacher undefined unless spec.distills()), labels
// [batch, seq] int64, -100 where not supervised. With a `head`, they are the final hidden states
// and the loss applies the head to `chunkRows` supervised positions at a time (0: as many as keep
// one chunk's fp32 logits within 64 MiB); without one, they are the logits themselves.
//
// A chunk's logits live only while its terms are computed: with gradients enabled and `student`
// requiring them, each chunk's backward runs at once into the gradient of the student's rows, and
// `total` carries that gradient into the student's graph. So no [tokens, vocab] tensor of either
// side exists, whatever the vocabulary, and the result is the whole-tensor computation's up to the
// order of fp32 sums. Error(kInput) when no position is supervised.
LossTerms computeLoss(const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& labels,
                      const LossSpec& spec, const Head& head = {}, int64_t chunkRows = 0);

}  // namespace qpipe::qat
