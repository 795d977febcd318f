"""Time and peak memory of ``hf-mhc convert`` on a ~2 GB sharded Llama checkpoint, against copying the files.

The synthetic checkpoint (random bfloat16 weights, several safetensors shards with an index) is written tensor by
tensor into a temporary folder, never held in memory. ``--family llama`` (default) writes a Llama; ``--family
qwen3_moe`` a Qwen3-MoE in the layout transformers saves and the Hub publishes, one tensor per expert (the names and
shapes of ``save_pretrained``, taken from the model built on the meta device). Each measured command then runs in its
own child process (started by a small launcher), whose wall time and peak RSS (``ru_maxrss``) are recorded:

- ``copy``: ``shutil.copytree`` of the checkpoint folder (the baseline; data may still sit in the page cache);
- ``copy_fsync``: the same, then ``fsync`` of every copied file, which the conversion also does before its rename;
- ``convert``: the ``hf-mhc convert SRC OUT --no-verify`` console script (verification loads both models, which is
  not the streaming part being measured; the conversion fsyncs every weight file before renaming OUT into place);
- ``import``: a process that only imports ``hf_mhc.cli``, the fixed memory cost of torch + transformers.

Runs alternate copy / convert ``--repeats`` times; the medians are reported. Usage::

    .venv/bin/python benchmarks/bench_convert.py [--size-gb 2] [--repeats 3] [--json benchmarks/results/convert.json]
    .venv/bin/python benchmarks/bench_convert.py --family qwen3_moe --size-gb 1 [--json ...convert_moe.json]

Prints each command to stderr as it starts and each run's figures as it ends, then the table; the results are written
as JSON only with ``--json PATH`` (otherwise printed after the table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchlib import add_json_argument, progress, report
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedConfig, Qwen3MoeConfig
from transformers.core_model_loading import revert_weight_conversion

from hf_mhc.conversion.safetensors_stream import SafetensorsStreamWriter, TensorSpec

HF_MHC_SCRIPT = Path(sys.executable).with_name("hf-mhc")
SOURCE_SHARD_BYTES = 450 * 10**6


def synthetic_llama_config(size_gb: float) -> LlamaConfig:
    """A Llama config (hidden 2048, GQA 16/4 heads, untied) with enough layers for ``size_gb`` GB of bfloat16."""
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    config.architectures = ["LlamaForCausalLM"]
    per_layer = sum(math.prod(shape) for shape in layer_shapes(config).values())
    embeddings = 2 * config.vocab_size * config.hidden_size
    config.num_hidden_layers = max(1, round((size_gb * 1e9 / 2 - embeddings) / per_layer))
    return config


def layer_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    return {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (config.intermediate_size, hidden),
        "mlp.up_proj.weight": (config.intermediate_size, hidden),
        "mlp.down_proj.weight": (hidden, config.intermediate_size),
    }


def synthetic_qwen3_moe_config(size_gb: float) -> Qwen3MoeConfig:
    """A Qwen3-MoE config (hidden 1024, 32 experts of width 384, 4 active) with enough layers for ``size_gb`` GB."""
    config = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=384, num_experts=32,
        num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_hidden_layers=1,
        max_position_embeddings=2048, tie_word_embeddings=False, dtype="bfloat16",
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    specs = saved_layout_specs(config)
    embeddings = sum(spec.nbytes for spec in specs if ".layers." not in spec.name)
    config.num_hidden_layers = max(1, round((size_gb * 1e9 - embeddings) / (sum(s.nbytes for s in specs) - embeddings)))
    return config


def saved_layout_specs(config: PreTrainedConfig) -> list[TensorSpec]:
    """The tensors ``save_pretrained`` writes for ``config``, in bfloat16: MoE experts one tensor per expert."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = revert_weight_conversion(model, model.state_dict())
    return [TensorSpec(name, torch.bfloat16, tuple(tensor.shape)) for name, tensor in state.items()]


def checkpoint_specs(config: PreTrainedConfig) -> list[TensorSpec]:
    if config.model_type != "llama":
        return saved_layout_specs(config)
    specs = [TensorSpec("model.embed_tokens.weight", torch.bfloat16, (config.vocab_size, config.hidden_size))]
    for layer in range(config.num_hidden_layers):
        for name, shape in layer_shapes(config).items():
            specs.append(TensorSpec(f"model.layers.{layer}.{name}", torch.bfloat16, shape))
    specs.append(TensorSpec("model.norm.weight", torch.bfloat16, (config.hidden_size,)))
    specs.append(TensorSpec("lm_head.weight", torch.bfloat16, (config.vocab_size, config.hidden_size)))
    return specs


def write_synthetic_checkpoint(folder: Path, config: PreTrainedConfig) -> int:
    """Write ``config``'s checkpoint into ``folder`` in shards of about ``SOURCE_SHARD_BYTES``; returns its bytes."""
    shards: list[list[TensorSpec]] = [[]]
    for spec in checkpoint_specs(config):
        if shards[-1] and sum(s.nbytes for s in shards[-1]) + spec.nbytes > SOURCE_SHARD_BYTES:
            shards.append([])
        shards[-1].append(spec)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for number, specs in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        with SafetensorsStreamWriter(folder / file_name, specs, metadata={"format": "pt"}) as writer:
            for spec in specs:
                if spec.name.endswith("norm.weight"):
                    values = torch.ones(spec.shape, dtype=torch.bfloat16)
                else:
                    values = (torch.randn(spec.shape, generator=generator) * 0.02).to(torch.bfloat16)
                writer.write_tensor(spec.name, [values])
                weight_map[spec.name] = file_name
    total = sum(spec.nbytes for specs in shards for spec in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(folder)
    return total


# Runs argv[1:] and reports its wall time and peak RSS. A small launcher process, so that the measured child does not
# inherit this script's memory high-water mark through fork (ru_maxrss survives fork + exec).
LAUNCHER = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
child = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
seconds = time.perf_counter() - start
peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_rss_mb": peak_kib / 1024, "returncode": child.returncode,
                  "stderr": child.stderr.decode(errors="replace")[-2000:]}))
"""


COPY_FSYNC_CODE = """
import os, shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2])
for name in os.listdir(sys.argv[2]):
    with open(os.path.join(sys.argv[2], name), "rb+") as copied:
        os.fsync(copied.fileno())
"""


def measure(command: list[str]) -> dict[str, float]:
    """Wall seconds and peak RSS (MB, ``RUSAGE_CHILDREN.ru_maxrss``) of ``command`` in its own child process."""
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER, *command], capture_output=True, text=True, check=True)
    result = json.loads(launcher.stdout)
    if result["returncode"] != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result['returncode']}): {result['stderr']}")
    return {"seconds": result["seconds"], "peak_rss_mb": result["peak_rss_mb"]}


SYNTHETIC_CONFIGS = {"llama": synthetic_llama_config, "qwen3_moe": synthetic_qwen3_moe_config}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in GB (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command (default 3; medians reported)")
    parser.add_argument("--family", choices=sorted(SYNTHETIC_CONFIGS), default="llama",
                        help="llama (default) or qwen3_moe (MoE experts one tensor per expert, as published)")
    add_json_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run_benchmark(args)
    report(markdown_table(result), result, args.json)


def run_benchmark(args: argparse.Namespace) -> dict:
    """Write the synthetic checkpoint, time every command ``args.repeats`` times; the results (medians, ratios,
    every run, the machine)."""
    config = SYNTHETIC_CONFIGS[args.family](args.size_gb)
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        tmp_path = Path(tmp)
        source = tmp_path / "source"
        source.mkdir()
        started = time.perf_counter()
        progress(f"writing the synthetic checkpoint ({args.size_gb} GB) to {source}")
        source_bytes = write_synthetic_checkpoint(source, config)
        shard_sizes = [path.stat().st_size for path in source.glob("model-*.safetensors")]
        progress(f"wrote {source_bytes / 1e9:.2f} GB in {len(shard_sizes)} shards ({config.num_hidden_layers} layers) "
                 f"in {time.perf_counter() - started:.0f} s")

        runs: dict[str, list[dict[str, float]]] = {"copy": [], "copy_fsync": [], "convert": [], "import": []}
        copy_code = "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2])"
        for repeat in range(args.repeats):
            copy_out, convert_out = tmp_path / f"copy-{repeat}", tmp_path / f"mhc-{repeat}"
            commands = {
                "copy": [sys.executable, "-c", copy_code, str(source), str(copy_out)],
                "copy_fsync": [sys.executable, "-c", COPY_FSYNC_CODE, str(source), str(copy_out)],
                "convert": [str(HF_MHC_SCRIPT), "convert", str(source), str(convert_out), "--no-verify"],
                "import": [sys.executable, "-c", "import hf_mhc.cli"],
            }
            for name, command in commands.items():
                progress(f"repeat {repeat + 1}/{args.repeats}: {name}")
                runs[name].append(measure(command))
                if name == "copy":
                    shutil.rmtree(copy_out)
            output_bytes = sum(f.stat().st_size for f in convert_out.glob("*.safetensors"))
            shutil.rmtree(copy_out)
            shutil.rmtree(convert_out)
            progress(f"repeat {repeat + 1}/{args.repeats} done: " + "; ".join(
                f"{name} {r[-1]['seconds']:.1f} s / {r[-1]['peak_rss_mb']:.0f} MB" for name, r in runs.items()))

    median = {
        name: {key: statistics.median(run[key] for run in results) for key in results[0]}
        for name, results in runs.items()
    }
    return {
        "command": "hf-mhc convert SRC OUT --no-verify",
        "checkpoint": {
            "family": config.model_type,
            "dtype": "bfloat16",
            "layers": config.num_hidden_layers,
            "bytes": source_bytes,
            "source_shards": len(shard_sizes),
            "largest_source_shard_bytes": max(shard_sizes),
            "output_weight_bytes": output_bytes,
        },
        "repeats": args.repeats,
        "median": median,
        "ratio_convert_to_copy": {
            key: median["convert"][key] / median["copy"][key] for key in ("seconds", "peak_rss_mb")
        },
        "ratio_convert_to_copy_fsync_seconds": median["convert"]["seconds"] / median["copy_fsync"]["seconds"],
        "convert_rss_above_import_mb": median["convert"]["peak_rss_mb"] - median["import"]["peak_rss_mb"],
        "runs": runs,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }


def markdown_table(result: dict) -> str:
    median, ratio = result["median"], result["ratio_convert_to_copy"]
    checkpoint = result["checkpoint"]
    return "\n".join(
        [
            f"{checkpoint['family']} checkpoint, bfloat16, {checkpoint['bytes'] / 1e9:.2f} GB in "
            f"{checkpoint['source_shards']} shards "
            f"(medians of {result['repeats']} runs, each in a fresh process):",
            "",
            "| command | seconds | peak RSS (MB) |",
            "|---|---:|---:|",
            f"| `shutil.copytree` (baseline) | {median['copy']['seconds']:.1f} | {median['copy']['peak_rss_mb']:.0f} |",
            f"| `shutil.copytree` + fsync | {median['copy_fsync']['seconds']:.1f} "
            f"| {median['copy_fsync']['peak_rss_mb']:.0f} |",
            f"| `hf-mhc convert --no-verify` | {median['convert']['seconds']:.1f} "
            f"| {median['convert']['peak_rss_mb']:.0f} |",
            f"| ratio convert / copy | {ratio['seconds']:.1f}x | {ratio['peak_rss_mb']:.1f}x |",
            f"| ratio convert / (copy + fsync) | {result['ratio_convert_to_copy_fsync_seconds']:.1f}x | |",
            f"| `import hf_mhc.cli` only | {median['import']['seconds']:.1f} | {median['import']['peak_rss_mb']:.0f} |",
            "",
            f"Peak RSS of the conversion above the import baseline: {result['convert_rss_above_import_mb']:.0f} MB "
            f"(largest source shard {checkpoint['largest_source_shard_bytes'] / 1e6:.0f} MB). The conversion's "
            f"time includes {median['import']['seconds']:.1f} s of importing torch and transformers.",
        ]
    )


if __name__ == "__main__":
    main()
