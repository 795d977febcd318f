"""Fine-tune an mHC causal LM with Trainer (full or LoRA) and log the mHC stability diagnostics.

    python examples/finetune.py                          # defaults below, no download
    python examples/finetune.py --model MHC_CHECKPOINT --dataset "my_texts/*.txt" --lora
    python examples/finetune.py --model RESIDUAL_LLAMA_OR_QWEN --upcycle --hc-mult 4 \\
        --dataset wikitext --dataset-config wikitext-2-raw-v1 --report-to tensorboard
    accelerate launch --config_file examples/accelerate/multi_gpu_ddp.yaml examples/finetune.py --model ...

--model: an mHC checkpoint, or with --upcycle a residual Llama / Mistral / Qwen2 / Qwen3 one, converted on the fly
(function-preserving, so training starts from the source model's exact behaviour). Default:
../shared/assets/stories260K (a real pretrained Llama, upcycled) when that folder exists.
--dataset: a Hugging Face Hub dataset id, or local .txt / .json / .jsonl / .csv / .parquet files (a path or a glob).
Default: Jane Austen's novels from ../shared/assets/janeausten/*.txt when present, else Python's own help texts
(pydoc_data). Texts are tokenised, joined with EOS and cut into --block-size token blocks.

Every --stability-every steps the mHC stability report (hf_mhc.diagnostics) is logged next to the loss: the
composite forward / backward gain of the residual mixing, how far comb is from doubly stochastic, how alike the
streams are, and the pre / post ranges, as mhc/* scalars for TensorBoard or W&B (--report-to).

Output (--output-dir): the fine-tuned model and tokenizer; with --lora the adapter instead (it carries the HC maps,
trained in full; load it with peft.AutoPeftModelForCausalLM), plus upcycled_base/ when the base was upcycled here
and merged/ with --merge-lora.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
from itertools import chain
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

import hf_mhc
from hf_mhc.diagnostics import MHCStabilityCallback

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES260K = ASSETS / "stories260K"
JANEAUSTEN = ASSETS / "janeausten"

# transformers renamed TrainingArguments.gradient_checkpointing to activation_checkpointing during 5.x
CHECKPOINTING_FIELD = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in TrainingArguments.__dataclass_fields__
)
LOCAL_BUILDERS = {".txt": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
                  ".parquet": "parquet"}


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model", help="mHC checkpoint (or residual one with --upcycle): folder or Hub id")
    model.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: --model)")
    model.add_argument("--upcycle", action="store_true", help="convert a residual checkpoint to mHC on the fly")
    model.add_argument("--hc-mult", type=int, default=None, help="streams n for --upcycle (default 4)")
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", help="Hub dataset id or local files / glob (default: see above)")
    data.add_argument("--dataset-config", help="Hub dataset configuration name")
    data.add_argument("--split", default="train", help="Hub dataset split (default train)")
    data.add_argument("--text-column", default="text", help="column holding the text (default text)")
    data.add_argument("--block-size", type=int, default=128, help="tokens per training sequence (default 128)")
    data.add_argument("--max-train-blocks", type=int, default=None, help="use at most this many training blocks")
    data.add_argument("--eval-blocks", type=int, default=32, help="held-out blocks for the eval loss (0: none)")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per device per step (default 8)")
    train.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    train.add_argument("--lr", type=float, default=None, help="peak learning rate (default 5e-4, 2e-3 with --lora)")
    train.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default steps // 10)")
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--bf16", action="store_true", help="bf16 mixed precision (autocast, float32 master weights)")
    train.add_argument("--gradient-checkpointing", action="store_true")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--output-dir", default="outputs/finetune", help="where the model or adapter is saved")
    train.add_argument("--logging-steps", type=int, default=10, help="log the loss every N steps (default 10)")
    train.add_argument("--report-to", default="none", help="Trainer integrations: none, tensorboard, wandb, ...")
    lora = parser.add_argument_group("LoRA (hf_mhc.peft.mhc_lora_config: backbone projections + full HC maps)")
    lora.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of every weight")
    lora.add_argument("--lora-r", type=int, default=8)
    lora.add_argument("--lora-alpha", type=int, default=16)
    lora.add_argument("--lora-dropout", type=float, default=0.0)
    lora.add_argument("--merge-lora", action="store_true", help="also save the merged model to OUTPUT_DIR/merged")
    stability = parser.add_argument_group("stability diagnostics (hf_mhc.diagnostics)")
    stability.add_argument("--stability-every", type=int, default=None,
                           help="log the mHC stability report every N steps (default: --logging-steps; 0: off)")
    stability.add_argument("--stability-per-site", action="store_true", help="also log every layer's sites")
    args = parser.parse_args(argv)

    if args.model is None:
        if not STORIES260K.is_dir():
            parser.error("--model is required (the default ../shared/assets/stories260K is not present)")
        args.model, args.upcycle = str(STORIES260K), True
    positive = ("steps", "batch_size", "grad_accum", "block_size", "logging_steps", "lora_r", "lora_alpha")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_blocks < 0 or (args.max_train_blocks is not None and args.max_train_blocks < 1):
        parser.error("--eval-blocks must be >= 0 and --max-train-blocks >= 1")
    if args.hc_mult is not None and not args.upcycle:
        parser.error("--hc-mult only applies with --upcycle (an mHC checkpoint keeps its own number of streams)")
    if args.merge_lora and not args.lora:
        parser.error("--merge-lora needs --lora")
    if args.stability_every is None:
        args.stability_every = args.logging_steps
    if args.stability_every < 0:
        parser.error(f"--stability-every must be >= 0, got {args.stability_every}")
    if args.lr is None:
        args.lr = 2e-3 if args.lora else 5e-4
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10
    return parser, args


def load_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> hf_mhc.MHCForCausalLM:
    """The mHC model to train: loaded, or upcycled from a residual checkpoint with --upcycle (float32 weights)."""
    try:
        model_type = AutoConfig.from_pretrained(args.model).model_type
    except (OSError, ValueError) as exc:
        parser.error(f"cannot load --model {args.model}: {str(exc).strip().splitlines()[0]}")
    if model_type == "mhc":
        if args.upcycle:
            parser.error(f"{args.model} is already an mHC checkpoint: drop --upcycle")
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if not args.upcycle:
        parser.error(f"{args.model} is a residual {model_type!r} model: add --upcycle to convert it to mHC")
    if model_type not in hf_mhc.SUPPORTED_BACKBONES:
        parser.error(f"cannot upcycle a {model_type!r} model; supported: {', '.join(hf_mhc.SUPPORTED_BACKBONES)}")
    source = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    try:
        return hf_mhc.upcycle(source, hc_mult=4 if args.hc_mult is None else args.hc_mult)
    except ValueError as exc:
        parser.error(f"cannot upcycle {args.model}: {str(exc).strip().splitlines()[0]}")


def pydoc_texts() -> Dataset:
    """Python's own help texts (about 450 kB in every CPython), one row per paragraph."""
    from pydoc_data.topics import topics

    paragraphs = (paragraph.strip() for key in sorted(topics) for paragraph in topics[key].split("\n\n"))
    return Dataset.from_dict({"text": [paragraph for paragraph in paragraphs if paragraph]})


def load_texts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Dataset, str]:
    """The raw text dataset and a description of it."""
    spec = args.dataset
    if spec is None:
        if JANEAUSTEN.is_dir():
            spec = str(JANEAUSTEN / "*.txt")
        else:
            return pydoc_texts(), "Python's pydoc_data help texts"
    files = sorted(glob.glob(os.path.expanduser(spec)))
    try:
        if files:
            suffixes = {Path(file).suffix.lower() for file in files}
            builders = {LOCAL_BUILDERS.get(suffix) for suffix in suffixes}
            if len(builders) != 1 or None in builders:
                parser.error(f"--dataset {spec}: files must share one of {', '.join(LOCAL_BUILDERS)}; got {suffixes}")
            builder = builders.pop()
            options = {"sample_by": "paragraph"} if builder == "text" else {}
            dataset = load_dataset(builder, data_files=files, split="train", **options)
            description = f"{len(files)} local file(s) matching {spec}"
        elif glob.has_magic(spec) or Path(spec).suffix.lower() in LOCAL_BUILDERS:
            parser.error(f"--dataset {spec}: no such file")
        else:
            dataset = load_dataset(spec, args.dataset_config, split=args.split)
            description = f"{spec} ({args.dataset_config or 'default'} / {args.split})"
    except (OSError, ValueError, ConnectionError) as exc:
        parser.error(f"cannot load --dataset {spec}: {str(exc).strip().splitlines()[0]}")
    if args.text_column not in dataset.column_names:
        parser.error(f"--dataset has no column {args.text_column!r} (columns: {', '.join(dataset.column_names)}); "
                     "pass --text-column")
    return dataset, description


def token_blocks(texts: Dataset, tokenizer, text_column: str, block_size: int) -> Dataset:
    """Tokenise every text, append EOS, join them and cut ``block_size`` blocks: rows of input_ids and labels."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict) -> dict:
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [text_ids + eos for text_ids in ids]}

    def group(batch: dict) -> dict:
        joined = list(chain.from_iterable(batch["input_ids"]))
        usable = len(joined) // block_size * block_size
        blocks = [joined[start : start + block_size] for start in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    tokenized = texts.map(tokenize, batched=True, remove_columns=texts.column_names, desc="tokenise")
    return tokenized.map(group, batched=True, batch_size=1000, desc=f"blocks of {block_size}")


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    model = load_model(parser, args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (OSError, ValueError) as exc:
        parser.error(f"no tokenizer for {args.tokenizer or args.model} ({str(exc).strip().splitlines()[0]}); "
                     "pass --tokenizer")
    max_positions = model.config.backbone_config.max_position_embeddings
    if args.block_size > max_positions:
        parser.error(f"--block-size {args.block_size} exceeds the model's {max_positions} positions")

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type="cosine",
        weight_decay=args.weight_decay,
        bf16=args.bf16,
        **{CHECKPOINTING_FIELD: args.gradient_checkpointing},
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=args.report_to,
        seed=args.seed,
        disable_tqdm=True,
    )
    texts, corpus = load_texts(parser, args)
    with training_args.main_process_first(desc="tokenise"):
        blocks = token_blocks(texts, tokenizer, args.text_column, args.block_size)
    if len(blocks) <= args.eval_blocks:
        parser.error(f"the dataset gives only {len(blocks)} blocks of {args.block_size} tokens; need more than "
                     f"--eval-blocks {args.eval_blocks}")
    train_set, eval_set = blocks, None
    if args.eval_blocks:
        split = blocks.train_test_split(test_size=args.eval_blocks, shuffle=True, seed=args.seed)
        train_set, eval_set = split["train"], split["test"]
    if args.max_train_blocks is not None:
        train_set = train_set.select(range(min(args.max_train_blocks, len(train_set))))

    if args.lora:
        from peft import get_peft_model

        from hf_mhc.peft import mhc_lora_config

        if args.upcycle:
            # The adapter applies to the upcycled model, which exists nowhere else: save it and name it as the base,
            # so that AutoPeftModelForCausalLM.from_pretrained(OUTPUT_DIR) finds it.
            base_dir = (Path(args.output_dir) / "upcycled_base").resolve()
            if training_args.process_index == 0:
                model.save_pretrained(base_dir)
                tokenizer.save_pretrained(base_dir)
            model.name_or_path = str(base_dir)
        lora_config = mhc_lora_config(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout)
        model = get_peft_model(model, lora_config)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set,
                      data_collator=default_data_collator)
    if args.merge_lora and trainer.is_fsdp_enabled:
        parser.error("--merge-lora does not work on FSDP-sharded weights: merge the saved adapter afterwards")
    stability = None
    if args.stability_every:
        stability = MHCStabilityCallback(every_n_steps=args.stability_every, trainer=trainer,
                                         per_site=args.stability_per_site)
        trainer.add_callback(stability)

    main_process = trainer.is_world_process_zero()
    n_params = sum(param.numel() for param in model.parameters())
    n_trainable = sum(param.numel() for param in model.parameters() if param.requires_grad)
    config = model.config
    if main_process:
        print(f"model: {args.model}{' (upcycled)' if args.upcycle else ''}: mHC {config.backbone_config.model_type}, "
              f"n = {config.hc_mult} streams, {config.backbone_config.num_hidden_layers} layers, {n_params:,} "
              f"parameters, {n_trainable:,} trainable{' (LoRA + HC maps)' if args.lora else ''}")
        print(f"data: {corpus}: {len(train_set)} training blocks of {args.block_size} tokens"
              f"{f', {len(eval_set)} held out' if eval_set is not None else ''}")
    eval_before = trainer.evaluate()["eval_loss"] if eval_set is not None else None
    trainer.train()
    eval_after = trainer.evaluate()["eval_loss"] if eval_set is not None else None

    trainer.save_model(args.output_dir)
    if main_process:
        tokenizer.save_pretrained(args.output_dir)
    if args.merge_lora and main_process:
        merged = model.merge_and_unload()
        merged.save_pretrained(Path(args.output_dir) / "merged")
        tokenizer.save_pretrained(Path(args.output_dir) / "merged")
    if main_process:
        if eval_before is not None:
            print(f"held-out loss {eval_before:.4f} -> {eval_after:.4f} "
                  f"(perplexity {math.exp(eval_before):.2f} -> {math.exp(eval_after):.2f})")
        if stability is not None:
            scalars = stability.last_scalars
            print(f"mHC stability at the end: composite forward gain {scalars['mhc/composite_forward_gain']:.6f}, "
                  f"backward gain {scalars['mhc/composite_backward_gain']:.6f}, largest |comb row sum - 1| "
                  f"{scalars['mhc/max_comb_row_sum_deviation']:.2e}")
        saved = "model"
        if args.lora:
            saved = "LoRA adapter (with the HC maps; load it with peft.AutoPeftModelForCausalLM)"
        merged_note = f"; merged model to {Path(args.output_dir) / 'merged'}" if args.merge_lora else ""
        print(f"saved the {saved} and tokenizer to {args.output_dir}{merged_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
