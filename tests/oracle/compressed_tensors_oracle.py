"""compressed-tensors (PyPI) as the oracle for the quantization core's on-disk conventions.

  run IN OUT   IN holds "weight" (fp32 [out, in]); OUT gets, per case, "<case>.scale",
               "<case>.zero_point" and "<case>.q" from compressed-tensors' calculate_qparams and
               quantize, and "<case>.dequant_of_ours" = compressed-tensors' dequantize applied
               to qpipe's own q/scale/zero point (read from IN as "<case>.our_q" etc.)
"""
import sys

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

CASES = {
    "int8_channel_asym": QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="channel"),
    "int8_channel_sym": QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "fp8_channel": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
    "fp8_tensor": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor"),
}


def main(in_path, out_path):
    given = load_file(in_path)
    w = given["weight"]
    out = {}
    for name, args in CASES.items():
        dims = 1 if args.strategy == "channel" else None
        lo = w.amin(dim=dims, keepdim=True) if dims else w.amin().reshape(1)
        hi = w.amax(dim=dims, keepdim=True) if dims else w.amax().reshape(1)
        scale, zero_point = calculate_qparams(torch.minimum(lo, torch.zeros_like(lo)),
                                              torch.maximum(hi, torch.zeros_like(hi)), args)
        out[f"{name}.scale"] = scale.float().contiguous()
        out[f"{name}.zero_point"] = zero_point.float().contiguous()
        out[f"{name}.q"] = quantize(w, scale, zero_point, args).float().contiguous()
        ours = (given[f"{name}.our_q"], given[f"{name}.our_scale"], given[f"{name}.our_zero_point"])
        out[f"{name}.dequant_of_ours"] = dequantize(ours[0].float(), ours[1], ours[2], args).float().contiguous()
    save_file(out, out_path)


if __name__ == "__main__":
    assert sys.argv[1] == "run"
    main(*sys.argv[2:])
