"""``hf-mhc serve``: transformers' OpenAI-compatible server on an mHC model, started as a subprocess on loopback and
talked to with the real ``openai`` client, with and without continuous batching. Greedy answers are compared token for
token with ``model.generate`` in this process, concurrent answers with one-at-a-time ones."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import STORIES260K, free_port
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_mhc
from hf_mhc.cli import main as hf_mhc_main
from hf_mhc.compat import SERVE_REJECTS_FULL_CONTEXT
from hf_mhc.serving import MAX_TOKENS_FIELDS, SERVED_CLASSES, context_error, max_tokens_error

NEEDS_SERVING = "hf-mhc serve's tests need the serving extra: pip install 'hf-mhc[serving]'"
openai = pytest.importorskip("openai", reason=NEEDS_SERVING)
pytest.importorskip("fastapi", reason=NEEDS_SERVING)
pytest.importorskip("uvicorn", reason=NEEDS_SERVING)

MODEL = "outputs/stories-mhc"  # the served folder, relative to the server's working directory: the requests' model id
DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
CHAT_TEMPLATE = (  # stories260K's tokenizer has none
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
         "friends. One day, she saw a big red ball under a tree and")
PROMPTS = [" ".join(STORY.split()[: 2 + index]) for index in range(16)]  # 16 prompts of 2 to 17 words
MAX_TOKENS = [4 + index % 5 * 3 for index in range(16)]  # 4 to 16 new tokens
STARTUP_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120
SERVER_MODES = {
    "sequential": [],
    "continuous-batching": ["--continuous-batching", "--cb-num-blocks", "64", "--cb-block-size", "32"],
}


def offline_source() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A random 2-layer Llama with 512 positions and a word-level tokenizer of :data:`STORY`'s words built here."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", *dict.fromkeys(STORY.replace(",", " ,").replace(".", " .").split())]
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2)
    return LlamaForCausalLM(config).eval(), tokenizer


@pytest.fixture(scope="module")
def served_folder(tmp_path_factory) -> Path:
    """The server's working directory, holding ``outputs/stories-mhc``: stories260K (or, without
    ``../shared/assets``, :func:`offline_source`) upcycled to 4 streams, its hyper-connection weights then perturbed
    (so that it no longer computes the source's function, as after fine-tuning), saved with the tokenizer and a chat
    template."""
    workdir = tmp_path_factory.mktemp("serve")
    torch.manual_seed(0)
    if STORIES260K.is_dir():
        source = AutoModelForCausalLM.from_pretrained(STORIES260K)
        tokenizer = AutoTokenizer.from_pretrained(STORIES260K)
    else:
        source, tokenizer = offline_source()
    model = hf_mhc.upcycle(source, hc_mult=4)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_hc." in name or "hc_head." in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
    ids = tokenizer(STORY, return_tensors="pt").input_ids
    with torch.no_grad():  # greedy answers tell the served model from its source
        assert not torch.equal(*(m.generate(ids, max_new_tokens=16, do_sample=False) for m in (model, source)))
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(workdir / MODEL)
    tokenizer.save_pretrained(workdir / MODEL)
    return workdir


@pytest.fixture(scope="module")
def reference(served_folder):
    """``greedy(input_ids, max_new_tokens) -> (text, new token count)``: ``model.generate`` of the saved folder in this
    process, decoded as the server decodes (special tokens skipped), and the tokenizer."""
    folder = served_folder / MODEL
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert isinstance(model, SERVED_CLASSES)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs (OMP_NUM_THREADS=1 below): the same reductions

    def greedy(input_ids: torch.Tensor, max_new_tokens: int) -> tuple[str, int]:
        with torch.no_grad():
            output = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
        new = output[0, input_ids.shape[-1]:]
        return tokenizer.decode(new, skip_special_tokens=True), len(new)

    yield greedy, tokenizer
    torch.set_num_threads(threads)


def start_server(workdir: Path, *options: str) -> tuple[subprocess.Popen, str, Path]:
    """``hf-mhc serve MODEL --host 127.0.0.1 --port PORT --device cpu OPTIONS`` from ``workdir``, polled on ``/health``
    until it answers (a bounded loop); its output goes to a log file. Returns the process, its base URL and log."""
    port = free_port()
    log = workdir / f"server-{port}.log"
    command = [str(Path(sys.executable).with_name("hf-mhc")), "serve", MODEL, "--host", "127.0.0.1", "--port",
               str(port), "--device", "cpu", *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=workdir, env=env, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"hf-mhc serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return process, url, log
        except OSError:
            time.sleep(0.5)
    stop_server(process)
    raise AssertionError(f"hf-mhc serve did not answer /health in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


@pytest.fixture(scope="module", params=list(SERVER_MODES))
def server(request, served_folder):
    """A running ``hf-mhc serve`` (sequential generation, or ``--continuous-batching``) and an ``openai`` client."""
    process, url, log = start_server(served_folder, *SERVER_MODES[request.param])
    try:
        yield new_client(url), url
        assert process.poll() is None, f"the server stopped:\n{log.read_text()[-3000:]}"
    finally:
        stop_server(process)


def new_client(url: str):
    """An ``openai`` client of the server at ``url``, with a connection pool of its own, which never retries."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def complete(client, prompt: str, max_tokens: int, stream: bool) -> tuple[str, int | None]:
    """A greedy ``/v1/completions`` answer: its text and completion token count (``None`` when streamed)."""
    if not stream:
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return answer.choices[0].text, answer.usage.completion_tokens
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices), None


def test_health_and_models(server):
    client, url = server
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
        assert json.load(response) == {"status": "ok"}
    assert [model.id for model in client.models.list()] == [MODEL]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_greedy_completions_equal_generate(server, reference, stream):
    client, _ = server
    greedy, tokenizer = reference
    for prompt, max_tokens in list(zip(PROMPTS, MAX_TOKENS, strict=True))[:: 1 if not stream else 5]:
        expected, new_tokens = greedy(tokenizer(prompt, return_tensors="pt").input_ids, max_tokens)
        text, completion_tokens = complete(client, prompt, max_tokens, stream)
        assert text == expected, prompt
        assert completion_tokens in (None, new_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_greedy_chat_equals_generate_on_the_chat_template(server, reference, stream):
    client, _ = server
    greedy, tokenizer = reference
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    expected, new_tokens = greedy(input_ids, 12)
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    else:
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        text = answer.choices[0].message.content
        assert answer.usage.completion_tokens == new_tokens
    assert text == expected


def test_sixteen_concurrent_requests_answer_as_one_at_a_time(server):
    client, _ = server
    one_at_a_time = [complete(client, prompt, max_tokens, False)
                     for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS, strict=True)]
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        futures = [pool.submit(complete, client, prompt, max_tokens, False)
                   for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS, strict=True)]
        concurrent = [future.result(timeout=REQUEST_TIMEOUT_S) for future in futures]
    assert concurrent == one_at_a_time


def full_context_message(prompt_tokens: int, context: int = 512) -> str:
    """The 400 message for a prompt that fills the context: transformers' own where it checks that itself (5.25 on),
    hf-mhc serve's before."""
    if SERVE_REJECTS_FULL_CONTEXT:
        return (f"The prompt has {prompt_tokens} tokens, but the model takes at most {context}, prompt and answer "
                "(`--max-model-len`).")
    return context_error(prompt_tokens, None, context)


def post_raw(url: str, body: bytes) -> tuple[int, dict]:
    """``POST body`` to ``url`` as JSON; the status and the decoded answer."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def test_bad_requests_get_http_400_and_the_server_keeps_serving(server, reference):
    client, url = server
    greedy, tokenizer = reference
    with pytest.raises(openai.BadRequestError) as unknown_model:
        client.completions.create(model="no-such-model", prompt="Once", max_tokens=4)
    assert "pinned to 'outputs/stories-mhc'" in unknown_model.value.response.text
    with pytest.raises(openai.BadRequestError) as unknown_model:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert "pinned to 'outputs/stories-mhc'" in unknown_model.value.response.text
    long_prompt = " ".join([STORY] * 20)  # more tokens than the model's 512 positions
    prompt_tokens = len(tokenizer(long_prompt).input_ids)
    long_chat = [{"role": "user", "content": long_prompt}]
    chat_tokens = len(tokenizer.apply_chat_template(long_chat, add_generation_prompt=True,
                                                    return_dict=True)["input_ids"])
    assert min(prompt_tokens, chat_tokens) > 512
    short_tokens = len(tokenizer(PROMPTS[3]).input_ids)
    hi = [{"role": "user", "content": "Hi"}]
    hi_tokens = len(tokenizer.apply_chat_template(hi, add_generation_prompt=True, return_dict=True)["input_ids"])
    cases = [  # (endpoint, request, transformers serve's {"detail": ...} message)
        ("completions", dict(prompt="Once", max_tokens=-3), "`max_tokens` must be a positive integer; got -3."),
        ("completions", dict(prompt="Once", max_tokens=0, stream=True),
         "`max_tokens` must be a positive integer; got 0."),
        ("chat", dict(messages=hi, max_tokens=-3), "`max_tokens` must be a positive integer; got -3."),
        ("chat", dict(messages=hi, max_completion_tokens=-1, max_tokens=4),
         "`max_completion_tokens` must be a positive integer; got -1."),
        ("completions", dict(prompt=long_prompt, max_tokens=4), full_context_message(prompt_tokens)),
        ("completions", dict(prompt=long_prompt, stream=True), full_context_message(prompt_tokens)),
        ("chat", dict(messages=long_chat, max_tokens=4, stream=True), full_context_message(chat_tokens)),
        ("completions", dict(prompt=long_prompt, max_tokens=-1), "`max_tokens` must be a positive integer; got -1."),
        ("completions", dict(prompt=PROMPTS[3], max_tokens=512 - short_tokens + 1),
         f"The prompt's {short_tokens} tokens and max_tokens={512 - short_tokens + 1} exceed the model's context "
         "of 512 tokens."),
        ("chat", dict(messages=hi, max_completion_tokens=600, max_tokens=4),
         f"The prompt's {hi_tokens} tokens and max_completion_tokens=600 exceed the model's context of 512 tokens."),
    ]
    for endpoint, bad, message in cases:
        # a client of its own: were the server to answer a 500, uvicorn would close the connection
        bad_client = new_client(url)
        create = bad_client.completions.create if endpoint == "completions" else bad_client.chat.completions.create
        with pytest.raises(openai.APIStatusError) as error:
            create(model=MODEL, temperature=0, **bad)
        assert error.value.status_code == 400, (endpoint, bad)
        assert error.value.response.json() == {"detail": message}
        assert error.value.response.headers["x-request-id"]  # set by transformers' middleware, as on its own 400s
    for endpoint in ("completions", "chat/completions"):  # nested past Python's recursion limit: plain transformers'
        status, answer = post_raw(f"{url}/v1/{endpoint}", b"[" * 100_000 + b"]" * 100_000)  # answer, not a 500
        assert status == 400, (endpoint, status, answer)
    expected = greedy(tokenizer(PROMPTS[3], return_tensors="pt").input_ids, MAX_TOKENS[3])
    assert complete(client, PROMPTS[3], MAX_TOKENS[3], False) == expected


def test_max_tokens_and_context_checks():
    fields = MAX_TOKENS_FIELDS["/v1/chat/completions"]
    assert max_tokens_error({"max_tokens": 4, "max_completion_tokens": None}, fields) is None
    assert max_tokens_error({}, fields) is None
    for value, shown in ((0, "0"), (-3, "-3"), (2.0, "2.0"), (True, "true"), ("4", '"4"')):
        message = max_tokens_error({"max_tokens": value}, fields)
        assert message == f"`max_tokens` must be a positive integer; got {shown}."
    assert context_error(511, None, 512) is None
    assert context_error(511, 1, 512) is None
    assert context_error(512, None, 512) == "The prompt has 512 tokens; the model's context is 512 tokens."
    assert context_error(500, 13, 512) == (
        "The prompt's 500 tokens and max_tokens=13 exceed the model's context of 512 tokens.")
    assert context_error(500, 13, 512, "max_completion_tokens") == (
        "The prompt's 500 tokens and max_completion_tokens=13 exceed the model's context of 512 tokens.")


def test_the_documented_client_snippet_runs_against_the_server(served_folder):
    """The client block of docs/serving.md (not run by tests/test_docs.py: it needs a running server), as pasted but
    for its port, against a server started here as the page starts it."""
    text = DOCS.read_text(encoding="utf-8")
    snippet = re.search(r"<!-- not run by the tests: the client of a running server.*?-->\n```python\n(.*?)```",
                        text, re.S).group(1)
    assert "http://127.0.0.1:8000/v1" in snippet
    process, url, log = start_server(served_folder, "--continuous-batching")
    try:
        script = served_folder / "client_snippet.py"
        script.write_text(snippet.replace("http://127.0.0.1:8000/v1", f"{url}/v1"), encoding="utf-8")
        result = subprocess.run([sys.executable, script.name], cwd=served_folder, capture_output=True, text=True,
                                timeout=REQUEST_TIMEOUT_S)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip()
    finally:
        stop_server(process)


def test_importing_hf_mhc_makes_the_served_classes_resolvable_where_transformers_serve_looks_them_up():
    """In a fresh process that imports ``hf_mhc`` and then transformers' CLI, as the model process transformers 5.25's
    server spawns does (it imports the ``hf-mhc`` script, then the model manager): the manager's
    ``getattr(transformers, architecture)`` finds the mHC classes."""
    check = ("import hf_mhc.cli, transformers.cli.transformers, transformers.processing_utils\n"
             "from transformers.cli.serving import model_manager\n"
             "from hf_mhc.serving import MAX_TOKENS_FIELDS, SERVED_CLASSES, context_error, max_tokens_error\n"
             "assert all(getattr(model_manager.transformers, c.__name__) is c for c in SERVED_CLASSES)\n")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr[-3000:]


def test_missing_serving_dependencies_end_in_one_line_and_options_are_transformers_serve_s(monkeypatch, capsys):
    import transformers.utils.import_utils as import_utils
    from transformers.cli.serving import server

    build_server = server.build_server
    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)
    assert hf_mhc_main(["serve", MODEL]) == 1
    assert capsys.readouterr().err.strip() == (
        "hf-mhc serve: error: serving needs fastapi, uvicorn, pydantic and openai: pip install 'hf-mhc[serving]'"
    )
    monkeypatch.undo()
    assert hf_mhc_main(["serve", MODEL, "--no-such-option"]) == 2
    assert "No such option '--no-such-option'" in capsys.readouterr().err
    assert server.build_server is build_server  # hf-mhc serve's wrapper is gone once it returns
    assert hf_mhc_main(["serve", "--help"]) == 0
    usage = capsys.readouterr().out
    assert "Usage: hf-mhc serve [OPTIONS] [FORCE_MODEL]" in usage
    assert all(option in usage for option in ("--continuous-batching", "--cb-num-blocks", "--quantization"))
