"""Independent replay of qpipe's histogram observer, for the windows pinned in
tests/unit/test_observer.cpp (not run by ctest; run with .venv-test).

The histogram is built here with numpy on qpipe's power-of-two bins ([-2^k, 2^k), 2048 bins, k the
least integer with absmax < 2^k); the l2 error is torch's own
HistogramObserver._compute_quantization_error (in float64), driven by msmodelslim's search (start
from the occupied range's error, torch's 1e-5 quantile moves) and tightened to the data inside the
window, as docs/quantization.md describes.

    .venv-test/bin/python tests/oracle/histogram_quant_pins.py
"""
import math

import numpy as np
import torch
from torch.ao.quantization.observer import HistogramObserver

torch.set_default_dtype(torch.float64)
BINS = 2048


def histogram(values):
    v = np.asarray(values, dtype=np.float32).astype(np.float64)
    absmax = float(np.abs(v).max())
    k = math.frexp(absmax)[1] if absmax > 0 else -149
    index = np.floor(v * 2.0 ** (10 - k)).astype(np.int64) + BINS // 2
    counts = np.bincount(index, minlength=BINS).astype(np.float64)
    low = np.full(BINS, np.inf)
    high = np.full(BINS, -np.inf)
    np.minimum.at(low, index, v)
    np.maximum.at(high, index, v)
    return k, counts, low, high


def int8_qparams(lo, hi, symmetric):
    """msmodelslim calculate_int_qparam in fp32 (docs/quantization.md)."""
    lo = torch.tensor([lo], dtype=torch.float32).clamp(max=0)
    hi = torch.tensor([hi], dtype=torch.float32).clamp(min=0)
    eps = torch.finfo(torch.float32).eps
    if symmetric:
        return torch.maximum(-lo, hi).div(127).clamp(min=eps), torch.zeros(1)
    scale = (hi / 255 - lo / 255).clamp(min=eps)
    return scale, torch.round(-lo / scale) - 128


def kl_error(k, counts, start, end, symmetric):
    """msmodelslim _compute_kl_error: p in fp32, bincount weights rounded to fp16, q spread evenly
    over the source bins that fake quantization sends to the same bin."""
    width = 2.0 ** (k - 10)
    edge = -(2.0**k)
    eps = float(torch.finfo(torch.float32).eps)
    hist = torch.tensor(counts)
    p = (hist / hist.sum()).float()
    mid = (torch.arange(BINS, dtype=torch.float64) + 0.5) * width + edge
    lo, hi = start * width + edge, (end + 1) * width + edge
    scale, zp = int8_qparams(lo, hi, symmetric)
    q = torch.round(mid.float() / scale + zp).clamp(-128, 127)
    fake = ((q - zp) * scale).double()
    fake[:start] = lo
    fake[end:] = hi
    target = (torch.floor((fake - lo) / width) + start).clamp(start, end).long()
    mass = torch.zeros(BINS, dtype=torch.float64).index_add_(0, target, p.half().double())
    sources = torch.bincount(target, minlength=BINS).double()
    qd = (mass / sources.clamp(min=eps))[target].float()
    return float((p * torch.log(p.clamp(min=eps) / qd.clamp(min=eps))).sum())


def clip_range(k, counts, low, high, kl=None):
    observer = HistogramObserver(bins=BINS)
    observer.histogram = torch.tensor(counts)
    observer.min_val = torch.tensor(-(2.0**k))
    observer.max_val = torch.tensor(2.0**k)

    def error(start, end):
        if kl is not None:
            return kl_error(k, counts, start, end, kl == "sym")
        return float(observer._compute_quantization_error(start, end))

    csum = np.cumsum(counts)
    total = csum[-1]
    occupied = np.nonzero(counts)[0]
    start, end = int(occupied[0]), int(occupied[-1])
    norm_min = error(start, end)
    alpha, beta = 0.0, 1.0
    while alpha < beta:
        next_alpha, next_beta = alpha + 1e-5, beta - 1e-5
        lower, upper = np.float32(next_alpha * total), np.float32(next_beta * total)
        l = start
        while l < end and np.float32(csum[l]) < lower:
            l += 1
        r = end
        while r > start and np.float32(csum[r]) > upper:
            r -= 1
        next_start, next_end = start, end
        if l - start > end - r:
            next_start, alpha = l, next_alpha
        else:
            next_end, beta = r, next_beta
        if (next_start, next_end) == (start, end):
            continue
        norm = error(next_start, next_end)
        if norm > norm_min:
            break
        norm_min, start, end = norm, next_start, next_end
    return float(low[start : end + 1].min()), float(high[start : end + 1].max()), start, end


def show(name, values, kl=None):
    k, counts, low, high = histogram(values)
    occupied = np.nonzero(counts)[0]
    lo, hi, start, end = clip_range(k, counts, low, high, kl)
    print(f"{name}: k={k} occupied [{occupied[0]}, {occupied[-1]}] window [{start}, {end}] clip ({lo!r}, {hi!r})")


u = (torch.arange(20000, dtype=torch.float32) + 0.5) / 20000
show("uniform", torch.linspace(-3, 5, 20480, dtype=torch.float32).numpy())
show("outlier", np.concatenate([torch.linspace(-1, 1, 100000, dtype=torch.float32).numpy(), [1000.0]]))
show("cauchy", torch.tan((u - 0.5) * 3.1).numpy())
show("normal", torch.erfinv(u * 2 - 1).numpy())
show("normal kl asym", torch.erfinv(u * 2 - 1).numpy(), kl="asym")
even = ((torch.arange(20480, dtype=torch.float32) + 0.5) / 20480 * 8 - 4).numpy()
show("even", even)
show("even kl sym", even, kl="sym")
show("uniform kl sym", torch.linspace(-3, 5, 20480, dtype=torch.float32).numpy(), kl="sym")
show("relu", torch.linspace(0, 5, 20480, dtype=torch.float32).numpy())
