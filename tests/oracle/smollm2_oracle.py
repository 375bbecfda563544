"""transformers and tokenizers on the real SmolLM2-135M folder (.cache/models/smollm2-135m).

  encode MODEL LINES OUT        ids of every line of LINES (JSON list of strings) -> OUT (JSON)
  greedy MODEL PROMPT N         prompt ids followed by N greedy tokens (JSON list), fp32
  ppl MODEL DATA SEQ_LEN MAX    perplexity by qpipe's definition (docs/data.md) of the first MAX
                                texts of DATA (jsonl with "text"), printed as JSON
"""
import json
import math
import sys

import torch
import transformers as tf
from tokenizers import Tokenizer


def encode(model, lines_path, out_path):
    tokenizer = Tokenizer.from_file(f"{model}/tokenizer.json")
    lines = json.load(open(lines_path, encoding="utf-8"))
    ids = [tokenizer.encode(line, add_special_tokens=False).ids for line in lines]
    json.dump(ids, open(out_path, "w"))


def greedy(model, prompt, n):
    tokenizer = Tokenizer.from_file(f"{model}/tokenizer.json")
    lm = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids])
    with torch.no_grad():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(n), do_sample=False,
                          pad_token_id=0)
    print(json.dumps(out[0].tolist()))


def ppl(model, data, seq_len, max_texts):
    seq_len, max_texts = int(seq_len), int(max_texts)
    texts = [json.loads(line)["text"] for line in open(data, encoding="utf-8") if line.strip()][:max_texts]
    tokenizer = Tokenizer.from_file(f"{model}/tokenizer.json")
    ids = torch.tensor(tokenizer.encode("\n\n".join(texts), add_special_tokens=False).ids)
    lm = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    windows = ids.numel() // seq_len
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            window = ids[w * seq_len:(w + 1) * seq_len].unsqueeze(0)
            logits = lm(window).logits.float()[0, :-1]
            nll = torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="none")
            total += nll.double().sum().item()
            count += nll.numel()
    print(json.dumps({"ppl": math.exp(total / count), "tokens": count, "windows": windows}))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"encode": encode, "greedy": greedy, "ppl": ppl}[command](*args)
