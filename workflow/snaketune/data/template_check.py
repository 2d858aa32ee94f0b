"""The chat template proven on every tokenized row, before any training: each assistant turn ends in a trained
end-of-turn token, and each reply starts on a token boundary right after the generation prompt.

Both are bugs that train without an error and show only at inference. A stop token never trained: Axolotl #3754
(Gemma's turns end in `<end_of_turn>`, the config trained `<eos>`; the loss looked healthy and the model never
stopped). A generation prompt that inference appends but training never tokenized that way (a trailing space the
reply's first token swallows in training): the model sees a prompt it never saw before a reply.

The end-of-turn token is the one the template writes after a reply: the first special token (eos, or an added special
token such as ChatML's `<|im_end|>`) after the first reply of a two-exchange probe rendered whole, so a template that
writes it only when another turn follows is caught too. Per row, its id must be a trained label among the tokens of
each assistant span (snaketune.data.chat marks the spans), and a token must start exactly where the span starts (the
end of the generation prompt): then the tokens inference feeds, the prompt rendered with the generation prompt and
encoded alone, are the row's tokens up to the reply (check_chat_template encodes the probe's prompt alone to show it
once; per row the boundary is read from the offsets, which costs nothing where encoding every prefix would double the
stage's time). Rows are checked before truncation: a turn that max_length cuts loses its end there, not in the
template.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class TurnError(ValueError):
    """A row breaks the template's promises; the message names the token (snaketune.data.chat adds where)."""


def special_ids(tokenizer) -> set[int]:
    """eos, bos, pad and every added token marked special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False))
    return ids


def first_special(tokenizer, backend, text: str) -> int | None:
    """The first special token of `text`, encoded as the template's text is (no added specials)."""
    specials = special_ids(tokenizer)
    return next((i for i in backend.encode(text, add_special_tokens=False).ids if i in specials), None)


@dataclass
class TurnCheck:
    """What the check found over a stage's rows (stats.json's `template_check`)."""

    end_of_turn: str
    end_of_turn_id: int
    tool_rendering: str
    """`template` (the model's template renders tools) or `project` (snaketune.data.tools.plain_turns)."""
    assistant_turns: int = 0
    conversations: int = 0
    conversations_with_tools: int = 0
    generation_prompt: str = field(default="")

    def as_json(self) -> dict:
        return {
            "end_of_turn": self.end_of_turn,
            "end_of_turn_id": self.end_of_turn_id,
            "generation_prompt": self.generation_prompt,
            "tool_rendering": self.tool_rendering,
            "assistant_turns_checked": self.assistant_turns,
            "conversations_checked": self.conversations,
            "conversations_with_tools": self.conversations_with_tools,
            "checks": [
                "each assistant turn's end-of-turn token is a trained label",
                "each reply starts on a token boundary after the generation prompt (what inference appends)",
            ],
        }


def check_row(
    text: str,
    ids: np.ndarray,
    offsets: np.ndarray,
    labels: np.ndarray,
    spans: list[tuple[int, int]],
    end_id: int,
    tokenizer,
) -> None:
    """Raise TurnError unless every span holds a trained `end_id` and starts on a token boundary."""
    starts = offsets[:, 0]
    for turn, (s, e) in enumerate(spans, 1):
        inside = np.flatnonzero((starts >= s) & (starts < e))
        straddling = np.flatnonzero((starts < s) & (offsets[:, 1] > s))
        if len(straddling):
            j = int(straddling[0])
            raise TurnError(
                f"assistant turn {turn}: the generation prompt ({text[max(0, s - 24) : s]!r} at its end) ends inside "
                f"the token {tokenizer.convert_ids_to_tokens(int(ids[j]))!r} (id {int(ids[j])}), which runs across "
                "the reply's start: inference stops the prompt there and feeds tokens training never showed before "
                "a reply; allowed: a template whose generation prompt ends where the reply's first token starts "
                "(no trailing space before the reply, e.g. DeepSeek's 'Assistant:')"
            )
        if not np.any((ids[inside] == end_id) & (labels[inside] == end_id)):
            shown = text[s:e] if e - s <= 80 else text[s : s + 38] + " ... " + text[e - 38 : e]
            has_it = bool(np.any(ids[inside] == end_id))
            raise TurnError(
                f"assistant turn {turn} ({shown!r}) does not end in a trained end-of-turn token: the template writes "
                f"{tokenizer.convert_ids_to_tokens(end_id)!r} (id {end_id}) after a reply, and "
                + ("it carries no label there" if has_it else "it lies outside the turn's trained tokens")
                + ", so a model trained on this never learns to stop; allowed: a chat template that writes the "
                "end-of-turn token inside the assistant's turn, e.g. tokenize.chat_template: deepseek"
            )
