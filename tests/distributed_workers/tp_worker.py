"""Tensor-parallel worker (one process per rank, gloo on CPU): ``tp_worker.py CHECKPOINT``.

Loads an mHC folder with transformers' own engine, ``from_pretrained(..., distributed_config=DistributedConfig(
tp_size=2))``, and checks against the same folder loaded in one process: the attention and MLP projections are
sharded ``DTensor``s, the float32 HC parameters are replicated, and logits, loss and every gradient agree.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hf_mhc  # noqa: F401  (registers model_type "mhc")


def main(checkpoint: str) -> None:
    torch.manual_seed(0)
    input_ids = torch.randint(3, 90, (2, 9))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    reference_logits = reference(input_ids).logits.detach()
    reference(input_ids, labels=input_ids).loss.backward()
    reference_grads = {name: param.grad for name, param in reference.named_parameters()}

    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q_proj, DTensor), type(q_proj)
    assert q_proj.to_local().shape[0] * world == reference.model.layers[0].self_attn.q_proj.weight.shape[0]
    for name, param in model.named_parameters():
        if "_hc." in name or name.startswith("model.hc_head."):
            assert not isinstance(param, DTensor) and param.dtype == torch.float32, name

    logits = model(input_ids).logits
    assert (logits - reference_logits).abs().max() <= 1e-5 * reference_logits.abs().max(), "logits differ"
    model(input_ids, labels=input_ids).loss.backward()
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        expected = reference_grads[name]
        scale = expected.abs().max().clamp_min(1e-12)
        assert (grad - expected).abs().max() <= 1e-4 * scale, f"gradient of {name} differs"
    print(f"rank {rank}: tensor-parallel logits and gradients match")


if __name__ == "__main__":
    main(sys.argv[1])
