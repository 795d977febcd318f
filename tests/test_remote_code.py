"""A saved mHC folder loads through AutoModelForCausalLM on a machine where hf_mhc cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from conftest import VOCAB, tiny_backbone_config

from hf_mhc import MHCConfig, MHCForCausalLM

LOAD_WITHOUT_PLUGIN = textwrap.dedent(
    """
    import sys
    sys.modules["hf_mhc"] = None  # `import hf_mhc` now raises ImportError
    import torch
    from transformers import AutoModelForCausalLM
    folder, ids_file, out_file = sys.argv[1:]
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert not type(model).__module__.startswith("hf_mhc"), type(model).__module__
    with torch.no_grad():
        torch.save(model(torch.load(ids_file)).logits, out_file)
    print(type(model).__module__)
    """
)


def remote_code_logits(folder: Path, ids: torch.Tensor, work: Path) -> torch.Tensor:
    """The logits of ``folder`` loaded with ``trust_remote_code=True`` in a process where ``hf_mhc`` cannot be
    imported (its own copy of the modeling code, from ``transformers_modules``)."""
    torch.save(ids, work / "ids.pt")
    env = {**os.environ, "HF_HOME": str(work / "hf_home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_PLUGIN, str(folder), str(work / "ids.pt"), str(work / "out.pt")],
        env=env, capture_output=True, text=True, timeout=300, cwd=work,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1].startswith("transformers_modules"), result.stdout
    return torch.load(work / "out.pt")


def test_saved_folder_loads_with_remote_code_without_the_plugin(tmp_path):
    config = MHCConfig(backbone_config=tiny_backbone_config("qwen2"), hc_mult=3, hc_init="deepseek_v4")
    model = MHCForCausalLM(config).eval()
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    ids = torch.randint(0, VOCAB, (2, 7))
    # The plugin runs its own kernels, the remote copy the plain reference formula: equal up to float32 rounding.
    with torch.no_grad():
        torch.testing.assert_close(remote_code_logits(folder, ids, tmp_path), model(ids).logits, atol=1e-5, rtol=1e-5)


WITHOUT_TRITON = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # as on a platform without Triton
    import torch
    import hf_mhc
    from transformers import LlamaConfig
    config = hf_mhc.MHCConfig(backbone_config=LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                          num_attention_heads=4, vocab_size=50))
    model = hf_mhc.MHCForCausalLM(config)
    model(torch.randint(0, 50, (1, 5)), labels=torch.randint(0, 50, (1, 5))).loss.backward()
    try:
        hf_mhc.apply_mhc_kernels(model)
    except ImportError:
        print("apply_mhc_kernels needs triton")
    """
)


def test_the_plugin_imports_and_trains_without_triton(tmp_path):
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "apply_mhc_kernels needs triton" in result.stdout
