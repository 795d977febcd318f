"""The CPU decode fast path (``kernels/cpu_decode.py``, ``cpu_decode.cpp``): its numbers against the float64 oracle
for every residual map and stream dtype, when the ops dispatch to it, greedy generation through it, and the one warning
when it cannot be built. The kernels are JIT-built once per machine, then loaded from the torch extensions cache.
"""

from __future__ import annotations

import copy
import functools
import itertools
import types
import warnings

import pytest
import torch
from conftest import assert_same_greedy_decoding, tiny_backbone_config
from reference_check import check_against_reference, random_head_params, random_site_params
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
    model = hf_mhc.upcycle(copy.deepcopy(source), hc_mult=4, residual_map=residual_map).eval()
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


def test_progress_line_only_when_it_really_compiles(tmp_path, monkeypatch, capsys):
    from torch.utils import cpp_extension

    def load(name, sources, build_directory, **options):
        (tmp_path / name / f"{name}.so").write_bytes(b"")  # what a real build leaves
        return "module"

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", load)
    assert cpu_decode.build() == "module"
    assert capsys.readouterr().err == "building hf-mhc's CPU decode kernels (once) ...\n"
    assert cpu_decode.build() == "module"
    assert capsys.readouterr().err == ""
