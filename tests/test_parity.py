"""Parity with the DeepSpec reference traces in tests/fixtures/parity (qwen3 and gemma4 cases).

gemma4_tiny mixes sliding and full-attention target layers with K=V full
layers, a softcap and non-unit ``layer_scalar``s; its draft uses the target's
full-attention geometry.
"""

import pytest

from helpers import check_draft_context_cache, check_natural_generation, check_prefill, check_rounds, load_parity_case

pytestmark = pytest.mark.numerics  # rerun on the bundled BLAS by .ci/run

CASES = ["qwen3_tiny", "gemma4_tiny"]


@pytest.fixture(scope="module", params=CASES)
def case(request, parity_dir):
    return load_parity_case(parity_dir / request.param)


def test_prefill_matches_reference(case):
    params, traces = case
    check_prefill(params, *traces["natural"])


@pytest.mark.parametrize("mode", ["natural", "forced"])
def test_rounds_match_reference(case, mode):
    params, traces = case
    check_rounds(params, *traces[mode])


def test_natural_generation_matches_reference(case):
    params, traces = case
    check_natural_generation(params, traces["natural"][1])


def test_draft_context_cache_matches_reference(case):
    params, traces = case
    check_draft_context_cache(params, *traces["forced"])
