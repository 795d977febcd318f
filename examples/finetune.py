"""Fine-tune an mHC causal LM with Trainer (full or LoRA) and log the mHC stability diagnostics.

    python examples/finetune.py                          # defaults below, no download
    python examples/finetune.py --model MHC_CHECKPOINT --dataset "my_texts/*.txt" --lora
    python examples/finetune.py --model RESIDUAL_LLAMA_OR_QWEN --upcycle --hc-mult 4 \\
        --dataset wikitext --dataset-config wikitext-2-raw-v1 --report-to tensorboard
    accelerate launch --config_file examples/accelerate/multi_gpu_ddp.yaml examples/finetune.py --model ...

--model: an mHC checkpoint, or with --upcycle a residual one of a supported family (hf_mhc.SUPPORTED_BACKBONES),
converted on the fly (function-preserving, so training starts from the source model's exact behaviour). Default:
../shared/assets/stories260K (a real pretrained Llama, upcycled) when that folder exists.
--dataset: a Hugging Face Hub dataset id, or local .txt / .json / .jsonl / .csv / .parquet files (a path, a glob or
a folder of them; null and empty texts are skipped, and a dataset with no text at all is refused).
Default: Jane Austen's novels from ../shared/assets/janeausten/*.txt when present, else Python's own help texts
(pydoc_data). Texts are tokenised, joined with EOS and cut into --block-size token blocks.

Every --stability-every steps the mHC stability report (hf_mhc.diagnostics) is logged next to the loss: the
composite forward / backward gain of the residual mixing, how far comb is from doubly stochastic, how alike the
streams are, and the pre / post ranges, as mhc/* scalars for TensorBoard or W&B (--report-to).

Output (--output-dir, which must be new or empty): the fine-tuned model and tokenizer; with --lora the adapter instead
(it carries the HC maps, trained in full; load it with peft.AutoPeftModelForCausalLM), plus upcycled_base/ when the
base was upcycled here (the adapter names it as its base) and merged/ with --merge-lora. Every --save-steps steps a
Trainer checkpoint goes to OUTPUT_DIR/checkpoint-STEP (the last --save-total-limit are kept): after a crash, run the
same command with --resume to continue from the newest complete one. Trainer writes trainer_state.json last, so a
checkpoint without it (or with it cut short) is an interrupted save: --resume skips it and says so, and since the
resumed run would save into it, first sets it aside, renamed to incomplete-checkpoint-STEP.XXXX (deleting nothing; not
to a checkpoint-* name, which --save-total-limit would rotate away), with one line saying so. It refuses, in one line,
to run when a later complete checkpoint is there (nothing complete is replaced or moved), and a checkpoint it names
that is incomplete, damaged (a file cut short) or not a Trainer's.

--overwrite reuses the folder of an earlier run: before training it deletes that run's model, adapter and tokenizer
files (with the mHC code files saved beside a model), its model card (PEFT's, or hf-mhc's when unedited), merged/,
upcycled_base/ and checkpoint-*/ (so that no stale adapter_config.json or weight shard can mix into the new result),
lists what it deleted, and keeps every other file. It refuses a folder that holds no model, adapter or Trainer
output, and the working directory or the home folder.

Bad input (a missing path, unusable dataset files or texts, an unwritable or non-empty --output-dir, a --report-to
integration that is not installed, ...) stops before any training with one "finetune.py: error: ..." line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset, Value, load_dataset
from transformers import (
    AutoConfig,
    AutoTokenizer,
    Trainer,
    TrainerState,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # example_utils, also when this file is imported by path

from example_utils import (  # noqa: E402
    JANEAUSTEN,
    STORIES260K,
    add_example_option,
    checkpoint_folders,
    checkpoint_step,
    checkpoint_to_resume,
    clear_earlier_output,
    damaged_file,
    dataset_token_blocks,
    has_text,
    hc_mult_or_default,
    incomplete_in_the_way,
    innermost_message,
    learning_rate,
    load_causal_lm,
    load_config,
    perplexity,
    pydoc_paragraphs,
    set_aside_incomplete,
)

import hf_mhc  # noqa: E402
from hf_mhc.common import first_line, folder_error, looks_like_local_path, output_path_error  # noqa: E402
from hf_mhc.diagnostics import MHCStabilityCallback  # noqa: E402
from hf_mhc.model_card import CARD_FILE, is_hf_mhc_card_file  # noqa: E402

# transformers renamed TrainingArguments.gradient_checkpointing to activation_checkpointing during 5.x
CHECKPOINTING_FIELD = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in TrainingArguments.__dataclass_fields__
)
LOCAL_BUILDERS = {".txt": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
                  ".parquet": "parquet"}
# What an earlier run (save_pretrained, PEFT, the tokenizer, Trainer checkpoints) wrote: --overwrite deletes these
# names, and only these, so that none of them can leak into the new result (e.g. a stale adapter_config.json, which
# transformers applies to the full model saved beside it).
OUTPUT_FILE_PATTERNS = (
    "config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
    "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
    "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "training_args.bin",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
    "trainer_state.json", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth",
)
OUTPUT_SUBFOLDERS = ("merged", "upcycled_base")  # and checkpoint-STEP
# What Trainer._save_checkpoint writes before trainer_state.json, each part under one of these names (full or LoRA
# weights, FSDP's sharded folders).
TRAINER_CHECKPOINT_PARTS = {
    "model weights": ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin",
                      "pytorch_model_fsdp_0"),
    "optimizer state": ("optimizer.pt", "optimizer.bin", "optimizer_0"),
    "scheduler state": ("scheduler.pt",),
}
# The trainer_state.json fields Trainer reads on resuming, and their types.
TRAINER_STATE_FIELDS = {"global_step": int, "train_batch_size": int, "log_history": list}


def mhc_code_files() -> set[str]:
    """The ``.py`` files that saving an mHC model copies beside it (its remote code): a new save writes them again."""
    import inspect

    from transformers.dynamic_module_utils import get_relative_import_files

    modules = {inspect.getfile(hf_mhc.MHCForCausalLM), inspect.getfile(hf_mhc.MHCConfig)}
    return {Path(file).name for module in modules for file in (module, *get_relative_import_files(module))}


def add_model_and_data_arguments(parser: argparse.ArgumentParser, block_size: int):
    """The "model" and "data" option groups this script shares with ``pipeline_finetune.py``; returns both groups."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", help="mHC checkpoint (or residual one with --upcycle): folder or Hub id")
    model.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: --model)")
    model.add_argument("--upcycle", action="store_true", help="convert a residual checkpoint to mHC on the fly")
    add_example_option(model, "--hc-mult")
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", help="Hub dataset id or local files / glob (default: see above)")
    data.add_argument("--dataset-config", help="Hub dataset configuration name")
    data.add_argument("--split", default="train", help="Hub dataset split (default train)")
    data.add_argument("--text-column", default="text", help="column holding the text (default text)")
    add_example_option(data, "--block-size", default=block_size)
    return model, data


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model, data = add_model_and_data_arguments(parser, block_size=128)
    data.add_argument("--max-train-blocks", type=int, default=None, help="use at most this many training blocks")
    data.add_argument("--eval-blocks", type=int, default=32, help="held-out blocks for the eval loss (0: none)")
    train = parser.add_argument_group("training")
    add_example_option(train, "--steps", default=100)
    train.add_argument("--batch-size", type=int, default=8, help="sequences per device per step (default 8)")
    train.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    train.add_argument("--lr", type=learning_rate, default=None,
                       help="peak learning rate (default 5e-4, 2e-3 with --lora)")
    add_example_option(train, "--warmup-steps")
    add_example_option(train, "--weight-decay")
    train.add_argument("--bf16", action="store_true", help="bf16 mixed precision (autocast, float32 master weights)")
    train.add_argument("--gradient-checkpointing", action="store_true")
    add_example_option(train, "--seed")
    train.add_argument("--output-dir", default="outputs/finetune",
                       help="new or empty folder for the model or adapter (default outputs/finetune)")
    train.add_argument("--overwrite", action="store_true",
                       help="reuse the --output-dir of an earlier run: delete its results first (see above)")
    train.add_argument("--save-steps", type=int, default=50,
                       help="save a Trainer checkpoint every N steps to OUTPUT_DIR/checkpoint-N (default 50; 0: none)")
    train.add_argument("--save-total-limit", type=int, default=2, help="checkpoints to keep (default 2)")
    add_example_option(train, "--resume")
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
    positive = ("steps", "batch_size", "grad_accum", "logging_steps", "lora_r", "lora_alpha", "save_total_limit")
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
    if args.stability_every < 0 or args.save_steps < 0:
        parser.error("--stability-every and --save-steps must be >= 0")
    if args.resume is not None and args.overwrite:
        parser.error("--resume continues the run in --output-dir, --overwrite replaces it: choose one")
    args.report_to = [name.strip() for name in args.report_to.split(",") if name.strip() not in ("", "none")]
    if args.lr is None:
        args.lr = 2e-3 if args.lora else 5e-4
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10
    return parser, args


def check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """Refuse unusable --model, --tokenizer and --output-dir before any work; return the output folder."""
    for option in ("model", "tokenizer"):
        name = getattr(args, option)
        missing = None if name is None else folder_error(name)
        if missing is not None:
            parser.error(f"--{option}: {missing}")
    model_dir = Path(args.model).expanduser()
    if (model_dir / "adapter_config.json").is_file():
        if (model_dir / "config.json").is_file():
            parser.error(f"--model {args.model} holds a PEFT adapter (adapter_config.json) beside the model, which "
                         "transformers would apply on load: move the adapter files to their own folder")
        parser.error(f"--model {args.model} is a PEFT adapter, not a model: pass its base model, or the merged model "
                     "(--merge-lora writes OUTPUT_DIR/merged)")

    out = Path(args.output_dir).expanduser()
    unusable = output_path_error(args.output_dir, folder=True)
    if unusable is not None:
        parser.error(f"--output-dir {args.output_dir}: {unusable}")
    resolved = out.resolve()
    for option in ("model", "tokenizer"):
        source = Path(getattr(args, option) or args.model).expanduser()
        if not source.is_dir():
            continue
        if source.resolve() == resolved:
            what = "the adapter would be saved into the model it is trained on" if args.lora else (
                "the result would replace the model being trained")
            parser.error(f"--output-dir is the --{option} folder {source}: {what}; choose another --output-dir")
        if (args.overwrite or args.resume is not None) and resolved in source.resolve().parents:
            parser.error(f"--{option} {source} is inside --output-dir, whose earlier results this run replaces")
    if args.resume is not None and out.is_dir() and any(out.iterdir()) and not looks_like_earlier_output(out):
        parser.error(f"--resume: --output-dir {args.output_dir} holds no earlier run; choose its own --output-dir")
    if args.resume is None and out.is_dir() and any(out.iterdir()):
        if not args.overwrite:
            parser.error(f"--output-dir {args.output_dir} is not empty: pass --overwrite to replace the earlier run "
                         "in it (--resume to continue it), or choose a new folder")
        if resolved in (Path.cwd().resolve(), Path.home().resolve()) or resolved == resolved.parent:
            parser.error(f"--overwrite will not clear {resolved} (the working directory, home or root folder)")
        if not looks_like_earlier_output(out):
            parser.error(f"--overwrite: {args.output_dir} holds no model, adapter or Trainer checkpoint, so it is not "
                         "the output of an earlier run; refusing to delete anything in it")
    return out


def is_peft_model_card(path: Path) -> bool:
    """The README.md that PEFT writes beside an adapter (front matter with ``library_name: peft``)."""
    try:
        head = path.read_text(encoding="utf-8", errors="replace")[:4096]
    except OSError:
        return False
    return head.startswith("---") and "library_name: peft" in head.split("\n---", 1)[0]


def is_earlier_model_card(path: Path) -> bool:
    """A ``README.md`` that a run wrote: PEFT's beside an adapter, or hf-mhc's beside an upcycled model, unedited
    (:func:`hf_mhc.model_card.is_hf_mhc_card_file`). A card someone wrote or edited is no run's output."""
    if path.name != CARD_FILE or not path.is_file() or path.is_symlink():
        return False
    return is_peft_model_card(path) or is_hf_mhc_card_file(path)


def looks_like_earlier_output(folder: Path) -> bool:
    """Whether ``folder`` holds what a fine-tuning run writes: a model, an adapter, a Trainer checkpoint."""
    def json_has(name: str, key: str) -> bool:
        try:
            return key in json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            return False

    return ((folder / "training_args.bin").is_file() or json_has("config.json", "model_type")
            or json_has("adapter_config.json", "peft_type")
            or any(checkpoint_step(entry) is not None and (entry / "trainer_state.json").is_file()
                   for entry in folder.iterdir()))


def clear_earlier_run(folder: Path, *, checkpoints: bool, subfolders: tuple[str, ...] = OUTPUT_SUBFOLDERS
                      ) -> tuple[list[str], list[str]]:
    """Delete the files an earlier run wrote to ``folder`` (:data:`OUTPUT_FILE_PATTERNS`, the mHC remote-code files
    and the model cards of PEFT and hf-mhc), there and in ``subfolders`` and, with ``checkpoints``, in ``checkpoint-*``
    (:func:`example_utils.clear_earlier_output`). Every other file stays. Returns the deleted and the kept names."""
    code_files = mhc_code_files()

    def is_output_file(entry: Path) -> bool:
        return (any(entry.match(pattern) for pattern in OUTPUT_FILE_PATTERNS) or entry.name in code_files
                or is_earlier_model_card(entry))

    def cleared_subfolder(relative: Path) -> bool:
        return len(relative.parts) == 1 and (relative.name in subfolders or (
            checkpoints and checkpoint_step(folder / relative) is not None))

    return clear_earlier_output(folder, is_output_file, cleared_subfolder)


def resume_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace, out: Path
                      ) -> tuple[str, str, list[tuple[Path, str]]] | None:
    """The complete Trainer checkpoint --resume names (``None`` without --resume), checked to be whole and to fit
    this run, a note on the incomplete ones skipped (:func:`example_utils.checkpoint_to_resume`), and the incomplete
    later checkpoints that Trainer would save into, to set aside (:func:`example_utils.incomplete_in_the_way`; a
    complete one is refused)."""
    if args.resume is None:
        return None
    checkpoint, state, skipped = checkpoint_to_resume(parser, args.resume, out)
    try:
        trainer_state = TrainerState(**state)  # as Trainer reads it
    except TypeError as error:
        parser.error(f"--resume {checkpoint}: trainer_state.json is not a Trainer state ({first_line(error)})")
    wrong = [name for name, kind in TRAINER_STATE_FIELDS.items()
             if not isinstance(getattr(trainer_state, name), kind) or isinstance(getattr(trainer_state, name), bool)]
    if wrong:
        parser.error(f"--resume {checkpoint}: trainer_state.json is not a Trainer state ({', '.join(wrong)} missing "
                     "or not of Trainer's type)")
    step = trainer_state.global_step
    later = [folder for folder in checkpoint_folders(out) if checkpoint_step(folder) > step]
    in_the_way = incomplete_in_the_way(parser, checkpoint, step, reversed(later))
    for part, names in TRAINER_CHECKPOINT_PARTS.items():
        if not any((checkpoint / name).exists() for name in names):
            parser.error(f"--resume {checkpoint}: no {part} ({names[0]}) in it: not a whole Trainer checkpoint")
    damaged = damaged_file(checkpoint)
    if damaged is not None:
        parser.error(f"--resume {checkpoint}: {damaged}")
    is_adapter = (checkpoint / "adapter_config.json").is_file()
    if is_adapter != args.lora:
        parser.error(f"--resume {checkpoint} holds {'a LoRA adapter' if is_adapter else 'a full model'}: "
                     f"{'add' if is_adapter else 'drop'} --lora")
    return str(checkpoint), skipped, in_the_way


def check_resume_fits(parser: argparse.ArgumentParser, args: argparse.Namespace, checkpoint: str,
                      model: hf_mhc.MHCForCausalLM) -> None:
    """Refuse to resume from a checkpoint of a differently shaped model (another --model or --hc-mult)."""
    folder = Path(checkpoint)
    if (folder / "adapter_config.json").is_file():  # a LoRA checkpoint: its base holds the model's config
        folder = Path(json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
                      .get("base_model_name_or_path") or "")
    try:
        saved = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError):
        return  # nothing to compare with: the Trainer reports what does not load

    def shape(config) -> dict[str, int]:
        text = config.get_text_config()
        return {"hc_mult": config.hc_mult, **{name: getattr(text, name) for name in (
            "num_hidden_layers", "hidden_size", "vocab_size")}}

    if getattr(saved, "model_type", None) == "mhc" and shape(saved) != shape(model.config):
        parser.error(f"--resume {checkpoint} holds a model with {shape(saved)}, but --model {args.model} gives "
                     f"{shape(model.config)}: pass the --model and --hc-mult of that run")


def check_report_to(parser: argparse.ArgumentParser, names: list[str]) -> None:
    """Refuse a --report-to integration that transformers does not know or that is not installed."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    installed = set(get_available_reporting_integrations())
    for name in names:
        if name == "all":
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            parser.error(f"--report-to {name}: unknown integration; choose from none, all, "
                         f"{', '.join(INTEGRATION_TO_CALLBACK)}")
        if name not in installed:
            package = {"azure_ml": "azureml-core", "comet_ml": "comet-ml"}.get(name, name)
            parser.error(f"--report-to {name}: {name} is not installed (pip install {package})")


def load_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> hf_mhc.MHCForCausalLM:
    """The mHC model to train: loaded, or upcycled from a residual checkpoint with --upcycle (float32 weights)."""
    model_type = load_config(parser, args.model).model_type
    if model_type == "mhc":
        if args.upcycle:
            parser.error(f"{args.model} is already an mHC checkpoint: drop --upcycle")
        model = load_causal_lm(parser, args.model, dtype=torch.float32)
    else:
        if not args.upcycle:
            parser.error(f"{args.model} is a residual {model_type!r} model: add --upcycle to convert it to mHC")
        if model_type not in hf_mhc.SUPPORTED_BACKBONES:
            parser.error(f"cannot upcycle a {model_type!r} model; supported: {', '.join(hf_mhc.SUPPORTED_BACKBONES)}")
        source = load_causal_lm(parser, args.model, dtype=torch.float32)
        try:
            model = hf_mhc.upcycle(source, hc_mult=hc_mult_or_default(args.hc_mult))
        except ValueError as exc:
            parser.error(f"cannot upcycle {args.model}: {first_line(exc)}")
    if getattr(model, "_hf_peft_config_loaded", False):  # transformers applied an adapter it found with the model
        parser.error(f"--model {args.model} came with a PEFT adapter: pass its base model or a merged one")
    return model


def pydoc_texts() -> Dataset:
    """Python's own help texts (about 450 kB in every CPython), one row per paragraph."""
    return Dataset.from_dict({"text": list(pydoc_paragraphs())})


def json_error(path: str) -> str | None:
    """Why ``path`` is not JSON that the ``json`` dataset builder reads (one document, or one per line), else None."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as whole_file_error:
        if text.lstrip().startswith("["):
            return f"line {whole_file_error.lineno}: {whole_file_error.msg}"
    for number, line in enumerate(text.splitlines(), 1):  # JSON lines
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                return f"line {number}: {error.msg}"
    return None


def local_dataset_files(parser: argparse.ArgumentParser, spec: str) -> list[str] | None:
    """The files --dataset names (a file, a glob, or a folder of them); ``None`` when it is a Hub dataset id."""
    expanded = os.path.expanduser(spec)
    if os.path.isdir(expanded):
        files = sorted(str(path) for path in Path(expanded).iterdir() if path.suffix.lower() in LOCAL_BUILDERS)
        if not files:
            parser.error(f"--dataset {spec}: no {' / '.join(LOCAL_BUILDERS)} files in this folder")
    else:
        files = sorted(path for path in glob.glob(expanded) if os.path.isfile(path))
    if not files:
        if glob.has_magic(spec):
            parser.error(f"--dataset {spec}: no file matches")
        if Path(spec).suffix.lower() in LOCAL_BUILDERS or looks_like_local_path(spec):
            parser.error(f"--dataset {spec}: no such file or folder")
        return None
    suffixes = {Path(file).suffix.lower() for file in files}
    builders = {LOCAL_BUILDERS.get(suffix) for suffix in suffixes}
    if len(builders) != 1 or None in builders:
        parser.error(f"--dataset {spec}: files must share one of {', '.join(LOCAL_BUILDERS)}; got {sorted(suffixes)}")
    empty = [file for file in files if os.path.getsize(file) == 0]
    if empty:
        parser.error(f"--dataset {spec}: empty file{'s' if len(empty) > 1 else ''} {', '.join(empty)}")
    if builders == {"json"}:
        for file in files:
            error = json_error(file)
            if error is not None:
                parser.error(f"--dataset {file}: invalid JSON, {error}")
    return files


def load_texts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Dataset, str]:
    """The raw text dataset and a description of it; its --text-column checked to hold strings."""
    spec = args.dataset
    if spec is None:
        if JANEAUSTEN.is_dir():
            spec = str(JANEAUSTEN / "*.txt")
        else:
            return pydoc_texts(), "Python's pydoc_data help texts"
    files = local_dataset_files(parser, spec)
    try:
        if files is not None:
            builder = LOCAL_BUILDERS[Path(files[0]).suffix.lower()]
            options = {"sample_by": "paragraph"} if builder == "text" else {}
            dataset = load_dataset(builder, data_files=files, split="train", **options)
            description = f"{len(files)} local file(s) matching {spec}"
        else:
            dataset = load_dataset(spec, args.dataset_config, split=args.split)
            description = f"{spec} ({args.dataset_config or 'default'} / {args.split})"
    except Exception as exc:  # datasets raises many kinds of errors; each means bad input here
        parser.error(f"cannot load --dataset {spec}: {innermost_message(exc)}")
    if args.text_column not in dataset.column_names:
        parser.error(f"--dataset has no column {args.text_column!r} (columns: {', '.join(dataset.column_names)}); "
                     "pass --text-column")
    feature = dataset.features[args.text_column]
    if not (isinstance(feature, Value) and feature.dtype in ("string", "large_string")):
        parser.error(f"--dataset column {args.text_column!r} holds {feature}, not text: pass --text-column with a "
                     "column of strings")
    if len(dataset) == 0:
        parser.error(f"--dataset {spec}: no texts")
    if not has_text(dataset, args.text_column):
        parser.error(f"--dataset {spec}: no text to train on (every {args.text_column!r} is empty or null)")
    return dataset, description


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    out = check_paths(parser, args)
    checkpoint, skipped, in_the_way = resume_checkpoint(parser, args, out) or (None, "", [])
    check_report_to(parser, args.report_to)
    model = load_model(parser, args)
    if checkpoint is not None:
        check_resume_fits(parser, args, checkpoint, model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (OSError, ValueError) as exc:
        parser.error(f"no tokenizer for {args.tokenizer or args.model} ({first_line(exc)}); pass --tokenizer")
    max_positions = model.config.backbone_config.max_position_embeddings
    if args.block_size > max_positions:
        parser.error(f"--block-size {args.block_size} exceeds the model's {max_positions} positions")

    training_args = TrainingArguments(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type="cosine",
        weight_decay=args.weight_decay,
        bf16=args.bf16,
        # On a machine without an accelerator say so: bf16 on CPU needs it, and so does DeepSpeed on CPU ranks
        # (without it transformers' DeepSpeed setup sees one process on each rank, which then train on the same rows).
        use_cpu=not torch.accelerator.is_available(),
        **{CHECKPOINTING_FIELD: args.gradient_checkpointing},
        logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit,
        report_to=args.report_to,
        seed=args.seed,
        disable_tqdm=True,
    )
    texts, corpus = load_texts(parser, args)
    with training_args.main_process_first(desc="tokenise"):
        blocks = dataset_token_blocks(texts, tokenizer, args.text_column, args.block_size)
    if not len(blocks):
        parser.error(f"the dataset gives 0 blocks of {args.block_size} tokens: add text or lower --block-size")
    if len(blocks) <= args.eval_blocks:
        parser.error(f"the dataset gives only {len(blocks)} blocks of {args.block_size} tokens; need more than "
                     f"--eval-blocks {args.eval_blocks}")
    train_set, eval_set = blocks, None
    if args.eval_blocks:
        split = blocks.train_test_split(test_size=args.eval_blocks, shuffle=True, seed=args.seed)
        train_set, eval_set = split["train"], split["test"]
    if args.max_train_blocks is not None:
        train_set = train_set.select(range(min(args.max_train_blocks, len(train_set))))

    main_process = training_args.process_index == 0
    if args.overwrite and main_process and out.is_dir():
        removed, kept = clear_earlier_run(out, checkpoints=True)
        print(f"--overwrite: deleted the earlier run's {', '.join(removed) or 'nothing'} from {out}"
              f"{f'; kept {len(kept)} other file(s): ' + ', '.join(kept[:8]) if kept else ''}")
    if in_the_way and main_process:  # a killed save's checkpoint-STEP, which Trainer would save into (or rotate away)
        try:
            print("\n".join(set_aside_incomplete(in_the_way)))
        except OSError as error:
            parser.error(f"--resume: cannot set aside an incomplete checkpoint: {first_line(error)}")
    if args.lora:
        from peft import get_peft_model

        from hf_mhc.peft import mhc_lora_config, save_adapter_base

        if args.upcycle:
            # The adapter applies to the upcycled model, which exists nowhere else: save it and name it as the base,
            # so that AutoPeftModelForCausalLM.from_pretrained(OUTPUT_DIR) finds it.
            with training_args.main_process_first(desc="save the upcycled base", local=False):
                if main_process:
                    save_adapter_base(model, out / "upcycled_base", tokenizer)
            model.name_or_path = str((out / "upcycled_base").absolute())
        elif Path(args.model).expanduser().is_dir():
            model.name_or_path = str(Path(args.model).expanduser().absolute())  # found from any working directory
        lora_config = mhc_lora_config(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                      model_type=model.config.backbone_config.model_type)  # the family's projections
        set_seed(args.seed)  # the LoRA A matrices are random: the same --seed gives the same run
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
        if checkpoint is not None:
            print(f"resuming from {checkpoint}{skipped}")
    # Under DeepSpeed, Trainer.evaluate before Trainer.train leaves Accelerate without the training engine
    # ("'NoneType' object has no attribute 'backward'" in transformers 5.24): the held-out loss is measured after only.
    evaluate_first = eval_set is not None and not trainer.is_deepspeed_enabled
    eval_before = trainer.evaluate()["eval_loss"] if evaluate_first else None
    trainer.train(resume_from_checkpoint=checkpoint)
    eval_after = trainer.evaluate()["eval_loss"] if eval_set is not None else None

    if checkpoint is not None and main_process:  # a finished earlier attempt's result must not mix into this one
        clear_earlier_run(out, checkpoints=False, subfolders=("merged",))
    # A LoRA model saves through PeftModel.save_pretrained (PEFT's own format: any PEFT version works), never through
    # transformers' built-in adapter API, which needs PEFT >= 0.22.
    trainer.save_model(str(out))
    if main_process:
        tokenizer.save_pretrained(out)
    if args.merge_lora and main_process:
        merged = model.merge_and_unload()
        merged.save_pretrained(out / "merged")
        tokenizer.save_pretrained(out / "merged")
    if main_process:
        if eval_before is not None:
            print(f"held-out loss {eval_before:.4f} -> {eval_after:.4f} "
                  f"(perplexity {perplexity(eval_before):.2f} -> {perplexity(eval_after):.2f})")
        elif eval_after is not None:
            print(f"held-out loss {eval_after:.4f} (perplexity {perplexity(eval_after):.2f})")
        if stability is not None:
            scalars = stability.last_scalars
            print(f"mHC stability at the end: composite forward gain {scalars['mhc/composite_forward_gain']:.6f}, "
                  f"backward gain {scalars['mhc/composite_backward_gain']:.6f}, largest |comb row sum - 1| "
                  f"{scalars['mhc/max_comb_row_sum_deviation']:.2e}")
        saved = "model"
        if args.lora:
            saved = "LoRA adapter (with the HC maps; load it with peft.AutoPeftModelForCausalLM)"
        merged_note = f"; merged model to {out / 'merged'}" if args.merge_lora else ""
        print(f"saved the {saved} and tokenizer to {args.output_dir}{merged_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
