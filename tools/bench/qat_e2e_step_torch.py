"""The end2end QAT step of tools/bench/qat_step.sh (MODE=end2end) written in PyTorch: SmolLM2 (transformers)
with every decoder-layer Linear fake-quantized as in qat_step_torch.py (FP8 E4M3 per-tensor
weights and static inputs, LSQ, s = s0 * alpha), trained with AdamW on CAKLD + LM loss to the
same model with its fake quantization bypassed (no_grad), one 512-token sample per step, gradient
clipping. Prints the median seconds per step and this process's peak RSS in MiB.
  python qat_e2e_step_torch.py MODEL_DIR STEPS THREADS
"""
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from qat_step_torch import FakeQuantLinear, time_steps


class Bypassable(FakeQuantLinear):
    bypass = False

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) if Bypassable.bypass else super().forward(x)


def cakld_plus_lm(student, teacher, ids):
    s, t, y = student[0, :-1].float(), teacher[0, :-1].float(), ids[0, 1:]
    ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    forward = (lt.exp() * (lt - ls)).sum(-1)
    backward = (ls.exp() * (ls - lt)).sum(-1)
    conf = lt.gather(-1, y.unsqueeze(1)).squeeze(1).exp()
    return F.cross_entropy(s, y) + (conf * backward + (1 - conf) * forward).mean()


def main():
    model_dir, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    linears = {n: m for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    inputs = {}
    with torch.no_grad():
        hooks = [m.register_forward_hook(lambda m, i, o, n=n: inputs.__setitem__(n, i[0].abs().max()))
                 for n, m in linears.items()]
        model(ids)
        for h in hooks:
            h.remove()
    for name in linears:
        parent, _, child = name.rpartition(".")
        setattr(model.model.layers.get_submodule(parent), child, Bypassable(linears[name], inputs[name]))
    def loss():
        with torch.no_grad():
            Bypassable.bypass = True
            teacher = model(ids).logits
            Bypassable.bypass = False
        return cakld_plus_lm(model(ids).logits, teacher, ids)

    print(time_steps(model, loss, steps))

if __name__ == "__main__":
    main()
