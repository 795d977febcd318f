"""Load a residual checkpoint and the mHC checkpoint upcycled from it with the same weight quantization, as a CPU user
does (``from_pretrained(..., quantization_config=...)``), and save what came of each.

    python tests/workers/quantized_weights.py SOURCE MHC METHOD IDS_PT OUT_PT

METHOD is ``torchao`` (``TorchAoConfig(Int8WeightOnlyConfig())``) or ``quanto`` (``QuantoConfig(weights="int8")``).
Run by ``tests/test_quantized_weights.py`` in a process of its own, with torchao and optimum-quanto on its
``PYTHONPATH``. OUT_PT holds, for both models loaded in float32: the parameters whose class is not a plain
``Parameter`` (the quantized ones, by name: class), and greedy ``generate`` from IDS_PT (sequences and per-step
logits); for the mHC model also each HC parameter's class and dtype, loaded in float32 and with ``dtype=bfloat16``,
and with torchao the model saved beside OUT_PT and reloaded: its model card and parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, QuantoConfig, TorchAoConfig

import hf_mhc  # noqa: F401  (registers the mHC classes)
from hf_mhc.conversion import is_hc_parameter

NEW_TOKENS = 16


def quantization_config(method: str):
    if method == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    return QuantoConfig(weights="int8")


def quantized_parameters(model: torch.nn.Module) -> dict[str, str]:
    return {name: type(p).__name__ for name, p in model.named_parameters() if type(p) is not torch.nn.Parameter}


def hc_parameters(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    return {name: (type(p).__name__, str(p.dtype)) for name, p in model.named_parameters() if is_hc_parameter(name)}


def main(source: str, mhc: str, method: str, ids_file: str, out_file: str) -> None:
    ids = torch.load(ids_file)
    result = {}
    for key, folder in (("source", source), ("mhc", mhc)):
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization_config(method)).eval()
        generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
        result[key] = {"class": type(model).__name__, "quantized": quantized_parameters(model),
                       "hc": hc_parameters(model), "sequences": generated.sequences, "logits": generated.logits}
        if key == "mhc" and method == "torchao":  # quanto's quantized models are not serializable
            model.save_pretrained(saved := Path(out_file).parent / "saved")
            reloaded = AutoModelForCausalLM.from_pretrained(saved)
            result["saved"] = {"card": (saved / "README.md").read_text(), "quantized": quantized_parameters(reloaded),
                               "hc": hc_parameters(reloaded)}
    half = AutoModelForCausalLM.from_pretrained(mhc, quantization_config=quantization_config(method),
                                                dtype=torch.bfloat16)
    result["mhc_bfloat16"] = {"quantized": quantized_parameters(half), "hc": hc_parameters(half),
                              "embedding": str(half.get_input_embeddings().weight.dtype)}
    torch.save(result, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
