"""vLLM serves hf-mhc checkpoints: SmolLM2-135M-Instruct (``make real-model``) upcycled to 4 streams, a copy of it
with random token-dependent HC maps (so that an implementation that computes the source's function instead of the
mHC model's cannot pass), and random 2-layer mHC models of Qwen2, Qwen3, Mistral and OLMo 2 (which the native model
does not serve), through the registry's CPU build of vLLM.

vLLM lives in an environment of its own (``make vllm-env``: ``.venv/vllm``, or the Python named by
``HF_MHC_VLLM_PYTHON``); this process never imports it. ``vllm_workers/generate.py`` runs every ``vllm.LLM`` of the
module in one process of that environment, on both paths: vLLM's choice (``model_impl="auto"``: hf-mhc's plugin serves
the native model) and vLLM's Transformers backend (``model_impl="transformers"``). One OpenAI-compatible server
(``python -m vllm.entrypoints.openai.api_server``, loopback, bounded by timeouts) serves the perturbed copy to the
``openai`` client.

Greedy tokens are compared with transformers' ``generate`` of the same folder, in float32, up to the first step where
transformers' two best logits are within the converter's logit tolerance of each other (a tie that rounding may break
either way); the log-probability vLLM gives each chosen token is within twice that tolerance of transformers' (a
log-softmax moves by at most twice the largest change of its logits).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import free_port, import_script, randomize_hc
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import hf_mhc
from hf_mhc import compat
from hf_mhc.conversion import is_hc_parameter
from hf_mhc.conversion.verify import logit_tolerance

openai = pytest.importorskip("openai", reason="the server test needs the openai client: pip install 'hf-mhc[serving]'")

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("HF_MHC_VLLM_PYTHON", REPO / ".venv" / "vllm" / "bin" / "python"))
SKIP_REASON = f"vLLM is not installed at {VLLM_PYTHON}: make vllm-env (make test installs it)"
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=SKIP_REASON)

HC_MULT = 4
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
NEW_TOKENS = 24
NATIVE_CLASS = "MHCForCausalLM"  # hf_mhc.vllm_model's native model (the class the plugin registers)
TRANSFORMERS_BACKEND_CLASS = "TransformersForCausalLM"
TINY_FAMILIES = ("qwen2", "qwen3", "mistral", "olmo2")  # olmo2 (norms after the sublayers) is not served natively
RUNS = {  # name: (folder, model_impl, dtype, the class vLLM builds)
    "upcycled-native": ("upcycled", "auto", "float32", NATIVE_CLASS),
    "perturbed-native": ("perturbed", "auto", "float32", NATIVE_CLASS),
    "upcycled-transformers": ("upcycled", "transformers", "float32", TRANSFORMERS_BACKEND_CLASS),
    "perturbed-transformers": ("perturbed", "transformers", "float32", TRANSFORMERS_BACKEND_CLASS),
    "perturbed-native-bfloat16": ("perturbed", "auto", "bfloat16", NATIVE_CLASS),
    **{f"{family}-auto": (family, "auto", "float32", NATIVE_CLASS if family != "olmo2" else TRANSFORMERS_BACKEND_CLASS)
       for family in TINY_FAMILIES},
}
WORKER_TIMEOUT_S = 900
STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 120
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ""}


def vllm_environment() -> dict[str, str]:
    """This process's environment for vLLM's processes, with :data:`VLLM_ENV` and without ``ATEN_CPU_CAPABILITY``:
    vLLM compiles parts of every engine with inductor (eager or not), whose CPU code does not build under
    ``ATEN_CPU_CAPABILITY=default`` (``'at::vec' has not been declared``); transformers' references in this process
    still take the kernels it names."""
    return {**{key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}, **VLLM_ENV}


@pytest.fixture(scope="module")
def folders(real_model_built, tmp_path_factory) -> dict[str, Path]:
    """The real model upcycled to :data:`HC_MULT` streams (the source's function), the same with random
    token-dependent maps at every site and in the read-out, and a random 2-layer mHC model of each of
    :data:`TINY_FAMILIES` (DeepSeek-V4's random maps; norm weights and biases moved off 1 and 0, so that a misplaced
    one shows), each saved with the real model's tokenizer."""
    root = tmp_path_factory.mktemp("vllm")
    tokenizer = AutoTokenizer.from_pretrained(real_model_built)
    model = hf_mhc.upcycle(AutoModelForCausalLM.from_pretrained(real_model_built, dtype=torch.float32),
                           hc_mult=HC_MULT)
    models = {"upcycled": lambda: model, "perturbed": lambda: randomize_hc(model, fn_std=0.02, base_std=0.5)}
    for family in TINY_FAMILIES:
        models[family] = lambda family=family: tiny_mhc(family, len(tokenizer))
    saved = {}
    for name, build in models.items():
        torch.manual_seed(0)
        build().save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        saved[name] = root / name
    return saved


def tiny_mhc(family: str, vocab_size: int) -> hf_mhc.MHCForCausalLM:
    """A random 2-layer mHC model of ``family`` with heads of 64 (the smallest vLLM's CPU attention takes)."""
    backbone = AutoConfig.for_model(family, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=vocab_size,
                                    max_position_embeddings=1024, tie_word_embeddings=False)
    model = hf_mhc.MHCForCausalLM(hf_mhc.MHCConfig(backbone_config=backbone, hc_mult=HC_MULT, hc_init="deepseek_v4"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1 and not is_hc_parameter(name):
                parameter.add_(0.2 * torch.randn_like(parameter))
    return model.eval()


@pytest.fixture(scope="module")
def references(folders) -> dict[str, list[dict]]:
    """transformers' greedy ``generate`` of each folder: per prompt the new token ids and the logits of each step."""
    tokenizer = AutoTokenizer.from_pretrained(folders["upcycled"])
    found = {}
    for name, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        found[name] = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
            found[name].append({"token_ids": out.sequences[0, ids.shape[1]:].tolist(),
                                "logits": [step[0].float() for step in out.logits]})
    return found


@pytest.fixture(scope="module")
def vllm_results(folders, tmp_path_factory) -> dict[str, dict]:
    """Every run of :data:`RUNS` through ``vllm_workers/generate.py``: its ``RESULT`` by name."""
    work = tmp_path_factory.mktemp("vllm-runs")
    spec = {"prompts": PROMPTS, "max_tokens": NEW_TOKENS,
            "runs": [{"name": name, "folder": str(folders[folder]), "model_impl": impl, "dtype": dtype}
                     for name, (folder, impl, dtype, _) in RUNS.items()]}
    (work / "spec.json").write_text(json.dumps(spec))
    ran = subprocess.run([str(VLLM_PYTHON), str(REPO / "tests" / "vllm_workers" / "generate.py"),
                          str(work / "spec.json")], cwd=work, capture_output=True, text=True,
                         timeout=WORKER_TIMEOUT_S, env=vllm_environment())
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-6000:]
    results = [json.loads(line.removeprefix("RESULT ")) for line in ran.stdout.splitlines()
               if line.startswith("RESULT ")]
    found = {result.pop("name"): result for result in results}
    found["compat"] = next(json.loads(line.removeprefix("COMPAT ")) for line in ran.stdout.splitlines()
                           if line.startswith("COMPAT "))
    found["log"] = ran.stdout + ran.stderr
    return found


def compared_steps(reference: dict) -> int:
    """How many of ``reference``'s steps are compared: all, or up to its first near-tie of the two best logits."""
    for step, logits in enumerate(reference["logits"]):
        top2 = logits.topk(2).values
        if top2[0] - top2[1] <= logit_tolerance(logits.abs().max().item()):
            return step
    return len(reference["logits"])


def test_the_perturbed_copy_does_not_compute_the_sources_function(references):
    assert references["perturbed"] != references["upcycled"]
    assert any(got["token_ids"] != expected["token_ids"]
               for got, expected in zip(references["perturbed"], references["upcycled"], strict=True))


@pytest.mark.parametrize("run", [name for name, (_, _, dtype, _) in RUNS.items() if dtype == "float32"])
def test_greedy_tokens_and_logprobs_equal_transformers_generate(vllm_results, references, run):
    folder = RUNS[run][0]
    compared = [compared_steps(expected) for expected in references[folder]]
    assert sum(compared) >= len(PROMPTS) * NEW_TOKENS // 2, f"near-ties leave too little to compare: {compared}"
    for prompt, got, expected, steps in zip(PROMPTS, vllm_results[run]["completions"], references[folder], compared,
                                            strict=True):
        assert got["token_ids"][:steps] == expected["token_ids"][:steps], prompt
        if steps == len(expected["logits"]):  # no tie: the same length (both stop at the end-of-sequence token)
            assert len(got["token_ids"]) == len(expected["token_ids"]), prompt
        for step in range(steps):
            token = expected["token_ids"][step]
            logits = expected["logits"][step]
            want = torch.log_softmax(logits.double(), dim=-1)[token].item()
            assert abs(got["logprobs"][step][str(token)] - want) <= 2 * logit_tolerance(logits.abs().max().item()), (
                prompt, step)


@pytest.mark.parametrize("run", list(RUNS))
def test_each_path_serves_with_float32_hc_parameters(vllm_results, run):
    """vLLM's choice (``auto``) is the native model for the dense families with the ``sinkhorn`` map and the
    Transformers backend for any other; the Transformers backend when asked for; the HC parameters stay float32
    whatever the model's dtype."""
    _, _, dtype, expected_class = RUNS[run]
    result = vllm_results[run]
    assert result["class"] == expected_class
    assert result["dtypes"] == {"hc": ["torch.float32"], "other": [f"torch.{dtype}"]}


def test_the_plugin_logs_which_path_serves_the_model(vllm_results, folders):
    lines = [line for line in vllm_results["log"].splitlines() if "hf-mhc: serving" in line]
    assert any(f"serving {folders['perturbed']} with the native vLLM mHC model (llama, sinkhorn;" in line
               for line in lines)
    assert any(f"serving {folders['olmo2']} with vLLM's Transformers backend (backbone family 'olmo2';" in line
               for line in lines)


def test_bfloat16_serving_answers_as_float32_at_first(vllm_results):
    """In bfloat16 the first greedy token of each prompt is float32's, unless float32's two best logits lie within
    bfloat16's rounding of the largest logit (8 mantissa bits) of each other."""
    float32, bfloat16 = vllm_results["perturbed-native"], vllm_results["perturbed-native-bfloat16"]
    for prompt, got, expected in zip(PROMPTS, bfloat16["completions"], float32["completions"], strict=True):
        best = sorted(expected["logprobs"][0].values(), reverse=True)
        if best[0] - best[1] > 2 ** -7 * 30:  # 30: the size of SmolLM2's logits
            assert got["token_ids"][0] == expected["token_ids"][0], prompt


# --- vLLM's OpenAI-compatible server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    """``python -m vllm.entrypoints.openai.api_server`` on the perturbed copy, on loopback, polled on ``/health``
    (a bounded loop), stopped at the end; and an ``openai`` client of it."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folders["perturbed"]),
               "--served-model-name", "mhc", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
               "--trust-remote-code", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=vllm_environment(), stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, f"vLLM's server exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no /health in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        yield client
        assert process.poll() is None, f"vLLM's server stopped:\n{log.read_text()[-4000:]}"
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait(timeout=30)


def test_a_chat_completion_through_the_openai_client_is_transformers_greedy_answer(server, folders):
    tokenizer = AutoTokenizer.from_pretrained(folders["perturbed"])
    model = AutoModelForCausalLM.from_pretrained(folders["perturbed"], dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    expected = {"token_ids": out.sequences[0, ids.shape[1]:].tolist(), "logits": [step[0] for step in out.logits]}
    steps = compared_steps(expected)
    reply = server.chat.completions.create(model="mhc", messages=messages, max_tokens=16, temperature=0.0,
                                           logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    got = [int(entry.token.removeprefix("token_id:")) for entry in reply.choices[0].logprobs.content]
    assert got[:steps] == expected["token_ids"][:steps]
    if steps == len(expected["token_ids"]):
        assert reply.choices[0].message.content == tokenizer.decode(expected["token_ids"], skip_special_tokens=True)


def complete(client, prompt: str) -> str:
    return client.completions.create(model="mhc", prompt=prompt, max_tokens=8, temperature=0.0).choices[0].text


def test_sixteen_concurrent_requests_answer_as_one_at_a_time(server):
    prompts = [f"{PROMPTS[index % 4]}{' and' * (index // 4)}" for index in range(16)]
    one_at_a_time = [complete(server, prompt) for prompt in prompts]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda prompt: complete(server, prompt), prompts))
    assert concurrent == one_at_a_time


@pytest.mark.parametrize(("request_options", "error"), [
    ({"model": "no-such-model"}, "NotFoundError"),
    ({"max_tokens": 600}, "BadRequestError"),  # more than the 512 positions of --max-model-len
])
def test_a_bad_request_gets_a_4xx_and_the_server_goes_on(server, request_options, error):
    with pytest.raises(openai.APIStatusError) as raised:
        server.completions.create(**{"model": "mhc", "prompt": PROMPTS[0], "max_tokens": 4, **request_options})
    assert type(raised.value).__name__ == error and 400 <= raised.value.status_code < 500
    assert complete(server, PROMPTS[0])



def test_vllms_private_apis_resolve_in_the_vllm_environment(vllm_results):
    """The things of vLLM that hf-mhc reaches beyond its public API (``hf_mhc.compat.PRIVATE_APIS``) exist in the
    vLLM that ``make vllm-env`` installs, a release ``hf_mhc.compat.TESTED`` lists (the worker resolves them)."""
    listed = [entry.target for entry in compat.PRIVATE_APIS if entry.package == "vllm"]
    assert listed and vllm_results["compat"] == {"resolved": listed, "tested": True}


def test_bench_vllm_refuses_bad_arguments_in_one_line_and_reads_which_path_served(tmp_path, capsys, monkeypatch):
    """``benchmarks/bench_vllm.py`` (run at full size for the serving page): its argument errors, and the line of a
    server's log that names the implementation serving the mHC model."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    module = import_script(REPO / "benchmarks" / "bench_vllm.py")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for argv, message in ((["--model", str(tmp_path)], f"--model: no config.json in {tmp_path}"),
                          (["--model", str(tmp_path / "model"), "--vllm-python", str(tmp_path / "python")],
                           f"--vllm-python: no {tmp_path / 'python'}"),
                          (["--model", str(tmp_path / "model"), "--vllm-python", str(VLLM_PYTHON), "--concurrency",
                            "0"], "must be positive")):
        with pytest.raises(SystemExit):
            module.parse_args(argv)
        assert message in capsys.readouterr().err.splitlines()[-1]
    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=1) INFO [model.py:733] Resolved architecture: MHCForCausalLM\n(EngineCore pid=2) "
                   "INFO [vllm_model.py:316] hf-mhc: serving /m with the native vLLM mHC model (llama, sinkhorn)\n")
    assert module.served_by(log) == "serving /m with the native vLLM mHC model (llama, sinkhorn)"
    log.write_text("(APIServer pid=1) INFO [model.py:733] Resolved architecture: TransformersForCausalLM\n")
    assert module.served_by(log) == "vLLM's TransformersForCausalLM"
