"""Check a converted checkpoint against its source: logits on fixed prompts, and greedy decoding.

Both models are loaded in the same dtype, one after the other (never both in memory), on CUDA when available.

Tolerances on ``max |logits_mHC - logits_source|`` over all prompt positions:

- float32 (and float64 sources): ``1e-4``, absolute. The function-preserving initialisation is exact up to float32
  rounding (the real stories260K Llama: 2e-5 at a logit scale of 18).
- bfloat16: ``0.1 * max |logits_source|``; float16: ``0.02 * max |logits_source|``. In half precision the mHC model
  rounds its streams differently from the residual model, so both drift from the float32 function by about the
  same amount. Measured on the real stories260K Llama (5 layers): mHC vs source 1.4% (bf16) and 0.19% (fp16) of
  the logit scale, the source itself vs float32 1.5% and 0.3%. Rounding noise grows roughly with the square root
  of depth, so the thresholds leave room for models of ~50 layers and more, while a wrong, missing or mis-cast
  tensor moves the logits by a sizeable fraction of their scale. Non-finite logits always fail.

Greedy decoding is reported, not enforced: in half precision a near-tie can flip a token (stories260K in bfloat16
diverges at the 4th generated token of one prompt, and so does the source itself in bfloat16 against float32).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

ABSOLUTE_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.float64: 1e-4}
RELATIVE_TOLERANCES: dict[torch.dtype, float] = {torch.bfloat16: 0.1, torch.float16: 0.02}
GREEDY_TOKENS = 32
PROMPT_TEXTS: tuple[str, ...] = (
    "Once upon a time, there was a little girl who",
    "The capital of France is",
    "def fibonacci(n):\n    return",
)
FIXED_PROMPT_LENGTHS: tuple[int, ...] = (8, 16, 24)


@dataclass(frozen=True)
class VerificationResult:
    """Outcome of :func:`verify_conversion`; ``passed`` when the logit difference is within ``tolerance``."""

    dtype: str
    prompts: int
    prompt_source: str
    max_abs_logit_diff: float
    tolerance: float
    greedy_tokens: int
    greedy_agrees: bool

    @property
    def passed(self) -> bool:
        return math.isfinite(self.max_abs_logit_diff) and self.max_abs_logit_diff <= self.tolerance

    def summary(self) -> str:
        """One line: dtype, prompts, the difference against its threshold, and the greedy-decoding agreement."""
        greedy = "agrees" if self.greedy_agrees else "DIFFERS"
        if not self.greedy_agrees and self.dtype in ("bfloat16", "float16"):
            greedy += f" (in {self.dtype} rounding flips near-ties, as it does between the source and float32)"
        return (
            f"{self.dtype}, {self.prompts} prompts ({self.prompt_source}): max |logit difference| "
            f"{self.max_abs_logit_diff:.3g} (threshold {self.tolerance:.3g}); greedy decoding of "
            f"{self.greedy_tokens} tokens {greedy}"
        )


def logit_tolerance(dtype: torch.dtype, logit_scale: float) -> float:
    """Largest acceptable ``max |Δ logits|`` for models run in ``dtype`` whose logits reach ``logit_scale``."""
    if dtype in ABSOLUTE_TOLERANCES:
        return ABSOLUTE_TOLERANCES[dtype]
    if dtype in RELATIVE_TOLERANCES:
        return RELATIVE_TOLERANCES[dtype] * max(logit_scale, 1.0)
    raise ValueError(f"no verification tolerance for {dtype}; use float32, bfloat16 or float16.")


def verification_prompts(source_folder: Path, vocab_size: int) -> tuple[list[torch.Tensor], str]:
    """Fixed prompts as 1-D token-id tensors: :data:`PROMPT_TEXTS` through the source's tokenizer when it loads,
    otherwise seeded random ids in ``[0, vocab_size)`` of lengths :data:`FIXED_PROMPT_LENGTHS`."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source_folder)
        prompts = [torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long) for text in PROMPT_TEXTS]
        if all(0 < len(ids) and int(ids.max()) < vocab_size for ids in prompts):
            return prompts, "tokenizer"
    except Exception:  # no tokenizer files, or one this environment cannot load: fall back to fixed ids
        pass
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab_size, (length,), generator=generator) for length in FIXED_PROMPT_LENGTHS]
    return prompts, "token ids"


def _run_prompts(
    folder: Path, dtype: torch.dtype, device: str, prompts: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits ``[T, vocab]`` per prompt (float32, CPU), and ``[P, GREEDY_TOKENS]`` greedily decoded ids.

    Logits come from each prompt alone; greedy decoding runs on the left-padded batch of all prompts at once.
    """
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    longest = max(len(ids) for ids in prompts)
    batch = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, ids in enumerate(prompts):
        batch[row, longest - len(ids) :] = ids
        mask[row, longest - len(ids) :] = 1
    greedy = GenerationConfig(
        do_sample=False, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, pad_token_id=0
    )
    with torch.no_grad():
        logits = [model(ids[None].to(device)).logits[0].float().cpu() for ids in prompts]
        output = model.generate(batch.to(device), attention_mask=mask.to(device), generation_config=greedy)
    del model
    gc.collect()
    return logits, output[:, longest:].cpu()


def verify_conversion(
    source_folder: str | Path,
    converted_folder: str | Path,
    dtype: torch.dtype,
    vocab_size: int,
    device: str | None = None,
) -> VerificationResult:
    """Compare the converted checkpoint with its source, both loaded in ``dtype``, on fixed prompts.

    Returns the largest absolute logit difference over every prompt position, its tolerance
    (:func:`logit_tolerance`) and whether greedy decoding of :data:`GREEDY_TOKENS` tokens agrees on every prompt.
    """
    source_folder, converted_folder = Path(source_folder), Path(converted_folder)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    prompts, prompt_source = verification_prompts(source_folder, vocab_size)
    source_logits, source_tokens = _run_prompts(source_folder, dtype, device, prompts)
    converted_logits, converted_tokens = _run_prompts(converted_folder, dtype, device, prompts)
    max_diff = max(float((got - want).abs().max()) for got, want in zip(converted_logits, source_logits, strict=True))
    if not all(torch.isfinite(logits).all() for logits in source_logits + converted_logits):
        max_diff = math.inf
    logit_scale = max(float(logits.abs().max()) for logits in source_logits)
    return VerificationResult(
        dtype=str(dtype).removeprefix("torch."),
        prompts=len(prompts),
        prompt_source=prompt_source,
        max_abs_logit_diff=max_diff,
        tolerance=logit_tolerance(dtype, logit_scale if math.isfinite(logit_scale) else 1.0),
        greedy_tokens=GREEDY_TOKENS,
        greedy_agrees=torch.equal(converted_tokens, source_tokens),
    )


__all__ = ["VerificationResult", "logit_tolerance", "verify_conversion"]
