"""What the store (``dspark_fn.store``: the target's past answers as n-gram
tables) would be worth as a proposal source, simulated offline on the
held-out split, and the shipped store built.

    python bench/store_sim.py           # tau per family: copies, the store, either, the store learning
    python bench/store_sim.py sizes     # file size and tau of stores pruned in other ways
    python bench/store_sim.py designs   # lookup time and memory: n-gram tables vs a suffix array
    python bench/store_sim.py build     # writes the shipped store (dspark_fn/default_store/store.npz)

The store holds the committed corpus's answers less those of the held-out
prompts (the split's 36 prompts taken from the corpus); no evaluation set
is in the corpus (tests/test_held_out.py). The held-out answers are the
target's greedy ones: the corpus's for the prompts taken from it, and for
the 40 written ones the embedded default's (``generate``, width 1), decoded
once and kept in ANSWERS, one line each as it finishes, so a killed run
resumes. Every answer is cut to TOKENS.

The simulation walks each answer as the decoder would: every round
proposes SLOTS tokens from the context so far (prompt and answer), keeps the
leading ones the answer continues with (the round's own target token must
lie inside the answer) and emits one more; tau = mean(kept + 1). Sources:
``copy`` (``CopyIndex``, as the decoder copies), ``store`` (the shipped
store), ``either`` (a copy whose match is 2 tokens or more, else the
store), ``either, learning`` (as either, the store learning each answer as
it finishes, in the split's order).

Environment: TOKENS (default 128), SLOTS (default 5), ANSWERS (default
/tmp/dspark-store-sim/held-out-answers.jsonl).
"""

import gzip
import json
import os
import sys
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dspark_fn import atomic, store
from dspark_fn.catalog import load_target_named
from dspark_fn.chat import chat_tokens, stop_tokens
from dspark_fn.copying import CopyIndex
from dspark_fn.distill.answers import complete_lines

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ROOT / "corpus" / "held-out.jsonl"
CORPUS = ROOT / "corpus" / "smollm2-135m-answers.jsonl.gz"
TOKENS = int(os.environ.get("TOKENS", 128))
SLOTS = int(os.environ.get("SLOTS", 5))
ANSWERS = Path(os.environ.get("ANSWERS", "/tmp/dspark-store-sim/held-out-answers.jsonl"))
VOCAB = 49152  # SmolLM2's
SHIPPED = {"longest": 4, "least_count": 2}  # `sizes`: tau of longer contexts or of every context, at 2x the entries
PRUNINGS = tuple({"longest": longest, "least_count": least} for longest, least in
                 ((8, 2), (6, 1), (6, 2), (6, 3), (5, 2), (4, 1), (4, 2), (4, 3), (3, 2), (3, 3)))


def split_rows(tokenizer) -> list[dict]:
    """The held-out split, each prompt chat-templated to ids."""
    rows = [json.loads(line) for line in SPLIT.read_text().splitlines() if line.strip()]
    return [{**row, "prompt": chat_tokens(tokenizer, row["turns"][0])} for row in rows]


def corpus_answers() -> dict:
    """``{prompt ids: answer ids}`` of the committed corpus."""
    with gzip.open(CORPUS, "rt") as handle:
        return {tuple(row["prompt"]): row["answer"] for row in map(json.loads, handle)}


def store_answers(corpus: dict, rows: list) -> list:
    """The corpus's answers a shipped store may hold: the held-out prompts' left out."""
    held_out = {tuple(row["prompt"]) for row in rows}
    return [answer for prompt, answer in corpus.items() if prompt not in held_out]


def generated_answers(rows: list) -> dict:
    """``{prompt ids: answer}`` of the embedded default's greedy answers to
    ``rows``, decoded where ANSWERS lacks them."""
    done = {tuple(line["prompt"]): line["answer"] for line in map(json.loads, complete_lines(ANSWERS))}
    missing = [row for row in rows if tuple(row["prompt"]) not in done]
    if missing:
        from dspark_fn import generate, load_pair

        params, tokenizer = load_pair()
        print(f"decoding {len(missing)} held-out answers into {ANSWERS}", file=sys.stderr, flush=True)
        ANSWERS.parent.mkdir(parents=True, exist_ok=True)
        answers = defaultdict(list)
        prompts = [row["prompt"] for row in missing]
        for event in generate(params, prompts, TOKENS, width=1, stop_tokens=stop_tokens(tokenizer)):
            answers[event.tag] += event.emitted
            if event.finish:
                done[tuple(prompts[event.tag])] = answers[event.tag]
                atomic.append_line(ANSWERS, json.dumps({"family": missing[event.tag]["family"],
                                                        "prompt": prompts[event.tag], "answer": answers[event.tag]}))
    return done


class HeldOut(NamedTuple):
    family: str
    written: bool  # written for the split (else a corpus prompt, its template's siblings in the store)
    prompt: list
    answer: list  # the target's greedy answer, cut to TOKENS


def held_out_answers(rows: list, corpus: dict) -> list:
    """A ``HeldOut`` for every prompt of the split."""
    generated = generated_answers([row for row in rows if tuple(row["prompt"]) not in corpus])
    return [HeldOut(row["family"], row["source"] == "written", row["prompt"],
                    (corpus.get(tuple(row["prompt"])) or generated[tuple(row["prompt"])])[:TOKENS]) for row in rows]


def kept(proposal: list, rest: list) -> int:
    """Leading tokens of ``proposal`` that ``rest`` goes on with, short of its last token."""
    count = 0
    for proposed, token in zip(proposal, rest[:-1]):
        if proposed != token:
            break
        count += 1
    return count


def walk(prompt: list, answer: list, propose) -> list:
    """``(proposed tokens, kept)`` of each round that emits ``answer`` after ``prompt``."""
    index, position, rounds = CopyIndex(prompt), 0, []
    while position < len(answer):
        proposal = propose(prompt + answer[:position], index)
        accepted = kept(proposal, answer[position:])
        rounds.append((len(proposal), accepted))
        index.extend(answer[position : position + accepted + 1])
        position += accepted + 1
    return rounds


def copy_source(context: list, index: CopyIndex) -> list:
    return index.lookup(SLOTS).tokens


def store_source(shipped: store.Store):
    return lambda context, index: shipped.propose(context, SLOTS).tokens


def either_source(shipped: store.Store):
    def propose(context: list, index: CopyIndex) -> list:
        copy = index.lookup(SLOTS)
        return copy.tokens if copy.match >= 2 else shipped.propose(context, SLOTS).tokens

    return propose


def simulate(answers: list, sources: dict, learning: store.Store | None = None) -> list:
    """``{source: [(proposed, kept) per round]}`` of each answer; the
    ``learning`` store (the one a source proposes from) learns each answer
    after it."""
    rounds = []
    for held_out in answers:
        rounds.append({name: walk(held_out.prompt, held_out.answer, propose) for name, propose in sources.items()})
        if learning is not None:
            learning.learn(held_out.answer)
    return rounds


def pooled(rounds: list, name: str) -> list:
    return [round_ for answer in rounds for round_ in answer[name]]


def tau(rounds: list) -> float:
    return sum(accepted + 1 for _, accepted in rounds) / max(len(rounds), 1)


def shipped_store(answers: list, capacity: int = store.CAPACITY, **pruning) -> store.Store:
    return store.build_store(answers, VOCAB, store.DEFAULT_IDENTITY, capacity=capacity, **pruning)


def setting(answering: bool = True) -> tuple:
    """``(held-out answers or None, the store's answers)``."""
    _, _, tokenizer = load_target_named(None, lazy=True)
    rows, corpus = split_rows(tokenizer), corpus_answers()
    return held_out_answers(rows, corpus) if answering else None, store_answers(corpus, rows)


def table() -> None:
    answers, _ = setting()
    shipped = store.load(store.DEFAULT_STORE, VOCAB, store.DEFAULT_IDENTITY)
    learning = store.load(store.DEFAULT_STORE, VOCAB, store.DEFAULT_IDENTITY)
    rounds = simulate(answers, {"copy": copy_source, "store": store_source(shipped), "either": either_source(shipped),
                                "either, learning": either_source(learning)}, learning)
    print(f"{len(answers)} held-out answers of up to {TOKENS} tokens, {SLOTS} proposed a round; the shipped store: "
          f"{len(shipped)} contexts, {store.DEFAULT_STORE.stat().st_size / 1e6:.2f} MB\n")
    print("| prompts | count | tokens | tau: copy | store | either | either, learning | rounds proposing: copy | "
          "store | either |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    groups = {family: lambda held_out, family=family: held_out.family == family
              for family in sorted({held_out.family for held_out in answers})}
    groups.update({"written for the split": lambda held_out: held_out.written,
                   "from the corpus": lambda held_out: not held_out.written, "all": lambda held_out: True})
    for group, member in groups.items():
        chosen = [answer_rounds for held_out, answer_rounds in zip(answers, rounds) if member(held_out)]
        pools = {name: pooled(chosen, name) for name in ("copy", "store", "either", "either, learning")}
        share = {name: sum(proposed > 0 for proposed, _ in pool) / len(pool) for name, pool in pools.items()}
        tokens = sum(len(held_out.answer) for held_out in answers if member(held_out))
        print(f"| {group} | {len(chosen)} | {tokens} | {tau(pools['copy']):.2f} | {tau(pools['store']):.2f} | "
              f"{tau(pools['either']):.2f} | {tau(pools['either, learning']):.2f} | {share['copy']:.0%} | "
              f"{share['store']:.0%} | {share['either']:.0%} |", flush=True)


def sizes() -> None:
    answers, sequences = setting()
    print(f"stores of {len(sequences)} answers ({sum(map(len, sequences))} tokens); tau over {len(answers)} held-out "
          f"answers\n")
    print("| longest context | contexts seen at least | contexts | file MB | tau: store | either |")
    print("|---|---|---|---|---|---|")
    for pruning in PRUNINGS:
        built = shipped_store(sequences, capacity=1 << 24, **pruning)
        path = built.save(Path(os.environ.get("TMPDIR", "/tmp")) / "dspark-store-sim-size.npz")
        rounds = simulate(answers, {"store": store_source(built), "either": either_source(built)})
        every = {name: pooled(rounds, name) for name in ("store", "either")}
        print(f"| {pruning['longest']} | {pruning['least_count']} | {len(built)} | {path.stat().st_size / 1e6:.2f} | "
              f"{tau(every['store']):.2f} | {tau(every['either']):.2f} |", flush=True)
        path.unlink()


class SuffixArray:
    """The other design measured: the answers end to end (each followed by
    a separator) and their suffixes in order; a context's occurrences are
    one range of it, found by binary search, and each proposed token
    narrows the range to the suffixes that go on with it."""

    def __init__(self, sequences: list, separator: int):
        self.separator = separator
        self.text = np.concatenate([np.append(np.asarray(s, np.int64), separator) for s in sequences])
        self.order = self._sorted_suffixes().astype(np.int32)
        self.text = self.text.astype(np.int32)

    def _sorted_suffixes(self) -> np.ndarray:
        """Prefix doubling: suffixes ranked by their first 2^i tokens until all ranks differ."""
        size, rank, span = len(self.text), self.text.copy(), 1
        while True:
            second = np.full(size, -1, np.int64)
            second[:-span] = rank[span:]
            order = np.lexsort((second, rank))
            pairs = rank[order] * (size + 2) + second[order] + 1
            rank = np.empty(size, np.int64)
            rank[order] = np.concatenate([[0], np.cumsum(pairs[1:] != pairs[:-1])])
            if rank[order[-1]] == size - 1:
                return order
            span *= 2

    def _bound(self, pattern: list, past: bool) -> int:
        low, high = 0, len(self.order)
        while low < high:
            middle = (low + high) // 2
            start = self.order[middle]
            prefix = self.text[start : start + len(pattern)].tolist()
            if prefix < pattern or (past and prefix == pattern):
                low = middle + 1
            else:
                high = middle
        return low

    def _most_frequent(self, low: int, high: int, depth: int) -> tuple | None:
        """``(token, low, high)``: the token most often at ``depth`` in the
        suffixes ``low:high`` (which share their first ``depth`` tokens) and
        the range of those it follows; None where only separators stand there."""
        following = self.text[self.order[low:high] + depth]
        starts = np.flatnonzero(np.concatenate([[True], following[1:] != following[:-1]]))
        runs = np.diff(np.append(starts, len(following))) * (following[starts] != self.separator)
        if not runs.any():
            return None
        best = int(runs.argmax())
        return int(following[starts[best]]), low + int(starts[best]), low + int(starts[best] + runs[best])

    def propose(self, context: list, slots: int, longest: int) -> list:
        for length in range(min(longest, len(context)), store.SHORTEST - 1, -1):
            low, high = self._bound(context[-length:], False), self._bound(context[-length:], True)
            found = self._most_frequent(low, high, length) if high > low else None
            if found:
                break
        else:
            return []
        tokens = []
        while found and len(tokens) < slots:
            token, low, high = found
            tokens.append(token)
            found = self._most_frequent(low, high, length + len(tokens))
        return tokens


def designs() -> None:
    answers, sequences = setting()
    contexts = [held_out.prompt + held_out.answer[:position] for held_out in answers
                for position in range(len(held_out.answer))]
    print(f"{len(sequences)} answers, {sum(map(len, sequences))} tokens; {len(contexts)} lookups (every position of "
          f"the held-out answers), {SLOTS} tokens each; CPU time, best of 3\n")
    print("| design | longest context | entries | build s | memory MB | lookup us |")
    print("|---|---|---|---|---|---|")
    begun = time.process_time()
    suffixes = SuffixArray(sequences, VOCAB)
    suffixes_built_in = time.process_time() - begun
    for longest in sorted({6, SHIPPED["longest"]}, reverse=True):
        for name, least_count in (("n-gram tables, every context", 1), ("n-gram tables, contexts seen twice", 2)):
            tracemalloc.start()
            begun = time.process_time()
            built = shipped_store(sequences, capacity=1 << 24, longest=longest, least_count=least_count)
            built_in = time.process_time() - begun
            memory = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            lookup = best_time(lambda: [built.propose(c, SLOTS) for c in contexts]) / len(contexts)
            print(f"| {name} | {longest} | {len(built)} | {built_in:.0f} | {memory / 1e6:.0f} | {lookup * 1e6:.1f} |",
                  flush=True)
            del built
        memory = suffixes.text.nbytes + suffixes.order.nbytes
        lookup = best_time(lambda: [suffixes.propose(c, SLOTS, longest) for c in contexts]) / len(contexts)
        print(f"| suffix array | {longest} | {len(suffixes.text)} | {suffixes_built_in:.0f} | {memory / 1e6:.1f} | "
              f"{lookup * 1e6:.1f} |", flush=True)


def best_time(run, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        begun = time.process_time()
        run()
        times.append(time.process_time() - begun)
    return min(times)


def build() -> None:
    _, sequences = setting(answering=False)
    built = shipped_store(sequences, **SHIPPED)
    path = built.save(store.DEFAULT_STORE)
    print(f"{path}: {len(built)} contexts of {len(sequences)} answers, {path.stat().st_size / 1e6:.2f} MB")


def main() -> None:
    {"sizes": sizes, "designs": designs, "build": build}.get(sys.argv[1] if len(sys.argv) > 1 else "", table)()


if __name__ == "__main__":
    main()
