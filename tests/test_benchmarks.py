"""The benchmark scripts print progress, and write their results only to the ``--json PATH`` they are given.

The scripts run in this process at their smallest sizes (a few seconds in all). ``bench_upcycle`` and
``bench_convert`` measure child processes (each imports torch) and a 2 GB checkpoint: there the measurement and the
checkpoint writer are replaced by stand-ins, and the rest of the script runs as it is. ``bench_pipeline`` starts its
two gloo ranks (child processes) for real once: the second run of a test reuses the ranks' results of the first.
``bench_serve`` starts its two ``hf-mhc serve`` processes for real, in each run. ``bench_real_model`` runs on a tiny
Llama folder with the byte tokenizer and a chat template, its ``hf-mhc convert`` and copy in this process.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, JANEAUSTEN, STORIES260K, import_script, tiny_backbone_config

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = ["bench_kernels", "bench_memory", "bench_training_step", "bench_upcycle", "bench_convert", "bench_kv_cache",
           "bench_pipeline", "paper_miniature", "upcycle_miniature", "bench_generate",
           "bench_serve", "bench_real_model"]
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
                        "--log-every", "2", "--tokenizer", "bytes", "--seeds", "2"],
    "upcycle_miniature": ["--source", "pretrained", "--pretrain-layers", "2", "--pretrain-hidden", "32",
                          "--pretrain-steps", "2", "--tokenizer", "bytes", "--steps", "3", "--seeds", "2",
                          "--log-every", "2", "--batch-size", "2", "--block-size", "16", "--variants",
                          "residual,sinkhorn,naive"],
    "bench_generate": ["--hidden", "64", "--batch", "1", "--layers", "1", "--vocab", "128", "--new-tokens", "2",
                       "--prompt", "4", "--repeats", "1"],
    "bench_serve": ["--hidden", "64", "--layers", "1", "--modes", "continuous-batching", "--concurrency", "2",
                    "--requests-per-client", "1", "--new-tokens", "2", "--prompt", "2", "--repeats", "1"],
    "bench_real_model": ["--only", "decode", "memory", "--repeats", "1", "--new-tokens", "2", "--tokens", "8"],
}
PROGRESS = {
    "bench_kernels": "repeat 1/1: ",
    "bench_memory": "case 6/6: residual Llama, gradient checkpointing",
    "bench_training_step": "repeat 1/1: ",
    "bench_upcycle": "repeat 1/1: hf_mhc.upcycle",
    "bench_convert": "repeat 1/1: convert",
    "bench_kv_cache": "dense: cache 6/6: fp8: prompt 1/1",
    "bench_pipeline": "repeat 1/1: residual Llama",
    "paper_miniature": "lr 0.003: seed 1: identity: step 3/3",
    "upcycle_miniature": "pretrained 2x32: seed 1: naive: step 3/3",
    "bench_generate": "case 1/1: C=64 batch=1: repeat 1/1",
    "bench_serve": "mode 1/1: continuous-batching: concurrency 2: repeat 1/1",
    "bench_real_model": "decode, dynamic cache: repeat 1/1: ",
}


@pytest.fixture
def load(monkeypatch):
    """Import a script from ``benchmarks/`` as a module (its folder on ``sys.path``, as when it runs)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))

    return lambda name: import_script(BENCHMARKS / f"{name}.py")


def stand_ins(module, name: str, monkeypatch, scratch: Path) -> None:
    """No child processes and no 2 GB checkpoint for the two scripts that need them; ``upcycle_miniature`` caches its
    pretrained source in ``scratch``."""
    if name == "upcycle_miniature":
        monkeypatch.setattr(module, "CACHE", scratch)
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
    if name == "bench_real_model":  # its default model: a tiny Llama folder instead of make real-model's
        monkeypatch.setattr(module, "real_model_folder", lambda: save_tiny_chat_llama(scratch / "tiny-llama"))
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
def test_a_run_prints_progress_and_writes_results_only_with_json(load, name, tmp_path, tmp_path_factory, monkeypatch,
                                                                capsys):
    if name == "bench_serve" and not STORIES260K.is_dir():
        pytest.skip("bench_serve serves models with ../shared/assets/stories260K's tokenizer")
    committed = files_under(BENCHMARKS / "results")
    monkeypatch.chdir(tmp_path)
    module = load(name)
    stand_ins(module, name, monkeypatch, tmp_path_factory.mktemp("cache"))

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


def check_summary(runs: dict, summary: dict) -> None:
    """``summary[arm]`` against the runs: the mean and extremes over seeds of the final held-out loss, of its
    difference to the residual run of the same seed, of the tokens-per-second ratio to it and of the held-out loss at
    the last logged point within the residual run's training time."""
    def expected(values):
        return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}

    def within(run, seconds):
        logged = zip(run["heldout_loss"], run["train_seconds_at_log"], strict=True)
        return [loss for loss, spent in logged if spent <= seconds][-1]

    assert list(summary) == list(runs)
    for arm, seeds in runs.items():
        baseline = runs["residual"]
        rows = {
            "final_heldout_loss": [run["final_heldout_loss"] for run in seeds.values()],
            "heldout_minus_residual": [run["final_heldout_loss"] - baseline[seed]["final_heldout_loss"]
                                       for seed, run in seeds.items()],
            "tokens_per_second_ratio": [run["tokens_per_second"] / baseline[seed]["tokens_per_second"]
                                        for seed, run in seeds.items()],
            "heldout_within_residual_time": [within(run, baseline[seed]["train_seconds"])
                                             for seed, run in seeds.items()],
        }
        for key, values in rows.items():
            assert summary[arm][key] == pytest.approx(expected(values), rel=1e-12, abs=1e-12), (arm, key)


def test_paper_miniature_records_every_variant_on_every_seed_and_rejects_unknown_ones(load, tmp_path, capsys):
    module = load("paper_miniature")
    module.main([*TINY["paper_miniature"], "--json", str(tmp_path / "run.json"), "--plot", str(tmp_path / "run.png")])
    results = json.loads((tmp_path / "run.json").read_text())
    runs = results["runs"]
    assert list(runs) == ["residual", "unconstrained", "sinkhorn", "permutations", "identity"]
    for name, seeds in runs.items():
        assert list(seeds) == ["0", "1"], name
        for run in seeds.values():
            assert run["step"] == [0, 2, 3] and len(run["step_loss"]) == 3, name
            for key in ("loss", "heldout_loss", "grad_norm", "train_seconds_at_log", "composite_forward_gain_max",
                        "composite_backward_gain_max"):
                assert len(run[key]) == 3, (name, key)
        # another seed: another initialisation and other batches
        assert seeds["0"]["heldout_loss"][0] != seeds["1"]["heldout_loss"][0], name
        assert seeds["0"]["step_loss"] != seeds["1"]["step_loss"], name
    assert runs["residual"]["0"]["composite_forward_gain_max"] == [1.0, 1.0, 1.0]
    assert runs["identity"]["1"]["composite_backward_gain_max"] == [1.0, 1.0, 1.0]
    # Same seed, same data, function-preserving start: every model starts from the residual model's held-out loss.
    for seed in ("0", "1"):
        start = [seeds[seed]["heldout_loss"][0] for seeds in runs.values()]
        assert max(start) - min(start) < 1e-4 * start[0], seed
    check_summary(runs, results["summary"])
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        module.main([*TINY["paper_miniature"], "--variants", "residual,hyper"])
    err = capsys.readouterr().err
    assert err.startswith("paper_miniature.py: error: --variants: unknown variant hyper;") and err.count("\n") == 1


def test_upcycle_miniature_arms_start_where_they_should(load, tmp_path, capsys):
    """Every function-preserving arm starts at its source's held-out loss (within 1e-4 relative) and the naive
    conversion does not start exactly there; seeds differ; the summary is the mean and extremes of the runs. Sources:
    the real stories260K on a slice of Jane Austen when ../shared/assets is present, and the script's own pretrained
    one. DeepSeek-V4's HC initialisation (the naive arm) shifts a pre-norm model's held-out loss only a little
    (4e-5 to 2.5e-3 relative in the runs of this test's sizes), so the naive bound is 1e-6 relative: 15 times the
    largest step-0 difference of a function-preserving arm measured here (6e-8, float32 rounding)."""
    module = load("upcycle_miniature")
    dataset = []
    sources = ["pretrained"]
    if STORIES260K.is_dir() and JANEAUSTEN.is_dir():
        (tmp_path / "emma.txt").write_text((JANEAUSTEN / "emma.txt").read_text(encoding="utf-8")[:60_000])
        dataset = ["--dataset", str(tmp_path / "emma.txt")]
        sources = [str(STORIES260K), "pretrained"]
    arms = "residual,sinkhorn,unconstrained,identity,permutations,naive"
    module.main([*TINY["upcycle_miniature"], "--variants", arms, *dataset,
                 *[arg for source in sources for arg in ("--source", source)],
                 "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "run.json"),
                 "--plot", str(tmp_path / "run.png")])
    results = json.loads((tmp_path / "run.json").read_text())
    assert len(results["sources"]) == len(sources)
    assert list((tmp_path / "cache").glob("pretrained-2x32-*/model.safetensors"))
    for name, source in results["sources"].items():
        runs, source_loss = source["runs"], source["source_heldout_loss"]
        assert list(runs) == ["residual", "sinkhorn", "unconstrained", "identity", "permutations", "naive"], name
        for arm, seeds in runs.items():
            assert list(seeds) == ["0", "1"], (name, arm)
            for run in seeds.values():
                assert run["step"] == [0, 2, 3] and len(run["loss"]) == len(run["heldout_loss"]) == 3, (name, arm)
                start = abs(run["heldout_loss"][0] - source_loss) / source_loss
                if arm == "naive":
                    assert start > 1e-6, (name, arm, start)
                else:
                    assert start <= 1e-4, (name, arm, start)
            assert seeds["0"]["step_loss"] != seeds["1"]["step_loss"], (name, arm)  # other batches
        assert runs["naive"]["0"]["heldout_loss"][0] != runs["naive"]["1"]["heldout_loss"][0]  # another init
        hc = {arm: seeds["0"]["hc_parameters"] for arm, seeds in runs.items()}
        assert hc["residual"] == 0 and hc["naive"] == hc["sinkhorn"] > 0, hc
        check_summary(runs, source["summary"])
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        module.main([*TINY["upcycle_miniature"], "--variants", "residual,hyper"])
    err = capsys.readouterr().err
    assert err.startswith("upcycle_miniature.py: error: --variants: unknown arm hyper;") and err.count("\n") == 1


def usage_error(module, argv: list[str], capsys) -> str:
    """The one ``SCRIPT: error: ...`` line of a run of ``module.main(argv)`` that ends with exit status 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    lines = err.splitlines()
    assert lines and lines[-1].startswith(f"{module.PROG}: error: "), err
    return lines[-1].removeprefix(f"{module.PROG}: error: ")


def no_work(module, monkeypatch) -> None:
    """Fail the test if the script reads its corpus, the first thing it does after checking its arguments."""
    def load_text(pattern):
        raise AssertionError(f"the corpus was read ({pattern}): the arguments were not checked first")

    monkeypatch.setattr(module, "load_text", load_text)


@pytest.mark.parametrize(("name", "args", "message"), [
    ("paper_miniature", ["--block-size", "1"], "--block-size must be >= 2 (each token is trained on the next one), "
                                               "got 1"),
    ("upcycle_miniature", ["--block-size", "1"], "--block-size must be >= 2 (each token is trained on the next "
                                                 "one), got 1"),
    ("paper_miniature", ["--streams", "9"], "--streams must be an integer from 1 to 8 (MHCConfig's hc_mult), got 9"),
    ("paper_miniature", ["--streams", "0"], "--streams must be an integer from 1 to 8 (MHCConfig's hc_mult), got 0"),
    ("paper_miniature", ["--streams", "5"], "--variants permutations needs --streams <= 4, got 5"),
    ("upcycle_miniature", ["--hc-mult", "9", "--variants", "residual,sinkhorn"],
     "--hc-mult must be an integer from 1 to 8 (MHCConfig's hc_mult), got 9"),
    ("upcycle_miniature", ["--hc-mult", "5", "--variants", "residual,permutations"],
     "--variants permutations needs --hc-mult <= 4, got 5"),
])
def test_the_miniatures_refuse_a_block_size_or_stream_count_they_cannot_train_before_any_work(
        load, monkeypatch, capsys, name, args, message):
    """A block of one token has no next token (the losses were NaN, the exit status 0); hc_mult is 1 to 8 (9 was a
    traceback from MHCConfig), and permutations takes at most 4 streams."""
    module = load(name)
    no_work(module, monkeypatch)
    assert usage_error(module, [*TINY[name], *args], capsys) == message


def save_gpt2(folder: Path, tokenizer_config: dict | None = None) -> None:
    """A tiny GPT-2 (a family hf_mhc does not support) saved to ``folder``, without a tokenizer unless
    ``tokenizer_config`` (written as its ``tokenizer_config.json``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def test_upcycle_miniature_names_an_unsupported_family_or_a_folder_without_a_tokenizer_in_one_line(
        load, tmp_path, monkeypatch, capsys):
    """Checked from the source's config and files before the corpus is read: an unsupported family was a traceback
    from hf_mhc.upcycle after the source's held-out loss, and a folder without a tokenizer 'the dataset (0 tokens)
    is too small'."""
    from conftest import save_source

    from hf_mhc import SUPPORTED_BACKBONES

    module = load("upcycle_miniature")
    no_work(module, monkeypatch)
    gpt2, llama = tmp_path / "gpt2", tmp_path / "llama"
    save_gpt2(gpt2)
    save_source(llama)
    tiny = [*TINY["upcycle_miniature"][2:], "--cache-dir", str(tmp_path / "cache")]  # without --source pretrained
    assert usage_error(module, [*tiny, "--source", str(gpt2)], capsys) == (
        f"--source {gpt2}: Unsupported mHC backbone 'gpt2' (no wiring entry for this family); supported backbone "
        f"families: {', '.join(SUPPORTED_BACKBONES)}.")
    no_tokenizer = ("the folder has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
                    "vocab.json, vocab.txt, spiece.model); save the model's tokenizer into it "
                    "(tokenizer.save_pretrained)")
    # the residual arm alone trains any causal LM: then the missing tokenizer is what stops it
    assert usage_error(module, [*tiny, "--source", str(gpt2), "--variants", "residual"], capsys) == (
        f"--source {gpt2}: {no_tokenizer}")
    assert usage_error(module, [*tiny, "--source", str(llama)], capsys) == f"--source {llama}: {no_tokenizer}"
    assert not (tmp_path / "cache").exists()


def test_a_tokenizer_without_a_vocabulary_is_named_not_taken_for_a_small_dataset(load, tmp_path, capsys):
    """A tokenizer_config.json naming a tokenizer class, with no vocabulary beside it: transformers loads an empty
    tokenizer, which turns any text into 0 tokens."""
    module = load("upcycle_miniature")
    source = tmp_path / "gpt2"
    save_gpt2(source, {"tokenizer_class": "GPT2Tokenizer"})
    (tmp_path / "corpus.txt").write_text("It is a truth universally acknowledged.\n" * 50)
    message = usage_error(module, [*TINY["upcycle_miniature"][2:], "--source", str(source), "--variants", "residual",
                                   "--dataset", str(tmp_path / "corpus.txt")], capsys)
    assert message == (f"the tokenizer of {source.resolve()} (GPT2Tokenizer) turns the corpus into 0 tokens: it has "
                       "no vocabulary")


def save_tiny_chat_llama(folder: Path) -> Path:
    """A 2-layer Llama with tied embeddings (as SmolLM2) over the byte tokenizer, which gets a one-line chat template,
    saved to ``folder`` (once); ``initializer_range=0.2`` gives logits of a few units, so the greedy tokens of the
    source and its upcycle agree for a reason."""
    from transformers import AutoModelForCausalLM

    if (folder / "config.json").is_file():
        return folder
    tokenizer = import_script(EXAMPLES / "fsdp2_finetune.py").byte_tokenizer()
    tokenizer.chat_template = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    config = tiny_backbone_config("llama", vocab_size=len(tokenizer), tie_word_embeddings=True,
                                  initializer_range=0.2)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def copy_or_convert_here(command: list[str]) -> dict[str, float]:
    """``bench_convert.measure`` in this process: ``hf-mhc convert ...`` through the CLI's ``main``, the copy
    (``python -c CODE SRC OUT``) with ``shutil.copytree``; the seconds, no peak RSS."""
    from hf_mhc.cli import main as hf_mhc_main

    start = time.perf_counter()
    if command[1] == "convert":
        assert hf_mhc_main(command[1:]) == 0
    else:
        shutil.copytree(command[-2], command[-1])
    return {"seconds": time.perf_counter() - start, "peak_rss_mb": 0.0}


def test_bench_real_model_measures_every_section_and_the_two_models_answer_alike(load, tmp_path, monkeypatch, capsys,
                                                                                 one_thread):
    """Every section on the tiny Llama: decode (the chat prompt, the same tokens), memory (measured against hf-mhc
    plan, within 10 %), train (three models, float32 and bfloat16 autocast), convert (with and without verifying,
    against a copy); one table per section, the command line first."""
    folder = save_tiny_chat_llama(tmp_path / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    module = load("bench_real_model")
    monkeypatch.setattr(module, "measure", copy_or_convert_here)
    argv = ["--model", str(folder), "--repeats", "2", "--new-tokens", "3", "--tokens", "8", "--convert-repeats", "1",
            "--threads", "1", "--json", "out/results.json"]
    module.main(argv)
    out, err = capsys.readouterr()
    for line in ("decode, dynamic cache: repeat 2/2: residual ", "memory: hf-mhc plan of the same shapes",
                 "train, bfloat16 autocast: repeat 2/2: residual ", "convert: repeat 1/1: convert --no-verify"):
        assert line in err
    tables = out.split(f"command: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_real_model.py --model "
                       f"{folder} ")[1]  # after what hf-mhc convert printed
    assert sum(line.startswith("| --- |") for line in tables.splitlines()) == 5  # decode, memory, train, convert, RSS

    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["threads"] == 1 and results["sections"] == ["decode", "memory", "train", "convert"]
    decode = results["decode"]
    assert decode["chat_template"] and decode["new_tokens"] == 3 and [run["cache"] for run in decode["runs"]] == [
        "dynamic"]
    run = decode["runs"][0]
    assert run["tokens_equal"] is True
    assert run["residual_tokens_per_s"] > 0 and run["mhc_tokens_per_s"] > 0
    assert run["ratio_min"] <= run["ratio_median"] <= run["ratio_max"]
    memory = results["memory"]
    assert [row["case"] for row in memory["rows"]] == ["residual", "mhc", "mhc + hc_recompute"]
    for row in memory["rows"]:
        assert row["measured_bytes"] > 0 and row["measured_over_planned"] == pytest.approx(1, abs=0.1)
    assert memory["plan_command"] == (f"hf-mhc plan {folder} --hc-mult 4 --dtype float32 --tokens 8 --batch 2 "
                                      "--json PATH")
    rows = results["train"]["rows"]
    assert [(row["dtype"], row["case"]) for row in rows] == [
        (dtype, case) for dtype in ("float32", "bfloat16") for case in ("residual", "mhc", "mhc + hc_recompute")]
    assert all(row["median_ms"] > 0 and row["ratio_min"] <= row["ratio_max"] for row in rows)
    assert rows[0]["ratio_of_medians"] == rows[3]["ratio_of_medians"] == 1
    convert = results["convert"]
    assert convert["ratio_to_copy_seconds"].keys() == {"convert", "convert --no-verify"}
    assert set(tmp_path.iterdir()) == {folder, tmp_path / "out"}  # the copies and conversions were temporary
    assert [row["phase"] for row in results["rss"]] == ["loading both models", "decode", "memory", "train"]


def test_bench_real_model_profile_splits_a_step_between_mhc_ops_optimizer_and_matmuls(load, tmp_path, monkeypatch,
                                                                                         capsys, one_thread):
    """``--profile``: the residual model runs none of hf-mhc's ops, the mHC model does; the parts add up to the step,
    and a matrix product inside an hf-mhc op counts as the op's, not twice."""
    folder = save_tiny_chat_llama(tmp_path / "tiny-llama")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    module = load("bench_real_model")
    results = module.main(["--model", str(folder), "--only", "train", "--dtypes", "float32", "--repeats", "1",
                           "--tokens", "8", "--threads", "1", "--profile"])
    out, err = capsys.readouterr()
    assert "train, float32: profiled step of mhc + hc_recompute" in err and "one more step of each" in out
    profiles = {row["case"]: row["profile_ms"] for row in results["train"]["rows"]}
    assert profiles["residual"]["hf_mhc_ops"] == 0 < profiles["mhc"]["hf_mhc_ops"]
    for parts in profiles.values():
        assert parts["optimizer"] > 0 and parts["matmuls"] > 0
        assert parts["step"] == pytest.approx(sum(value for part, value in parts.items() if part != "step"))
        assert parts["hf_mhc_ops"] + parts["optimizer"] + parts["matmuls"] <= parts["step"]

    from transformers import AutoModelForCausalLM

    import hf_mhc

    mhc = hf_mhc.upcycle(AutoModelForCausalLM.from_pretrained(folder), hc_mult=4)
    with torch.profiler.profile() as profiler:
        mhc(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    placed = {module.under_mhc_op(event) for event in profiler.events() if event.name in module.MATMULS}
    assert placed == {True, False}  # the mHC maps' products inside hf-mhc's ops, the backbone's outside


def test_bench_real_model_names_a_missing_model_in_one_line(load, tmp_path, monkeypatch):
    module = load("bench_real_model")
    monkeypatch.setenv("HF_MHC_REAL_MODEL", str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match=r"^bench_real_model.py: error: no real model in .*missing: run make "
                                         r"real-model"):
        module.main(["--only", "convert"])
    with pytest.raises(SystemExit, match=r"^bench_real_model.py: error: --model: no config.json in "):
        module.main(["--model", str(tmp_path), "--only", "convert"])


def test_bench_serve_takes_a_model_folder(load, tmp_path, capsys):
    """``--model FOLDER``: that model and its upcycle are saved with its own tokenizer and no end-of-sequence token (the
    servers then generate exactly ``--new-tokens``); a folder without ``config.json`` is refused in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    module = load("bench_serve")
    source = save_tiny_chat_llama(tmp_path / "tiny-llama")
    folders = module.save_models(tmp_path / "saved", 64, 1, source)
    assert AutoConfig.from_pretrained(folders["residual"]).model_type == "llama"
    assert AutoConfig.from_pretrained(folders["mhc"]).model_type == "mhc"
    for folder in folders.values():
        assert GenerationConfig.from_pretrained(folder).eos_token_id is None
        assert (folder / "tokenizer_config.json").is_file() and (folder / "chat_template.jinja").is_file()
    residual = AutoModelForCausalLM.from_pretrained(folders["residual"])
    original = AutoModelForCausalLM.from_pretrained(source)
    assert all(torch.equal(a, b) for a, b in zip(residual.state_dict().values(), original.state_dict().values(),
                                                 strict=True))
    with pytest.raises(SystemExit):
        module.parse_args(["--model", str(tmp_path / "saved")])
    assert "--model: no config.json in " in capsys.readouterr().err


def test_upcycle_miniature_chat_answers_after_training(load, tmp_path, capsys):
    """``--chat PROMPT``: the source (untrained) and each arm of the first seed answer greedily through the chat
    template; an untrained function-preserving arm answers as the source does, token for token. A source without a
    chat template is refused in one line before anything trains."""
    module = load("upcycle_miniature")
    source = save_tiny_chat_llama(tmp_path / "tiny-llama")
    (tmp_path / "emma.txt").write_text("It was a truth universally acknowledged. " * 400)
    common = ["--source", str(source), "--dataset", str(tmp_path / "emma.txt"), "--steps", "1", "--seeds", "2",
              "--batch-size", "2", "--block-size", "16", "--log-every", "1", "--variants", "residual,sinkhorn,naive",
              "--chat", "hello", "--chat-tokens", "6", "--json", str(tmp_path / "run.json")]
    module.main([*common, "--lr", "1e-12", "--hc-lr", "1e-12"])  # training that changes no greedy token
    chat = json.loads((tmp_path / "run.json").read_text())["sources"]["tiny-llama"]["chat"]
    assert chat["prompt"] == "hello" and chat["seed"] == 0
    answers = chat["answers"]
    assert list(answers) == ["source", "residual", "sinkhorn", "naive"]
    assert answers["source"] and answers["residual"] == answers["sinkhorn"] == answers["source"]
    assert "| sinkhorn |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        module.main(["--source", "pretrained", "--chat", "hello"])
    assert capsys.readouterr().err.strip() == ("upcycle_miniature.py: error: --chat: the source pretrained has no "
                                               "tokenizer with a chat template")
