"""Prompts as a model expects them: messages through its chat template, and
the tokens that end its turn. Shared by the command line, the evaluation
protocol, the server and training."""


def template_tokens(tokenizer, turns: list[dict], think: bool = False, **template_options) -> list[int]:
    """``turns`` (``{"role", "content"}`` each) as the model's chat template lays
    them out, ready for the assistant's reply; without a template, their
    contents one per line. ``think`` is read by Qwen3 templates and ignored by
    others; ``template_options`` (e.g. ``tools``) go to the template."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode("\n".join(turn["content"] for turn in turns))
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, enable_thinking=think,
                                              **template_options))


def template_text(tokenizer, turns: list[dict], think: bool = False, **template_options) -> str:
    """``turns`` laid out by the chat template as text, ready for the
    assistant's reply: a release's processor reads it with the images (a
    turn's content may be a list of parts, ``{"type": "image"}`` among them,
    which a multimodal release's template writes as its image placeholder)."""
    return tokenizer.apply_chat_template(turns, add_generation_prompt=True, enable_thinking=think, tokenize=False,
                                         **template_options)


def image_turn(text: str, images: int) -> dict:
    """A user turn of ``images`` images, then ``text``."""
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}


def chat_tokens(tokenizer, text: str, system: str | None = None, think: bool = False) -> list[int]:
    """One user message (after an optional system message) as the model's chat template lays it out."""
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return template_tokens(tokenizer, turns, think)


def stop_tokens(tokenizer) -> list[int]:
    """The tokens that end the model's turn."""
    return sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])


def _last(tokens: list, marker: tuple) -> int:
    """Where the last occurrence of ``marker`` starts in ``tokens`` (-1: none)."""
    size = len(marker)
    return next((i for i in range(len(tokens) - size, -1, -1) if tuple(tokens[i : i + size]) == marker), -1)


def thinking_ahead(tokenizer, prompt: list[int]) -> tuple | None:
    """How a thinking model (mlx-lm's ``has_thinking``: Qwen3-style ``<think>``)
    goes on from ``prompt``: ``(start, end)``, the markers of its thinking
    (``start`` None when the prompt leaves it inside its thinking already;
    each the ids of its tokens, ``end`` its text when it takes several), or
    None when no thinking comes first (the tokenizer knows none, or the
    prompt closed one just before the reply, as templates do with thinking
    off). A constraint on the reply applies from the end of the thinking on."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens)
    opened, closed = _last(prompt, start), _last(prompt, end)
    ending = list(end) if len(end) == 1 else tokenizer.think_end
    if opened > closed:
        return None, ending
    if closed >= 0 and not tokenizer.decode(prompt[closed + len(end) :]).strip():
        return None
    return list(start), ending
