"""The blockwise QAT step of tools/bench/qat_step.sh written in PyTorch: one SmolLM2 decoder layer
(transformers) with every Linear fake-quantized (FP8 E4M3 per-tensor weights and static inputs,
LSQ, scales s = s0 * alpha as qpipe's relative parametrization), trained with AdamW on the MSE to
the float layer's output, one 512-token sample per step. Prints the median seconds per step and
this process's peak RSS in MiB.
  python qat_step_torch.py MODEL_DIR STEPS THREADS
"""
import math
import os
import resource
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

QMAX = 448.0


def fake_quant(x, s):
    g = 1.0 / math.sqrt(x.numel() / s.numel() * QMAX)
    s = (s - s * g).detach() + s * g
    c = (x / s).clamp(-QMAX, QMAX)
    return ((c.to(torch.float8_e4m3fn).to(torch.float32) - c).detach() + c) * s


class FakeQuantLinear(torch.nn.Module):
    def __init__(self, linear, x_absmax):
        super().__init__()
        self.weight = linear.weight.detach()
        self.bias = linear.bias.detach() if linear.bias is not None else None
        self.w0 = self.weight.abs().max().reshape(1) / QMAX
        self.a0 = x_absmax.reshape(1) / QMAX
        self.w_alpha = torch.nn.Parameter(torch.ones(1))
        self.a_alpha = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        w = fake_quant(self.weight, self.w0 * self.w_alpha)
        return torch.nn.functional.linear(fake_quant(x, self.a0 * self.a_alpha), w, self.bias)


def main():
    model_dir, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    layer = model.model.layers[0]
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(512).unsqueeze(0)
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
        rotary = model.model.rotary_emb(hidden, positions)
        inputs = {}
        hooks = [m.register_forward_hook(lambda m, i, o, n=n: inputs.__setitem__(n, i[0].abs().max()))
                 for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
        target = layer(hidden, position_embeddings=rotary)
        target = target[0] if isinstance(target, tuple) else target
        for h in hooks:
            h.remove()
    for name, module in list(layer.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, FakeQuantLinear(child, inputs[full]))
    def loss():
        out = layer(hidden, position_embeddings=rotary)
        out = out[0] if isinstance(out, tuple) else out
        return torch.nn.functional.mse_loss(out, target)

    print(time_steps(layer, loss, steps))


def time_steps(module, loss, steps):
    """AdamW (lr 1e-2) on module's trainable parameters with clipping at 1.0, `steps` times, the
    forward under bf16 autocast when the environment has BF16=1 (HF's bf16: True);
    "<median seconds per step after two> <peak RSS MiB>"."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    bf16 = os.environ.get("BF16", "0") == "1"
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            value = loss()
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return f"{statistics.median(times[2:]):.4f} {rss:.0f}"


if __name__ == "__main__":
    main()
