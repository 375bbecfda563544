"""Perplexity by qpipe's definition (docs/data.md), in PyTorch, for test_perplexity_oracle.cpp.

The model is the test's toy one: logits[t] = table[ids[t]] + position[t], read from raw files.
Prints {"ppl", "mean_nll", "tokens", "windows"} as JSON.

usage: perplexity.py IDS TABLE POSITION VOCAB SEQ_LEN MAX_WINDOWS DTYPE
"""
import json
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

ids_path, table_path, position_path = sys.argv[1:4]
vocab, seq_len, max_windows = (int(a) for a in sys.argv[4:7])
dtype = getattr(torch, sys.argv[7])

ids = torch.from_numpy(np.fromfile(ids_path, dtype=np.int64))
table = torch.from_numpy(np.fromfile(table_path, dtype=np.float32)).view(vocab, vocab)
position = torch.from_numpy(np.fromfile(position_path, dtype=np.float32)).view(seq_len, vocab)

windows = ids.numel() // seq_len
if max_windows > 0:
    windows = min(windows, max_windows)
batch = ids[: windows * seq_len].view(windows, seq_len)
logits = (table[batch] + position).to(dtype)  # the forward's output type, as the C++ side returns it

# Position t predicts token t + 1; the fp32 NLLs are summed in double.
nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), batch[:, 1:].reshape(-1), reduction="none")
tokens = nll.numel()
mean_nll = nll.double().sum().item() / tokens
print(json.dumps({"ppl": math.exp(mean_nll), "mean_nll": mean_nll, "tokens": tokens, "windows": windows}))
