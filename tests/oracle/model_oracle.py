"""transformers as the oracle for qpipe's model families.

  make FAMILY DIR          writes a tiny random fp32 checkpoint of FAMILY into DIR
  logits DIR IDS MASK OUT  runs DIR's model in fp32 on IDS/MASK (safetensors, int64 [batch, seq])
                           and writes the logits to OUT (safetensors, "logits")
  both FAMILY DIR IDS MASK OUT   make, then logits for every row of IDS and for the first alone
                                 (OUT gets "logits" and "single")
"""
import sys

import torch
from safetensors.torch import load_file, save_file
import transformers as tf

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=211, max_position_embeddings=256, rms_norm_eps=1e-6)


def config(family):
    if family == "llama":  # Llama-3 style rope scaling, untied head
        return tf.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if family == "smollm":  # SmolLM2's shape: tied embeddings, plain rope, MHA
        return tf.LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    if family == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False)
    if family in ("qwen3_moe", "qwen3_moe_fused"):
        return tf.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, num_experts=6,
                                 num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                 tie_word_embeddings=False)
    raise SystemExit(f"unknown family {family}")


def make(family, directory):
    torch.manual_seed(1234)
    model = tf.AutoModelForCausalLM.from_config(config(family), dtype=torch.float32)
    with torch.no_grad():  # random norms and biases too, so every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    if family == "qwen3_moe_fused":
        fuse_experts(directory)


def fuse_experts(directory):
    """Rewrites per-expert weights as fused [E, 2I, H] gate_up_proj and [E, H, I] down_proj."""
    path = f"{directory}/model.safetensors"
    state = load_file(path)
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    layers = sorted({k.split(".mlp.experts.")[0] for k in state if ".mlp.experts." in k})
    for layer in layers:
        n = len({k.split(".mlp.experts.")[1].split(".")[0] for k in state if k.startswith(layer + ".mlp.experts.")})
        gate_up = [torch.cat([state[f"{layer}.mlp.experts.{e}.gate_proj.weight"],
                              state[f"{layer}.mlp.experts.{e}.up_proj.weight"]]) for e in range(n)]
        down = [state[f"{layer}.mlp.experts.{e}.down_proj.weight"] for e in range(n)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack(down).contiguous()
    save_file(out, path, metadata={"format": "pt"})


def run(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float().contiguous()


def logits(directory, ids_path, mask_path, out_path):
    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    save_file({"logits": run(model, load_file(ids_path)["ids"], load_file(mask_path)["mask"])}, out_path)


def both(family, directory, ids_path, mask_path, out_path):
    make(family, directory)
    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids, mask = load_file(ids_path)["ids"], load_file(mask_path)["mask"]
    save_file({"logits": run(model, ids, mask), "single": run(model, ids[:1], mask[:1])}, out_path)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"make": make, "logits": logits, "both": both}[command](*args)
