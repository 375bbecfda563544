"""Reference for learnable_scale_qat's fake quantization and optimizer, written in plain PyTorch.

For each case: a Linear's weight W, an input x and a target y (seeded), the PTQ scales (absmax /
qmax), then STEPS steps of: y_hat = linear(fq(x, s_a), fq(W, s_w)), loss = mse(y_hat, y),
backward, clip_grad_norm_, AdamW (torch.optim), with the scales themselves as the parameters
("absolute", AngelSlim's) or s = s0 * alpha, alpha from 1 ("relative", mcore_qad's). Prints one
line per case:
  name dtype scope group ste act_dtype param  W x y s_w0 s_a0 grad_w grad_a s_w s_a loss0
tensors as hex of their fp32 bytes, with their shapes fixed by the case (see CASES); grad_* are
the first step's gradients (of the parameters) before clipping, s_w and s_a the scales after the
last step; s_a fields are "-" without a static activation.
The straight-through estimators follow AngelSlim's Quantizer (round and clamp both STE) and LSQ
(real clamp, gradient scale 1/sqrt(N*qmax)) as docs/qat.md states them; nothing here is shared
with the C++ code.
"""
import math
import struct

import torch

OUT, IN, TOKENS = 8, 16, 6
STEPS = 3
LR = {"absolute": 1e-4, "relative": 1e-2}  # a step of about 3 % of the scales either way
MAX_NORM = 5e-3
QMAX = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": 448.0}
QMIN = {"int8": -128.0, "int4": -8.0, "fp8_e4m3": -448.0}

# name, weight dtype, weight scope, group, ste, activation dtype ("float": none), parameter
CASES = [
    ("int8_channel_static_angelslim", "int8", "per_channel", 0, "angelslim", "int8", "absolute"),
    ("int8_channel_static_lsq", "int8", "per_channel", 0, "lsq", "int8", "absolute"),
    ("fp8_tensor_static_angelslim", "fp8_e4m3", "per_tensor", 0, "angelslim", "fp8_e4m3", "absolute"),
    ("fp8_channel_static_lsq", "fp8_e4m3", "per_channel", 0, "lsq", "fp8_e4m3", "absolute"),
    ("int4_group_angelslim", "int4", "per_group", 8, "angelslim", "float", "absolute"),
    ("int4_group_lsq", "int4", "per_group", 8, "lsq", "float", "absolute"),
    ("int8_channel_static_relative", "int8", "per_channel", 0, "angelslim", "int8", "relative"),
    ("fp8_tensor_static_lsq_relative", "fp8_e4m3", "per_tensor", 0, "lsq", "fp8_e4m3", "relative"),
    ("int4_group_relative", "int4", "per_group", 8, "angelslim", "float", "relative"),
]


def hexof(t):
    values = t.detach().to(torch.float32).flatten().tolist()
    return struct.pack(f"<{len(values)}f", *values).hex()


def fake_quant(x, s, dtype, ste):
    qmin, qmax = QMIN[dtype], QMAX[dtype]
    if ste == "lsq":
        g = 1.0 / math.sqrt(x.numel() / s.numel() * qmax)
        s = (s - s * g).detach() + s * g
    u = x / s
    if dtype == "fp8_e4m3":
        c = u.clamp(qmin, qmax) if ste == "lsq" else (u.clamp(qmin, qmax) - u).detach() + u
        q = (c.to(torch.float8_e4m3fn).to(torch.float32) - c).detach() + c
    else:
        r = (u.round() - u).detach() + u
        q = r.clamp(qmin, qmax) if ste == "lsq" else (r.clamp(qmin, qmax) - r).detach() + r
    return q * s


def weight_fq(w, s, dtype, scope, group, ste):
    if scope == "per_group":
        g = w.reshape(OUT, IN // group, group)
        return fake_quant(g, s.unsqueeze(-1), dtype, ste).reshape(OUT, IN)
    return fake_quant(w, s, dtype, ste)


def initial_weight_scale(w, dtype, scope, group):
    a = w.abs()
    if scope == "per_tensor":
        m = a.max().reshape(1)
    elif scope == "per_channel":
        m = a.amax(dim=1, keepdim=True)
    else:
        m = a.reshape(OUT, IN // group, group).amax(dim=-1)
    return m / QMAX[dtype]


def main():
    for index, (name, dtype, scope, group, ste, act, param) in enumerate(CASES):
        gen = torch.Generator().manual_seed(1000 + index)
        w = torch.randn(OUT, IN, generator=gen) * 0.2
        w[0, 3] = 1.5  # an outlier that saturates once its row's scale shrinks
        x = torch.randn(TOKENS, IN, generator=gen)
        y = torch.randn(TOKENS, OUT, generator=gen)
        s_w0 = initial_weight_scale(w, dtype, scope, group)
        s_a0 = (x.abs().max() / QMAX[act] * 0.7).reshape(1) if act != "float" else None

        def parameter(s0):
            return (torch.ones_like(s0) if param == "relative" else s0.clone()).requires_grad_(True)

        def scale(p, s0):
            return s0 * p if param == "relative" else p

        params = [parameter(s_w0)] + ([parameter(s_a0)] if s_a0 is not None else [])
        opt = torch.optim.AdamW(params, lr=LR[param], weight_decay=0.0)
        grads = None
        loss0 = None
        for step in range(STEPS):
            s_w = scale(params[0], s_w0)
            xq = fake_quant(x, scale(params[1], s_a0), act, ste) if s_a0 is not None else x
            out = torch.nn.functional.linear(xq, weight_fq(w, s_w, dtype, scope, group, ste))
            loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
            if step == 0:
                loss0 = loss.item()
                grads = [p.grad.detach().clone() for p in params]
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
        with_act = s_a0 is not None
        fields = [name, dtype, scope, str(group), ste, act, param, hexof(w), hexof(x), hexof(y), hexof(s_w0),
                  hexof(s_a0) if with_act else "-", hexof(grads[0]), hexof(grads[1]) if with_act else "-",
                  hexof(scale(params[0], s_w0)), hexof(scale(params[1], s_a0)) if with_act else "-", repr(loss0)]
        print(" ".join(fields))


if __name__ == "__main__":
    main()
