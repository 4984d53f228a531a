"""Side-by-side speed: the target alone (mlx-lm greedy ``generate_step``) vs
dspark on the same weights and prompts, in one process, medians of repeats."""

import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx

from .buffers import capacity_for, init_cache
from .constraints import Grammar
from .driver import generate
from .prefilling import prefill, prefill_slots
from .rounds import propose, verify
from .sampling import allowed_tokens
from .stats import Tally
from .types import Params


def baseline_tokens(model, prompt: list[int], max_new_tokens: int, stop: set, temperature: float = 0.0,
                    grammar: Grammar | None = None, on_token=None) -> list[int]:
    """Decoding with mlx-lm's generate_step (greedy, or sampled at ``temperature``
    with mlx-lm's own sampler), cut at the first stop token; under ``grammar``
    its mask is applied to the logits (a logits processor), as constrained
    decoding does. ``on_token(count)`` hears of each token as it comes."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    tokens = []
    sampler = make_sampler(temp=temperature) if temperature else (lambda x: mx.argmax(x, axis=-1))
    processors = [] if grammar is None else [grammar_processor(grammar, len(prompt))]
    steps = generate_step(mx.array(prompt), model, max_tokens=max_new_tokens, sampler=sampler,
                          logits_processors=processors)
    for token, _ in steps:
        tokens.append(int(token))
        if on_token is not None:
            on_token(len(tokens))
        if tokens[-1] in stop:
            break
    return tokens


def grammar_processor(grammar: Grammar, prompt_length: int):
    """An mlx-lm logits processor holding the tokens after the prompt to ``grammar``."""
    matcher = grammar.matcher()
    followed = [prompt_length]  # tokens of the sequence the matcher has seen, the prompt included

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        matcher.commit(tokens[followed[0]:].tolist())
        followed[0] = tokens.shape[-1]
        return mx.where(allowed_tokens(mx.array(matcher.mask()), logits.shape[-1]), logits, -mx.inf)

    return processor


def dspark_tokens(params, prompt, max_new_tokens, stop, acceptance: Tally | None = None, **options):
    tokens = []
    for event in generate(params, prompt, max_new_tokens, stop_tokens=stop, **options):
        tokens += event.emitted
        if acceptance is not None:
            acceptance.count(event)
    return tokens


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def evaluated(fn, *args):
    out = fn(*args)
    mx.eval(out)
    return out


def stage_seconds(params, prompt, max_new_tokens, stop) -> tuple[float, float, int]:
    """Seconds spent drafting and verifying, and the number of rounds, timed
    apart (a host sync between the stages, which ``generate`` does not pay)."""
    width = params.spec.block_size + 1
    capacity = capacity_for(max(prefill_slots(len(prompt)), len(prompt) + max_new_tokens + width))
    cache, tokens = prefill(params, init_cache(params, 1, capacity), [prompt])
    drafting = verifying = 0.0
    rounds, produced, token = 0, 1, tokens.item()
    while produced < max_new_tokens and token not in stop:
        proposal, seconds = timed(evaluated, propose, params, cache, tokens)
        drafting += seconds
        (cache, result), seconds = timed(evaluated, verify, params, cache, tokens, proposal, width)
        verifying += seconds
        rounds += 1
        emitted = result.emitted[0, : result.count.item()].tolist()
        produced, token, tokens = produced + len(emitted), emitted[-1], result.next_tokens
        if stop & set(emitted):
            break
    return drafting, verifying, rounds


@dataclass
class BenchResult:
    baseline_tokens_per_s: list = field(default_factory=list)
    dspark_tokens_per_s: list = field(default_factory=list)
    acceptance: Tally = field(default_factory=Tally)
    identical: bool | None = True  # None: sampled, nothing to compare token by token
    prompts: int = 0
    stages: list = field(default_factory=lambda: [0.0, 0.0, 0])

    def summary(self) -> dict:
        baseline = statistics.median(self.baseline_tokens_per_s) if self.baseline_tokens_per_s else 0.0
        dspark = statistics.median(self.dspark_tokens_per_s) if self.dspark_tokens_per_s else 0.0
        return {
            "prompts": self.prompts,
            "repeats": len(self.dspark_tokens_per_s),
            "baseline_tokens_per_s": baseline,
            "dspark_tokens_per_s": dspark,
            "speedup": dspark / baseline if baseline else 0.0,
            "tau": self.acceptance.tau,
            "acceptance_rate": self.acceptance.acceptance_rate,
            "per_slot_acceptance": self.acceptance.per_slot,
            "drafted_share": self.acceptance.drafted_share,
            "sources": self.acceptance.sources(),
            "identical": self.identical,
            "draft_ms_per_round": 1e3 * self.stages[0] / max(self.stages[2], 1),
            "verify_ms_per_round": 1e3 * self.stages[1] / max(self.stages[2], 1),
        }


def run_side_by_side(candidates: dict, model, prompts, max_new_tokens, stop, repeats=3, on_step=lambda: None,
                     **options) -> dict[str, BenchResult]:
    """Each repeat runs every prompt through the target alone once, then through each
    candidate ``{name: params}`` or ``{name: (params, options of its own)}`` (the order
    rotating by repeat); tokens/s per repeat, so every candidate's ratio shares one
    baseline. Returns a result per candidate. With ``sampling=Sampling(temperature=T)``
    among the options the target alone samples at T too (mlx-lm's sampler), and
    tokens are not compared."""
    if not candidates:
        raise ValueError("run_side_by_side needs at least one candidate: pass {name: params}")
    stop = set(stop)
    names = list(candidates)
    candidates = {name: (value, {}) if isinstance(value, Params) else value for name, value in candidates.items()}
    temperature = getattr(options.get("sampling"), "temperature", 0.0)
    results = {name: BenchResult(prompts=len(prompts), identical=True if not temperature else None) for name in names}
    # Warm-up: compile dspark's kernels and mlx-lm's graph once, outside the timings.
    for params, own in candidates.values():
        dspark_tokens(params, prompts[0], 8, stop, **options, **own)
    baseline_tokens(model, prompts[0], 8, stop, temperature)
    for repeat in range(repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        baseline = [0, 0.0]  # tokens, seconds; apart from the candidates', whatever their names
        counts = {name: [0, 0.0] for name in names}
        for prompt in prompts:
            expected, seconds = timed(baseline_tokens, model, prompt, max_new_tokens, stop, temperature)
            baseline[0] += len(expected)
            baseline[1] += seconds
            for name in order:
                result = results[name]
                acceptance = result.acceptance if repeat == 0 else None
                params, own = candidates[name]
                tokens, seconds = timed(dspark_tokens, params, prompt, max_new_tokens, stop, acceptance,
                                        **options, **own)
                counts[name][0] += len(tokens)
                counts[name][1] += seconds
                if not temperature:
                    result.identical &= tokens == expected
            on_step()
        for name, result in results.items():
            result.baseline_tokens_per_s.append(baseline[0] / baseline[1])
            result.dspark_tokens_per_s.append(counts[name][0] / counts[name][1])
    return results


def run_bench(params, model, prompts, max_new_tokens, stop, repeats=3, on_step=lambda: None, **options) -> BenchResult:
    """The target alone vs one dspark pair (``run_side_by_side``), with draft and verify time per round."""
    result = run_side_by_side({"dspark": params}, model, prompts, max_new_tokens, stop, repeats, on_step,
                              **options)["dspark"]
    for prompt in prompts:
        result.stages = [a + b for a, b in zip(result.stages, stage_seconds(params, prompt, max_new_tokens, set(stop)))]
    return result
