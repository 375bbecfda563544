"""Python safetensors as the oracle for qpipe's reader and writer.

  write DIR   writes DIR/python.safetensors with one tensor per dtype (seeded)
  dump FILE   prints name, dtype, shape and the raw bytes (hex) of every tensor
"""
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def write(directory):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4, 3, generator=g) * 50
    tensors = {str(t).replace("torch.", ""): base.to(t) for t in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
        torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
    tensors["empty"] = torch.empty(0, 2)
    save_file(tensors, f"{directory}/python.safetensors", metadata={"producer": "python"})


def dump(path):
    with safe_open(path, framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            dtype = str(t.dtype).replace("torch.", "")
            print(name, dtype, list(t.shape), raw.hex())


if __name__ == "__main__":
    {"write": write, "dump": dump}[sys.argv[1]](sys.argv[2])
