"""Oracle for qpipe's GGUF reader and converter: gguf-py (llama.cpp's own Python package) writes the
fixtures and dequantises them; transformers and tokenizers load what `qpipe convert gguf` wrote.

  quants OUT_DIR                 quants.gguf, one tensor per ggml type, and <name>.f32 with
                                 gguf.quants.dequantize's fp32 values (raw little-endian)
  llama OUT.gguf EXPECTED [--pre P] [--tied] [--rope_freq_base F]
                                 a tiny random Llama GGUF with a byte-level BPE tokenizer, and the HF
                                 weights it must convert to (EXPECTED, safetensors)
  check MODEL_DIR EXPECTED       load MODEL_DIR with transformers and tokenizers and compare
  generate MODEL_DIR PROMPT      greedy-decode 12 tokens (the real SmolLM2)
"""

import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

RNG = np.random.default_rng(20240607)


def finite_half(count, low, high):
    """Random fp16 scale fields as bytes, finite and of either sign."""
    values = RNG.uniform(low, high, count) * RNG.choice([-1.0, 1.0], count)
    return values.astype(np.float16).view(np.uint8).reshape(count, 2)


def k_quant_blocks(qtype, n_blocks):
    """Random K-quant blocks (gguf-py cannot quantise them): random payload, finite d / dmin."""
    size = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}[qtype]
    blocks = RNG.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if qtype in (T.Q4_K, T.Q5_K):
        blocks[:, 0:2] = finite_half(n_blocks, 1e-3, 1.0)
        blocks[:, 2:4] = finite_half(n_blocks, 1e-3, 1.0)
    else:
        blocks[:, 208:210] = finite_half(n_blocks, 1e-3, 1.0)
    return blocks


def write_quants(out_dir):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out_dir / "quants.gguf", "llama")
    data = RNG.standard_normal((3, 4, 64)).astype(np.float32)
    # PyTorch shape (3, 4, 64): ne = {64, 4, 3}, checking the dimension order on three axes.
    writer.add_tensor("f32", data)
    writer.add_tensor("f16", RNG.standard_normal((5, 96)).astype(np.float16))
    writer.add_tensor("bf16", quantize(RNG.standard_normal((6, 64)).astype(np.float32), T.BF16), raw_dtype=T.BF16)
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        values = (RNG.standard_normal((7, 128)) * RNG.uniform(0.01, 3.0, (7, 1))).astype(np.float32)
        writer.add_tensor(qtype.name.lower(), quantize(values, qtype), raw_dtype=qtype)
    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        rows, blocks_per_row = 3, 2
        blocks = k_quant_blocks(qtype, rows * blocks_per_row).reshape(rows, -1)
        writer.add_tensor(qtype.name.lower(), blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    for tensor in GGUFReader(out_dir / "quants.gguf").tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype("<f4")
        values.tofile(out_dir / f"{tensor.name}.f32")
        print(tensor.name, tensor.tensor_type.name, "x".join(str(n) for n in values.shape))


# A tiny Llama: GQA (4 heads, 2 KV heads), 2 layers, every supported weight type somewhere.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "cat", "sat", "on", "mat", "hello", "world", "in", "er", "ing"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def byte_symbols():
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def vocabulary():
    tokens = list(SPECIALS) + byte_symbols()
    merges = []
    for word in WORDS:
        for text in (word, "\u0120" + word):  # "Ġ": a leading space
            current = text[0]
            for ch in text[1:]:
                merged = current + ch
                if merged not in tokens:
                    merges.append(f"{current} {ch}")
                    tokens.append(merged)
                current = merged
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def llama_permute(weight, heads):
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of each head."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama_unpermute(weight, heads):
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama(path, expected_path, pre, tied, rope_freq_base=500000.0):
    from safetensors.numpy import save_file

    tokens, merges, types = vocabulary()
    vocab = len(tokens)
    writer = GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(rope_freq_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    expected = {}

    def add(gguf_name, hf_name, weight, qtype, heads=0):
        stored = llama_permute(weight, heads) if heads else weight
        if qtype == T.F32:
            writer.add_tensor(gguf_name, stored)
            back = stored
        elif qtype == T.F16:
            writer.add_tensor(gguf_name, stored.astype(np.float16))
            back = stored.astype(np.float16).astype(np.float32)
        else:
            packed = quantize(stored, qtype)
            writer.add_tensor(gguf_name, packed, raw_dtype=qtype)
            back = dequantize(packed, qtype)
        expected[hf_name] = np.ascontiguousarray(llama_unpermute(back, heads) if heads else back).astype(np.float32)

    def rand(*shape, scale=0.2):
        return (RNG.standard_normal(shape) * scale).astype(np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, HIDDEN), T.Q8_0)
    layer_types = [
        {"q": T.Q4_1, "k": T.Q4_0, "v": T.F16, "o": T.BF16, "gate": T.Q5_0, "up": T.Q5_1, "down": T.Q8_0},
        {"q": T.Q8_0, "k": T.F16, "v": T.Q4_1, "o": T.Q4_0, "gate": T.F32, "up": T.Q8_0, "down": T.Q4_1},
    ]
    for i, qt in enumerate(layer_types):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", h + "input_layernorm.weight", 1 + rand(HIDDEN, scale=0.1), T.F32)
        add(p + "attn_q.weight", h + "self_attn.q_proj.weight", rand(HEADS * HEAD_DIM, HIDDEN), qt["q"], HEADS)
        add(p + "attn_k.weight", h + "self_attn.k_proj.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN), qt["k"], KV_HEADS)
        add(p + "attn_v.weight", h + "self_attn.v_proj.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN), qt["v"])
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", rand(HIDDEN, HEADS * HEAD_DIM), qt["o"])
        add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + rand(HIDDEN, scale=0.1), T.F32)
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", rand(FFN, HIDDEN), qt["gate"])
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", rand(FFN, HIDDEN), qt["up"])
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", rand(HIDDEN, FFN), qt["down"])
    add("output_norm.weight", "model.norm.weight", 1 + rand(HIDDEN, scale=0.1), T.F32)
    if not tied:
        add("output.weight", "lm_head.weight", rand(vocab, HIDDEN), T.Q4_0)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(expected, expected_path)
    print(f"wrote {path}: {len(expected)} tensors, vocab {vocab}")


def reference_tokenizer():
    """The tokenizer built directly with the tokenizers API from the same vocabulary: what the
    converted tokenizer.json must behave like."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges, _ = vocabulary()
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def check(model_dir, expected_path):
    import torch
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, LlamaForCausalLM

    expected = load_file(expected_path)
    # The converted weights in their saved dtype: the expected values rounded the same way.
    dtype = getattr(torch, json.loads((Path(model_dir) / "config.json").read_text())["torch_dtype"])
    expected = {name: tensor.to(dtype).to(torch.float32) for name, tensor in expected.items()}
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = model.state_dict()
    tied = "lm_head.weight" not in expected
    for name, tensor in expected.items():
        assert name in state, f"{name} missing from the converted model"
        assert state[name].shape == tensor.shape, f"{name}: shape {tuple(state[name].shape)} != {tuple(tensor.shape)}"
        assert torch.equal(state[name], tensor), f"{name}: values differ"
    if tied:
        assert torch.equal(state["lm_head.weight"], expected["model.embed_tokens.weight"]), "lm_head is not tied"
    print(f"weights: {len(expected)} tensors equal ({dtype})")
    cfg = model.config
    print(f"config: layers={cfg.num_hidden_layers} heads={cfg.num_attention_heads} kv={cfg.num_key_value_heads} "
          f"head_dim={cfg.head_dim} eps={cfg.rms_norm_eps} theta={cfg.rope_parameters['rope_theta']} "
          f"tied={cfg.tie_word_embeddings} bos={cfg.bos_token_id} eos={cfg.eos_token_id}")
    with torch.no_grad():
        logits = model(torch.tensor([[5, 40, 41, 7]])).logits
    assert torch.isfinite(logits).all()
    print(f"forward: logits {tuple(logits.shape)} finite")

    converted = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    reference = reference_tokenizer()
    auto = AutoTokenizer.from_pretrained(model_dir)
    for text in ["the cat sat on the mat", "hello world 12345!", "<|im_start|>user\nhi<|im_end|>", "  ínger \t2x"]:
        ids = converted.encode(text).ids
        assert ids == reference.encode(text).ids, f"{text!r}: {ids} != {reference.encode(text).ids}"
        assert auto(text)["input_ids"] == ids, f"{text!r}: AutoTokenizer {auto(text)['input_ids']} != {ids}"
        assert converted.decode(ids, skip_special_tokens=False) == text, f"{text!r} does not round-trip"
    print("tokenizer: 4 texts encode as the reference and round-trip")
    chat = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n", repr(chat)
    print(f"special: bos={auto.bos_token} eos={auto.eos_token} pad={auto.pad_token} unk={auto.unk_token}")


def generate(model_dir, prompt):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs = tok(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    print(json.dumps({"ids": inputs["input_ids"][0].tolist(), "text": tok.decode(out[0])}))


def main(argv):
    command = argv[1]
    if command == "quants":
        write_quants(argv[2])
    elif command == "llama":
        pre = argv[argv.index("--pre") + 1] if "--pre" in argv else "smollm"
        base = float(argv[argv.index("--rope_freq_base") + 1]) if "--rope_freq_base" in argv else 500000.0
        write_llama(argv[2], argv[3], pre, "--tied" in argv, base)
    elif command == "check":
        check(argv[2], argv[3])
    elif command == "generate":
        generate(argv[2], argv[3])
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv)
