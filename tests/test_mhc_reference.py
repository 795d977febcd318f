"""``hf_mhc.mhc_reference``, the plain formulas: in float64 they are the oracle (their own exact derivative), in float32
(``hc_implementation="reference"``, and the fallback of checkpoints loaded without the plugin) they match it; the
permutation limit; the function-preserving initialisation."""

from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace

import pytest
import torch
from reference_check import check_against_reference, leaf, random_head_params, random_site_params

from hf_mhc import mhc_reference
from hf_mhc.mhc_reference import MAX_PERMUTATION_STREAMS, RESIDUAL_MAPS

HC_EPS = 1e-6
NORM_EPS = 1e-6
MAGNITUDE = 2.5  # the identity map's post magnitude: not 2, so that a hard-coded 2 fails


def map_cases(streams=(1, 2, 3, 4, 5, 6, 7, 8)) -> list:
    return [pytest.param(residual_map, n, id=f"{residual_map}-n{n}") for residual_map in RESIDUAL_MAPS
            for n in streams if residual_map != "permutations" or n <= MAX_PERMUTATION_STREAMS]


def settings(residual_map: str, iters: int = 20) -> dict:
    return dict(sinkhorn_iters=iters, eps=HC_EPS, norm_eps=NORM_EPS, residual_map=residual_map,
                post_magnitude=MAGNITUDE if residual_map == "identity" else 2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("residual_map", "n"), map_cases())
def test_float32_site_matches_the_oracle(residual_map, n, dtype):
    """A site computed in float32 (the default): ``mhc_coeffs``, and ``mhc_coeffs_pre`` then ``mhc_post_res``."""
    x = leaf(torch.randn(2, 3, n, 8).to(dtype))
    params = [leaf(p) for p in random_site_params(n, 8, residual_map)]
    formula = functools.partial(mhc_reference.mhc_coeffs, **settings(residual_map))
    pre, post, comb = check_against_reference(formula, formula, [x, *params])
    assert pre.dtype == post.dtype == comb.dtype == torch.float32

    def site(x, fn, base, scale, sublayer_output, compute_dtype=torch.float32):
        y, post, comb = mhc_reference.mhc_coeffs_pre(x, fn, base, scale, compute_dtype=compute_dtype,
                                                     **settings(residual_map))
        return y, mhc_reference.mhc_post_res(x, sublayer_output, post, comb, compute_dtype=compute_dtype)

    y, new = check_against_reference(site, site, [x, *params, leaf(torch.randn(2, 3, 8).to(dtype))])
    assert y.dtype == new.dtype == dtype


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_float32_head_and_sinkhorn_match_the_oracle(n):
    x = leaf(torch.randn(2, 3, n, 8))
    head = functools.partial(mhc_reference.mhc_head, eps=HC_EPS, norm_eps=NORM_EPS)
    check_against_reference(head, head, [x, *(leaf(p) for p in random_head_params(n, 8))])
    project = functools.partial(mhc_reference.sinkhorn, iters=20, eps=HC_EPS)
    check_against_reference(project, project, [leaf(torch.randn(2, 3, n, n) * 3)])


@pytest.mark.parametrize("residual_map", RESIDUAL_MAPS)
def test_float64_formulas_are_their_own_exact_derivative(residual_map):
    """``torch.autograd.gradcheck`` in float64: a formula that dropped to float32 anywhere (a ``compute_dtype`` not
    passed on) fails, as would a formula whose autograd graph is not its derivative."""
    n, hidden = 3, 4
    x = torch.randn(1, 2, n, hidden, dtype=torch.float64, requires_grad=True)
    params = [p.double().requires_grad_(True) for p in random_site_params(n, hidden, residual_map)]
    float64 = dict(compute_dtype=torch.float64)

    def site(x, fn, base, scale, sublayer_output):
        y, post, comb = mhc_reference.mhc_coeffs_pre(x, fn, base, scale, **settings(residual_map, iters=5), **float64)
        return y, mhc_reference.mhc_post_res(x, sublayer_output, post, comb, **float64)

    sublayer_output = torch.randn(1, 2, hidden, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(site, (x, *params, sublayer_output))
    if residual_map == "sinkhorn":
        head = [p.double().requires_grad_(True) for p in random_head_params(n, hidden)]
        assert torch.autograd.gradcheck(
            functools.partial(mhc_reference.mhc_head, eps=HC_EPS, norm_eps=NORM_EPS, **float64), (x, *head))


def test_compute_dtype_sets_the_coefficients_dtype_and_streams_keep_theirs():
    x = torch.randn(1, 2, 3, 8)
    pre, post, comb = mhc_reference.mhc_coeffs(x, *random_site_params(3, 8), compute_dtype=torch.float64,
                                               **settings("sinkhorn"))
    assert pre.dtype == post.dtype == comb.dtype == torch.float64
    assert mhc_reference.mhc_pre(x, pre, compute_dtype=torch.float64).dtype == torch.float32
    y = torch.randn(1, 2, 8)
    assert mhc_reference.mhc_post_res(x, y, post, comb, compute_dtype=torch.float64).dtype == torch.float32


def test_permutation_limit_is_one_message():
    """The text ``MHCConfig`` (``hc_mult``, ``hc_residual_map``) and the ops (``n``, ``residual_map``) raise."""
    for n in range(1, MAX_PERMUTATION_STREAMS + 1):
        mhc_reference.check_permutation_streams(n, "n")
    with pytest.raises(ValueError) as error:
        mhc_reference.check_permutation_streams(5, "hc_mult", "hc_residual_map")
    assert str(error.value) == ("hc_residual_map='permutations' supports hc_mult <= 4: it mixes all n! permutation "
                                "matrices, a cost that grows as n! (24 at n=4, 120 at n=5); got hc_mult=5.")
    with pytest.raises(ValueError, match=r"^residual_map='permutations' supports n <= 4: .*; got n=6\.$"):
        mhc_reference.check_permutation_streams(6, "n")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_permutation_matrices_start_with_the_identity_in_lexicographic_order(n):
    matrices = mhc_reference.permutation_matrices(n, dtype=torch.float64)
    assert matrices.dtype == torch.float64 and matrices.shape[0] == len(list(itertools.permutations(range(n))))
    assert torch.equal(matrices[0], torch.eye(n, dtype=torch.float64))
    assert torch.equal(matrices.sum(-1), torch.ones(matrices.shape[:2], dtype=torch.float64))
    assert torch.equal(matrices.sum(-2), torch.ones(matrices.shape[:2], dtype=torch.float64))
    order = [tuple(matrix.argmax(-1).tolist()) for matrix in matrices]
    assert order == sorted(order) and len(set(order)) == len(order)


def test_map_sizes_and_streams_of_agree():
    for residual_map, n in itertools.product(RESIDUAL_MAPS, range(1, 6)):
        base = torch.zeros(sum(mhc_reference.map_sizes(n, residual_map)))
        assert mhc_reference.streams_of(base, residual_map) == n
    with pytest.raises(ValueError, match="available maps: sinkhorn, unconstrained, identity, permutations"):
        mhc_reference.map_sizes(3, "hc")


def init_config(residual_map: str, n: int) -> SimpleNamespace:
    """The ``MHCConfig`` attributes the initialisation reads."""
    return SimpleNamespace(hc_mult=n, hc_eps=HC_EPS, hc_residual_map=residual_map, hc_init_post_delta=0.5,
                           hc_init_comb_diag=4.0, hc_sinkhorn_iters=20, hc_post_magnitude=MAGNITUDE)


@pytest.mark.parametrize("sublayer_index", [0, 3])
@pytest.mark.parametrize(("residual_map", "n"), map_cases(streams=(1, 2, 3, 4)))
def test_function_preserving_start_carries_the_residual_network(residual_map, n, sublayer_index):
    """With ``fn = 0`` and the function-preserving ``base``, a site on streams that are copies of ``m`` collapses to
    ``m`` and its merge has the stream mean ``s^(k+1)·y + s·m`` at site ``k`` (``s`` = comb's row sum: exactly 1 for
    all maps but Sinkhorn's, whose ``hc_eps`` terms make it ``1 - O(hc_eps)``); the head averages the streams."""
    config = init_config(residual_map, n)
    base = mhc_reference.function_preserving_hc_base(config, sublayer_index).double()
    fn = torch.zeros(base.shape[0], n * 8, dtype=torch.float64)
    scale = torch.ones(mhc_reference.scale_size(residual_map), dtype=torch.float64)
    m, y = torch.randn(2, 3, 1, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    streams = m.expand(2, 3, n, 8)
    float64 = dict(compute_dtype=torch.float64, **settings(residual_map))
    collapsed, post, comb = mhc_reference.mhc_coeffs_pre(streams, fn, base, scale, **float64)
    row_sum = 1.0 if comb is None else comb.sum(-1).mean().item()
    merged = mhc_reference.mhc_post_res(streams, y, post, comb, compute_dtype=torch.float64)
    # base is stored in float32: the maps are exact up to its rounding
    torch.testing.assert_close(collapsed, m.squeeze(-2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merged.mean(-2), row_sum ** (sublayer_index + 1) * y + row_sum * m.squeeze(-2),
                               atol=1e-6, rtol=1e-6)
    head = (torch.zeros(n, n * 8, dtype=torch.float64), mhc_reference.function_preserving_head_base(config).double(),
            torch.ones(1, dtype=torch.float64))
    torch.testing.assert_close(mhc_reference.mhc_head(streams, *head, eps=HC_EPS, norm_eps=NORM_EPS,
                                                      compute_dtype=torch.float64), m.squeeze(-2), atol=1e-6, rtol=1e-6)
