#!/usr/bin/env python3
"""Writes data/sft.jsonl, the SFT set of the QAT practices (docs/data.md), from data/calib.jsonl.

Each calibration paragraph (Jane Austen, public domain, via Debian's r-cran-janeaustenr, MIT) becomes
one chat: the user asks for the passage to be continued and gives its opening sentences (about the
first 40 % of its characters, cut at a sentence end), the assistant answers with the rest. The
output is deterministic: rerunning this script rewrites the same file.
  tools/make_sft_data.py [CALIB_JSONL] [OUT_JSONL]
"""
import json
import re
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
source = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "data" / "calib.jsonl"
target = Path(sys.argv[2]) if len(sys.argv) > 2 else root / "data" / "sft.jsonl"

with source.open() as inp, target.open("w") as out:
    for line in inp:
        text = json.loads(line)["text"]
        ends = [m.end() for m in re.finditer(r"[.!?;][\"']?\s", text)]
        cut = min((e for e in ends if e >= 0.4 * len(text)), default=None)
        if cut is None or cut >= len(text) - 20:
            continue
        head, tail = text[:cut].strip(), text[cut:].strip()
        record = {"messages": [{"role": "user", "content": "Continue this passage:\n\n" + head},
                               {"role": "assistant", "content": tail}]}
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
