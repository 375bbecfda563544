"""msmodelslim's quantization formulas (docs/quantization.md,
msmodelslim/ir/api/impl/{int,fp}_quantization.py) in plain torch, as the oracle for qpipe::quant.

  (no argument)  one line per case: NAME DTYPE SCOPE SYM GROUP NDIM DIMS... X SCALE ZP Q, where X is
                 the fp32 input, SCALE fp32, ZP int32 and Q int8 (or float8_e4m3fn), raw hex
  ssz            one line per case: NAME BITS ROWS COLS W SCALE, the SSZ weight scale search
                 (msmodelslim core/quantizer/impl/ssz.py, symmetric), W and SCALE fp32 raw hex
"""
import sys

import torch


def hexof(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes().hex()


def reduce_dims(scope, x, group):
    if scope == "per_tensor":
        return x.reshape(1, -1), lambda t: t.reshape(1)
    if scope == "per_channel":
        return x.reshape(x.shape[0], -1), lambda t: t.reshape(x.shape[0], 1)
    if scope == "per_group":
        return x.reshape(-1, group), lambda t: t.reshape(x.shape[0], x.shape[1] // group)
    if scope == "per_token":
        return x.reshape(-1, x.shape[-1]), lambda t: t.reshape(*x.shape[:-1], 1)
    if scope == "per_head":
        h = x.transpose(0, 1).reshape(x.shape[1], -1)
        return h, lambda t: t.reshape(1, x.shape[1], 1, 1)
    raise ValueError(scope)


def expand(t, scope, group):
    return t.repeat_interleave(group, dim=1) if scope == "per_group" else t


def case(name, dtype, scope, sym, group, x):
    rows, shape_back = reduce_dims(scope, x, group)
    mn = shape_back(rows.amin(dim=1))
    mx = shape_back(rows.amax(dim=1))
    if dtype == "fp8_e4m3":
        scale = torch.maximum(mn.abs(), mx.abs()).clamp(min=1e-12) / 448
        zp = torch.zeros_like(scale)
        q = torch.clamp(x / expand(scale, scope, group), -448, 448).to(torch.float8_e4m3fn)
    else:
        bits = 8 if dtype == "int8" else 4
        mn = torch.clamp(mn, max=0)
        mx = torch.clamp(mx, min=0)
        eps = torch.finfo(torch.float32).eps
        if sym:
            qmax = 2 ** (bits - 1) - 1
            scale = torch.clamp(torch.maximum(-mn, mx) / qmax, min=eps)
            zp = torch.zeros_like(scale)
        else:
            qmax = 2 ** bits - 1
            scale = torch.clamp(mx / qmax - mn / qmax, min=eps)
            zp = torch.round(-mn / scale) + (-(2 ** (bits - 1)))
        q = torch.round(x / expand(scale, scope, group) + expand(zp, scope, group))
        q = torch.clamp(q, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1).to(torch.int8)
    print(name, dtype, scope, int(sym), group, x.dim(), *x.shape, hexof(x), hexof(scale), hexof(zp.to(torch.int32)),
          hexof(q))


def main():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(16, 64, generator=g) * 3
    w[3, 5] = 40.0
    a = torch.randn(2, 5, 64, generator=g) + 0.7
    kv = torch.randn(2, 4, 5, 8, generator=g) * torch.tensor([1.0, 5.0, 0.1, 30.0]).reshape(1, 4, 1, 1)
    case("w8_channel_sym", "int8", "per_channel", True, 0, w)
    case("w8_channel_asym", "int8", "per_channel", False, 0, w + 1)
    case("w4_channel_sym", "int4", "per_channel", True, 0, w)
    case("w4_group_asym", "int4", "per_group", False, 16, w)
    case("w4_group_sym", "int4", "per_group", True, 32, w)
    case("a8_token_sym", "int8", "per_token", True, 0, a)
    case("a8_token_asym", "int8", "per_token", False, 0, a)
    case("a8_tensor_asym", "int8", "per_tensor", False, 0, a)
    case("fp8_tensor", "fp8_e4m3", "per_tensor", True, 0, w * 100)
    case("fp8_channel", "fp8_e4m3", "per_channel", True, 0, w)
    case("fp8_token", "fp8_e4m3", "per_token", True, 0, a)
    case("kv8_head", "int8", "per_head", True, 0, kv)


def ssz(name, bits, w, iterations=50):
    qmax = 2 ** (bits - 1) - 1
    wt = w.t()  # msmodelslim works on W.T, reducing over dim 0
    scale = torch.clamp(wt.abs().amax(dim=0, keepdim=True) / qmax, min=torch.finfo(torch.float32).eps)
    quant = lambda s: torch.clamp(torch.round(wt / s), -qmax - 1, qmax)
    q = quant(scale)
    best_scale = scale
    best_mse = torch.mean((wt - q * scale) ** 2, dim=0, keepdim=True)
    for _ in range(iterations):
        scale = torch.sum(wt * q, dim=0, keepdim=True) / torch.sum(q * q, dim=0, keepdim=True).clamp(min=1e-30)
        q = quant(scale)
        mse = torch.mean((wt - q * scale) ** 2, dim=0, keepdim=True)
        mask1 = (best_mse - mse) / best_mse.clamp(min=1e-4) < 1e-10
        mask2 = torch.abs(best_mse - mse) < 1e-10
        if torch.sum(torch.logical_and(~mask1, ~mask2)) == 0:
            break
        better = mse < best_mse
        best_mse = torch.where(better, mse, best_mse)
        best_scale = torch.where(better, scale, best_scale)
    print(name, bits, w.shape[0], w.shape[1], hexof(w), hexof(best_scale.flatten()))


def main_ssz():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 96, generator=g)
    w[0, 0] = 9.0
    w[5] = 0.0
    ssz("ssz_int4", 4, w)
    ssz("ssz_int8", 8, w * 0.02)


if __name__ == "__main__":
    main_ssz() if sys.argv[1:] == ["ssz"] else main()
