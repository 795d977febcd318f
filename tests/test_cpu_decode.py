"""The CPU decode fast path (``kernels/cpu_decode.py``, ``cpu_decode.cpp``): its numbers against the float64 oracle
for every residual map and stream dtype, when the ops dispatch to it, greedy generation through it, the one warning
when it cannot be built, and its loading, which never hangs on a lock. The kernels are JIT-built once per machine, then
loaded from the torch extensions cache; the loading tests copy that library into a folder of their own.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import itertools
import os
import shutil
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_same_greedy_decoding, tiny_backbone_config
from reference_check import check_against_reference, random_head_params, random_site_params
from torch.utils import cpp_extension
from transformers import AutoModelForCausalLM

import hf_mhc
from hf_mhc import mhc_reference
from hf_mhc.kernels import cpu_decode, functional
from hf_mhc.kernels.common import MAP_CODES

HIDDEN = 37  # not a multiple of any vector width
SETTINGS = dict(sinkhorn_iters=20, eps=1e-2, norm_eps=1e-3, post_magnitude=1.5)  # eps large enough to be seen


def cases() -> list:
    return [pytest.param(residual_map, n, tokens, dtype, id=f"{residual_map}-n{n}-T{tokens}-{str(dtype)[6:]}")
            for residual_map, n in itertools.product(mhc_reference.RESIDUAL_MAPS, (1, 2, 3, 4, 8))
            if residual_map != "permutations" or n <= mhc_reference.MAX_PERMUTATION_STREAMS
            for tokens, dtype in itertools.product((1, 3, 64), cpu_decode.FAST_DTYPES)]


@pytest.fixture(scope="module")
def built():
    module = cpu_decode.extension()
    assert module is not None, "the CPU decode kernels did not build (see the warning)"
    return module


@pytest.mark.parametrize(("residual_map", "n", "tokens", "dtype"), cases())
def test_kernels_match_the_oracle(built, residual_map, n, tokens, dtype):
    """``coeffs_pre``, ``post_res`` (on the maps ``coeffs_pre`` returned) and ``head`` against ``mhc_reference``."""
    streams = torch.randn(1, tokens, n, HIDDEN).to(dtype)
    identity = residual_map == "identity"
    iters, eps, norm_eps, magnitude = (SETTINGS[key] for key in ("sinkhorn_iters", "eps", "norm_eps", "post_magnitude"))

    def coeffs_pre(streams, fn, base, scale):
        y, post, comb = built.coeffs_pre(streams, fn, base, scale, iters, eps, norm_eps, MAP_CODES[residual_map],
                                         magnitude)
        assert not identity or comb.numel() == 0
        return y, post, None if identity else comb

    y, post, comb = check_against_reference(
        coeffs_pre, functools.partial(mhc_reference.mhc_coeffs_pre, residual_map=residual_map, **SETTINGS),
        [streams, *random_site_params(n, HIDDEN, residual_map)], backward=False)
    assert y.dtype == dtype and post.dtype == torch.float32 and y.shape == (1, tokens, HIDDEN)

    def post_res(streams, sublayer, post, comb):
        return built.post_res(streams, sublayer, post, post.new_empty(0) if comb is None else comb, identity)

    (new,) = check_against_reference(post_res, mhc_reference.mhc_post_res,
                                     [streams, torch.randn(1, tokens, HIDDEN).to(dtype), post, comb], backward=False)
    assert new.dtype == dtype

    check_against_reference(lambda *inputs: built.head(*inputs, eps, norm_eps),
                            functools.partial(mhc_reference.mhc_head, eps=eps, norm_eps=norm_eps),
                            [streams, *random_head_params(n, HIDDEN)], backward=False)


@pytest.fixture
def counted(built, monkeypatch):
    """The kernels with a call counter per function, as the ops see them."""
    calls = {name: 0 for name in ("coeffs_pre", "post_res", "head")}

    def counting(name):
        def call(*args):
            calls[name] += 1
            return getattr(built, name)(*args)
        return call

    wrapper = types.SimpleNamespace(**{name: counting(name) for name in calls})
    monkeypatch.setattr(cpu_decode, "extension", lambda: wrapper)
    return calls


class Subclass(torch.Tensor):
    pass


def run_site(n=4, tokens=1, requires_grad=False):
    """One site through the public ops: ``mhc_coeffs_pre``, ``mhc_post_res``, ``mhc_head``."""
    streams = torch.randn(1, tokens, n, HIDDEN)
    fn, base, scale = (p.requires_grad_(requires_grad) for p in random_site_params(n, HIDDEN))
    y, post, comb = functional.mhc_coeffs_pre(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    new = functional.mhc_post_res(streams, y, post, comb)
    functional.mhc_head(new, fn[:n], base[:n], scale[:1], eps=1e-6, norm_eps=1e-6)
    return new


def test_dispatch_takes_the_fast_path_only_without_grad(counted, monkeypatch):
    with torch.no_grad():
        run_site(requires_grad=True)
    assert counted == {"coeffs_pre": 1, "post_res": 1, "head": 1}
    run_site(requires_grad=False)  # grad mode on, but nothing requires grad
    assert counted == {"coeffs_pre": 2, "post_res": 2, "head": 2}

    out = run_site(requires_grad=True)  # training: the custom ops, with their backward
    assert out.grad_fn is not None and counted["coeffs_pre"] == 2
    with torch.no_grad():
        run_site(tokens=cpu_decode.MAX_TOKENS + 1)  # a prompt longer than the decode range
    assert counted["coeffs_pre"] == 2
    with torch.no_grad():  # a tensor subclass (DTensor, say): the C++ reads plain tensors only
        streams = torch.randn(1, 1, 4, HIDDEN).as_subclass(Subclass)
        functional.mhc_coeffs_pre(streams, *random_site_params(4, HIDDEN), sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    with torch.no_grad():
        run_site()
    assert counted["coeffs_pre"] == 2
    monkeypatch.delenv(cpu_decode.ENV_SWITCH)


def test_the_fast_path_runs_under_cpu_autocast_as_the_torch_path(counted, monkeypatch):
    """A no-grad forward under CPU bf16 autocast (``Trainer.evaluate`` with bf16 on CPU ranks, as DeepSpeed's bf16
    mode runs it) takes the fast path, whose kernels compute in the tensors' dtypes as the torch path does (which turns
    autocast off for the HC math): the same logits, bit for bit here (measured), compared to one bf16 step."""
    config = hf_mhc.MHCConfig(backbone_config=tiny_backbone_config("llama"), hc_mult=3, hc_init="deepseek_v4")
    model = hf_mhc.MHCForCausalLM(config).eval()
    ids = torch.randint(3, 90, (2, 5))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fast = model(ids).logits
        assert counted["coeffs_pre"] > 0
        monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
        expected = model(ids).logits
    assert (fast.float() - expected.float()).abs().max() <= 2.0**-8 * expected.float().abs().max()


@pytest.mark.parametrize("residual_map", ["sinkhorn", "identity"])
def test_compiled_decode_calls_the_kernels_through_their_custom_ops(counted, monkeypatch, residual_map):
    """Under ``torch.compile(fullgraph=True)`` a no-grad site traces to the ``hf_mhc::cpu_decode_*`` ops, whose run
    calls the C++ kernels (counted), with the eager fast path's numbers exactly; the same graph honours the switch
    turned off afterwards (the eager kernels' numbers); with grad it traces the training ops instead."""
    n = 4
    streams = torch.randn(2, 1, n, HIDDEN)
    fn, base, scale = random_site_params(n, HIDDEN, residual_map)
    hc_fn, hc_base, hc_scale = random_head_params(n, HIDDEN)

    def site(streams):
        y, post, comb = functional.mhc_coeffs_pre(streams, fn, base, scale, sinkhorn_iters=20, eps=1e-6,
                                                  norm_eps=1e-6, residual_map=residual_map)
        new = functional.mhc_post_res(streams, y, post, comb)
        return new, functional.mhc_head(new, hc_fn, hc_base, hc_scale, eps=1e-6, norm_eps=1e-6)

    torch._dynamo.reset()
    compiled = torch.compile(site, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected = site(streams)
        assert counted == {"coeffs_pre": 1, "post_res": 1, "head": 1}
        outputs = compiled(streams)
        outputs = compiled(streams)  # the second call runs the compiled graph alone
    assert counted == {"coeffs_pre": 3, "post_res": 3, "head": 3}
    for out, ref in zip(outputs, expected, strict=True):  # bit-exact: the same kernels on the same tensors
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    with torch.no_grad():
        switched_off, eager = compiled(streams), site(streams)
    assert counted == {"coeffs_pre": 3, "post_res": 3, "head": 3}
    for out, ref in zip(switched_off, eager, strict=True):  # bit-exact: both run the eager torch kernels
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    monkeypatch.delenv(cpu_decode.ENV_SWITCH)
    fn.requires_grad_(True)
    torch._dynamo.reset()
    new, _ = torch.compile(site, fullgraph=True, backend="aot_eager")(streams)
    assert new.grad_fn is not None and counted["coeffs_pre"] == 3


@pytest.mark.parametrize("residual_map", ["sinkhorn", "unconstrained"])
def test_greedy_generate_same_tokens_as_eager(counted, monkeypatch, residual_map):
    source = AutoModelForCausalLM.from_config(tiny_backbone_config("llama")).eval()
    model = hf_mhc.upcycle(copy.deepcopy(source), hc_mult=4, hc_residual_map=residual_map).eval()
    with torch.no_grad():  # HC parameters away from the function-preserving init, so the maps matter
        for name, param in model.named_parameters():
            if name.endswith(("_hc.fn", "_hc.base", "hc_fn", "hc_base")):
                param.add_(torch.randn_like(param) * 0.5)
    prompt = torch.randint(3, 101, (2, 5))
    options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                   return_dict_in_generate=True)
    fast = model.generate(input_ids=prompt, **options)
    assert counted["coeffs_pre"] >= 2 * 2 * 12 and counted["head"] >= 12  # layers x sites x decode steps
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    calls = dict(counted)
    eager = model.generate(input_ids=prompt, **options)
    assert counted == calls
    assert_same_greedy_decoding(fast, eager)


def test_failed_build_warns_once_and_runs_eager(monkeypatch):
    def no_compiler():
        raise RuntimeError("Error building extension: c++: command not found")

    reference = run_site_output()
    monkeypatch.setattr(cpu_decode, "build", no_compiler)
    cpu_decode.extension.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = run_site_output(), run_site_output()
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1 and "c++: command not found" in messages[0], messages
        assert cpu_decode.ENV_SWITCH in messages[0]
        torch.testing.assert_close(first, reference)
        torch.testing.assert_close(second, reference)
    finally:
        cpu_decode.extension.cache_clear()


def run_site_output():
    torch.manual_seed(1)
    with torch.no_grad():
        return run_site()


def fake_load(calls: list, seconds: float = 0.0):
    """``cpp_extension.load`` without a compiler: writes ``NAME.so`` (the caller's text) where torch would, after
    ``seconds``, and returns a module standing for it."""
    def load(name, sources, build_directory, **options):
        calls.append(build_directory)
        time.sleep(seconds)
        library = Path(build_directory) / f"{name}.so"
        library.write_text(f"built in {build_directory}")
        return types.SimpleNamespace(__file__=str(library))
    return load


@pytest.fixture
def fake_builds(tmp_path, monkeypatch):
    """An empty extensions folder, ``load`` faked (the folders it built in) and ``import_library`` reading the text
    of the library it is given."""
    calls = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load(calls))
    monkeypatch.setattr(cpu_decode, "import_library", lambda name, path: path.read_text())
    return calls


def test_progress_line_only_when_it_really_compiles(fake_builds, capsys):
    """The first build compiles in a private folder and renames the library into place; the second loads it."""
    name = cpu_decode.extension_name()
    first = cpu_decode.build()
    assert capsys.readouterr().err == "building hf-mhc's CPU decode kernels (once) ...\n"
    assert len(fake_builds) == 1 and first == f"built in {fake_builds[0]}"
    assert Path(fake_builds[0]).parent == cpu_decode.build_directory(name)
    assert Path(fake_builds[0]).name.startswith(cpu_decode.PRIVATE_BUILD_PREFIX)
    assert cpu_decode.build() == first
    assert capsys.readouterr().err == "" and len(fake_builds) == 1
    assert sorted(os.listdir(cpu_decode.build_directory(name))) == [cpu_decode.BUILD_LOCK, f"{name}.so"]


@pytest.mark.parametrize("locked", [True, False], ids=["locked", "lock-deleted"])
def test_two_builds_at_once_both_end_with_a_complete_library(fake_builds, monkeypatch, locked):
    """Two builds at once (threads here; the lock is per open file, so they exclude each other as processes do): the
    second waits and loads the first's library. With the lock deleted meanwhile (``build_lock`` a no-op here) both
    compile, each renames a complete library into place and loads whichever is there."""
    monkeypatch.setattr(cpp_extension, "load", fake_load(fake_builds, seconds=0.5))
    if not locked:
        monkeypatch.setattr(cpu_decode, "build_lock", lambda path: contextlib.nullcontext())
    results = [None, None]

    def build(index):
        results[index] = cpu_decode.build()

    threads = [threading.Thread(target=build, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    name = cpu_decode.extension_name()
    complete = {f"built in {folder}" for folder in fake_builds}
    assert len(fake_builds) == (1 if locked else 2)
    assert set(results) <= complete and None not in results
    assert (cpu_decode.build_directory(name) / f"{name}.so").read_text() in complete
    assert [entry for entry in os.listdir(cpu_decode.build_directory(name))
            if entry.startswith(cpu_decode.PRIVATE_BUILD_PREFIX)] == []


ANSWER_TIMEOUT_S = 60  # "never hang" for a process started after a killed one (it needs about 20 s on 2 busy cores)


def wait_for(condition, process: subprocess.Popen, what: str, timeout_s: float = 120) -> None:
    """Poll ``condition`` until it holds, failing when ``process`` exits first or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the process meant to {what} exited with {process.returncode}"
        assert time.monotonic() < deadline, f"the process meant to {what} did not within {timeout_s} s"
        time.sleep(0.1)


def kill(process: subprocess.Popen) -> None:
    process.kill()  # SIGKILL: nothing of its own runs, as after a timeout's kill -9 or an OOM kill
    process.wait(timeout=30)


def copy_built_library(built, extensions: Path) -> Path:
    """The folder of ``built``'s library under ``extensions``, with a copy of the library: built by an earlier
    process."""
    name = cpu_decode.extension_name()
    folder = extensions / name
    folder.mkdir(parents=True)
    shutil.copy(cpu_decode.build_directory(name) / f"{name}.so", folder / f"{name}.so")
    return folder


HOLD_TORCH_LOCK = """
import sys, time
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1]).try_acquire()  # what torch.utils.cpp_extension.load does on every load, built or not
time.sleep(600)
"""

GENERATE = """
import torch
from transformers import LlamaConfig
import hf_mhc
from hf_mhc.kernels import cpu_decode
backbone = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = hf_mhc.MHCForCausalLM(hf_mhc.MHCConfig(backbone_config=backbone, hc_mult=4)).eval()
out = model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
print(out.shape[1], cpu_decode.extension() is not None)
"""


def test_a_process_killed_holding_the_lock_does_not_hang_the_next(built, tmp_path):
    """A process killed while holding torch's extension lock (Ctrl-C or a timeout during a first forward) leaves the
    lock file behind; the next process's ``generate`` on CPU takes the fast path at once instead of waiting for it."""
    folder = copy_built_library(built, tmp_path / "extensions")
    lock = folder / "lock"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder.parent), "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_TORCH_LOCK, str(lock)], cwd=tmp_path, env=env)
    try:
        wait_for(lock.exists, holder, "take torch's lock")
    finally:
        kill(holder)
    assert lock.exists()
    try:
        result = subprocess.run([sys.executable, "-c", GENERATE], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=ANSWER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"generate did not answer within {ANSWER_TIMEOUT_S} s after a process was killed holding {lock}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["7", "True"]  # 3 + 4 tokens, through the C++ kernels
    assert "building" not in result.stderr and "waiting" not in result.stderr


BUILD_UNTIL_KILLED = """
import time
from pathlib import Path
from torch.utils import cpp_extension
from hf_mhc.kernels import cpu_decode

def load(name, sources, build_directory, **options):  # a compile that is killed halfway
    (Path(build_directory) / "cpu_decode.o").write_text("half")
    time.sleep(600)

cpp_extension.load = load
cpu_decode.build()
"""


def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(fake_builds, tmp_path, monkeypatch, capsys):
    """A process killed while building holds hf-mhc's build lock and torch's lock in its private folder: the next
    build takes the lock at once (the kernel released it), removes the dead build's folder and installs its own."""
    name = cpu_decode.extension_name()
    folder = cpu_decode.build_directory(name)
    builder = subprocess.Popen([sys.executable, "-c", BUILD_UNTIL_KILLED], cwd=tmp_path,
                               env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: any(folder.glob(f"{cpu_decode.PRIVATE_BUILD_PREFIX}*/cpu_decode.o")), builder,
                 "start a build")
    finally:
        kill(builder)
    monkeypatch.setattr(cpu_decode, "LOCK_WAIT_S", 30.0)
    start = time.monotonic()
    assert cpu_decode.build() == f"built in {fake_builds[0]}"
    assert time.monotonic() - start < 10
    assert capsys.readouterr().err == "building hf-mhc's CPU decode kernels (once) ...\n"  # no wait
    assert sorted(os.listdir(folder)) == [cpu_decode.BUILD_LOCK, f"{name}.so"]


@contextlib.contextmanager
def held(path: Path):
    """``path`` locked as a live build holds it (a lock of its own open file, so it excludes this process too)."""
    with open(path, "w") as file:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


def no_build(*args, **kwargs):
    raise AssertionError("cpp_extension.load called: it takes torch's lock, and would build")


def fresh_extension():
    """``cpu_decode.extension()`` as a new process's first call would run it, failing on any warning."""
    cpu_decode.extension.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return cpu_decode.extension()
    finally:
        cpu_decode.extension.cache_clear()


def test_a_built_library_loads_without_the_lock(built, tmp_path, monkeypatch):
    """An already-built library is imported directly: no ``cpp_extension.load`` (which takes torch's lock on every
    load), no lock file created, and neither a stale torch lock nor a build lock held by a live process delays it."""
    folder = copy_built_library(built, tmp_path)
    name = cpu_decode.extension_name()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", no_build)
    streams = torch.randn(2, 1, 4, HIDDEN)
    head_params = random_head_params(4, HIDDEN)
    expected = built.head(streams, *head_params, 1e-6, 1e-6)

    module = fresh_extension()
    assert module is not None
    torch.testing.assert_close(module.head(streams, *head_params, 1e-6, 1e-6), expected, rtol=0, atol=0)
    assert os.listdir(folder) == [f"{name}.so"]

    (folder / "lock").touch()  # left by a process killed inside cpp_extension.load
    monkeypatch.setattr(cpu_decode, "LOCK_WAIT_S", 5.0)  # a wait, if the load waited, would warn
    with held(folder / cpu_decode.BUILD_LOCK):
        start = time.monotonic()
        module = fresh_extension()
        assert time.monotonic() - start < 5
    torch.testing.assert_close(module.head(streams, *head_params, 1e-6, 1e-6), expected, rtol=0, atol=0)


def test_a_build_held_past_the_wait_warns_naming_the_lock_and_runs_eager(tmp_path, monkeypatch, capsys):
    """When another process holds the build lock past ``LOCK_WAIT_S`` (a live build that does not end), one
    RuntimeWarning line names the lock file and how to remove it, and the eager torch kernels run."""
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    reference = run_site_output()  # the eager torch kernels
    monkeypatch.delenv(cpu_decode.ENV_SWITCH)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", no_build)
    monkeypatch.setattr(cpu_decode, "LOCK_WAIT_S", 0.5)
    lock = cpu_decode.build_directory(cpu_decode.extension_name()) / cpu_decode.BUILD_LOCK
    lock.parent.mkdir(parents=True)
    cpu_decode.extension.cache_clear()
    try:
        with held(lock), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.monotonic()
            first, second = run_site_output(), run_site_output()
            elapsed = time.monotonic() - start
    finally:
        cpu_decode.extension.cache_clear()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert f"held the build lock {lock} for 0.5 s" in messages[0] and f"rm {lock}" in messages[0]
    assert "\n" not in messages[0] and elapsed < 10
    assert capsys.readouterr().err == (f"waiting for another process's build of hf-mhc's CPU decode kernels "
                                       f"(lock {lock}) ...\n")
    torch.testing.assert_close(first, reference, rtol=0, atol=0)  # bit-exact: the same eager kernels, same tensors
    torch.testing.assert_close(second, reference, rtol=0, atol=0)
