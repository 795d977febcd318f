"""What ``paper_miniature.py`` and ``upcycle_miniature.py`` share: the corpus and its held-out blocks, the optimiser
and schedule, the training loop that steps every arm in turn, the summary over seeds and the figure.

An *arm* is one model of a comparison (the residual baseline, an mHC variant, ...). :func:`train_arms` trains all
arms of one seed side by side: at every step each arm takes its step on the same batch, one after the other, so the
machine's load falls on all arms alike and their step times compare. Every ``log_every`` steps each arm records its
training loss (mean over the interval), its held-out loss (fixed held-out blocks), the largest gradient norm of the
interval (before clipping), the composite forward / backward gain of its residual maps
(``hf_mhc.diagnostics.stability_report``; 1 by definition for a residual model) and its training time so far (the
sum of its own step times; evaluation excluded).
"""

from __future__ import annotations

import functools
import glob
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from benchlib import progress
from transformers import LlamaConfig

from hf_mhc.configuration_mhc import MAX_HC_MULT
from hf_mhc.conversion.upcycle import is_hc_parameter
from hf_mhc.diagnostics import stability_report
from hf_mhc.mhc_reference import MAX_PERMUTATION_STREAMS

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES260K = ASSETS / "stories260K"
HELD_OUT_FRACTION = 0.1
HELD_OUT_BLOCKS = 16
GAIN_BLOCKS = 2
SPIKE_FACTOR = 2.0
SPIKE_WINDOW = 50
BASELINE = "residual"


class UsageError(ValueError):
    """Bad input: reported by the script as one ``SCRIPT: error: ...`` line."""


def check_clip_and_plot(grad_clip: float, plot: Path | None) -> None:
    """``UsageError`` for a ``--grad-clip`` that is not a norm >= 0 (0: no clipping), and for a ``--plot`` that is not
    a ``.png`` path or that matplotlib, absent, cannot draw."""
    if not (math.isfinite(grad_clip) and grad_clip >= 0):
        raise UsageError(f"--grad-clip must be a norm >= 0 (0: no clipping), got {grad_clip}")
    if plot is not None:
        if plot.suffix.lower() != ".png":
            raise UsageError(f"--plot {plot}: expected a .png path")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib") from None


def check_block_size(block_size: int) -> None:
    """``UsageError`` for a ``--block-size`` under 2: every token of a block is trained on the next one, and a block of
    one token has none (its loss would be the mean over no positions, NaN)."""
    if block_size < 2:
        raise UsageError(f"--block-size must be >= 2 (each token is trained on the next one), got {block_size}")


def check_streams(option: str, streams: int, arms: list[str]) -> None:
    """``UsageError`` unless the mHC arms can take ``streams`` streams: ``hc_mult`` from 1 to ``MAX_HC_MULT``, and
    at most ``MAX_PERMUTATION_STREAMS`` with the ``permutations`` arm. ``option`` is the script's name for it."""
    if not 1 <= streams <= MAX_HC_MULT:
        raise UsageError(f"{option} must be an integer from 1 to {MAX_HC_MULT} (MHCConfig's hc_mult), got {streams}")
    if "permutations" in arms and streams > MAX_PERMUTATION_STREAMS:
        raise UsageError(f"--variants permutations needs {option} <= {MAX_PERMUTATION_STREAMS}, got {streams}")


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
    """Token ids ``[N]`` (int64), the vocabulary size and the tokenizer's name. ``tokenizer``: ``"bytes"``,
    ``"auto"`` (stories260K's when ``../shared/assets/stories260K`` is present, bytes otherwise), ``"stories260K"``
    or a folder / Hub id that ``AutoTokenizer`` loads."""
    if tokenizer == "auto":
        tokenizer = "stories260K" if STORIES260K.is_dir() else "bytes"
    if tokenizer == "bytes":
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long(), 256, "bytes"
    name = tokenizer
    if tokenizer == "stories260K":
        if not STORIES260K.is_dir():
            raise UsageError(f"--tokenizer stories260K: {STORIES260K} is not present; use --tokenizer bytes")
        tokenizer = str(STORIES260K)
    ids, vocab_size = tokenize_with(text, str(Path(tokenizer).resolve()) if Path(tokenizer).exists() else tokenizer)
    return ids, vocab_size, name


@functools.lru_cache(maxsize=2)
def tokenize_with(text: str, tokenizer: str) -> tuple[torch.Tensor, int]:
    """``text`` tokenised by the tokenizer that ``AutoTokenizer`` loads from ``tokenizer`` (cached: two sources with
    one tokenizer tokenise the corpus once)."""
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load a tokenizer from {tokenizer}: {str(error).splitlines()[0]}") from None
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    if not ids and text.strip():
        raise UsageError(f"the tokenizer of {tokenizer} ({type(loaded).__name__}) turns the corpus into 0 tokens: "
                         "it has no vocabulary")
    return torch.tensor(ids, dtype=torch.long), len(loaded)


def held_out_blocks(ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """``HELD_OUT_BLOCKS`` evenly spaced blocks ``[HELD_OUT_BLOCKS, block_size]`` of ``ids``."""
    if ids.numel() < HELD_OUT_BLOCKS * block_size:
        raise UsageError(f"the held-out part ({ids.numel()} tokens) is too small for --block-size {block_size}")
    stride = (ids.numel() - block_size) // (HELD_OUT_BLOCKS - 1)
    return torch.stack([ids[i * stride:i * stride + block_size] for i in range(HELD_OUT_BLOCKS)])


def split_corpus(ids: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first 90 % of ``ids`` (training) and the held-out blocks of the last 10 %."""
    split = int(ids.numel() * (1 - HELD_OUT_FRACTION))
    if split <= block_size:
        raise UsageError(f"the dataset ({ids.numel()} tokens) is too small for --block-size {block_size}")
    return ids[:split], held_out_blocks(ids[split:], block_size)


def llama_config(layers: int, hidden: int, vocab_size: int, max_positions: int) -> LlamaConfig:
    """A deep, narrow Llama: ``hidden / 32`` heads of 32 (full multi-head attention), an MLP of ``8/3 * hidden``
    rounded up to a multiple of 32, RMSNorm eps 1e-5, untied embeddings. ``hidden`` must be a multiple of 32."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=32 * math.ceil(8 * hidden / 3 / 32),
        num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


@dataclass
class Schedule:
    """AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices), linear warm-up over the first 5 % of ``steps``, then
    cosine decay to 10 % of the rate; ``hc_lr`` (default ``lr``) for the HC parameters of an mHC model; gradients
    clipped to ``grad_clip`` (0: no clipping)."""

    steps: int
    lr: float
    hc_lr: float | None = None
    grad_clip: float = 1.0
    batch_size: int = 8
    block_size: int = 64
    log_every: int = 20

    def factor(self, step: int) -> float:
        """The multiple of the peak rate at ``step`` (counted from 1)."""
        warmup = max(1, self.steps // 20)
        if step <= warmup:
            return step / warmup
        fraction = (step - warmup) / max(1, self.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * fraction))

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                groups.setdefault((is_hc_parameter(name), parameter.dim() >= 2), []).append(parameter)
        hc_lr = self.lr if self.hc_lr is None else self.hc_lr
        return torch.optim.AdamW(
            [{"params": params, "weight_decay": 0.1 if matrix else 0.0, "peak_lr": hc_lr if hc else self.lr}
             for (hc, matrix), params in groups.items()], lr=self.lr, betas=(0.9, 0.95))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    loss = model(input_ids=blocks, labels=blocks, use_cache=False).loss.item()
    model.train(was_training)
    return loss


def composite_gains(model: torch.nn.Module, blocks: torch.Tensor) -> tuple[float, float]:
    if not hasattr(model.config, "hc_mult"):
        return 1.0, 1.0  # one stream carried by the identity: the residual map's gain is 1 by definition
    composite = stability_report(model, blocks)["composite"]
    return composite["forward_gain_max"], composite["backward_gain_max"]


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Trainable parameters, all and those of the HC maps."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return {"parameters": sum(p.numel() for _, p in named),
            "hc_parameters": sum(p.numel() for name, p in named if is_hc_parameter(name))}


class Arm:
    """One model in training: its optimiser, its curves and its per-step records."""

    def __init__(self, name: str, model: torch.nn.Module, schedule: Schedule):
        self.name, self.model, self.schedule = name, model.train(), schedule
        self.optimizer = schedule.optimizer(model)
        self.curves = {key: [] for key in ("step", "loss", "heldout_loss", "grad_norm", "train_seconds_at_log",
                                           "composite_forward_gain_max", "composite_backward_gain_max")}
        self.step_loss, self.step_grad_norm, self.step_seconds, self.spikes = [], [], [], []
        self.interval_losses, self.interval_norms = [], []
        self.diverged_at: int | None = None

    def step(self, step: int, batch: torch.Tensor) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["peak_lr"] * self.schedule.factor(step)
        start = time.perf_counter()
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        clip = self.schedule.grad_clip or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_seconds.append(time.perf_counter() - start)
        value = loss.item()
        if not math.isfinite(value):
            self.diverged_at = step
            return
        window = self.step_loss[-SPIKE_WINDOW:]
        if len(window) >= 10 and value > SPIKE_FACTOR * statistics.median(window):
            self.spikes.append({"step": step, "loss": value, "running_median": statistics.median(window)})
        self.step_loss.append(value)
        self.step_grad_norm.append(grad_norm)
        self.interval_losses.append(value)
        self.interval_norms.append(grad_norm)

    def log(self, step: int, data: dict[str, torch.Tensor]) -> None:
        forward, backward = composite_gains(self.model, data["gain_blocks"])
        curves = self.curves
        curves["step"].append(step)
        curves["loss"].append(statistics.fmean(self.interval_losses) if self.interval_losses else None)
        curves["heldout_loss"].append(held_out_loss(self.model, data["heldout_blocks"]))
        curves["grad_norm"].append(max(self.interval_norms) if self.interval_norms else None)
        curves["train_seconds_at_log"].append(sum(self.step_seconds))
        curves["composite_forward_gain_max"].append(forward)
        curves["composite_backward_gain_max"].append(backward)
        self.interval_losses.clear()
        self.interval_norms.clear()

    def result(self) -> dict:
        finished = self.diverged_at is None
        seconds = sum(self.step_seconds)
        tokens = len(self.step_loss) * self.schedule.batch_size * self.schedule.block_size
        return {
            **self.curves,
            "final_loss": self.curves["loss"][-1] if finished else None,
            "final_heldout_loss": self.curves["heldout_loss"][-1] if finished else None,
            "max_composite_forward_gain": max(self.curves["composite_forward_gain_max"]),
            "max_composite_backward_gain": max(self.curves["composite_backward_gain_max"]),
            "loss_spikes": self.spikes,
            "step_loss": self.step_loss,
            "step_grad_norm": self.step_grad_norm,
            "diverged_at_step": self.diverged_at,
            "median_step_ms": 1e3 * statistics.median(self.step_seconds),
            "train_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else None,
            **parameter_counts(self.model),
        }


def train_arms(models: dict[str, torch.nn.Module], data: dict[str, torch.Tensor], schedule: Schedule, seed: int,
               label: str) -> dict[str, dict]:
    """Train every model of ``models`` (arm name to model) on the same batches, drawn from ``data["train"]`` with
    ``seed``, one step of each arm in turn. Returns each arm's curves and summary numbers; an arm whose loss is not
    finite stops there (``diverged_at_step``), the others go on."""
    arms = [Arm(name, model, schedule) for name, model in models.items()]
    generator = torch.Generator().manual_seed(seed)
    train_ids = data["train"]
    for arm in arms:
        arm.log(0, data)
    for step in range(1, schedule.steps + 1):
        starts = torch.randint(0, train_ids.numel() - schedule.block_size, (schedule.batch_size,), generator=generator)
        batch = torch.stack([train_ids[start:start + schedule.block_size] for start in starts.tolist()])
        for arm in arms:
            if arm.diverged_at is not None:
                continue
            arm.step(step, batch)
            if arm.diverged_at is not None:
                progress(f"{label}: {arm.name}: step {step}: loss not finite: diverged, stopping this arm")
            elif step % schedule.log_every == 0 or step == schedule.steps:
                arm.log(step, data)
                curves = arm.curves
                progress(f"{label}: {arm.name}: step {step}/{schedule.steps}: loss {curves['loss'][-1]:.4f}, "
                         f"held-out {curves['heldout_loss'][-1]:.4f}, grad norm {curves['grad_norm'][-1]:.3g}, "
                         f"composite gain fwd {curves['composite_forward_gain_max'][-1]:.4g} bwd "
                         f"{curves['composite_backward_gain_max'][-1]:.4g}, "
                         f"{1e3 * statistics.median(arm.step_seconds):.0f} ms/step")
    return {arm.name: arm.result() for arm in arms}


def heldout_within(run: dict, seconds: float) -> float | None:
    """The held-out loss of ``run`` at its last logged point whose training time is at most ``seconds`` (no
    interpolation)."""
    within = [loss for loss, spent in zip(run["heldout_loss"], run["train_seconds_at_log"], strict=True)
              if spent <= seconds]
    return within[-1] if within else None


def spread(values: list[float | None]) -> dict:
    """Mean, min and max of the finite values, and how many there were."""
    finite = [value for value in values if value is not None and math.isfinite(value)]
    if not finite:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(finite), "min": min(finite), "max": max(finite), "n": len(finite)}


def summarize(runs: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per arm, over seeds: the final held-out loss, its paired difference to the residual arm of the same seed, the
    tokens-per-second ratio to that arm, and the held-out loss reached within that arm's training time (equal
    compute); each as mean, min, max and the number of seeds it has a value for."""
    baseline = runs.get(BASELINE, {})
    summary = {}
    for name, seeds in runs.items():
        final = {seed: run["final_heldout_loss"] for seed, run in seeds.items()}
        paired, ratio, equal_time = [], [], []
        for seed, run in seeds.items():
            reference = baseline.get(seed)
            if reference is None:
                continue
            if final[seed] is not None and reference["final_heldout_loss"] is not None:
                paired.append(final[seed] - reference["final_heldout_loss"])
            if run["tokens_per_second"] and reference["tokens_per_second"]:
                ratio.append(run["tokens_per_second"] / reference["tokens_per_second"])
            equal_time.append(heldout_within(run, reference["train_seconds"]))
        summary[name] = {
            "final_heldout_loss": spread(list(final.values())),
            "heldout_minus_residual": spread(paired),
            "tokens_per_second_ratio": spread(ratio),
            "heldout_within_residual_time": spread(equal_time),
            "diverged_seeds": [seed for seed, run in seeds.items() if run["diverged_at_step"] is not None],
            "parameters": next(iter(seeds.values()))["parameters"],
            "hc_parameters": next(iter(seeds.values()))["hc_parameters"],
        }
    return summary


def fmt(stats: dict, digits: int = 3) -> str:
    """``mean (min-max)`` of a :func:`spread`, or ``-``."""
    if stats["mean"] is None:
        return "-"
    return f"{stats['mean']:.{digits}f} ({stats['min']:.{digits}f} to {stats['max']:.{digits}f})"


def summary_table(summary: dict[str, dict], header: str) -> str:
    lines = [header, "| arm | held-out loss, mean (min to max) | minus residual, same seed | within residual's time | "
             "tokens/s vs residual | trainable parameters (HC) | diverged |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in summary.items():
        lines.append(f"| {name} | {fmt(row['final_heldout_loss'])} | {fmt(row['heldout_minus_residual'])} | "
                     f"{fmt(row['heldout_within_residual_time'])} | {fmt(row['tokens_per_second_ratio'], 2)} | "
                     f"{row['parameters']:,} ({row['hc_parameters']:,}) | {len(row['diverged_seeds'])} |")
    return "\n".join(lines)


def plot_seeds(panels: dict[str, dict[str, dict[str, dict]]], path: Path, title: str) -> None:
    """One row per panel (a title to ``runs[arm][seed]``): held-out loss against step (mean over seeds, min-max
    band), against the arm's training time (one line per seed), and the composite forward gain of the residual maps
    against step (one line per seed, log axis)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(18, 4.4 * len(panels)))
    axes = figure.subplots(len(panels), 3, squeeze=False)
    for (step_axis, time_axis, gain_axis), (panel, runs) in zip(axes, panels.items(), strict=True):
        for name, seeds in runs.items():
            logged = list(seeds.values())
            length = min(len(run["step"]) for run in logged)
            steps = logged[0]["step"][:length]
            columns = list(zip(*(run["heldout_loss"][:length] for run in logged), strict=True))
            line, = step_axis.plot(steps, [statistics.fmean(column) for column in columns], marker=".",
                                   label=f"{name} ({len(logged)} seeds)")
            step_axis.fill_between(steps, [min(column) for column in columns], [max(column) for column in columns],
                                   color=line.get_color(), alpha=0.2)
            for index, run in enumerate(logged):
                label = name if index == 0 else None
                time_axis.plot(run["train_seconds_at_log"], run["heldout_loss"], color=line.get_color(),
                               linewidth=0.8, marker=".", label=label)
                gain_axis.plot(run["step"], run["composite_forward_gain_max"], color=line.get_color(),
                               linewidth=0.8, label=label)
        step_axis.set_title(f"{panel}: held-out loss (mean, min-max band)")
        step_axis.set_xlabel("training step")
        time_axis.set_title(f"{panel}: held-out loss against training time (each seed)")
        time_axis.set_xlabel("the arm's training time (s; evaluation excluded)")
        for axis in (step_axis, time_axis):
            axis.set_ylabel("held-out cross-entropy (nats / token)")
        gain_axis.set_title(f"{panel}: composite forward gain of the residual maps (each seed)")
        gain_axis.set_xlabel("training step")
        gain_axis.set_ylabel("max absolute row sum over depth (max over tokens)")
        gain_axis.set_yscale("log")
        for axis in (step_axis, time_axis, gain_axis):
            axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    progress(f"figure written to {path}")
