"""Shared fixtures: tiny backbone configs for every supported family, the optional real assets."""

from __future__ import annotations

import os
from pathlib import Path

# The op tests run on TEST_DEVICE: "cpu" (default) runs the Triton kernels in the interpreter, which must be switched
# on before any @triton.jit is evaluated; HF_MHC_TEST_DEVICE=cuda runs them compiled, on a GPU.
TEST_DEVICE = os.environ.get("HF_MHC_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES260K = ASSETS / "stories260K"
JANEAUSTEN = ASSETS / "janeausten"

VOCAB = 101


def tiny_backbone_config(family: str, *, tie_word_embeddings: bool = False, **overrides):
    """A 2-layer GQA config of ``family`` small enough for CPU tests (Qwen2 has q/k/v biases, Qwen3 q/k norms)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(sliding_window=6, **common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
