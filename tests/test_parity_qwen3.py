"""Parity with the DeepSpec reference traces in ../shared/parity/qwen3_tiny."""

import pytest

from helpers import check_draft_context_cache, check_natural_generation, check_prefill, check_rounds, load_parity_case


@pytest.fixture(scope="module")
def case(parity_dir):
    return load_parity_case(parity_dir / "qwen3_tiny")


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
