"""compressed-tensors + transformers as the oracle for qpipe's compressed_tensors checkpoints.

  make DIR                  writes a tiny random fp32 Llama into DIR (hidden 128, intermediate 256: int4
                            groups of 32 and 128 fit every projection)
  check SRC DIR IDS OUT     checks DIR's tensors with the safetensors library against the layout its
                            quantization_config implies (formats_and_peers.md §A1.5; SRC is the float
                            source, for the original shapes), then loads DIR with transformers
                            (compressed-tensors decompresses it) and writes to OUT the logits on IDS
                            ("logits") and every decompressed projection weight ("<module>.weight"),
                            lm_head's too when it is quantized (not in `ignore`: the checkpoint must
                            then be untied); NVFP4 weights as compressed-tensors dequantizes them in
                            fp32 (nvfp4_weights), the logits from transformers' bf16 ones;
                            asymmetric pack-quantized goes through compressed-tensors' decompressor
                            alone (see decompressed_source)
  kv DIR IDS OUT            loads DIR (a kv_cache_scheme checkpoint) with transformers and writes to OUT
                            the logits on IDS ("logits") and every attention's q_scale, k_scale and
                            v_scale as compressed-tensors holds them ("<attention>.k_scale")
Layout violations are printed and exit with status 1.
"""
import json
import math
import sys

import torch
import transformers as tf
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def make(directory):
    torch.manual_seed(4321)
    config = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, rms_norm_eps=1e-6,
                            tie_word_embeddings=True)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(directory)


def scale_shape(args, out, inp):
    group = [out, inp // (args["group_size"] or 1)]
    return {"tensor": [1], "channel": [out, 1], "group": group, "tensor_group": group}[args["strategy"]]


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def check_layout(src, directory):
    errors = []
    config = json.load(open(f"{directory}/config.json"))
    q = config["quantization_config"]
    if q["quant_method"] != "compressed-tensors" or q["quantization_status"] != "compressed":
        errors.append(f"quant_method/quantization_status: {q['quant_method']}, {q['quantization_status']}")
    (group,) = q["config_groups"].values()
    weights, inputs, fmt = group["weights"], group["input_activations"], group["format"]
    with safe_open(f"{directory}/model.safetensors", framework="pt") as f:
        if f.metadata().get("format") != "pt":
            errors.append(f"__metadata__ {f.metadata()}")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    source = load_file(f"{src}/model.safetensors")

    def expect(name, dtype, shape):
        if name not in tensors:
            errors.append(f"{name}: missing")
        elif tensors[name].dtype != dtype or list(tensors[name].shape) != shape:
            errors.append(f"{name}: {tensors[name].dtype} {list(tensors[name].shape)}, expected {dtype} {shape}")

    shapes = {k[: -len(".weight")]: source[k].shape for k in source if k.endswith("_proj.weight")}
    head_quantized = "lm_head" not in q["ignore"]
    if head_quantized:
        # The tied source has no lm_head.weight: the head is the embedding.
        shapes["lm_head"] = source.get("lm_head.weight", source["model.embed_tokens.weight"]).shape
        if config.get("tie_word_embeddings", True):
            errors.append("lm_head quantized but tie_word_embeddings is not false")
    projections = list(shapes)
    for p in projections:
        out, inp = shapes[p]
        sshape = scale_shape(weights, out, inp)
        bits = weights["num_bits"]
        if fmt == "nvfp4-pack-quantized":
            # As vLLM allocates them (formats_and_peers.md §A1.5).
            expect(p + ".weight_packed", torch.uint8, [out, inp // 2])
            expect(p + ".weight_scale", torch.float8_e4m3fn, sshape)
            expect(p + ".weight_global_scale", torch.float32, [1])
            if inputs is not None:
                expect(p + ".input_global_scale", torch.float32, [1])
            continue
        if fmt == "mxfp4-pack-quantized":
            # E8M0 exponents as uint8, no global scale (formats_and_peers.md §A1.5).
            expect(p + ".weight_packed", torch.uint8, [out, inp // 2])
            expect(p + ".weight_scale", torch.uint8, sshape)
            continue
        expect(p + ".weight_scale", torch.float32, sshape)
        if fmt == "pack-quantized":
            expect(p + ".weight_packed", torch.int32, [out, math.ceil(inp * bits / 32)])
            expect(p + ".weight_shape", torch.int64, [2])
            if p + ".weight_shape" in tensors and tensors[p + ".weight_shape"].tolist() != [out, inp]:
                errors.append(f"{p}.weight_shape {tensors[p + '.weight_shape'].tolist()}, expected {[out, inp]}")
            if not weights["symmetric"]:
                expect(p + ".weight_zero_point", torch.int32, [math.ceil(out * bits / 32), sshape[1]])
        else:
            dtype = torch.float8_e4m3fn if weights["type"] == "float" else torch.int8
            expect(p + ".weight", dtype, [out, inp])
            if not weights["symmetric"]:
                expect(p + ".weight_zero_point", torch.int8, sshape)
        if inputs is not None and not inputs["dynamic"]:
            expect(p + ".input_scale", torch.float32, [1])
        elif p + ".input_scale" in tensors:
            errors.append(f"{p}.input_scale written for dynamic or absent activation quantization")
    if fmt == "nvfp4-pack-quantized":
        # vLLM runs each fused GEMM with one global scale: its shards must share it.
        for p in (p for p in projections if "." in p):
            parent, leaf = p.rsplit(".", 1)
            for shards in FUSED:
                key = ".weight_global_scale"
                if leaf in shards and p + key in tensors:
                    for other in shards:
                        if parent + "." + other + key in tensors and not torch.equal(
                                tensors[parent + "." + other + key], tensors[p + key]):
                            errors.append(f"{p}{key} differs from {parent}.{other}{key}")
    expected_names = set()
    for p in projections:
        expected_names |= {k for k in tensors if k.startswith(p + ".")}
    for k in source:
        if not k.endswith("_proj.weight"):
            expect(k, source[k].dtype, list(source[k].shape))
            expected_names.add(k)
    if "lm_head.weight" in tensors and not head_quantized:
        errors.append("lm_head.weight written although the embeddings are tied")
    if set(tensors) != expected_names:
        errors.append(f"unexpected tensors {sorted(set(tensors) - expected_names)}")
    if q["ignore"] != ([] if head_quantized else ["lm_head"]):
        errors.append(f"ignore {q['ignore']}")
    return errors


def decompressed_source(src, directory):
    """The float source with every projection replaced by compressed-tensors' own decompression of
    DIR's tensors. For asymmetric pack-quantized weights: transformers 5.23 + compressed-tensors 0.20
    register weight_zero_point unpacked ([out, groups]) on their meta path and then refuse the packed
    [out/8, groups] tensor that compressed-tensors' own compressor writes (and vLLM reads)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    q = json.load(open(f"{directory}/config.json"))["quantization_config"]
    (group,) = q["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    tensors = load_file(f"{directory}/model.safetensors")
    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("_proj"):
                local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
                module.weight.copy_(compressor.decompress(local, scheme)["weight"])
    return model


def nvfp4_weights(directory):
    """compressed-tensors' own NVFP4 decompression, in fp32: its decompressor (what transformers
    runs) unpacks to bf16 and so rounds every weight to bf16."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    q = json.load(open(f"{directory}/config.json"))["quantization_config"]
    (group,) = q["config_groups"].values()
    args = QuantizationScheme.model_validate(group).weights
    tensors = load_file(f"{directory}/model.safetensors")
    out = {}
    for key, packed in tensors.items():
        if key.endswith(".weight_packed"):
            p = key[: -len(".weight_packed")]
            codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
            out[p + ".weight"] = dequantize(x_q=codes, scale=tensors[p + ".weight_scale"].float(), args=args,
                                            global_scale=tensors[p + ".weight_global_scale"],
                                            dtype=torch.float32).contiguous()
    return out


def check(src, directory, ids_path, out_path):
    errors = check_layout(src, directory)
    for e in errors:
        print("layout:", e)
    group = next(iter(json.load(open(f"{directory}/config.json"))["quantization_config"]["config_groups"].values()))
    nvfp4 = group["format"] == "nvfp4-pack-quantized"
    fp4 = nvfp4 or group["format"] == "mxfp4-pack-quantized"
    if group["format"] == "pack-quantized" and not group["weights"]["symmetric"]:
        model = decompressed_source(src, directory)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if fp4:
        # Decompressed to bf16 (MXFP4's values are exact in bf16, NVFP4's are not), which an fp32
        # forward refuses; transformers forbids .float() on a quantized model, and decompresses
        # only at the first forward, so decompress first and cast then. NVFP4's weights are then
        # compressed-tensors' own fp32 decompression (nvfp4_weights), so that the logits test the
        # activation path with the exact weights.
        model.hf_quantizer.compressor.decompress_model(model)
        for p in model.parameters():
            p.data = p.data.float()
        if nvfp4:
            exact = nvfp4_weights(directory)
            for name, module in model.named_modules():
                if name + ".weight" in exact:
                    module.weight.data = exact[name + ".weight"]
    model.eval()
    ids = load_file(ids_path)["ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out = {"logits": logits.contiguous()}
    head_quantized = "lm_head" not in json.load(open(f"{directory}/config.json"))["quantization_config"]["ignore"]
    for name, module in model.named_modules():
        if name.endswith("_proj") or (name == "lm_head" and head_quantized):
            out[name + ".weight"] = module.weight.detach().float().contiguous()
    save_file(out, out_path)
    if errors:
        sys.exit(1)


def kv(directory, ids_path, out_path):
    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = {"logits": model(input_ids=load_file(ids_path)["ids"]).logits.contiguous()}
    for name, module in model.named_modules():
        for key in ("q_scale", "k_scale", "v_scale"):
            if hasattr(module, key):
                out[f"{name}.{key}"] = getattr(module, key).detach().float().contiguous()
    save_file(out, out_path)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"make": make, "check": check, "kv": kv}[command](*args)
