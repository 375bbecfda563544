"""A synthetic Qwen3 checkpoint for memory and speed benches: random weights, real layout.

    .venv-test/bin/python tools/bench/make_synthetic_qwen3.py [--out DIR] [--num_layers N]
                                                             [--shard_bytes B] [--seed S]

Qwen3-1.7B's shape (hidden 2048, intermediate 6144, 16 heads / 8 KV heads of 128, q/k norm) with
40 decoder layers and an untied lm_head, bf16: 4,429,537,280 bytes of tensors (4.13 GiB), one
decoder layer 100,672,000 bytes. Written as transformers writes a sharded checkpoint
(model-0000i-of-0000n.safetensors with {"format": "pt"} metadata + model.safetensors.index.json),
with SmolLM2's tokenizer files (vocab_size = its 49,152 tokens).

Weights: normal(0, 0.02), RMSNorm weights 1. Each tensor has its own generator seeded from
(seed, tensor index), so the bytes do not depend on the shard size. The folder is written to a
temporary name and renamed when complete; an existing complete folder is left alone.

With --moe E: a Qwen3-MoE with E experts per layer at small widths instead (hidden 256, 4 heads /
2 KV heads of 64, experts of width 128, 8 per token, SmolLM2's vocabulary): the scheduler's bench
of hundreds of per-expert subgraphs in one wave (tools/bench/dts.sh with MODEL set to it).
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / ".cache/models/smollm2-135m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

VOCAB = 49152
DENSE = {"hidden": 2048, "intermediate": 6144, "heads": 16, "kv_heads": 8, "head_dim": 128, "experts": 0}
MOE = {"hidden": 256, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 64, "top_k": 8}


def config(num_layers, shape):
    moe = {}
    if shape["experts"]:
        moe = {"num_experts": shape["experts"], "num_experts_per_tok": shape["top_k"],
               "moe_intermediate_size": shape["intermediate"], "norm_topk_prob": True, "decoder_sparse_step": 1,
               "mlp_only_layers": []}
    return {
        "architectures": ["Qwen3MoeForCausalLM" if shape["experts"] else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if shape["experts"] else "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "head_dim": shape["head_dim"],
        "hidden_act": "silu",
        "hidden_size": shape["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": shape["intermediate"],
        "max_position_embeddings": 40960,
        "max_window_layers": num_layers,
        "num_attention_heads": shape["heads"],
        "num_hidden_layers": num_layers,
        "num_key_value_heads": shape["kv_heads"],
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB,
        **moe,
    }


def tensor_shapes(num_layers, shape):
    """(name, shape) in the order transformers' state_dict lists them."""
    hidden, inter, heads, kv, dim = (shape[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"))
    shapes = [("model.embed_tokens.weight", (VOCAB, hidden))]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (heads * dim, hidden)),
            (p + "self_attn.k_proj.weight", (kv * dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv * dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, heads * dim)),
            (p + "self_attn.q_norm.weight", (dim,)),
            (p + "self_attn.k_norm.weight", (dim,)),
        ]
        experts = [f"mlp.experts.{e}." for e in range(shape["experts"])] or ["mlp."]
        if shape["experts"]:
            shapes.append((p + "mlp.gate.weight", (shape["experts"], hidden)))
        for e in experts:
            shapes += [(p + e + "gate_proj.weight", (inter, hidden)), (p + e + "up_proj.weight", (inter, hidden)),
                       (p + e + "down_proj.weight", (hidden, inter))]
        shapes += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (VOCAB, hidden))]
    return shapes


def make_tensor(name, shape, seed, index):
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02).to(torch.bfloat16)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: .cache/bench/qwen3-synthetic-<N>l")
    parser.add_argument("--num_layers", type=int, default=40)
    parser.add_argument("--shard_bytes", type=int, default=2_000_000_000, help="max bytes per shard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", type=int, default=0, metavar="E", help="a small Qwen3-MoE with E experts per layer")
    args = parser.parse_args()
    dims = {**MOE, "experts": args.moe} if args.moe else DENSE
    kind = f"qwen3-moe{args.moe}-synthetic" if args.moe else "qwen3-synthetic"
    out = args.out or ROOT / f".cache/bench/{kind}-{args.num_layers}l"
    if (out / "model.safetensors.index.json").exists():
        print(f"{out}: present")
        return
    for f in TOKENIZER_FILES:
        if not (TOKENIZER_DIR / f).exists():
            sys.exit(f"{TOKENIZER_DIR / f} is missing; run tools/setup.sh first")

    shapes = tensor_shapes(args.num_layers, dims)
    # Shards as transformers' split_torch_state_dict_into_shards: fill in order, a new shard when
    # the next tensor would pass the limit.
    shards, current, current_bytes = [], [], 0
    for index, (name, shape) in enumerate(shapes):
        nbytes = numel(shape) * 2
        if current and current_bytes + nbytes > args.shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append((index, name, shape))
        current_bytes += nbytes
    shards.append(current)

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.time()
    weight_map, total = {}, 0
    for s, shard in enumerate(shards):
        file = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: make_tensor(name, shape, args.seed, index) for index, name, shape in shard}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
        del tensors
        print(f"{file}: {len(shard)} tensors ({time.time() - start:.0f} s)", flush=True)

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(config(args.num_layers, dims), indent=2) + "\n")
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / f, tmp / f)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    layer_bytes = sum(numel(shape) * 2 for name, shape in shapes if name.startswith("model.layers.0."))
    print(f"{out}: {len(shapes)} tensors, {total:,} bytes ({total / 2**30:.2f} GiB) in {len(shards)} shards, "
          f"one decoder layer {layer_bytes:,} bytes, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
