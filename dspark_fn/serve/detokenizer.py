"""The text of tokens that continue a sequence, as the tokenizer writes it there.

mlx-lm's streaming detokenizers drop the space that a text's first token
starts with: right for a chat reply, wrong for a completion, whose prompt +
text must be the decoded sequence (and for a token's own text in a list of
log-probabilities). Here each stretch of tokens is decoded after the token
before it and that token's text taken off, so whatever the tokenizer writes
at the boundary (a leading space, a character joined across tokens) stays.
"""

from os.path import commonprefix


def text_after(tokenizer, before: list, tokens: list) -> str:
    """The text ``tokens`` add when decoded after ``before``."""
    head, whole = tokenizer.decode(before), tokenizer.decode(before + tokens)
    return whole[len(commonprefix([head, whole])) :]


class ContinuingText:
    """A streaming detokenizer (``add_token``, ``finalize``, ``text``) for tokens
    that follow ``before``: a stretch is added to ``text`` once it decodes to
    whole characters."""

    def __init__(self, tokenizer, before: list):
        self.tokenizer, self.before, self.pending, self.text = tokenizer, list(before[-1:]), [], ""

    def add_token(self, token: int) -> None:
        self.pending.append(token)
        piece = text_after(self.tokenizer, self.before, self.pending)
        if not piece.endswith("\ufffd"):  # a character split over tokens waits for its last byte
            self.text += piece
            self.before, self.pending = self.pending[-1:], []

    def finalize(self) -> None:
        if self.pending:
            self.text += text_after(self.tokenizer, self.before, self.pending)
            self.before, self.pending = self.pending[-1:], []
