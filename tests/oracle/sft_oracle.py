"""transformers' chat template as the oracle for qpipe's SFT samples (core/io/include/qpipe/sft.h).

  sft_oracle.py MODEL DATA COUNT SEQ

For the first COUNT chat records of DATA (jsonl, "messages"), prints one JSON line each:
{"ids": [...], "labels": [...]}: the chat through the model's own apply_chat_template, the labels
the ids of the last assistant turn's tokens (from the end of the generation prompt of the turns
before it to its <|im_end|> included) and -100 elsewhere, both cut to SEQ tokens.
"""
import json
import sys

import transformers as tf


def token_ids(result):
    return list(result["input_ids"] if hasattr(result, "keys") else result)


def main(model, data, count, seq):
    tokenizer = tf.AutoTokenizer.from_pretrained(model)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with open(data) as inp:
        for line in list(inp)[:int(count)]:
            messages = json.loads(line)["messages"]
            ids = token_ids(tokenizer.apply_chat_template(messages, tokenize=True))
            prompt = token_ids(tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True))
            assert ids[:len(prompt)] == prompt
            last = len(ids) - 1 - ids[::-1].index(end)
            labels = [t if len(prompt) <= i <= last else -100 for i, t in enumerate(ids)]
            print(json.dumps({"ids": ids[:int(seq)], "labels": labels[:int(seq)]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
