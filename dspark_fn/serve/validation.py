"""Requests read and checked: an HTTP body becomes a ``Job`` (prompt ids, or
a prompt with images, limits, sampling, stop strings, tools,
log-probabilities) or an ``ApiError`` naming the field at fault and what it
takes."""

from dataclasses import dataclass

from ..chat import template_text, template_tokens
from ..constraints import Constraint, Grammar
from ..driver import TOP_LOG_PROBS
from ..sampling import Sampling
from ..types import ImagePrompt, prompt_ids
from ..vision import image_prompt, refusal
from .errors import ApiError
from .structured import Grammars, compiled, reply_constraint, response_constraint
from .images import ImageSources
from .schema import MAX_PROMPTS
from .tools import Tools, template_turns

@dataclass(frozen=True)
class Job:
    """A validated request: prompt ids, settings, and how to report it."""

    kind: str  # "chat" or "text"
    prompts: tuple  # token ids of each prompt (a chat: one, an ImagePrompt with images; completions: a list)
    max_tokens: int  # 0 (completions with echo): the prompt scored, nothing generated
    sampling: Sampling
    seed: int | None
    stop: tuple
    n: int
    stream: bool
    include_usage: bool
    top_log_probs: int | None = None  # log-probabilities asked: with this many most likely tokens each
    tools: Tools = Tools(())  # the function tools offered, after tool_choice
    echo: tuple = ()  # completions with echo: each prompt's text, sent before its completion
    constraint: Constraint | None = None  # what every reply must match
    grammar: Grammar | None = None  # the constraint compiled (``Grammars``)

    @property
    def scores_prompt(self) -> bool:
        """Echoed prompts' tokens are scored when log-probabilities are asked."""
        return bool(self.echo) and self.top_log_probs is not None


def number(body: dict, name: str, default, kind=float, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ApiError(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    value = kind(value)
    if low is not None and (value <= low if low_open else value < low):
        raise ApiError(f"'{name}' must be {'>' if low_open else '>='} {low}, got {value}", name)
    if high is not None and value > high:
        raise ApiError(f"'{name}' must be <= {high}, got {value}", name)
    return value


ROLES = ("system", "developer", "user", "assistant", "tool")


def message_content(message):
    """A message's content as the chat template takes it: its text, or (with
    images) its parts in order, each image as ``{"type": "image", "url"}``
    (the template writes the release's image placeholder for it)."""
    if not isinstance(message, dict) or "role" not in message:
        raise ApiError("each message needs a 'role' and a 'content'", "messages")
    if message["role"] not in ROLES:
        raise ApiError(f"unknown role {message['role']!r}: a message's role is one of {', '.join(ROLES)}", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and (message.get("tool_calls") or message["role"] == "assistant"):
        return ""
    if not isinstance(content, list) or not all(isinstance(p, dict) and p.get("type") in ("text", "image_url")
                                                 for p in content):
        raise ApiError("a message's content is a string or a list of 'text' and 'image_url' parts (no audio or "
                       "files)", "messages")
    if all(part["type"] == "text" for part in content):
        return "".join(part.get("text", "") for part in content)
    if message["role"] != "user":
        raise ApiError(f"images go in user messages, not in a {message['role']} message", "messages")
    return [{"type": "text", "text": part.get("text", "")} if part["type"] == "text"
            else {"type": "image", "url": image_url(part)} for part in content]


def image_url(part: dict):
    """An ``image_url`` part's URL (``{"url": ...}``, or the URL itself)."""
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def images_in(turns: list) -> list:
    """The image URLs of the turns' parts, in order."""
    return [part["url"] for turn in turns if isinstance(turn["content"], list)
            for part in turn["content"] if part["type"] == "image"]


class Reader:
    """Reads request bodies against what the server holds: its tokenizer, its
    model's name, the engine's context and verify width, and the grammars
    constraints compile to."""

    def __init__(self, engine, tokenizer, model_name: str, grammars: Grammars, images: ImageSources = ImageSources()):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.grammars, self.images = grammars, images

    def job(self, body, kind: str) -> Job:
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(f"model {model!r} is not served here; this server serves {self.model_name!r}",
                           "model", status=404, code="model_not_found")
        tools = Tools.from_body(body.get("tools"), body.get("tool_choice")) if kind == "chat" else Tools(())
        prompts = [(self.chat_prompt(body, tools), None)] if kind == "chat" else self.text_prompts(body)
        longest = max(len(prompt) for prompt, _ in prompts)
        room = self.engine.max_context - longest - self.engine.decoder.widest
        if room < 1:
            pictures = sum(len(prompt.images) for prompt, _ in prompts if isinstance(prompt, ImagePrompt))
            taking = f" with its {pictures} image(s) takes" if pictures else " has"
            fix = ": send fewer or smaller images" if pictures else ""
            raise ApiError(f"the prompt{taking} {longest} tokens; the context holds {self.engine.max_context}{fix}",
                           "messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        echo = kind == "text" and boolean(body, "echo")
        limit_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = number(body, limit_name, room, int, low=0 if echo else 1)
        if max_tokens > room:
            raise ApiError(f"{limit_name} {max_tokens} + the prompt's {longest} tokens exceed the context of "
                           f"{self.engine.max_context} tokens", limit_name, code="context_length_exceeded")
        sampling = Sampling(
            number(body, "temperature", 1.0, low=0, high=2),
            number(body, "top_k", 0, int, low=0, high=self.grammars.vocab_size),  # the model's vocabulary
            number(body, "top_p", 1.0, low=0, high=1, low_open=True),
        )
        constraint, grammar = self.constraint(body, kind, tools, prompt_ids(prompts[0][0]), echo)
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise ApiError("'stop' must be a string or a list of up to 4 non-empty strings", "stop")
        seed = body.get("seed")
        if seed is not None:
            seed = number(body, "seed", None, int)
        options = body.get("stream_options") or {}
        if kind == "text":
            unsupported_completion_options(body)
        texts = tuple(text if text is not None else self.tokenizer.decode(p) for p, text in prompts) if echo else ()
        return Job(kind=kind, prompts=tuple(prompt for prompt, _ in prompts), max_tokens=max_tokens, sampling=sampling,
                   seed=seed, stop=tuple(stop), n=number(body, "n", 1, int, low=1, high=8),
                   stream=boolean(body, "stream"), include_usage=bool(options.get("include_usage", False)),
                   top_log_probs=self.top_log_probs(body, kind), tools=tools, echo=texts, constraint=constraint,
                   grammar=grammar)

    def constraint(self, body: dict, kind: str, tools: Tools, prompt: list, echo: bool) -> tuple:
        """``(constraint, its grammar)``: what the replies must match
        (``structured``), compiled now, so that a bad one is a 400 before any
        row is taken; ``(None, None)`` for free replies."""
        if kind == "text":
            held = response_constraint(body.get("response_format"))
            field = "response_format"
            if held is not None and echo:
                raise ApiError("response_format cannot be combined with echo (the prompt is not held to it)",
                               "response_format")
        else:
            parallel = body.get("parallel_tool_calls", True)
            if not isinstance(parallel, bool):
                raise ApiError(f"'parallel_tool_calls' must be true or false, got {parallel!r}", "parallel_tool_calls")
            held, field = reply_constraint(body.get("response_format"), tools, parallel, self.tokenizer, prompt) \
                or (None, None)
        return (None, None) if held is None else (held, compiled(self.grammars, held, field))

    def top_log_probs(self, body: dict, kind: str) -> int | None:
        """Chat: ``logprobs`` (true/false) and ``top_logprobs`` (0-20); completions: ``logprobs`` (0-20)."""
        if kind == "text":
            return number(body, "logprobs", None, int, low=0, high=TOP_LOG_PROBS)
        asked = body.get("logprobs")
        if asked is not None and not isinstance(asked, bool):
            raise ApiError(f"'logprobs' must be true or false, got {asked!r}", "logprobs")
        top = number(body, "top_logprobs", None, int, low=0, high=TOP_LOG_PROBS)
        if top is not None and not asked:
            raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if asked else None

    def chat_prompt(self, body: dict, tools: Tools):
        """The conversation's token ids, or, when it holds images, its
        ``ImagePrompt`` (the images read, checked and laid out by the
        release's processor here, before the request is queued)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("'messages' must be a non-empty list", "messages")
        turns, template_options = template_turns(messages, message_content, self.tokenizer, tools)
        urls = images_in(turns)
        if not urls:
            return template_tokens(self.tokenizer, turns, **template_options)
        params = self.engine.params
        if params.vision is None:
            raise ApiError(refusal(params.spec.target.model_type), "messages")
        pictures = self.images.read_all(urls, "messages")
        text = template_text(self.tokenizer, turns, **template_options)
        try:
            return image_prompt(params, text, pictures)
        except ValueError as error:
            raise ApiError(str(error), "messages") from None

    def text_prompts(self, body: dict) -> list[tuple[list, str | None]]:
        """``(token ids, text given or None)`` of each prompt: a string, a list of
        token ids, or a list of either."""
        prompt = body.get("prompt")
        several = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
        prompts = [self.text_prompt(one) for one in (prompt if several else [prompt])]
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(f"{len(prompts)} prompts in one request; at most {MAX_PROMPTS}", "prompt")
        return prompts

    def text_prompt(self, prompt) -> tuple[list, str | None]:
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.engine.params.spec.target.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise ApiError(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
            return prompt, None
        raise ApiError("'prompt' must be a non-empty string, a list of token ids, or a list of either", "prompt")


def boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise ApiError(f"'{name}' must be true or false, got {value!r}", name)
    return bool(value)


def unsupported_completion_options(body: dict) -> None:
    """Completions options this server does not implement are refused, never ignored."""
    if body.get("suffix"):
        raise ApiError("'suffix' (insertion) is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise ApiError("'best_of' other than n is not supported: every choice generated is returned", "best_of")
