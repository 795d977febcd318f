"""The CPU decode fast path (``kernels/cpu_decode.cpp``): its numbers against the float64 reference formula, when the
ops dispatch to it, greedy generation through it, and the one warning when it cannot be built.

The kernels are JIT-built once per machine (about a minute on 2 cores, then loaded from the torch extensions cache).
"""

from __future__ import annotations

import copy
import itertools
import types
import warnings

import pytest
import torch
from conftest import assert_same_greedy_decoding, tiny_backbone_config
from transformers import AutoModelForCausalLM

import hf_mhc
from hf_mhc import mhc_reference
from hf_mhc.kernels import cpu_decode, functional
from hf_mhc.kernels.common import MAP_CODES

# Per-dtype tolerance on the stream-sized outputs (y, new streams), relative to max |reference|: one rounding to the
# dtype. The maps (post, comb) are float32 whatever the streams' dtype (the reference reads the same rounded
# streams), so they get the float32 tolerance.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
MAP_TOLERANCE = 1e-5
HIDDEN = 37  # not a multiple of any vector width
SETTINGS = dict(sinkhorn_iters=20, eps=1e-2, norm_eps=1e-3, post_magnitude=1.5)  # eps large enough to be seen


def cases() -> list:
    return list(_cases())


def _cases():
    for residual_map, n in itertools.product(mhc_reference.RESIDUAL_MAPS, (1, 2, 3, 4, 8)):
        if residual_map == "permutations" and n > mhc_reference.MAX_PERMUTATION_STREAMS:
            continue
        for tokens, dtype in itertools.product((1, 3, 64), TOLERANCE):
            yield pytest.param(residual_map, n, tokens, dtype, id=f"{residual_map}-n{n}-T{tokens}-{str(dtype)[6:]}")


def site_params(n: int, residual_map: str):
    rows = sum(mhc_reference.map_sizes(n, residual_map))
    fn = torch.randn(rows, n * HIDDEN) * 0.5
    base = torch.randn(rows)
    scale = torch.rand(mhc_reference.scale_size(residual_map)) + 0.5
    return fn, base, scale


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=rtol * max(1.0, expected.abs().max().item()))


# --- the formula in float64, written out (mhc_reference computes in float32) -----------------------------------


def mix64(streams, fn, norm_eps):
    flat = streams.double().flatten(-2)
    return (flat / torch.sqrt(flat.square().mean(-1, keepdim=True) + norm_eps)) @ fn.double().T


def sinkhorn64(logits, iters, eps):
    comb = torch.softmax(logits, -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def maps64(mix, base, scale, n, residual_map, sinkhorn_iters, eps, post_magnitude, **_):
    """pre, post, comb (None for identity) in float64."""
    sizes = mhc_reference.map_sizes(n, residual_map)
    (pre_w, post_w, comb_w), (pre_b, post_b, comb_b) = mix.split(sizes, -1), base.double().split(sizes)
    s = scale.double()
    if residual_map == "unconstrained":
        return (s[0] * torch.tanh(pre_w) + pre_b, s[1] * torch.tanh(post_w) + post_b,
                (s[2] * torch.tanh(comb_w) + comb_b).unflatten(-1, (n, n)))
    pre = torch.sigmoid(s[0] * pre_w + pre_b) + eps
    if residual_map == "identity":
        return pre, post_magnitude * torch.sigmoid(s[1] * post_w + post_b) + eps, None
    post = 2 * torch.sigmoid(s[1] * post_w + post_b)
    if residual_map == "permutations":
        weights = torch.softmax(s[2] * comb_w + comb_b, -1)
        order = torch.tensor(list(itertools.permutations(range(n))))
        perms = torch.eye(n, dtype=torch.float64)[order]  # P_k[i, perm_k[i]] = 1
        return pre, post, torch.einsum("...k,kij->...ij", weights, perms)
    return pre, post, sinkhorn64((s[2] * comb_w + comb_b).unflatten(-1, (n, n)), sinkhorn_iters, eps)


def collapse64(streams, weights):
    return (weights.unsqueeze(-1) * streams.double()).sum(-2)


def post_res64(streams, y, post, comb):
    x = streams.double()
    mixed = x if comb is None else comb.double().transpose(-1, -2) @ x
    return post.double().unsqueeze(-1) * y.double().unsqueeze(-2) + mixed


@pytest.fixture(scope="module")
def built():
    module = cpu_decode.extension()
    assert module is not None, "the CPU decode kernels did not build (see the warning)"
    return module


@pytest.mark.parametrize(("residual_map", "n", "tokens", "dtype"), cases())
def test_kernels_match_float64_reference(built, residual_map, n, tokens, dtype):
    streams = torch.randn(1, tokens, n, HIDDEN).to(dtype)
    fn, base, scale = site_params(n, residual_map)
    y, post, comb = built.coeffs_pre(streams, fn, base, scale, SETTINGS["sinkhorn_iters"], SETTINGS["eps"],
                                     SETTINGS["norm_eps"], MAP_CODES[residual_map],
                                     SETTINGS["post_magnitude"])
    ref_pre, ref_post, ref_comb = maps64(mix64(streams, fn, SETTINGS["norm_eps"]), base, scale, n, residual_map,
                                         **SETTINGS)
    assert y.dtype == dtype and post.dtype == torch.float32 and y.shape == (1, tokens, HIDDEN)
    close(y, collapse64(streams, ref_pre), TOLERANCE[dtype])
    close(post, ref_post, MAP_TOLERANCE)
    if residual_map == "identity":
        assert comb.numel() == 0
    else:
        close(comb, ref_comb, MAP_TOLERANCE)

    sublayer = torch.randn(1, tokens, HIDDEN).to(dtype)
    identity = residual_map == "identity"
    new = built.post_res(streams, sublayer, post, comb, identity)
    assert new.dtype == dtype
    close(new, post_res64(streams, sublayer, post, None if identity else comb), TOLERANCE[dtype])

    hc_fn, hc_base, hc_scale = torch.randn(n, n * HIDDEN) * 0.5, torch.randn(n), torch.rand(1) + 0.5
    head = built.head(streams, hc_fn, hc_base, hc_scale, SETTINGS["eps"], SETTINGS["norm_eps"])
    head_weights = torch.sigmoid(hc_scale.double() * mix64(streams, hc_fn, SETTINGS["norm_eps"]) + hc_base.double())
    close(head, collapse64(streams, head_weights + SETTINGS["eps"]), TOLERANCE[dtype])


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
    fn, base, scale = (p.requires_grad_(requires_grad) for p in site_params(n, "sinkhorn"))
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
        functional.mhc_coeffs_pre(streams, *site_params(4, "sinkhorn"), sinkhorn_iters=20, eps=1e-6, norm_eps=1e-6)
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    with torch.no_grad():
        run_site()
    assert counted["coeffs_pre"] == 2
    monkeypatch.delenv(cpu_decode.ENV_SWITCH)


@pytest.mark.parametrize("residual_map", ["sinkhorn", "identity"])
def test_compiled_decode_calls_the_kernels_through_their_custom_ops(counted, monkeypatch, residual_map):
    """Under ``torch.compile(fullgraph=True)`` a no-grad site traces to the ``hf_mhc::cpu_decode_*`` ops, whose run
    calls the C++ kernels (counted), with the eager fast path's numbers exactly; the same graph honours the switch
    turned off afterwards (the eager kernels' numbers); with grad it traces the training ops instead."""
    n = 4
    streams = torch.randn(2, 1, n, HIDDEN)
    fn, base, scale = site_params(n, residual_map)
    hc_fn, hc_base, hc_scale = torch.randn(n, n * HIDDEN) * 0.5, torch.randn(n), torch.rand(1) + 0.5

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


def test_the_decode_custom_ops_are_well_formed(built):
    n, streams = 3, torch.randn(2, 3, 3, HIDDEN)
    fn, base, scale = site_params(n, "sinkhorn")
    y, post, comb = built.coeffs_pre(streams, fn, base, scale, 5, 1e-6, 1e-6, 0, 2.0)
    hc = torch.randn(n, n * HIDDEN), torch.randn(n), torch.rand(1)
    for op, args in ((cpu_decode._coeffs_pre_op, (streams, fn, base, scale, 5, 1e-6, 1e-6, 0, 2.0)),
                     (cpu_decode._post_res_op, (streams, y, post, comb, False)),
                     (cpu_decode._head_op, (streams, *hc, 1e-6, 1e-6))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


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
