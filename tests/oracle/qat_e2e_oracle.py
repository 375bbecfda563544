"""Reference for learnable_scale_qat's end2end mode: two optimizer steps written in plain PyTorch.

  qat_e2e_oracle.py DIR OUT

DIR is a float Llama (quantized_checkpoint_oracle.py make). Every projection of its decoder layers
becomes a W4A16 fake-quantized Linear (int4, symmetric groups of 32, minmax start s0 = absmax / 7,
LSQ gradients, s = s0 * alpha with alpha trained from 1); lm_head and the embeddings stay float.
Each step: for every sample, the teacher's logits (the same modules bypassed, under no_grad), the
student's, and cakld + lm (both weights 1) averaged over the samples; backward, clip_grad_norm_
(1.0), torch.optim.AdamW (lr 1e-2, no weight decay, constant). OUT (safetensors) gets "ids"
[SAMPLES, SEQ], "loss0" (the first step's loss) and "<module>.weight_scale" after the last step.
The fake quantization and the losses are this file's own, as docs/qat.md states them.
"""
import math
import sys

import torch
import torch.nn.functional as F
import transformers as tf
from safetensors.torch import save_file

GROUP, QMAX, QMIN = 32, 7.0, -8.0
SAMPLES, SEQ, STEPS = 4, 24, 2
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FakeQuantLinear(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.weight = linear.weight.detach()
        self.bias = linear.bias
        out, inp = self.weight.shape
        groups = self.weight.reshape(out, inp // GROUP, GROUP)
        self.s0 = (groups.abs().amax(-1) / QMAX).clamp_min(torch.finfo(torch.float32).eps)
        self.alpha = torch.nn.Parameter(torch.ones_like(self.s0))
        self.bypass = False

    def scale(self):
        return self.s0 * self.alpha

    def forward(self, x):
        if self.bypass:
            return F.linear(x, self.weight, self.bias)
        out, inp = self.weight.shape
        w = self.weight.reshape(out, inp // GROUP, GROUP)
        s = self.scale().unsqueeze(-1)
        g = 1.0 / math.sqrt(GROUP * QMAX)  # LSQ: the scale's gradient times 1/sqrt(N*qmax)
        s = (s - s * g).detach() + s * g
        u = w / s
        q = ((u.round() - u).detach() + u).clamp(QMIN, QMAX)  # round straight through, clamp real
        return F.linear(x, (q * s).reshape(out, inp), self.bias)


def kl(log_p, log_q):
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def cakld_plus_lm(student, teacher, ids):
    s = student[0, :-1].float()
    t = teacher[0, :-1].float()
    y = ids[0, 1:]
    ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    conf = lt.gather(-1, y.unsqueeze(1)).squeeze(1).exp()
    kd = (conf * kl(ls, lt) + (1 - conf) * kl(lt, ls)).mean()
    return F.cross_entropy(s, y) + kd


def main(directory, out_path):
    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.requires_grad_(False)
    modules = {}
    for index, layer in enumerate(model.model.layers):
        for parent_name, parent in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for name in PROJECTIONS:
                if hasattr(parent, name):
                    fq = FakeQuantLinear(getattr(parent, name))
                    setattr(parent, name, fq)
                    modules[f"model.layers.{index}.{parent_name}.{name}"] = fq
    params = [m.alpha for m in modules.values()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(77)
    ids = torch.randint(0, model.config.vocab_size, (SAMPLES, SEQ), generator=gen)
    loss0 = None
    for step in range(STEPS):
        total = torch.zeros(())
        for row in range(SAMPLES):
            sample = ids[row:row + 1]
            with torch.no_grad():
                for m in modules.values():
                    m.bypass = True
                teacher = model(sample).logits
                for m in modules.values():
                    m.bypass = False
            loss = cakld_plus_lm(model(sample).logits, teacher, sample) / SAMPLES
            loss.backward()
            total += loss.detach()
        if step == 0:
            loss0 = total.clone()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    tensors = {"ids": ids, "loss0": loss0.reshape(1)}
    for name, m in modules.items():
        tensors[name + ".weight_scale"] = m.scale().detach().contiguous()
    save_file(tensors, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
