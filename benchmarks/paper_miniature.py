"""The mHC paper in miniature: a residual Llama and one mHC model per residual-map variant, trained from scratch.

    .venv/bin/python benchmarks/paper_miniature.py [--layers 24] [--hidden 128] [--streams 4] \
        [--steps 200] [--variants residual,unconstrained,sinkhorn,permutations,identity] [--lr 3e-3] \
        [--lr-sweep 3e-3,1e-2,3e-2] [--batch-size 8] [--block-size 64] [--log-every 20] [--seed 0] \
        [--json PATH] [--plot PATH.png]

Every model trains on the same data, in the same order, from the same seed and for the same number of tokens:

- ``residual``: a plain ``LlamaForCausalLM`` (one residual stream), the baseline;
- ``unconstrained``, ``sinkhorn``, ``permutations``, ``identity``: ``hf_mhc.upcycle`` of that very model (same
  backbone weights at step 0) with ``hc_residual_map`` set to the variant: Hyper-Connections (no constraint on the
  residual mixing), mHC (Sinkhorn-projected, doubly stochastic), mHC-lite (a convex combination of permutations) and
  streams carried by the identity (only ``pre`` / ``post`` learned). All start out computing the residual model.

The model is a deep, narrow Llama: ``--layers`` x ``--hidden`` (defaults 24 x 128), ``hidden / 32`` heads of 32
(full multi-head attention), an MLP of ``8/3 * hidden`` rounded up to a multiple of 32 (352 for 128), RMSNorm eps 1e-5,
untied embeddings. Data: Jane Austen's novels from ``../shared/assets/janeausten`` beside the project when present,
Python's ``pydoc_data`` topics otherwise (``--dataset GLOB`` for other text files), tokenised with the stories260K
tokenizer (512 tokens, from ``../shared/assets/stories260K``) or bytes (256 tokens; ``--tokenizer``). The last 10 %
of the tokens are held out; training batches are random blocks of the first 90 %, drawn from ``--seed``.

Optimiser: AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices), linear warm-up over the first 5 % of the steps,
then cosine decay to 10 % of ``--lr``; gradients clipped to norm ``--grad-clip`` (default 1; 0 turns clipping off;
the norm logged is the one before clipping). Every ``--log-every`` steps it records the training loss (mean over the
interval), the held-out loss (16 fixed held-out blocks), the largest gradient norm of the interval and the composite
forward / backward gain of the residual maps the model applies (``hf_mhc.diagnostics.stability_report`` on 2 fixed
held-out blocks: max absolute row / column sum of the product of the maps over depth, max over tokens; the residual
baseline's residual map is the identity, so its gains are 1 by definition). A loss spike is a step whose loss
exceeds twice the median of the previous 50 steps' losses (from step 11 on); a non-finite loss ends that model's run
(``diverged_at_step``).

``--lr-sweep LR,LR,...`` repeats the whole comparison at each learning rate (the stress test: raise the rate until
the baseline and unconstrained HC diverge or spike). Progress goes to stderr, the table to stdout; the results are
written as JSON only with ``--json PATH`` and the figure (training loss, gradient norm, composite gain on a log axis;
one row of panels per learning rate) only with ``--plot PATH.png``.
"""

from __future__ import annotations

import argparse
import glob
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from benchlib import add_json_argument, progress, report
from transformers import LlamaConfig, LlamaForCausalLM

import hf_mhc
from hf_mhc.diagnostics import stability_report
from hf_mhc.mhc_reference import RESIDUAL_MAPS

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
BASELINE = "residual"
VARIANTS = (BASELINE, "unconstrained", "sinkhorn", "permutations", "identity")
HELD_OUT_FRACTION = 0.1
HELD_OUT_BLOCKS = 16
GAIN_BLOCKS = 2
SPIKE_FACTOR = 2.0
SPIKE_WINDOW = 50
PROG = "paper_miniature.py"


class UsageError(ValueError):
    """Bad input: reported as one ``paper_miniature.py: error: ...`` line."""


def default_dataset() -> str | None:
    folder = ASSETS / "janeausten"
    return str(folder / "*.txt") if folder.is_dir() else None


def load_text(pattern: str | None) -> tuple[str, str]:
    """The corpus and a description of it: the files matching ``pattern`` (sorted, joined by blank lines), or Python's
    ``pydoc_data`` topics when ``pattern`` is None."""
    if pattern is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics)), "pydoc_data.topics"
    files = sorted(glob.glob(str(Path(pattern).expanduser())))
    files = [path for path in files if Path(path).is_file()]
    if not files:
        raise UsageError(f"--dataset {pattern}: no file matches")
    text = "\n\n".join(Path(path).read_text(encoding="utf-8", errors="replace") for path in files)
    if not text.strip():
        raise UsageError(f"--dataset {pattern}: the files are empty")
    return text, f"{len(files)} files in {Path(files[0]).parent.name}/"


def tokenize(text: str, tokenizer: str) -> tuple[torch.Tensor, int, str]:
    """Token ids ``[N]`` (int64), the vocabulary size and the tokenizer's name."""
    folder = ASSETS / "stories260K"
    if tokenizer == "auto":
        tokenizer = "stories260K" if folder.is_dir() else "bytes"
    if tokenizer == "bytes":
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long(), 256, "bytes"
    if not folder.is_dir():
        raise UsageError(f"--tokenizer stories260K: {folder} is not present; use --tokenizer bytes")
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(folder)
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long), len(loaded), "stories260K"


def backbone_config(args: argparse.Namespace, vocab_size: int) -> LlamaConfig:
    if args.hidden % 32:
        raise UsageError(f"--hidden must be a multiple of 32 (heads of 32), got {args.hidden}")
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=32 * math.ceil(8 * args.hidden / 3 / 32),
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32, num_key_value_heads=args.hidden // 32,
        max_position_embeddings=args.block_size, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def build(variant: str, config: LlamaConfig, args: argparse.Namespace) -> torch.nn.Module:
    """The model of ``variant``: the residual Llama of ``--seed``, or its upcycled mHC with that residual map."""
    torch.manual_seed(args.seed)
    residual = LlamaForCausalLM(config)
    if variant == BASELINE:
        return residual
    return hf_mhc.upcycle(residual, hc_mult=args.streams, hc_residual_map=variant)


def lr_at(step: int, args: argparse.Namespace, lr: float) -> float:
    """Linear warm-up over 5 % of the steps, then cosine decay to 10 % of ``lr`` (``step`` counts from 1)."""
    warmup = max(1, args.steps // 20)
    if step <= warmup:
        return lr * step / warmup
    progress_fraction = (step - warmup) / max(1, args.steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress_fraction)))


def optimizer_for(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    loss = model(input_ids=blocks, labels=blocks, use_cache=False).loss.item()
    model.train(was_training)
    return loss


def composite_gains(model: torch.nn.Module, variant: str, blocks: torch.Tensor) -> tuple[float, float]:
    if variant == BASELINE:
        return 1.0, 1.0  # one stream carried by the identity: the residual map's gain is 1 by definition
    composite = stability_report(model, blocks)["composite"]
    return composite["forward_gain_max"], composite["backward_gain_max"]


def train(variant: str, config: LlamaConfig, data: dict[str, torch.Tensor], args: argparse.Namespace, lr: float,
          label: str) -> dict:
    """Train one model; return its curves (lists over the logged steps) and summary numbers."""
    model = build(variant, config, args).train()
    optimizer = optimizer_for(model, lr)
    generator = torch.Generator().manual_seed(args.seed)  # the same batches, in the same order, for every model
    train_ids = data["train"]
    curves = {key: [] for key in ("step", "loss", "held_out_loss", "grad_norm", "composite_forward_gain_max",
                                  "composite_backward_gain_max")}
    step_seconds, losses, norms, spikes, interval_losses, interval_norms = [], [], [], [], [], []
    diverged_at = None

    def log_point(step: int) -> None:
        forward, backward = composite_gains(model, variant, data["gain_blocks"])
        curves["step"].append(step)
        curves["loss"].append(statistics.fmean(interval_losses) if interval_losses else None)
        curves["held_out_loss"].append(held_out_loss(model, data["held_out_blocks"]))
        curves["grad_norm"].append(max(interval_norms) if interval_norms else None)
        curves["composite_forward_gain_max"].append(forward)
        curves["composite_backward_gain_max"].append(backward)
        interval_losses.clear()
        interval_norms.clear()
        if step:
            progress(f"{label}: step {step}/{args.steps}: loss {curves['loss'][-1]:.4f}, held-out "
                     f"{curves['held_out_loss'][-1]:.4f}, grad norm {curves['grad_norm'][-1]:.3g}, composite gain "
                     f"fwd {forward:.4g} bwd {backward:.4g}, {1e3 * statistics.median(step_seconds):.0f} ms/step")

    log_point(0)
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, train_ids.numel() - args.block_size, (args.batch_size,), generator=generator)
        batch = torch.stack([train_ids[start:start + args.block_size] for start in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args, lr)
        start_time = time.perf_counter()
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_seconds.append(time.perf_counter() - start_time)
        value = loss.item()
        if not math.isfinite(value):
            diverged_at = step
            progress(f"{label}: step {step}: loss {value}: diverged, stopping this run")
            break
        window = losses[-SPIKE_WINDOW:]
        if len(window) >= 10 and value > SPIKE_FACTOR * statistics.median(window):
            spikes.append({"step": step, "loss": value, "running_median": statistics.median(window)})
        losses.append(value)
        norms.append(grad_norm)
        interval_losses.append(value)
        interval_norms.append(grad_norm)
        if step % args.log_every == 0 or step == args.steps:
            log_point(step)
    finite = [value for value in curves["held_out_loss"] if math.isfinite(value)]
    return {
        **curves,
        "final_loss": curves["loss"][-1] if diverged_at is None else None,
        "final_held_out_loss": curves["held_out_loss"][-1] if diverged_at is None else None,
        "best_held_out_loss": min(finite) if finite else None,
        "max_composite_forward_gain": max(curves["composite_forward_gain_max"]),
        "max_composite_backward_gain": max(curves["composite_backward_gain_max"]),
        "loss_spikes": spikes,
        "step_loss": losses,
        "step_grad_norm": norms,
        "diverged_at_step": diverged_at,
        "median_step_ms": 1e3 * statistics.median(step_seconds),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def check_variants(text: str) -> list[str]:
    variants = [name.strip() for name in text.split(",") if name.strip()]
    known = (BASELINE, *RESIDUAL_MAPS)
    unknown = [name for name in variants if name not in known]
    if unknown or not variants:
        raise UsageError(f"--variants: unknown variant {', '.join(unknown) or '(none given)'}; the installed hf_mhc "
                         f"knows {', '.join(known)}")
    return list(dict.fromkeys(variants))


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(value) for value in text.split(",") if value.strip()]
    except ValueError:
        raise UsageError(f"--lr-sweep {text}: expected comma-separated learning rates, e.g. 3e-3,1e-2") from None
    if not rates or not all(math.isfinite(rate) and rate > 0 for rate in rates):
        raise UsageError(f"--lr-sweep {text}: expected positive learning rates, e.g. 3e-3,1e-2")
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", metavar="GLOB", default=default_dataset(),
                        help="text files to train on (default: ../shared/assets/janeausten/*.txt when present, "
                             "Python's pydoc_data topics otherwise)")
    parser.add_argument("--tokenizer", choices=("auto", "stories260K", "bytes"), default="auto",
                        help="auto: stories260K when ../shared/assets/stories260K is present, bytes otherwise")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--streams", type=int, default=4, help="hc_mult of the mHC models")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-sweep", metavar="LR,LR,...", default=None,
                        help="run the whole comparison at each of these learning rates (instead of --lr)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="clip gradients to this norm (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--plot", type=Path, metavar="PATH.png", default=None,
                        help="write the figure (loss, gradient norm, composite gain) to PATH.png")
    add_json_argument(parser)
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict]:
    text, source = load_text(args.dataset)
    ids, vocab_size, tokenizer = tokenize(text, args.tokenizer)
    split = int(ids.numel() * (1 - HELD_OUT_FRACTION))
    train_ids, held_out = ids[:split], ids[split:]
    if held_out.numel() < HELD_OUT_BLOCKS * args.block_size or train_ids.numel() <= args.block_size:
        raise UsageError(f"the dataset ({ids.numel()} tokens) is too small for --block-size {args.block_size}")
    stride = (held_out.numel() - args.block_size) // (HELD_OUT_BLOCKS - 1)
    blocks = torch.stack([held_out[i * stride:i * stride + args.block_size] for i in range(HELD_OUT_BLOCKS)])
    data = {"train": train_ids, "held_out_blocks": blocks, "gain_blocks": blocks[:GAIN_BLOCKS]}
    return data, {"dataset": source, "tokenizer": tokenizer, "vocab_size": vocab_size, "tokens": ids.numel(),
                  "train_tokens": train_ids.numel(), "held_out_tokens": held_out.numel()}


def check_args(args: argparse.Namespace) -> None:
    for name in ("layers", "hidden", "streams", "steps", "batch_size", "block_size", "log_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if not (math.isfinite(args.grad_clip) and args.grad_clip >= 0):
        raise UsageError(f"--grad-clip must be a norm >= 0 (0: no clipping), got {args.grad_clip}")
    if args.plot is not None:
        if args.plot.suffix.lower() != ".png":
            raise UsageError(f"--plot {args.plot}: expected a .png path")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib") from None


def table(runs: dict[str, dict[str, dict]], header: str) -> str:
    lines = [header, "| lr | variant | final loss | held-out loss | max composite gain (fwd / bwd) | loss spikes | "
             "ms / step |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for lr, variants in runs.items():
        for variant, run in variants.items():
            if run["diverged_at_step"] is not None:
                final, held_out = f"diverged at step {run['diverged_at_step']}", "-"
            else:
                final, held_out = f"{run['final_loss']:.3f}", f"{run['final_held_out_loss']:.3f}"
            gains = f"{run['max_composite_forward_gain']:.4g} / {run['max_composite_backward_gain']:.4g}"
            if variant == BASELINE:
                gains += " (by definition)"
            lines.append(f"| {lr} | {variant} | {final} | {held_out} | {gains} | {len(run['loss_spikes'])} | "
                         f"{run['median_step_ms']:.0f} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4.2 * len(runs)))
    axes = figure.subplots(len(runs), 3, squeeze=False)
    for row, (lr, variants) in zip(axes, runs.items(), strict=True):
        loss_axis, norm_axis, gain_axis = row
        for variant, run in variants.items():
            steps = range(1, len(run["step_loss"]) + 1)
            line, = loss_axis.plot(steps, run["step_loss"], linewidth=0.7, label=f"{variant} (train)")
            loss_axis.plot(run["step"], run["held_out_loss"], linestyle="--", marker=".", color=line.get_color(),
                           label=f"{variant} (held-out)")
            norm_axis.plot(steps, run["step_grad_norm"], linewidth=0.7, color=line.get_color(), label=variant)
            gain_axis.plot(run["step"], run["composite_forward_gain_max"], color=line.get_color(),
                           label=f"{variant} forward")
            gain_axis.plot(run["step"], run["composite_backward_gain_max"], color=line.get_color(), linestyle=":",
                           label=f"{variant} backward")
        loss_axis.set_title(f"loss, lr {lr}")
        loss_axis.set_ylabel("cross-entropy (nats / token)")
        norm_axis.set_title("gradient norm (before clipping)")
        norm_axis.set_ylabel("gradient norm")
        norm_axis.set_yscale("log")
        gain_axis.set_title("composite gain of the residual maps over depth")
        gain_axis.set_ylabel("max absolute row / column sum (max over tokens)")
        gain_axis.set_yscale("log")
        for axis in row:
            axis.set_xlabel("training step")
            axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    progress(f"figure written to {path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        check_args(args)
        variants = check_variants(args.variants)
        rates = parse_rates(args.lr_sweep) if args.lr_sweep is not None else [args.lr]
        data, data_info = prepare(args)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    config = backbone_config(args, data_info["vocab_size"])
    progress(f"data: {data_info['dataset']}, {data_info['tokenizer']} tokenizer, {data_info['train_tokens']} "
             f"training / {data_info['held_out_tokens']} held-out tokens; model: Llama {args.layers} x {args.hidden}, "
             f"{config.num_attention_heads} heads, MLP {config.intermediate_size}, n = {args.streams} streams; "
             f"{torch.get_num_threads()} CPU threads")
    runs: dict[str, dict[str, dict]] = {}
    for lr in rates:
        runs[f"{lr:g}"] = {}
        for variant in variants:
            runs[f"{lr:g}"][variant] = train(variant, config, data, args, lr, f"lr {lr:g}: {variant}")
    header = (f"paper in miniature: Llama {args.layers} layers x {args.hidden}, n = {args.streams} streams, "
              f"{args.steps} steps of {args.batch_size} x {args.block_size} tokens, {data_info['tokenizer']} tokens "
              f"of {data_info['dataset']}, seed {args.seed}, {torch.get_num_threads()} CPU threads")
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
                if key not in ("json", "plot")}
    results = {
        "command": " ".join(["benchmarks/paper_miniature.py", *(sys.argv[1:] if argv is None else argv)]),
        "config": settings | data_info | {"threads": torch.get_num_threads(), "heads": config.num_attention_heads,
                                          "intermediate_size": config.intermediate_size},
    }
    if args.lr_sweep is None:
        results["variants"] = runs[f"{rates[0]:g}"]
    else:
        results["sweep"] = {lr: {"variants": variant_runs} for lr, variant_runs in runs.items()}
    if args.plot is not None:
        plot(runs, args.plot, header)
    report(table(runs, header), results, args.json)


if __name__ == "__main__":
    main()
