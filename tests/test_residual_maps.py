"""Residual-map variants beside mHC (``hc_residual_map``): the ops of both backends against an independent float64
transcription of each map's formula, their properties, their memory, and the models built on them.

The maps come from the same projection ``mix = RMSNorm(flat) @ fn.T`` as mHC; only the way ``pre``, ``post`` and
``comb`` are formed from it differs (and ``comb``'s shape), so these tests cover the coefficient ops and the merge.
mHC itself (``"sinkhorn"``) is tested in ``test_ops.py``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import (
    VOCAB,
    assert_logits_close,
    assert_one_line_error,
    assert_same_weights,
    convert,
    remote_code_logits,
    save_source,
    tiny_backbone_config,
)
from test_ops import (  # noqa: F401 (autouse fixtures)
    as64,
    check_grads,
    leaf,
    nan_poisoned_buffers,
    on_test_device,
    ref_sinkhorn,
)

from hf_mhc import MHCConfig, MHCForCausalLM
from hf_mhc.kernels import mhc_coeffs, mhc_coeffs_pre, mhc_post_res
from hf_mhc.profiling import saved_bytes_for_backward

BACKENDS = ["torch", "triton"]
VARIANTS = ["unconstrained", "identity", "permutations"]
ALL_MAPS = ["sinkhorn", *VARIANTS]
NORM_EPS = 1e-6
HC_EPS = 1e-6
ITERS = 4
MAGNITUDE = 2.5  # the identity map's post magnitude in the op tests: not 2, so that a hard-coded 2 fails


def streams_for(residual_map: str) -> list[int]:
    return [1, 2, 3, 4] if residual_map == "permutations" else [1, 2, 3, 4, 8]


def cases(maps=VARIANTS):
    return [(residual_map, n) for residual_map in maps for n in streams_for(residual_map)]


# --- float64 reference, written from the formulas, independent of hf_mhc.mhc_reference ---------------------------


def ref_permutations(n):
    """``[n!, n, n]``: ``P[k, i, perm_k[i]] = 1``, permutations in lexicographic order (the identity first)."""
    perms = list(itertools.permutations(range(n)))
    matrices = torch.zeros(len(perms), n, n, dtype=torch.float64)
    for k, perm in enumerate(perms):
        for i, j in enumerate(perm):
            matrices[k, i, j] = 1.0
    return matrices


def ref_sizes(n, residual_map):
    comb = {"sinkhorn": n * n, "unconstrained": n * n, "identity": 0, "permutations": math.factorial(n)}
    return n, n, comb[residual_map]


def ref_maps(x, fn, base, scale, residual_map, magnitude=MAGNITUDE):
    *lead, n, c = x.shape
    flat = x.reshape(*lead, n * c)
    flat_n = flat / torch.sqrt((flat * flat).mean(-1, keepdim=True) + NORM_EPS)
    mix = torch.einsum("...k,jk->...j", flat_n, fn)
    a, b, _ = ref_sizes(n, residual_map)
    pre_w, post_w, comb_w = mix[..., :a], mix[..., a : a + b], mix[..., a + b :]
    pre_b, post_b, comb_b = base[:a], base[a : a + b], base[a + b :]
    if residual_map == "unconstrained":
        pre = scale[0] * torch.tanh(pre_w) + pre_b
        post = scale[1] * torch.tanh(post_w) + post_b
        comb = scale[2] * torch.tanh(comb_w.reshape(*lead, n, n)) + comb_b.reshape(n, n)
        return pre, post, comb
    pre = 1 / (1 + torch.exp(-(scale[0] * pre_w + pre_b))) + HC_EPS
    if residual_map == "identity":
        post = magnitude / (1 + torch.exp(-(scale[1] * post_w + post_b))) + HC_EPS
        return pre, post, None
    post = 2 / (1 + torch.exp(-(scale[1] * post_w + post_b)))
    logits = scale[2] * comb_w + comb_b
    if residual_map == "permutations":
        weights = torch.exp(logits - logits.amax(-1, keepdim=True))
        weights = weights / weights.sum(-1, keepdim=True)
        return pre, post, torch.einsum("...k,kij->...ij", weights, ref_permutations(n))
    return pre, post, ref_sinkhorn(logits.reshape(*lead, n, n), ITERS, HC_EPS)


def ref_site(x, fn, base, scale, residual_map, sublayer_weight):
    """A whole site: collapse, a linear sublayer ``y @ W``, then the merge ``X'[i] = post[i] y + sum_j comb[j, i]
    X[j]`` (``comb = I`` for the identity map)."""
    pre, post, comb = ref_maps(x, fn, base, scale, residual_map)
    y = torch.einsum("...i,...ic->...c", pre, x) @ sublayer_weight
    carried = x if comb is None else torch.einsum("...ji,...jc->...ic", comb, x)
    return torch.einsum("...i,...c->...ic", post, y) + carried


def random_params(n, c, residual_map):
    rows = sum(ref_sizes(n, residual_map))
    scales = 2 if residual_map == "identity" else 3
    return torch.randn(rows, n * c) * 0.5, torch.randn(rows), torch.rand(scales) + 0.5


def settings(residual_map, iters=ITERS):
    return dict(sinkhorn_iters=iters, eps=HC_EPS, norm_eps=NORM_EPS, residual_map=residual_map,
                post_magnitude=MAGNITUDE if residual_map == "identity" else 2.0)


# --- ops ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("residual_map", "n"), cases())
@pytest.mark.parametrize("backend", BACKENDS)
def test_coeffs_match_float64_autograd(backend, residual_map, n):
    x = leaf(torch.randn(2, 3, n, 8))
    fn, base, scale = (leaf(p) for p in random_params(n, 8, residual_map))
    pre, post, comb = mhc_coeffs(x, fn, base, scale, backend=backend, **settings(residual_map))
    x64, fn64, base64, scale64 = as64(x, fn, base, scale)
    refs = ref_maps(x64, fn64, base64, scale64, residual_map)
    if residual_map == "identity":  # the comb applied is the identity, a constant (bit-exact: built, not computed)
        torch.testing.assert_close(comb, torch.eye(n).expand(2, 3, n, n), atol=0, rtol=0)
        outs, refs = (pre, post), refs[:2]
    else:
        outs = (pre, post, comb)
    for mine, ref in zip(outs, refs, strict=True):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine.double(), ref, atol=1e-5 * max(1.0, ref.abs().max().item()), rtol=1e-5)
    scale_of = max(ref.abs().max().item() for ref in refs)
    check_grads([x, fn, base, scale], outs, [x64, fn64, base64, scale64], refs, dict(atol=1e-4 * scale_of, rtol=1e-4))


@pytest.mark.parametrize(("residual_map", "n"), cases())
@pytest.mark.parametrize("backend", BACKENDS)
def test_site_matches_float64_autograd(backend, residual_map, n):
    """``mhc_coeffs_pre`` (one node) then a sublayer then ``mhc_post_res``: output and every input gradient, with
    random upstream gradients. The identity map returns ``comb=None`` and merges without mixing."""
    hidden = 8
    x = leaf(torch.randn(2, 3, n, hidden))
    fn, base, scale = (leaf(p) for p in random_params(n, hidden, residual_map))
    weight = leaf(torch.randn(hidden, hidden) / hidden**0.5)
    y, post, comb = mhc_coeffs_pre(x, fn, base, scale, backend=backend, **settings(residual_map))
    assert (comb is None) == (residual_map == "identity")
    out = mhc_post_res(x, y @ weight, post, comb, backend=backend)
    x64, fn64, base64, scale64, weight64 = as64(x, fn, base, scale, weight)
    ref = ref_site(x64, fn64, base64, scale64, residual_map, weight64)
    torch.testing.assert_close(out.double(), ref, atol=2e-5 * ref.abs().max().item(), rtol=2e-5)
    check_grads([x, fn, base, scale, weight], out, [x64, fn64, base64, scale64, weight64], ref,
                dict(atol=1e-4 * ref.abs().max().item(), rtol=1e-4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("residual_map", VARIANTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_site_in_16_bit(backend, residual_map, dtype):
    x = leaf(torch.randn(1, 5, 3, 16).to(dtype))
    fn, base, scale = (leaf(p) for p in random_params(3, 16, residual_map))
    weight = leaf(torch.randn(16, 16) / 4)
    y, post, comb = mhc_coeffs_pre(x, fn, base, scale, backend=backend, **settings(residual_map))
    out = mhc_post_res(x, (y.float() @ weight).to(dtype), post, comb, backend=backend)
    assert out.dtype == dtype
    x64, fn64, base64, scale64, weight64 = as64(x, fn, base, scale, weight)
    ref = ref_site(x64, fn64, base64, scale64, residual_map, weight64)
    tol = dict(atol=0.05 * ref.abs().max().item(), rtol=0.05)
    torch.testing.assert_close(out.double(), ref, **tol)
    check_grads([x, fn, base, scale, weight], out, [x64, fn64, base64, scale64, weight64], ref, tol)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("magnitude", [1.0, 30.0, 1e4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_permutations_comb_is_exactly_doubly_stochastic(backend, magnitude, n):
    """Rows and columns sum to 1 to float32 rounding at any logit size (Sinkhorn's rows are only approximately 1),
    entries in [0, 1]; a large bias on the first weight gives the identity (the documented order starts with it)."""
    x = torch.randn(1, 6, n, 8)
    fn, base, scale = random_params(n, 8, "permutations")
    _, _, comb = mhc_coeffs(x, fn * magnitude, base * magnitude, scale, backend=backend, **settings("permutations"))
    assert torch.isfinite(comb).all() and (comb >= 0).all() and (comb <= 1 + 1e-6).all()
    ones = torch.ones(1, 6, n)
    torch.testing.assert_close(comb.sum(-1), ones, atol=2e-6, rtol=0)
    torch.testing.assert_close(comb.sum(-2), ones, atol=2e-6, rtol=0)
    peaked = base.clone()
    peaked[2 * n :] = 0.0
    peaked[2 * n] = 100.0
    _, _, comb = mhc_coeffs(x, fn * 0, peaked, scale, backend=backend, **settings("permutations"))
    torch.testing.assert_close(comb, torch.eye(n).expand(1, 6, n, n), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unconstrained_comb_is_not_projected(backend):
    """Hyper-Connections' comb is its static part plus a bounded dynamic part: negative entries and row / column
    sums away from 1 pass through."""
    n = 3
    x = torch.randn(1, 4, n, 8)
    fn, _, scale = random_params(n, 8, "unconstrained")
    base = torch.cat([torch.zeros(2 * n), -2.0 * torch.ones(n * n)])
    _, _, comb = mhc_coeffs(x, fn, base, scale, backend=backend, **settings("unconstrained"))
    assert (comb < 0).all()
    assert ((comb.sum(-1) - 1).abs() > 1).all()


def test_permutations_of_more_than_four_streams_are_refused():
    fn, base, scale = random_params(4, 8, "permutations")
    x = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"n <= 4 streams: it mixes all n! permutation matrices \(24 at n=4, 120 at "
                                         r"n=5\); got n=5") as error:
        mhc_coeffs(x, fn, base, scale, **settings("permutations"))
    assert "\n" not in str(error.value)


def test_parameter_shapes_of_another_map_are_refused():
    fn, base, scale = random_params(3, 8, "sinkhorn")
    with pytest.raises(ValueError, match=r"residual_map='identity' needs fn \[6, 24\], base \[6\], scale \[2\]"):
        mhc_coeffs_pre(torch.randn(1, 2, 3, 8), fn, base, scale, **settings("identity"))
    with pytest.raises(ValueError, match="available maps: sinkhorn, unconstrained, identity, permutations"):
        mhc_coeffs_pre(torch.randn(1, 2, 3, 8), fn, base, scale, **settings("hc"))


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("residual_map", ALL_MAPS)
def test_site_saves_no_more_than_mhc_budget(residual_map, n):
    """Per token, a site of any map keeps the streams, the sublayer output and at most 512 bytes of float32
    coefficients (``mix``, ``rstd``, ``pre``, ``post``, ``comb``), mHC's budget."""
    tokens, hidden = 24, 64
    x = torch.randn(1, tokens, n, hidden, dtype=torch.bfloat16, requires_grad=True)
    fn, base, scale = (p.requires_grad_(True) for p in random_params(n, hidden, residual_map))

    def site():
        y, post, comb = mhc_coeffs_pre(x, fn, base, scale, **settings(residual_map, iters=20))
        return mhc_post_res(x, y, post, comb)

    saved = saved_bytes_for_backward(site, exclude=(fn, base, scale))
    coefficient_bytes = saved / tokens - (n + 1) * hidden * x.element_size()
    rows = sum(ref_sizes(n, residual_map))
    comb_floats = 0 if residual_map == "identity" else n * n
    assert coefficient_bytes == 4 * (rows + 1 + 2 * n + comb_floats) <= 512


# --- models -------------------------------------------------------------------------------------------------------


def variant_model(residual_map, hc_mult=3, **options):
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"), hc_mult=hc_mult, hc_residual_map=residual_map,
                       hc_init="deepseek_v4", **options)
    return MHCForCausalLM(config)


@pytest.mark.parametrize("residual_map", VARIANTS)
def test_model_trains_saves_and_reloads_with_its_map(residual_map, tmp_path):
    torch.set_default_device("cpu")
    model = variant_model(residual_map, **({"hc_post_magnitude": 3.0} if residual_map == "identity" else {}))
    rows = sum(ref_sizes(3, residual_map))
    assert model.model.layers[0].attn_hc.fn.shape == (rows, 3 * 32)
    ids = torch.randint(0, VOCAB, (2, 7))
    out = model(ids, labels=ids)
    out.loss.backward()
    for site in (model.model.layers[1].attn_hc, model.model.layers[0].ffn_hc):
        for parameter in (site.fn, site.base, site.scale):
            grad = parameter.grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    model.save_pretrained(tmp_path)
    reloaded = MHCForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.hc_residual_map == residual_map
    assert reloaded.config.hc_post_magnitude == (3.0 if residual_map == "identity" else 2.0)
    assert_same_weights(reloaded, model)
    with torch.no_grad():
        assert_logits_close(reloaded(ids).logits, model.eval()(ids).logits)


def test_maps_give_the_comb_applied():
    """Diagnostics read ``maps()``: for the identity map its comb is the identity, and the merge of the site's forward
    equals the merge with that comb."""
    torch.set_default_device("cpu")
    model = variant_model("identity")
    site = model.model.layers[0].attn_hc
    streams = torch.randn(2, 5, 3, 32)
    pre, post, comb = site.maps(streams)
    torch.testing.assert_close(comb, torch.eye(3).expand(2, 5, 3, 3), atol=0, rtol=0)  # built, not computed
    y, post_forward, none = site(streams)
    assert none is None
    # Bit-exact: with gradients wanted both run the same coefficient code on the same tensors.
    torch.testing.assert_close(post_forward, post, atol=0, rtol=0)
    torch.testing.assert_close(site.ops.post_res(streams, y, post, None), site.ops.post_res(streams, y, post, comb))


def test_permutations_checkpoint_loads_as_remote_code_without_the_plugin(tmp_path):
    torch.set_default_device("cpu")
    model = variant_model("permutations", hc_mult=4).eval()
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(remote_code_logits(folder, ids, tmp_path), model(ids).logits, atol=1e-5, rtol=1e-5)


# --- hc_implementation --------------------------------------------------------------------------------------------


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("residual_map", ["sinkhorn", "identity", "permutations"])
def test_every_hc_implementation_gives_the_same_logits_and_gradients(residual_map):
    """``reference`` (the plain formula), ``torch``, ``triton`` (the interpreter here) and ``auto`` (torch for CPU
    tensors) agree to float32 rounding, scaled to the values: per module, as a ``scale`` gradient is a sum over every
    token and column that cancels to far below its module's other gradients."""
    torch.set_default_device("cpu")
    model = variant_model(residual_map)
    assert model.model.layers[0].attn_hc.ops.implementation == "auto"
    ids = torch.randint(0, VOCAB, (2, 6))
    model.set_hc_implementation("reference")
    assert model.config.hc_implementation == "reference"
    ref_logits, ref_grads = logits_and_grads(model, ids)
    for implementation in ("torch", "triton", "auto"):
        model.set_hc_implementation(implementation)
        assert {m.ops.implementation for m in model.modules() if hasattr(m, "ops")} == {implementation}
        logits, grads = logits_and_grads(model, ids)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5 * ref_logits.abs().max().item(), rtol=1e-5)
        assert grads.keys() == ref_grads.keys()
        module_scale: dict[str, float] = {}
        for name, ref in ref_grads.items():
            module = name.rsplit(".", 1)[0]
            module_scale[module] = max(module_scale.get(module, 0.0), ref.abs().max().item())
        for name, grad in grads.items():
            atol = 1e-4 * module_scale[name.rsplit(".", 1)[0]]
            torch.testing.assert_close(grad, ref_grads[name], atol=atol, rtol=1e-4, msg=name)


def test_hc_implementation_is_read_when_the_model_is_built(tmp_path):
    torch.set_default_device("cpu")
    variant_model("unconstrained").save_pretrained(tmp_path)
    model = MHCForCausalLM.from_pretrained(tmp_path, hc_implementation="reference")
    assert {m.ops.implementation for m in model.modules() if hasattr(m, "ops")} == {"reference"}


def test_triton_on_cpu_tensors_without_the_interpreter_is_a_one_line_error(monkeypatch):
    torch.set_default_device("cpu")
    model = variant_model("identity", hc_implementation="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors; set TRITON_INTERPRET=1") as error:
        model(torch.randint(0, VOCAB, (1, 4)))
    assert "\n" not in str(error.value) and "hc_implementation='torch'" in str(error.value)


def test_a_failed_kernels_import_warns_once_and_runs_the_reference(monkeypatch, caplog):
    import sys

    from hf_mhc import modeling_mhc

    torch.set_default_device("cpu")
    monkeypatch.setitem(sys.modules, "hf_mhc.kernels", None)  # `import hf_mhc.kernels` now raises ImportError
    modeling_mhc.resolve_hc_ops.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            models = [variant_model("permutations"), variant_model("sinkhorn")]
        warnings = [r.getMessage() for r in caplog.records if "hf_mhc.kernels failed to import" in r.getMessage()]
        assert len(warnings) == 1 and "run the plain reference formula" in warnings[0]
        for model in models:
            assert {m.ops.implementation for m in model.modules() if hasattr(m, "ops")} == {"reference"}
        with pytest.raises(ImportError, match=r"hc_implementation='torch' needs hf_mhc.kernels, which failed to "
                                              r"import .*use hc_implementation='reference'"):
            variant_model("identity", hc_implementation="torch")
    finally:
        modeling_mhc.resolve_hc_ops.cache_clear()


@pytest.mark.parametrize("backend", BACKENDS)
def test_identity_map_is_hy_v4s_hyper_connection(backend):
    """transformers' ``HYV4HyperConnection`` (its ``hc_magnitude`` is ``post_magnitude``) and its decoder layer's merge
    ``post[i] * y + X[i]``, with the same parameters."""
    from transformers import HYV4Config
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4HyperConnection

    n, hidden = 4, 16
    config = HYV4Config(hidden_size=hidden, hc_mult=n, hc_magnitude=MAGNITUDE, hc_eps=HC_EPS, rms_norm_eps=NORM_EPS)
    upstream = HYV4HyperConnection(config)
    fn, base, scale = random_params(n, hidden, "identity")
    with torch.no_grad():
        upstream.fn.copy_(fn), upstream.base.copy_(base), upstream.scale.copy_(scale)
    x = torch.randn(2, 5, n, hidden)
    sublayer_output = torch.randn(2, 5, hidden)
    expected_post, expected_collapsed = upstream(x)
    expected = expected_post.unsqueeze(-1) * sublayer_output.unsqueeze(-2) + x
    y, post, comb = mhc_coeffs_pre(x, fn, base, scale, backend=backend, **settings("identity"))
    torch.testing.assert_close(post, expected_post, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y, expected_collapsed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mhc_post_res(x, sublayer_output, post, comb, backend=backend), expected,
                               atol=1e-5, rtol=1e-5)


# --- conversion ---------------------------------------------------------------------------------------------------


def test_convert_with_a_residual_map_writes_it_and_verifies(tmp_path, capsys):
    """``hf-mhc convert --residual-map identity``: config.json keeps the map, the folder loads, verification passes
    (the map's function-preserving start reproduces the source), and the model card names the map."""

    torch.set_default_device("cpu")
    source = save_source(tmp_path / "src", "qwen2")
    status, stdout, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--hc-mult", "3", "--residual-map",
                                  "identity")
    assert status == 0, err
    converted = MHCForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert converted.config.hc_residual_map == "identity"
    assert converted.model.layers[0].attn_hc.fn.shape == (6, 3 * 32)
    assert "residual map `identity`" in (tmp_path / "out" / "README.md").read_text()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)


def test_convert_refuses_permutations_of_five_streams_in_one_line(tmp_path, capsys):

    torch.set_default_device("cpu")
    save_source(tmp_path / "src", "llama")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--hc-mult", "5", "--residual-map",
                             "permutations")
    assert_one_line_error(status, err, "hc_residual_map='permutations' supports hc_mult <= 4")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("residual_map", VARIANTS)
def test_custom_op_registration_for_each_map(residual_map):
    """``torch.library.opcheck``: schemas, fake (meta) results and autograd registrations, with each map's shapes,
    also for the identity merge's empty ``comb``."""
    from hf_mhc.kernels.coeffs_op import mhc_coeffs_fwd_op
    from hf_mhc.kernels.coeffs_pre_op import mhc_coeffs_pre_fwd_op
    from hf_mhc.kernels.post_res_op import mhc_post_res_fwd_op

    n, hidden = 3, 8
    streams = torch.randn(2, 3, n, hidden, requires_grad=True)
    params = tuple(p.requires_grad_(True) for p in random_params(n, hidden, residual_map))
    magnitude = MAGNITUDE if residual_map == "identity" else 2.0
    for op in (mhc_coeffs_fwd_op, mhc_coeffs_pre_fwd_op):
        torch.library.opcheck(op, (streams, *params, 3, HC_EPS, NORM_EPS, "torch", residual_map, magnitude))
    if residual_map == "identity":
        torch.library.opcheck(mhc_post_res_fwd_op, (streams, torch.randn(2, 3, hidden, requires_grad=True),
                                                    torch.rand(2, 3, n, requires_grad=True), torch.zeros(0), "torch",
                                                    True))


@pytest.mark.parametrize("residual_map", ["identity", "permutations"])
def test_model_with_a_residual_map_compiles_with_fullgraph(residual_map):
    torch.set_default_device("cpu")
    model = variant_model(residual_map)
    ids = torch.randint(0, VOCAB, (1, 6))
    expected = model(ids).logits
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("residual_map", ["identity", "unconstrained"])
def test_selective_recomputation_gives_the_same_gradients(residual_map):
    torch.set_default_device("cpu")
    model = variant_model(residual_map)
    ids = torch.randint(0, VOCAB, (2, 6))
    logits, grads = logits_and_grads(model, ids)
    model.config.hc_recompute = True
    recomputed_logits, recomputed = logits_and_grads(model, ids)
    # Bit-exact: the checkpointed regions run the same ops, in the same order, on the same tensors.
    torch.testing.assert_close(recomputed_logits, logits, atol=0, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed[name], grad, atol=1e-6, rtol=1e-5, msg=name)
