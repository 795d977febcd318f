"""Greedy generation with vLLM's Python API (``vllm.LLM``), run by ``tests/test_vllm.py`` with the vLLM environment's
Python (``make vllm-env``), never imported by the test process.

    python generate.py SPEC.json

SPEC is ``{"runs": [{"name": ..., "folder": ..., "model_impl": "auto" | "transformers", "dtype": "float32"}, ...],
"prompts": [...], "max_tokens": N}``. Each run is one ``vllm.LLM`` over ``folder``, one after another in this
process (the engine runs in it: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). One ``RESULT`` line of JSON per run: the class
of the model vLLM built, the dtype of every HC parameter and of every other parameter, and for each prompt the
generated token ids and, per step, the two best log-probabilities (``{token id: logprob}``). First, one ``COMPAT``
line: the entries of ``hf_mhc.compat.PRIVATE_APIS`` for vLLM that resolve here, and whether this vLLM is a tested
release.
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model(served) below, in this process

from vllm import LLM, SamplingParams  # noqa: E402

from hf_mhc.conversion import is_hc_parameter  # noqa: E402


def served(model) -> dict:
    """What vLLM built: its class and the parameters' dtypes, HC and other."""
    dtypes = {"hc": set(), "other": set()}
    for name, parameter in model.named_parameters():
        dtypes["hc" if is_hc_parameter(name) else "other"].add(str(parameter.dtype))
    return {"class": type(model).__name__, "dtypes": {key: sorted(value) for key, value in dtypes.items()}}


def main(spec_path: str) -> None:
    from hf_mhc import compat

    resolved = [entry.target for entry in compat.PRIVATE_APIS
                if entry.package == "vllm" and compat.require(entry.target) is not None]
    print("COMPAT " + json.dumps({"resolved": resolved, "tested": compat.is_tested("vllm")}), flush=True)
    spec = json.loads(open(spec_path).read())
    sampling = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=2)
    for run in spec["runs"]:
        llm = LLM(model=run["folder"], dtype=run["dtype"], model_impl=run["model_impl"], trust_remote_code=True,
                  max_model_len=512, enforce_eager=True, seed=0)
        outputs = llm.generate(spec["prompts"], sampling, use_tqdm=False)
        result = {"name": run["name"], **llm.apply_model(served)[0], "completions": [
            {"token_ids": list(output.outputs[0].token_ids),
             "logprobs": [{str(token): entry.logprob for token, entry in step.items()}
                          for step in output.outputs[0].logprobs]}
            for output in outputs]}
        print("RESULT " + json.dumps(result), flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main(sys.argv[1])
