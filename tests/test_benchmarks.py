"""The benchmark scripts print progress, and write their results only to the ``--json PATH`` they are given.

The scripts run in this process at their smallest sizes (a few seconds in all). ``bench_upcycle`` and
``bench_convert`` measure child processes (each imports torch) and a 2 GB checkpoint: there the measurement and the
checkpoint writer are replaced by stand-ins, and the rest of the script runs as it is. ``bench_pipeline`` starts its
two gloo ranks (child processes) for real once: the second run of a test reuses the ranks' results of the first.
``bench_serve`` starts its two ``hf-mhc serve`` processes for real, in each run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import STORIES260K, import_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = ["bench_kernels", "bench_memory", "bench_training_step", "bench_upcycle", "bench_convert", "bench_kv_cache",
           "bench_pipeline", "paper_miniature", "bench_generate", "bench_serve"]
TINY = {
    "bench_kernels": ["--n", "2", "--hidden", "16", "--tokens", "8", "--repeats", "1", "--device", "cpu"],
    "bench_memory": ["--n", "2", "--hidden", "128", "--layers", "1", "--tokens", "16"],
    "bench_training_step": ["--n", "2", "--hidden", "128", "--layers", "1", "--tokens", "16", "--repeats", "1",
                            "--device", "cpu"],
    "bench_upcycle": ["--repeats", "1"],
    "bench_convert": ["--repeats", "1"],
    "bench_kv_cache": ["--tiny", "--models", "dense", "--prompts", "1", "--new-tokens", "2", "--context", "16"],
    "bench_pipeline": ["--hidden", "64", "--layers", "2", "--tokens", "8", "--batch", "2", "--microbatches", "2",
                       "--repeats", "1", "--threads", "1"],
    "paper_miniature": ["--steps", "3", "--layers", "2", "--hidden", "32", "--batch-size", "2", "--block-size", "16",
                        "--log-every", "2", "--tokenizer", "bytes"],
    "bench_generate": ["--hidden", "64", "--batch", "1", "--layers", "1", "--vocab", "128", "--new-tokens", "2",
                       "--prompt", "4", "--repeats", "1"],
    "bench_serve": ["--hidden", "64", "--layers", "1", "--modes", "continuous-batching", "--concurrency", "2",
                    "--requests-per-client", "1", "--new-tokens", "2", "--prompt", "2", "--repeats", "1"],
}
PROGRESS = {
    "bench_kernels": "repeat 1/1: ",
    "bench_memory": "case 6/6: residual Llama, gradient checkpointing",
    "bench_training_step": "repeat 1/1: ",
    "bench_upcycle": "repeat 1/1: hf_mhc.upcycle",
    "bench_convert": "repeat 1/1: convert",
    "bench_kv_cache": "dense: cache 6/6: fp8: prompt 1/1",
    "bench_pipeline": "repeat 1/1: residual Llama",
    "paper_miniature": "lr 0.003: identity: step 3/3",
    "bench_generate": "case 1/1: C=64 batch=1: repeat 1/1",
    "bench_serve": "mode 1/1: continuous-batching: concurrency 2: repeat 1/1",
}


@pytest.fixture
def load(monkeypatch):
    """Import a script from ``benchmarks/`` as a module (its folder on ``sys.path``, as when it runs)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))

    return lambda name: import_script(BENCHMARKS / f"{name}.py")


def stand_ins(module, name: str, monkeypatch) -> None:
    """No child processes and no 2 GB checkpoint for the two scripts that need them."""
    if name == "bench_upcycle":
        monkeypatch.setattr(module, "measure", lambda step, layers, hidden: {
            "seconds": 1.5, "peak_rss_above_source_mib": 10.0, "source_mib": 100.0})
    if name == "bench_convert":
        def write_checkpoint(folder: Path, config) -> int:
            (folder / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
            return 64

        def measure(command: list[str]) -> dict[str, float]:
            if "convert" in command:  # hf-mhc convert SRC OUT
                Path(command[command.index("convert") + 2]).mkdir()
            elif "copytree" in command[2]:  # python -c CODE SRC OUT
                Path(command[-1]).mkdir()
            return {"seconds": 2.0, "peak_rss_mb": 300.0}

        monkeypatch.setattr(module, "write_synthetic_checkpoint", write_checkpoint)
        monkeypatch.setattr(module, "measure", measure)
    if name == "bench_pipeline":
        ranks_results = {}

        def run_ranks_once(argv: list[str], threads: int) -> dict:
            if not ranks_results:
                ranks_results.update(run_ranks(argv, threads))
            return ranks_results

        run_ranks = module.run_ranks
        monkeypatch.setattr(module, "run_ranks", run_ranks_once)


def files_under(folder: Path) -> dict[str, int]:
    return {str(path.relative_to(folder)): path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_takes_json_and_has_no_default_output(load, name):
    args = load(name).parse_args([])
    assert args.json is None
    assert load(name).parse_args(["--json", "out/results.json"]).json == Path("out/results.json")


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_run_prints_progress_and_writes_results_only_with_json(load, name, tmp_path, monkeypatch, capsys):
    if name == "bench_serve" and not STORIES260K.is_dir():
        pytest.skip("bench_serve serves models with ../shared/assets/stories260K's tokenizer")
    committed = files_under(BENCHMARKS / "results")
    monkeypatch.chdir(tmp_path)
    module = load(name)
    stand_ins(module, name, monkeypatch)

    module.main(TINY[name])
    out, err = capsys.readouterr()
    assert files_under(tmp_path) == {} and files_under(BENCHMARKS / "results") == committed
    assert PROGRESS[name] in err
    table, printed = out.split("results (not written; pass --json PATH to save them):")
    assert "|---" in table.replace(" ", "")
    assert json.loads(printed)

    module.main([*TINY[name], "--json", "out/results.json"])
    out, err = capsys.readouterr()
    assert list(files_under(tmp_path)) == ["out/results.json"]
    assert files_under(BENCHMARKS / "results") == committed
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written.keys() == json.loads(printed).keys()
    assert "results written to out/results.json" in err and "not written" not in out


def test_the_synthetic_moe_checkpoint_has_the_layout_save_pretrained_writes(load, tmp_path):
    """bench_convert's Qwen3-MoE checkpoint: the names and shapes a real model's ``save_pretrained`` writes (one
    tensor per expert), the layout ``hf-mhc convert`` streams."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    module = load("bench_convert")
    config = module.synthetic_qwen3_moe_config(0.0)
    config.update(dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                       num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       num_hidden_layers=2))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        layout = {name: tuple(saved.get_slice(name).get_shape()) for name in saved.keys()}
    specs = {spec.name: spec.shape for spec in module.saved_layout_specs(config)}
    assert specs == layout and any(".experts.3." in name for name in specs)
    assert {spec.dtype for spec in module.saved_layout_specs(config)} == {torch.bfloat16}


def test_paper_miniature_records_every_variant_and_rejects_unknown_ones(load, tmp_path, capsys):
    module = load("paper_miniature")
    module.main([*TINY["paper_miniature"], "--json", str(tmp_path / "run.json"), "--plot", str(tmp_path / "run.png")])
    results = json.loads((tmp_path / "run.json").read_text())
    assert list(results["variants"]) == ["residual", "unconstrained", "sinkhorn", "permutations", "identity"]
    for name, run in results["variants"].items():
        assert run["step"] == [0, 2, 3] and len(run["step_loss"]) == 3, name
        for key in ("loss", "held_out_loss", "grad_norm", "composite_forward_gain_max", "composite_backward_gain_max"):
            assert len(run[key]) == 3, (name, key)
    assert results["variants"]["residual"]["composite_forward_gain_max"] == [1.0, 1.0, 1.0]
    assert results["variants"]["identity"]["composite_backward_gain_max"] == [1.0, 1.0, 1.0]
    # Same seed, same data, function-preserving start: every model starts from the residual model's held-out loss.
    start = {name: run["held_out_loss"][0] for name, run in results["variants"].items()}
    assert max(start.values()) - min(start.values()) < 1e-4
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        module.main([*TINY["paper_miniature"], "--variants", "residual,hyper"])
    err = capsys.readouterr().err
    assert err.startswith("paper_miniature.py: error: --variants: unknown variant hyper;") and err.count("\n") == 1
