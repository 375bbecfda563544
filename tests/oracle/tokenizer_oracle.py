"""Oracle for qpipe::Tokenizer: trains small byte-level BPE tokenizers with HF `tokenizers`, one per
model family's configuration, and writes them with the expected encodings of real text.

Usage: tokenizer_oracle.py OUT_DIR
Writes OUT_DIR/<family>.json (tokenizer.json files) and OUT_DIR/expected.json:
  {"cases": [text...], "families": [{"name", "file", "vocab_size", "encode", "encode_special",
   "decode", "decode_skip", "random_ids", "random_decode"}]}
"""

import glob
import gzip
import json
import os
import random
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANDWRITTEN = os.path.join(SOURCE_DIR, "tests", "fixtures", "tokenizer", "handwritten.jsonl")

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MERGES = 3000


def read_text(path):
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def real_lines():
    """Lines of text found on this machine: licenses, Python sources, man pages (sorted, so stable)."""
    site = glob.glob(os.path.join(SOURCE_DIR, ".venv-test", "lib", "python3*", "site-packages"))[0]
    groups = [
        (sorted(glob.glob("/usr/share/common-licenses/*")), 120),
        (sorted(glob.glob(os.path.join(site, "tokenizers", "**", "*.py"), recursive=True)), 60),
        (sorted(glob.glob(os.path.join(site, "yaml", "*.py"))), 40),
        (sorted(glob.glob(os.path.join(site, "idna", "*.py"))), 40),
        (sorted(glob.glob("/usr/share/man/man1/*.gz"))[:40], 15),
        (sorted(glob.glob("/usr/share/doc/*/copyright"))[:60], 10),
    ]
    lines = []
    for paths, per_file in groups:
        for path in paths:
            text = read_text(path) if os.path.isfile(path) else None
            if not text:
                continue
            # Keep the line endings, so that newline handling is compared too.
            taken = [line for line in text.splitlines(keepends=True) if line.strip()][:per_file]
            lines.extend(taken)
    return lines


def corpus_text():
    """A few MB of local text to train on."""
    site = glob.glob(os.path.join(SOURCE_DIR, ".venv-test", "lib", "python3*", "site-packages"))[0]
    paths = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(
        glob.glob(os.path.join(site, "**", "*.py"), recursive=True)
    )[:400]
    texts = [t for t in (read_text(p) for p in paths if os.path.isfile(p)) if t]
    return texts


def cases():
    with open(HANDWRITTEN, encoding="utf-8") as f:
        handwritten = [json.loads(line) for line in f]
    lines = real_lines()
    rng = random.Random(1234)
    # Paragraphs: several real lines together, so that runs of newlines and indentation meet.
    paragraphs = ["".join(rng.sample(lines, 5)) for _ in range(100)]
    # Chat-shaped text, where special tokens sit between ordinary text.
    chats = [
        f"<|im_start|>user\n{rng.choice(lines)}<|im_end|>\n<|im_start|>assistant\n{rng.choice(handwritten)}<|im_end|>"
        for _ in range(40)
    ]
    return handwritten + lines + paragraphs + chats


def byte_level_trainer(specials):
    return trainers.BpeTrainer(
        vocab_size=256 + MERGES + len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        show_progress=False,
    )


def gpt2(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(texts, byte_level_trainer(["<|endoftext|>"]))
    return tok


def llama3(texts):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(8)]
    tok.train_from_iterator(texts, byte_level_trainer(specials))
    tok.add_special_tokens(["<|eot_id|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    return tok


def qwen2(texts):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(texts, byte_level_trainer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ["<tool_call>", "</tool_call>"]])
    tok.add_special_tokens(["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"])
    return tok


def smollm2(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(texts, byte_level_trainer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    return tok


def options(texts):
    """Not a real family: the options the families leave at their defaults (split behaviours,
    stripped and single-word added tokens, NFKC, prefix space, Roberta post-processing)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.NFC()])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("-", behavior="merged_with_previous"),
            pre_tokenizers.Split(Regex(r"[.,;]"), behavior="merged_with_next"),
            pre_tokenizers.Split(Regex(r"\p{Lu}"), behavior="contiguous", invert=True),
            pre_tokenizers.Digits(individual_digits=False),
            pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, byte_level_trainer(["<s>", "</s>"]))
    tok.add_special_tokens(
        [
            AddedToken("<|endoftext|>", lstrip=True, rstrip=True),
            AddedToken("<|im_start|>", lstrip=True),
            AddedToken("<|im_end|>", rstrip=True),
        ]
    )
    tok.add_tokens([AddedToken("hello", single_word=True), AddedToken("Ärger", normalized=True), AddedToken("ﬁ")])
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))
    return tok


def strings_merges(path):
    """Rewrites merges as "left right" strings, the format of files written before tokenizers 0.20."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    texts = corpus_text()
    all_cases = cases()
    rng = random.Random(99)
    result = {"cases": all_cases, "families": []}
    for name, build in [("gpt2", gpt2), ("llama3", llama3), ("qwen2", qwen2), ("smollm2", smollm2), ("options", options)]:
        path = os.path.join(out_dir, name + ".json")
        build(texts).save(path)
        if name == "gpt2":
            strings_merges(path)
        tok = Tokenizer.from_file(path)
        plain = [e.ids for e in tok.encode_batch(all_cases, add_special_tokens=False)]
        special = [e.ids for e in tok.encode_batch(all_cases, add_special_tokens=True)]
        size = tok.get_vocab_size(with_added_tokens=True)
        # Random ids decode to arbitrary bytes: invalid UTF-8 must become U+FFFD as in HF.
        random_ids = [[rng.randrange(size) for _ in range(rng.randint(1, 6))] for _ in range(500)]
        result["families"].append(
            {
                "name": name,
                "file": path,
                "vocab_size": len(tok.get_vocab(with_added_tokens=True)),
                "encode": plain,
                "encode_special": special,
                "decode": tok.decode_batch(special, skip_special_tokens=False),
                "decode_skip": tok.decode_batch(special, skip_special_tokens=True),
                "random_ids": random_ids,
                "random_decode": tok.decode_batch(random_ids, skip_special_tokens=False),
            }
        )
    with open(os.path.join(out_dir, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)
    print(len(all_cases))


if __name__ == "__main__":
    main()
