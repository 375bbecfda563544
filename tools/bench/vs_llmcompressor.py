"""llm-compressor's side of tools/bench/vs_llmcompressor.sh, and the helpers the script needs.

    python vs_llmcompressor.py quantize MODEL OUT RECIPE IDS_JSON   (in .venv-bench)
        RECIPE: w8a8_dynamic | w8a8_static | sq_w8a8_static | fp8_static | w4a16. Loads MODEL (its own dtype), runs
        llm-compressor's oneshot with a QuantizationModifier of the scheme (after a SmoothQuantModifier with α 0.5
        and its default mappings for sq_w8a8_static) on the token ids of IDS_JSON
        ([[id, ...], ...], one list per calibration sample, fed as they are: no shuffling,
        truncation or padding), saves compressed-tensors into OUT and prints one JSON line of
        timings {"load_s", "oneshot_s", "save_s"}.
    python vs_llmcompressor.py ids MODEL DATA SAMPLES SEQ_LEN IDS_JSON   (any venv with tokenizers)
        The calibration samples as qpipe builds them (see calibration_ids).
    python vs_llmcompressor.py compare A B
        Tensor names, dtypes and shapes of two safetensors folders; exits 1 if they differ.
"""

import json
import sys
import time
from pathlib import Path


def calibration_ids(model, data, samples, seq_len):
    """qpipe quant's calibration windows (tools/qpipe/cmd_quant.cpp, calibrationSamples): every
    text of DATA joined with "\\n\\n", encoded once with the model's tokenizer.json without special
    tokens, cut into consecutive windows of SEQ_LEN tokens; the first SAMPLES windows."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    texts = []
    with open(data, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                texts.append(json.loads(line)["text"])
    ids = tokenizer.encode("\n\n".join(texts), add_special_tokens=False).ids
    count = min(samples, len(ids) // seq_len)
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(count)]


def scheme(num_bits, kind, strategy, symmetric=True, observer="minmax", **extra):
    """A compressed-tensors QuantizationArgs dict: static, with llm-compressor's observer name."""
    return {"num_bits": num_bits, "type": kind, "symmetric": symmetric, "strategy": strategy, "dynamic": False,
            "observer": observer, **extra}


def recipe(name):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    def groups(weights, input_activations=None):
        group = {"targets": ["Linear"], "weights": weights}
        if input_activations:
            group["input_activations"] = input_activations
        return QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": group})

    if name == "w8a8_dynamic":
        # compressed-tensors' W8A8 preset: int8 per-channel symmetric weights (minmax), int8
        # per-token symmetric dynamic activations.
        return QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])
    # Static activations from the min/max over all calibration tokens: static_minmax
    # (llm-compressor's default "minmax" is a moving average instead).
    if name == "w8a8_static":
        # configs/default/w8a8_static.yaml (msmodelslim's default_w8a8): int8 per-channel weights,
        # per-tensor asymmetric int8 activations.
        return groups(scheme(8, "int", "channel"), scheme(8, "int", "tensor", False, "static_minmax"))
    if name == "sq_w8a8_static":
        # configs/default/w8a8_static_smooth_quant.yaml: SmoothQuant (α 0.5, the default Llama
        # mappings), then the w8a8_static scheme.
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        return [SmoothQuantModifier(smoothing_strength=0.5), recipe("w8a8_static")]
    if name == "fp8_static":
        # configs/default/w8a8_fp8_static.yaml: FP8 E4M3 per-tensor weights and activations.
        return groups(scheme(8, "float", "tensor"), scheme(8, "float", "tensor", observer="static_minmax"))
    if name == "w4a16":
        # tools/bench/w4a16_g64.yaml: int4 symmetric weights in groups of 64; data-free.
        return groups(scheme(4, "int", "group", group_size=64))
    raise SystemExit(f"unknown recipe {name}")


def quantize(model_dir, out, recipe_name, ids_json):
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = json.loads(Path(ids_json).read_text())
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loaded = time.perf_counter()
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    with torch.inference_mode(False):
        oneshot(model=model, dataset=dataset, recipe=recipe(recipe_name), num_calibration_samples=len(ids),
                max_seq_length=max(len(x) for x in ids), shuffle_calibration_samples=False, batch_size=1)
    quantized = time.perf_counter()
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    saved = time.perf_counter()
    print(json.dumps({"load_s": loaded - start, "oneshot_s": quantized - loaded, "save_s": saved - quantized}))


def tensors(folder):
    from safetensors import safe_open

    found = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                s = st.get_slice(name)
                found[name] = (s.get_dtype(), tuple(s.get_shape()))
    return found


def compare(a, b):
    ta, tb = tensors(a), tensors(b)
    only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
    differ = sorted(n for n in set(ta) & set(tb) if ta[n] != tb[n])
    print(f"tensors: {len(ta)} in {a}, {len(tb)} in {b}; {len(set(ta) & set(tb))} shared")
    for title, names in (("only in " + str(a), only_a), ("only in " + str(b), only_b)):
        for n in names[:12]:
            print(f"  {title}: {n} {(ta.get(n) or tb.get(n))}")
        if len(names) > 12:
            print(f"  {title}: ... {len(names) - 12} more")
    for n in differ[:12]:
        print(f"  differs: {n}: {ta[n]} vs {tb[n]}")
    same = not only_a and not only_b and not differ
    print("same names, dtypes and shapes" if same else "DIFFERENT")
    values(a, b, sorted(n for n in set(ta) & set(tb) if ta[n] == tb[n]))
    return 0 if same else 1


def values(a, b, names):
    """How far the two tools' numbers are apart, per kind of tensor (weight, weight_scale, ...)."""
    import torch
    from safetensors import safe_open

    def opener(folder):
        handles = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            h = safe_open(str(f), "pt")
            for n in h.keys():
                handles[n] = h
        return handles

    ha, hb = opener(a), opener(b)
    kinds = {}
    for n in names:
        x, y = ha[n].get_tensor(n), hb[n].get_tensor(n)
        kind = n.rsplit(".", 1)[-1] if ".layers." in n else n
        equal, total, worst = kinds.get(kind, (0, 0, 0.0))
        diff = (x.double() - y.double()).abs()
        scale = y.double().abs().max().item() or 1.0
        kinds[kind] = (equal + int(diff.eq(0).sum()), total + x.numel(), max(worst, diff.max().item() / scale))
    for kind, (equal, total, worst) in sorted(kinds.items()):
        print(f"  {kind}: {equal / total:.4%} of {total:,} values equal, max |diff| / max |value| {worst:.2e}")


def main():
    command, args = sys.argv[1], sys.argv[2:]
    if command == "quantize":
        quantize(*args)
    elif command == "ids":
        model, data, samples, seq_len, out = args
        ids = calibration_ids(model, data, int(samples), int(seq_len))
        Path(out).write_text(json.dumps(ids))
        lengths = [len(x) for x in ids]
        print(f"{len(ids)} samples, {sum(lengths)} tokens, lengths {min(lengths)}..{max(lengths)}")
    elif command == "compare":
        sys.exit(compare(*args))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
