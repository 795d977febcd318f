"""Does upcycling pay? A pretrained residual model trained on, against its mHC upcycles and a naive conversion.

    .venv/bin/python benchmarks/upcycle_miniature.py [--source PATH_OR_HUB_ID|pretrained ...] \
        [--pretrain-layers 12] [--pretrain-hidden 64] [--pretrain-steps 200] [--dataset GLOB] [--steps 100] \
        [--lr 1e-3] [--hc-lr LR] [--seeds 3] [--variants residual,sinkhorn,...] [--hc-mult 4] \
        [--chat PROMPT] [--json PATH] [--plot PATH.png]

For each source and each of ``--seeds`` seeds (``--seed``, ``--seed + 1``, ...: the order of the batches, and the
naive arm's HC initialisation), these arms train on the same batches, side by side (one step of each in turn,
``training_runs.train_arms``), for ``--steps`` steps:

- ``residual``: the source model itself, trained on (what a user has without mHC);
- ``sinkhorn``, ``unconstrained``, ``identity``, ``permutations``: ``hf_mhc.upcycle`` of the source with that
  residual map (``--hc-mult`` streams): function-preserving, each starts at the source's held-out loss;
- ``naive``: the same n-stream mHC model (``sinkhorn``) with the backbone weights copied in and the HC tensors as
  DeepSeek-V4 initialises them (``MHCConfig(hc_init="deepseek_v4")``: ``fn`` ~ N(0, 0.02), ``base`` 0, ``scale`` 1,
  drawn from the seed), which does not compute the source's function.

Sources (``--source``, repeatable; default both of these):

- a folder or Hub id of a causal LM of a supported family, tokenised with its own tokenizer, trained on the whole
  corpus of ``--dataset`` (the last 10 % held out): by default ``../shared/assets/stories260K`` (a 5 x 64 Llama
  pretrained on TinyStories) on Jane Austen's novels, a change of domain;
- ``pretrained``: a ``--pretrain-layers`` x ``--pretrain-hidden`` Llama (``training_runs.llama_config``) that this
  script pretrains for ``--pretrain-steps`` steps (lr ``--pretrain-lr``, seed ``--seed``) on the first half of the
  corpus's first 90 % and then trains on the second half (held out: the last 10 %); it is cached under
  ``--cache-dir`` (default ``benchmarks/.cache/``) by its settings and its data, and reused.

Records per arm and seed (``training_runs.Arm``): training and held-out loss (16 fixed held-out blocks), gradient
norm, composite gains and training time every ``--log-every`` steps. The summary gives, per arm over seeds, the final
held-out loss, its difference to the residual arm of the same seed, the tokens-per-second ratio to that arm, the
held-out loss reached within the residual arm's training time (equal compute: the last logged point within that
time), the step-0 held-out loss and its relative difference to the source's, and the trainable parameters. Progress
goes to stderr, the tables to stdout (with ``--chat PROMPT``, also the source's and each arm's greedy answer after
training on the first seed), the results to ``--json PATH`` (``sources[NAME]["runs"][arm][seed]``,
``sources[NAME]["summary"][arm]``) and the figure to ``--plot PATH.png``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from benchlib import add_json_argument, progress, report
from training_runs import (
    BASELINE,
    GAIN_BLOCKS,
    STORIES260K,
    Schedule,
    UsageError,
    check_block_size,
    check_clip_and_plot,
    check_streams,
    default_dataset,
    held_out_loss,
    llama_config,
    load_text,
    plot_seeds,
    split_corpus,
    summarize,
    summary_table,
    tokenize,
    train_arms,
)
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import hf_mhc
from hf_mhc.configuration_mhc import check_backbone_type
from hf_mhc.modeling_mhc import MHCHyperConnection, MHCHyperHead

PRESERVING = ("sinkhorn", "unconstrained", "identity", "permutations")
NAIVE = "naive"
ARMS = (BASELINE, *PRESERVING, NAIVE)
PRETRAINED = "pretrained"
CACHE = Path(__file__).resolve().parent / ".cache"
PROG = "upcycle_miniature.py"
# A folder holds a tokenizer when it holds one of these (tokenizer.save_pretrained writes the first two).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def naive_conversion(source: torch.nn.Module, hc_mult: int, seed: int) -> torch.nn.Module:
    """The ``sinkhorn`` mHC model of ``source`` with its HC tensors re-initialised as DeepSeek-V4 does
    (``hc_init="deepseek_v4"``, drawn from ``seed``): the backbone copied in, the function not preserved."""
    model = hf_mhc.upcycle(source, hc_mult=hc_mult, hc_residual_map="sinkhorn")
    model.config.hc_init = "deepseek_v4"
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (MHCHyperConnection, MHCHyperHead)):
                model._init_weights(module)
    return model


def build_arms(source: torch.nn.Module, arms: list[str], hc_mult: int, seed: int) -> dict[str, torch.nn.Module]:
    """One model per arm, each independent of ``source`` (which stays as it is)."""
    models = {}
    for arm in arms:
        if arm == BASELINE:
            models[arm] = copy.deepcopy(source)
        elif arm == NAIVE:
            models[arm] = naive_conversion(source, hc_mult, seed)
        else:
            models[arm] = hf_mhc.upcycle(source, hc_mult=hc_mult, hc_residual_map=arm)
    return models


def chat_answers(models: dict[str, torch.nn.Module], tokenizer_source: str, prompt: str,
                 new_tokens: int) -> dict[str, str]:
    """Each model's greedy answer (``new_tokens`` at most) to ``prompt``, through the tokenizer's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    answers = {}
    for name, model in models.items():
        model.eval()
        with torch.no_grad():
            output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    do_sample=False)
        answers[name] = tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return answers


def pretrain_source(args: argparse.Namespace, data: dict[str, torch.Tensor], vocab_size: int,
                    fingerprint: dict) -> tuple[torch.nn.Module, dict]:
    """The ``pretrained`` source: loaded from the cache when it holds one made with these settings and data,
    pretrained on ``data["pretrain"]`` and saved there otherwise."""
    settings = {"layers": args.pretrain_layers, "hidden": args.pretrain_hidden, "steps": args.pretrain_steps,
                "lr": args.pretrain_lr, "batch_size": args.batch_size, "block_size": args.block_size,
                "seed": args.seed, "vocab_size": vocab_size, **fingerprint}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    folder = args.cache_dir / f"pretrained-{args.pretrain_layers}x{args.pretrain_hidden}-{key}"
    if (folder / "config.json").is_file():
        progress(f"pretrained source: loading {folder}")
        info = json.loads((folder / "pretraining.json").read_text())
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), info
    progress(f"pretrained source: pretraining a {args.pretrain_layers} x {args.pretrain_hidden} Llama for "
             f"{args.pretrain_steps} steps (cached in {folder})")
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(llama_config(args.pretrain_layers, args.pretrain_hidden, vocab_size, args.block_size))
    schedule = Schedule(steps=args.pretrain_steps, lr=args.pretrain_lr, grad_clip=args.grad_clip,
                        batch_size=args.batch_size, block_size=args.block_size,
                        log_every=max(1, args.pretrain_steps // 5))
    start = time.perf_counter()
    run = train_arms({"pretraining": model}, {**data, "train": data["pretrain"]}, schedule, args.seed,
                     "pretrained source")["pretraining"]
    info = settings | {"seconds": time.perf_counter() - start, "final_loss": run["final_loss"],
                       "final_heldout_loss": run["final_heldout_loss"]}
    model.save_pretrained(folder)
    (folder / "pretraining.json").write_text(json.dumps(info, indent=2) + "\n")
    return model, info


def load_source(source: str, args: argparse.Namespace, text: str, corpus: str) -> tuple[str, torch.nn.Module,
                                                                                         dict, dict]:
    """A source's name, model (float32), data (``train``, ``heldout_blocks``, ``gain_blocks``) and description."""
    if source == PRETRAINED:
        ids, vocab_size, tokenizer = tokenize(text, args.tokenizer)
        train_ids, blocks = split_corpus(ids, args.block_size)
        half = train_ids.numel() // 2
        if half <= args.block_size:
            raise UsageError(f"the dataset ({ids.numel()} tokens) is too small for --block-size {args.block_size}")
        data = {"pretrain": train_ids[:half], "train": train_ids[half:], "heldout_blocks": blocks,
                "gain_blocks": blocks[:GAIN_BLOCKS]}
        fingerprint = {"corpus": corpus, "tokenizer": tokenizer, "tokens": ids.numel(),
                       "checksum": int(ids.sum()) + 7 * int(ids[::97].sum())}
        model, pretraining = pretrain_source(args, data, vocab_size, fingerprint)
        name = f"pretrained {args.pretrain_layers}x{args.pretrain_hidden}"
        info = {"source": name, "pretraining": pretraining, "tokenizer": tokenizer, "pretrain_tokens": half,
                "train_tokens": train_ids.numel() - half, "heldout_tokens": ids.numel() - train_ids.numel()}
        return name, model, data, info
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise UsageError(f"--source {source}: cannot load a causal LM: {str(error).splitlines()[0]}") from None
    ids, vocab_size, tokenizer = tokenize(text, source)
    if vocab_size > model.config.vocab_size:
        raise UsageError(f"--source {source}: its tokenizer has {vocab_size} tokens, its model "
                         f"{model.config.vocab_size}")
    train_ids, blocks = split_corpus(ids, args.block_size)
    data = {"train": train_ids, "heldout_blocks": blocks, "gain_blocks": blocks[:GAIN_BLOCKS]}
    name = Path(source).name if Path(source).exists() else source
    info = {"source": source, "tokenizer": name, "train_tokens": train_ids.numel(),
            "heldout_tokens": ids.numel() - train_ids.numel()}
    return name, model, data, info


def check_source(source: str, args: argparse.Namespace, arms: list[str]) -> None:
    """What of a ``--source`` (not ``pretrained``) its config and files show, before anything is loaded or trained: a
    config that does not load, a family hf_mhc does not support (when an mHC arm is asked for: the project's own
    message, naming the supported ones), a ``--block-size`` beyond its positions, a folder without a tokenizer."""
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise UsageError(f"--source {source}: cannot load a causal LM: {str(error).splitlines()[0]}") from None
    if any(arm != BASELINE for arm in arms):
        try:
            check_backbone_type(config.model_type, config)
        except ValueError as error:
            raise UsageError(f"--source {source}: {error}") from None
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.block_size > positions:
        raise UsageError(f"--block-size {args.block_size} exceeds --source {source}'s {positions} positions")
    folder = Path(source)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"--source {source}: the folder has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "save the model's tokenizer into it (tokenizer.save_pretrained)")


def start_table(summary: dict[str, dict], source_loss: float) -> str:
    lines = [f"step-0 held-out loss (the source's: {source_loss:.6f}):", "| arm | step 0, per seed | max relative "
             "difference to the source |", "| --- | ---: | ---: |"]
    for arm, row in summary.items():
        starts = ", ".join(f"{value:.6f}" for value in row["start_heldout_loss"])
        lines.append(f"| {arm} | {starts} | {row['start_relative_difference']:.2e} |")
    return "\n".join(lines)


def default_sources() -> list[str]:
    return [str(STORIES260K), PRETRAINED] if STORIES260K.is_dir() else [PRETRAINED]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", action="append", metavar="PATH_OR_HUB_ID",
                        help="a causal LM of a supported family, or 'pretrained' (repeatable; default: "
                             "../shared/assets/stories260K when present, and pretrained)")
    parser.add_argument("--pretrain-layers", type=int, default=12)
    parser.add_argument("--pretrain-hidden", type=int, default=64)
    parser.add_argument("--pretrain-steps", type=int, default=200)
    parser.add_argument("--pretrain-lr", type=float, default=3e-3)
    parser.add_argument("--tokenizer", default="auto",
                        help="the pretrained source's: auto (stories260K when present, bytes otherwise), "
                             "stories260K or bytes")
    parser.add_argument("--cache-dir", type=Path, default=CACHE, help="where the pretrained source is cached")
    parser.add_argument("--dataset", metavar="GLOB", default=default_dataset(),
                        help="text files to train on (default: ../shared/assets/janeausten/*.txt when present, "
                             "Python's pydoc_data topics otherwise)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hc-lr", type=float, default=None, help="the HC parameters' rate (default: --lr)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="clip gradients to this norm (0: no clipping)")
    parser.add_argument("--seeds", type=int, default=3, help="repeat every arm on this many seeds")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--variants", default=",".join(ARMS), help=f"comma-separated arms, from {', '.join(ARMS)}")
    parser.add_argument("--hc-mult", type=int, default=4, help="streams of the mHC arms")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--chat", metavar="PROMPT", default=None,
                        help="after training, each arm of the first seed (and the source) answers PROMPT greedily "
                             "through the source's chat template (a --source whose tokenizer has one)")
    parser.add_argument("--chat-tokens", type=int, default=32, help="the longest --chat answer, in tokens")
    parser.add_argument("--plot", type=Path, metavar="PATH.png", default=None,
                        help="write the figure (held-out loss against step and time, composite gain) to PATH.png")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    args.source = list(dict.fromkeys(args.source or default_sources()))
    return args


def check_args(args: argparse.Namespace) -> list[str]:
    """Validate ``args``; return the arms."""
    for name in ("pretrain_layers", "pretrain_hidden", "pretrain_steps", "steps", "seeds", "batch_size",
                 "log_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_block_size(args.block_size)
    if args.pretrain_hidden % 32:
        raise UsageError(f"--pretrain-hidden must be a multiple of 32 (heads of 32), got {args.pretrain_hidden}")
    for name in ("lr", "hc_lr", "pretrain_lr"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    check_clip_and_plot(args.grad_clip, args.plot)
    if args.tokenizer not in ("auto", "stories260K", "bytes"):
        raise UsageError(f"--tokenizer must be auto, stories260K or bytes, got {args.tokenizer}")
    arms = list(dict.fromkeys(name.strip() for name in args.variants.split(",") if name.strip()))
    unknown = [name for name in arms if name not in ARMS]
    if unknown or not arms:
        raise UsageError(f"--variants: unknown arm {', '.join(unknown) or '(none given)'}; the arms are "
                         f"{', '.join(ARMS)}")
    check_streams("--hc-mult", args.hc_mult, arms)
    if args.chat is not None:
        if args.chat_tokens < 1:
            raise UsageError(f"--chat-tokens must be >= 1, got {args.chat_tokens}")
        from transformers import AutoTokenizer

        for source in args.source:
            try:
                template = source != PRETRAINED and AutoTokenizer.from_pretrained(source).chat_template
            except (OSError, ValueError) as error:
                raise UsageError(f"--chat: cannot load the tokenizer of {source}: {str(error).splitlines()[0]}"
                                 ) from None
            if not template:
                raise UsageError(f"--chat: the source {source} has no tokenizer with a chat template")
    return arms


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        arms = check_args(args)
        for source in args.source:
            if source != PRETRAINED:
                check_source(source, args, arms)
        text, corpus = load_text(args.dataset)
        sources = [load_source(source, args, text, corpus) for source in args.source]
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    seeds = list(range(args.seed, args.seed + args.seeds))
    schedule = Schedule(steps=args.steps, lr=args.lr, hc_lr=args.hc_lr, grad_clip=args.grad_clip,
                        batch_size=args.batch_size, block_size=args.block_size, log_every=args.log_every)
    results = {"command": " ".join(["benchmarks/upcycle_miniature.py", *(sys.argv[1:] if argv is None else argv)]),
               "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
                          if key not in ("json", "plot", "cache_dir")} | {"corpus": corpus,
                                                                          "threads": torch.get_num_threads()},
               "sources": {}}
    tables = []
    for name, source, data, info in sources:
        source_loss = held_out_loss(source, data["heldout_blocks"])
        progress(f"{name}: {info['train_tokens']} training / {info['heldout_tokens']} held-out tokens of {corpus}; "
                 f"held-out loss {source_loss:.4f}; arms {', '.join(arms)}; seeds {', '.join(map(str, seeds))}; "
                 f"{torch.get_num_threads()} CPU threads")
        by_seed, chat = {}, None
        for seed in seeds:
            models = build_arms(source, arms, args.hc_mult, seed)
            by_seed[seed] = train_arms(models, data, schedule, seed, f"{name}: seed {seed}")
            if args.chat is not None and seed == seeds[0]:
                progress(f"{name}: seed {seed}: chat answers")
                answers = chat_answers({"source": source, **models}, info["source"], args.chat, args.chat_tokens)
                chat = {"prompt": args.chat, "seed": seed, "answers": answers}
            del models
        runs = {arm: {str(seed): by_seed[seed][arm] for seed in seeds} for arm in arms}
        summary = summarize(runs)
        for arm, row in summary.items():
            starts = [run["heldout_loss"][0] for run in runs[arm].values()]
            row["start_heldout_loss"] = starts
            row["start_relative_difference"] = max(abs(start - source_loss) / abs(source_loss) for start in starts)
        results["sources"][name] = {**info, "source_heldout_loss": source_loss, "runs": runs, "summary": summary}
        if chat is not None:
            results["sources"][name]["chat"] = chat
            tables.append("\n".join([f"\n{name}: greedy answers to {args.chat!r} after training (seed {chat['seed']}):",
                                      "| model | answer |", "| --- | --- |",
                                      *(f"| {model} | {answer!r} |" for model, answer in chat["answers"].items())]))
        tables.append(summary_table(summary, f"\n{name}: final held-out loss after {args.steps} steps over "
                                             f"{len(seeds)} seeds (source's {source_loss:.3f}):"))
        tables.append(start_table(summary, source_loss))
    header = (f"upcycling in miniature: n = {args.hc_mult} streams, {args.steps} steps of {args.batch_size} x "
              f"{args.block_size} tokens of {corpus}, lr {args.lr:g} (HC {args.hc_lr or args.lr:g}), seeds "
              f"{', '.join(map(str, seeds))}, {torch.get_num_threads()} CPU threads")
    if args.plot is not None:
        plot_seeds({name: entry["runs"] for name, entry in results["sources"].items()}, args.plot, header)
    report("\n".join([header, *tables]), results, args.json)


if __name__ == "__main__":
    main()
