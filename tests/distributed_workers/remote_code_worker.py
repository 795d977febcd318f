"""transformers' distributed engine on an mHC checkpoint loaded as remote code, where ``hf_mhc`` cannot be imported.

``torchrun --nproc_per_node=2 remote_code_worker.py CHECKPOINT``: ``import hf_mhc`` raises here, so
``AutoModelForCausalLM.from_pretrained(CHECKPOINT, trust_remote_code=True, distributed_config=...)`` runs the code the
checkpoint ships (``modeling_mhc.py`` and the files it imports, ``distributed.py`` among them). For
``DistributedConfig(pp_size=2)`` and ``DistributedConfig(fsdp_size=2)`` each rank compares the logits with the same
remote code loaded in one process, and prints ``rank R: remote code PLAN matches``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.modules["hf_mhc"] = None  # `import hf_mhc` now raises ImportError
sys.path.insert(1, str(Path(__file__).resolve().parent))  # tolerances

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tolerances import FLOAT32_RTOL, assert_close_to_scale  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402


def main(checkpoint: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    input_ids = torch.arange(18).remainder(50).add(3).view(2, 9)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    assert type(reference).__module__.startswith("transformers_modules"), type(reference).__module__
    with torch.no_grad():
        expected = reference(input_ids).logits
    for plan, config in (("pp_size=2", DistributedConfig(pp_size=2)), ("fsdp_size=2", DistributedConfig(fsdp_size=2))):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True,
                                                     distributed_config=config).eval()
        model_class = next(cls for cls in type(model).__mro__ if not cls.__module__.startswith("torch."))  # FSDP's
        assert model_class.__module__.startswith("transformers_modules"), model_class.__module__
        if plan == "fsdp_size=2":
            assert isinstance(model.model.layers[0].attn_hc.fn, DTensor)
            assert model.model.layers[0].attn_hc.fn.dtype == torch.float32
        with torch.no_grad():
            logits = model(input_ids).logits
        assert_close_to_scale(logits, expected, rtol=FLOAT32_RTOL, name=f"{plan} logits")
        print(f"rank {rank}: remote code {plan} matches", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
