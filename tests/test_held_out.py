"""The committed corpus and the held-out split, checked on decoded text: no
answer's prompt is a bundled evaluation prompt or a near copy of one; the
split's written prompts are new to both; its corpus prompts are answered in
the corpus, so a run given the split (``--held-out-prompts``) must leave them
out, and does: it trains on none of its prompts and scores tau on them.

Breaks tried: a corpus holding one answer to a gsm8k prompt with its wording
changed around it (test_no_corpus_prompt...); ``distill`` leaving only the
bundled held-out prompts out of training (test_a_run_given_the_split...).
"""

import gzip
import json
from pathlib import Path

import mlx.core as mx
import pytest

from dspark_fn.distill.prompts import EvalIndex

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ROOT / "corpus" / "held-out.jsonl"
CORPUS = ROOT / "corpus" / "smollm2-135m-answers.jsonl.gz"
MARK = "@@the user's text@@"


def split_rows() -> list[dict]:
    return [json.loads(line) for line in SPLIT.read_text().splitlines() if line.strip()]


def user_text(tokenizer, ids: list, around: tuple) -> str:
    """The user message of a chat-templated prompt, from its decoded text."""
    before, after = around
    text = tokenizer.decode(ids)
    assert text.startswith(before) and text.endswith(after), text[:200]
    return text[len(before) : len(text) - len(after)]


@pytest.fixture(scope="module")
def corpus_texts() -> list[str]:
    """Every committed answer's prompt, decoded, its chat template taken off
    (and checked: the text templated again gives the same ids)."""
    from dspark_fn.catalog import load_target_named
    from dspark_fn.chat import chat_tokens

    _, _, tokenizer = load_target_named(None, lazy=True)
    around = tuple(tokenizer.decode(chat_tokens(tokenizer, MARK)).split(MARK))
    with gzip.open(CORPUS, "rt") as handle:
        prompts = [json.loads(line)["prompt"] for line in handle]
    texts = [user_text(tokenizer, ids, around) for ids in prompts]
    for ids, text in zip(prompts[::97], texts[::97]):
        assert chat_tokens(tokenizer, text) == ids
    return texts


def test_no_corpus_prompt_is_an_evaluation_prompt_or_a_near_copy(corpus_texts):
    assert len(corpus_texts) > 5000
    index = EvalIndex.bundled()
    assert [text for text in corpus_texts if index.resembles(text)] == []


def test_the_split_is_new_where_written_and_answered_where_taken_from_the_corpus(corpus_texts):
    rows = split_rows()
    assert {row["family"] for row in rows} == {"gsm8k", "humaneval", "math500", "mbpp", "mt-bench"}
    evaluation, corpus = EvalIndex.bundled(), EvalIndex(corpus_texts)
    written = [row["turns"][0] for row in rows if row["source"] == "written"]
    taken = [row["turns"][0] for row in rows if row["source"].startswith("corpus:")]
    assert len(written) == 40 and len(taken) == 36
    assert [text for text in written if evaluation.resembles(text) or corpus.resembles(text)] == []
    assert set(taken) <= set(corpus_texts)


def test_a_run_given_the_split_trains_on_none_of_its_prompts_and_scores_tau_on_them(tmp_path):
    from test_train import write_qwen3_release

    from dspark_fn import distill
    from dspark_fn.catalog import load_named
    from dspark_fn.chat import chat_tokens, stop_tokens
    from dspark_fn.distill import answers as answering
    from dspark_fn.distill import trainer
    from dspark_fn.distill.prompts import BUNDLED, read_jsonl_prompts

    write_qwen3_release(tmp_path / "target")
    held = read_jsonl_prompts(BUNDLED)[:3]  # prompts a run would otherwise answer first
    split = tmp_path / "split.jsonl"
    split.write_text("".join(json.dumps({"turns": [text]}) + "\n" for text in held))
    setup = distill.DistillConfig(taps=(1, 3), block_size=4, markov_rank=8, draft_vocab=64, answer_tokens=300,
                                 max_new_tokens=32, sources=("bundled",), answer_batch=4, shard_rows=4, held_out=2,
                                 held_out_file=str(split), eval_new_tokens=16, save_dtype="float32")
    config = trainer.TrainConfig(steps=2, checkpoint_every=2, anchors_per_sequence=4, sequences_per_step=2)
    last = distill.distill(str(tmp_path / "target"), tmp_path / "run", setup, config, log=lambda line: None)
    params, tokenizer, _ = load_named(str(tmp_path / "target"), str(tmp_path / "run" / "draft"), dtype=mx.float32)
    held_ids = [chat_tokens(tokenizer, text) for text in held]
    answered = [answer.prompt for answer in answering.read_answers(tmp_path / "run" / "answers.jsonl")]
    assert answered and not any(ids in answered for ids in held_ids)
    assert last.tau == trainer.held_out_tau(params, held_ids, 16, stop_tokens(tokenizer))
