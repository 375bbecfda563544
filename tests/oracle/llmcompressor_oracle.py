"""llm-compressor as the oracle for qpipe's smooth_quant (run with .venv-bench's Python).

  smooth MODEL IDS ALPHA OUT   loads MODEL in fp32, runs llm-compressor's oneshot with
                               SmoothQuantModifier(smoothing_strength=ALPHA) and its default
                               mappings on the token ids of IDS (safetensors "ids", int64
                               [samples, seq], one calibration sample per row, in order), and
                               writes every norm weight after smoothing to OUT (safetensors)
"""
import sys

import torch
from safetensors.torch import load_file, save_file


def smooth(model_dir, ids_path, alpha, out_path):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = load_file(ids_path)["ids"].tolist()
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    # oneshot wants a processor with a dataset; the samples are ids already, so it never tokenizes.
    processor = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")))
    with torch.inference_mode(False):
        oneshot(model=model, dataset=dataset, processor=processor, recipe=[SmoothQuantModifier(smoothing_strength=float(alpha))],
                num_calibration_samples=len(ids), max_seq_length=len(ids[0]), shuffle_calibration_samples=False,
                batch_size=1)
    norms = {n: p.detach().float().contiguous() for n, p in model.named_parameters() if n.endswith("layernorm.weight")}
    save_file(norms, out_path)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"smooth": smooth}[command](*args)
