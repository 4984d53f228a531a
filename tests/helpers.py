"""Builders shared by the tests: tiny random targets and drafts on disk, reference decoding."""

import json
import os
import random
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from safetensors.numpy import load_file

from numerics import assert_fp32_close

import dspark_fn
from dspark_fn.cache import settle
from dspark_fn.checkpoints import save_draft
from dspark_fn.drafts import resolve_arch
from dspark_fn.drafts.fresh import random_draft_weights

def missing_prerequisite(reason: str, module_level: bool = False) -> None:
    """Skip a test whose fixture or package is absent on a developer's machine;
    under CI (``CI`` set) fail instead, so a lost fixture cannot pass silently."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI requires it)", pytrace=False)
    pytest.skip(reason, allow_module_level=module_level)


PARITY = Path(os.environ.get("DSPARK_PARITY_DIR", Path(__file__).resolve().parent / "fixtures" / "parity"))


def target_config(model_type="qwen3", vocab=256, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16, tied=True):
    return {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tied,
        "attention_bias": model_type == "qwen2",
        "hidden_act": "silu",
    }


def build_target(directory: Path, config: dict, seed: int = 0, gain: float = 2.5, vector_spread: float = 0.0):
    """A random mlx-lm model saved as an HF directory; weights scaled up so
    greedy argmax margins stay far above float32 noise. ``vector_spread > 0``
    scales each 1-D tensor (norm weights, layer scalars) by U(1 - s, 1 + s) so
    that code ignoring one of them fails."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))

    def randomised(w):
        if w.ndim == 2:
            return w * gain
        if w.ndim == 1 and vector_spread:
            return w * mx.random.uniform(1 - vector_spread, 1 + vector_spread, w.shape)
        return w

    model.update(tree_map(randomised, model.parameters()))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return model


def draft_config(target: dict, layers=2, taps=(1, 3), block_size=7, markov_rank=8, mask_token_id=None, model_type="qwen3"):
    """A DeepSpec-style draft config derived from the target's (qwen3 drafts serve any llama-family target)."""
    config = dict(target)
    config.update(
        model_type=model_type,
        num_hidden_layers=layers,
        num_target_layers=target["num_hidden_layers"],
        target_layer_ids=list(taps),
        block_size=block_size,
        mask_token_id=target["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        tie_word_embeddings=False,
    )
    return config


def build_draft(directory: Path, config: dict, seed: int = 0, gain: float = 2.0, with_shared=False):
    arch = resolve_arch(config)
    weights = random_draft_weights(arch, arch.spec_from_config(config), seed=seed, gain=gain)
    if not with_shared:
        weights = {k: v for k, v in weights.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    return save_draft(directory, config, weights)


def build_pair(root: Path, config: dict, block_size: int):
    """A random target in ``root/target`` and a one-layer draft on taps 0 and 1 in ``root/draft``;
    returns the target's mlx-lm model."""
    model = build_target(root / "target", config, seed=7)
    build_draft(root / "draft", draft_config(config, layers=1, taps=(0, 1), block_size=block_size), seed=2)
    return model


def build_bigram_draft(directory: Path, config: dict, model, context, scale=1.0, seed=0, **draft_kwargs):
    """A draft that predicts like a bigram model of the target: its own head
    is zero and its Markov head holds ``scale`` x the target's next-token
    logits after ``context + [token]``, for every token. ``scale > 0`` gives
    proposals that often match the target; ``scale < 0`` proposes what the
    target rarely picks. Its confidence after token ``x`` is the measured
    acceptance rate ``1 - TV`` (at temperature 1) of its proposal against the
    target after a few random contexts ending in ``x``: what DeepSpec trains
    the confidence head to predict."""
    vocab = config["vocab_size"]
    table = model(mx.array([list(context) + [token] for token in range(vocab)]))[:, -1, :].astype(mx.float32)
    draft = draft_config(config, markov_rank=vocab, **draft_kwargs)
    arch = resolve_arch(draft)
    weights = random_draft_weights(arch, arch.spec_from_config(draft), seed=seed, gain=2.0)
    del weights["embed_tokens.weight"]
    weights["lm_head.weight"] = mx.zeros_like(weights["lm_head.weight"])
    weights["markov_head.markov_w1.weight"] = mx.eye(vocab)
    weights["markov_head.markov_w2.weight"] = scale * table.T
    accept = mx.clip(bigram_acceptance(model, scale * table, seed), 1e-4, 1 - 1e-4)
    hidden = mx.zeros((config["hidden_size"],))
    weights["confidence_head.proj.weight"] = mx.concatenate([hidden, mx.log(accept / (1 - accept))])[None]
    return save_draft(directory, draft, weights)


def bigram_acceptance(model, table: mx.array, seed: int, contexts: int = 8, length: int = 6) -> mx.array:
    """``[V]``: mean ``sum_v min(p_target(v), q(v))`` over random contexts ending in each token."""
    vocab = table.shape[0]
    prefixes = np.random.default_rng(seed).integers(0, vocab, size=(contexts, length))
    rows = [prefix.tolist() + [token] for token in range(vocab) for prefix in prefixes]
    target = mx.softmax(model(mx.array(rows))[:, -1, :].astype(mx.float32), axis=-1).reshape(vocab, contexts, vocab)
    proposal = mx.softmax(table, axis=-1)[:, None, :]
    return mx.minimum(target, proposal).sum(axis=-1).mean(axis=1)


def damp_attention(directory: Path, model, factor: float):
    """Scale every attention output projection of a built target by ``factor``
    and save it again: the next token then depends mostly on the current one,
    which a bigram draft predicts well (acceptance between none and all)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * factor
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return model


def mlx_lm_greedy(model, prompt, n):
    """The target alone, greedy, through mlx-lm's own decoding loop."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(token) for token, _ in steps]


def speculative_tokens(params, prompt, n, **kwargs):
    return [t for event in dspark_fn.generate(params, prompt, n, **kwargs) for t in event.emitted]


def random_prompt(rng: np.random.Generator, length: int, vocab: int):
    return rng.integers(0, vocab - 1, size=length).tolist()


def wrong_token(token: int, vocab: int) -> int:
    return (token + 1) % vocab


# Proposals built from the target's own greedy stream ``truth`` for round ``r``.
PROPOSALS = {
    "always-right": lambda truth, r, vocab: truth,
    "always-wrong": lambda truth, r, vocab: [wrong_token(t, vocab) for t in truth],
    # right for the first (round % width) slots, then wrong
    "partly-right": lambda truth, r, vocab: [
        t if i < r % (len(truth) + 1) else wrong_token(t, vocab) for i, t in enumerate(truth)
    ],
}


def right_prefix(proposal: list, truth: list) -> int:
    return next((i for i, (a, b) in enumerate(zip(proposal, truth)) if a != b), len(proposal))


def drive_proposals(model, params, vocab: int, prompts: list, kind: str, new_tokens: int, shift: int = 1,
                    truths: list | None = None, capacity: int = 512):
    """Verify proposals of ``kind`` in rounds over a batch of ``prompts`` (row
    ``b`` uses round ``r + shift * b``, so rows accept different counts);
    checks every round keeps exactly each row's right prefix until the row has
    ``new_tokens`` (then it only rides along) and returns ``(streams, rounds)``.
    The greedy streams proposals are made from are mlx-lm's of ``model``, or
    ``truths`` (at least ``new_tokens`` + the verify width of each row)."""
    width = params.spec.block_size + 1
    if truths is None:
        truths = [mlx_lm_greedy(model, prompt, new_tokens + width) for prompt in prompts]
    cache, anchors = dspark_fn.prefill(params, dspark_fn.init_cache(params, len(prompts), capacity), prompts)
    streams, r = [[t] for t in anchors.tolist()], 0
    while min(len(s) for s in streams) < new_tokens:
        running = [len(s) < new_tokens for s in streams]
        proposals = [
            PROPOSALS[kind](truth[len(s) : len(s) + width - 1], r + shift * b, vocab) if live else [0] * (width - 1)
            for b, (truth, s, live) in enumerate(zip(truths, streams, running))
        ]
        block = mx.concatenate([anchors[:, None], mx.array(proposals, mx.int32)], axis=1)
        cache, result = dspark_fn.verify_block(params, cache, block)
        counts, anchors = result.count.tolist(), result.next_tokens
        for b, (s, p, truth) in enumerate(zip(streams, proposals, truths)):
            if running[b]:
                assert counts[b] == right_prefix(p, truth[len(s):]) + 1, f"round {r} row {b}"
                s += result.emitted[b, : counts[b]].tolist()
        r += 1
    assert [s[:new_tokens] for s in streams] == [t[:new_tokens] for t in truths]
    return streams, r


# ---- parity replays against the DeepSpec reference traces (tests/fixtures/parity/<case>)

PARITY_CAPACITY = 128


def parity_budget(params) -> dict:
    """The fp32 error budget of a replay: every target and draft layer on the
    path, sums as long as the widest projection or the attended context."""
    target, draft = params.spec.target, params.spec.draft
    widths = [target.hidden_size * len(draft.target_layer_ids), PARITY_CAPACITY]
    widths += [getattr(spec, "intermediate_size", 0) for spec in (target, draft)]
    return dict(layers=target.num_layers + getattr(draft, "num_layers", 0), reduction=max(widths))


def close(actual, expected, what, budget: dict):
    assert_fp32_close(actual, expected, what, **budget)


def load_parity_case(root: Path):
    """The fixture's target + draft as ``Params`` and its natural/forced traces ``(tensors, meta)``."""
    params = dspark_fn.load(root / "target", root / "draft")
    traces = {
        mode: (load_file(str(root / f"{name}.safetensors")), json.loads((root / f"{name}.json").read_text()))
        for mode, name in (("natural", "trace"), ("forced", "trace_forced"))
    }
    return params, traces


def check_prefill(params, tensors, meta):
    """Target logits and tapped features over the prompt, and the first token."""
    spec, budget = params.spec, parity_budget(params)
    kv = spec.target_adapter.init_kv(spec.target, 1, 64)
    prompt = mx.array([meta["prompt_ids"]])
    hidden, features, _ = spec.target_adapter.forward(
        spec.target, params.target, kv, prompt, mx.array([0]), spec.taps
    )
    close(spec.target_adapter.logits(spec.target, params.target, hidden)[0], tensors["prefill_logits"], "prefill logits", budget)
    close(features[0], tensors["prefill_features"], "prefill features", budget)
    cache, first = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, PARITY_CAPACITY), meta["prompt_ids"])
    assert first.tolist() == [meta["first_token"]]
    assert cache.length.tolist() == [meta["prompt_len"]]


def check_rounds(params, tensors, meta):
    """Replay the recorded verify inputs; every round's draft outputs and
    verify decisions must equal the reference."""
    budget = parity_budget(params)
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, PARITY_CAPACITY), meta["prompt_ids"])
    emitted = list(tokens.tolist())
    for r, recorded in enumerate(meta["rounds"]):
        assert tokens.tolist() == [recorded["anchor_token"]], f"round {r} anchor"
        assert cache.length.tolist() == [recorded["anchor_pos"]], f"round {r} position"
        proposal = dspark_fn.draft_block(params, cache, tokens)
        close(proposal.hidden[0], tensors["block_hidden"][r], f"round {r} block hidden", budget)
        close(proposal.base_logits[0], tensors["base_logits"][r], f"round {r} base logits", budget)
        close(proposal.logits[0], tensors["corrected_logits"][r], f"round {r} corrected logits", budget)
        close(proposal.confidence_logits[0], tensors["confidence_logits"][r], f"round {r} confidence logits", budget)
        close(mx.sigmoid(proposal.confidence_logits[0]), tensors["confidences"][r], f"round {r} confidences", budget)
        assert proposal.tokens[0].tolist() == recorded["draft_tokens"], f"round {r} drafted tokens"

        block = mx.array([recorded["verify_input_ids"]], mx.int32)
        cache, result = dspark_fn.verify_block(params, cache, block)
        assert result.accepted.tolist() == [recorded["accepted"]], f"round {r} accepted"
        count = result.count.item()
        assert result.emitted[0, :count].tolist() == recorded["emitted"], f"round {r} emitted"
        tokens = result.next_tokens
        emitted += recorded["emitted"]
    assert emitted == meta["output_tokens"]
    if meta["mode"] == "forced":
        # the forced schedule exercises every acceptance length 0..block_size
        assert {r["accepted"] for r in meta["rounds"]} == set(range(meta["block_size"] + 1))


def check_natural_generation(params, meta):
    """``generate`` reproduces the natural trace: output, drafts and acceptances."""
    events = list(dspark_fn.generate(params, meta["prompt_ids"], len(meta["output_tokens"]), width=None))
    assert [t for e in events for t in e.emitted] == meta["output_tokens"]
    rounds = [e for e in events if e.kind == "round"]
    assert [e.drafted for e in rounds] == [r["draft_tokens"] for r in meta["rounds"]]
    assert [e.accepted for e in rounds] == [r["accepted"] for r in meta["rounds"]]


def check_draft_context_cache(params, tensors, meta):
    """Draft context K/V before rounds 0 and 1 equal the reference cache (context rows only)."""
    budget = parity_budget(params)
    cache, _ = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, PARITY_CAPACITY), meta["prompt_ids"])
    for r in range(2):
        block = mx.array([meta["rounds"][r]["verify_input_ids"]], mx.int32)
        expected_k, expected_v = tensors[f"debug.r{r}.cache_k"], tensors[f"debug.r{r}.cache_v"]
        # The reference cache holds context up to this round's anchor position.
        length = expected_k.shape[2]
        assert cache.length.item() == length
        for layer, (keys, values) in enumerate(cache.draft):
            close(keys[0, :, :length], expected_k[layer], f"round {r} layer {layer} keys", budget)
            close(values[0, :, :length], expected_v[layer], f"round {r} layer {layer} values", budget)
        cache, _ = dspark_fn.verify_block(params, cache, block)


class TargetRunner:
    """A target adapter's pure forward over fixed buffers, one call per step: logits of one row.

    ``kept`` (default: all of ``tokens``) is how many of the call's tokens are
    committed: recurrent layers settle on the state after them, as a round does.
    """

    def __init__(self, adapter, spec, params, capacity=128, taps=()):
        self.adapter, self.spec, self.params, self.taps = adapter, spec, params, taps
        self.kv = adapter.init_kv(spec, 1, capacity)
        self.features = None

    def __call__(self, tokens: list, start: int, kept: int | None = None) -> np.ndarray:
        hidden, self.features, kv = self.adapter.forward(
            self.spec, self.params, self.kv, mx.array([tokens]), mx.array([start]), self.taps
        )
        self.kv = settle(kv, mx.array([len(tokens) if kept is None else kept]))
        return np.array(self.adapter.logits(self.spec, self.params, hidden)[0])


def free_port() -> int:
    """A local TCP port free when called (the system's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def running(app):
    """An ASGI ``app`` served by uvicorn on a free local port, in a thread, for
    the ``with`` block: its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def ring_launcher(ranks: int) -> tuple[str, ...]:
    """``mlx.launch`` over the ring backend on ``ranks`` local processes, at
    ports free when called. The ring binds one port per rank from its starting
    port; they are taken below Linux's ephemeral range (32768 and up) because a
    port there can be held, as a client connection's end or in TIME_WAIT, by
    any of the suite's HTTP requests, and the rank that cannot bind it exits."""
    for _ in range(100):
        start = random.randrange(20000, 32768 - ranks)
        try:
            for port in range(start, start + ranks):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        launcher = Path(sys.executable).parent / "mlx.launch"  # installed with mlx beside this interpreter
        return str(launcher), "-n", str(ranks), "--backend", "ring", "--starting-port", str(start)
    raise RuntimeError("no run of free ports below 32768 for the ring backend")
