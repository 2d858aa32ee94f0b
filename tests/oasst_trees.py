"""Small hand-made oasst1-format trees for the conversations tests (tests/test_conversations.py: which paths
become conversations and what is dropped; tests/test_conversation_outputs.py: splits, stats and files)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from snaketune.data.conversations import Conversations, build_conversations


def msg(message_id: str, parent_id: str | None, role: str, text: str | None = None, **extra: Any) -> dict:
    """One message row; text defaults to something non-empty derived from the id."""
    return {
        "message_id": message_id,
        "parent_id": parent_id,
        "role": role,
        "text": f"text of {message_id}" if text is None else text,
        **extra,
    }


def frame(*rows: dict) -> pd.DataFrame:
    return pd.DataFrame(list(rows))


def all_rows(result: Conversations) -> pd.DataFrame:
    return pd.concat([result.train, result.validation], ignore_index=True)


def ids(result: Conversations) -> list[str]:
    return sorted(all_rows(result)["conversation_id"])


def by_id(result: Conversations) -> dict[str, list[dict]]:
    rows = all_rows(result)
    return dict(zip(rows["conversation_id"], rows["messages"], strict=True))


def pair(root: str, lang: str = "en", **root_extra: Any) -> list[dict]:
    """A minimal trainable tree: a question and one answer."""
    return [
        msg(root, None, "prompter", lang=lang, **root_extra),
        msg(f"{root}-a", root, "assistant", lang=lang),
    ]


# The rich fixture: every drop reason at least once.
#   t1 (prompter, en)
#   ├── a1 rank 0, deleted            -> deleted
#   │   └── p1                        -> under_dropped_parent
#   ├── a2 rank 1                     (top1 follows this: a1 is dropped)
#   │   ├── p2 rank 0, review failed  -> review_failed
#   │   │   └── a3                    -> under_dropped_parent
#   │   ├── p3 rank 1, blank text     -> empty_text
#   │   ├── p4 unranked
#   │   │   └── a4
#   │   └── p5 rank 2 (leaf)          (top1 follows this: numbered rank before unranked)
#   └── a5 unranked (leaf)
#   t2 (de): t2 -> t2-a ; t3: assistant root (non_alternating) ; t4: lone prompter (no_exchange)
#   o1 -> "missing", o2 -> o1 (orphan x2) ; l1 <-> l2, l3 -> l3, l4 -> l1 (loop x4)
RICH = [
    msg("t1", None, "prompter", lang="en"),
    msg("a1", "t1", "assistant", rank=0, deleted=True),
    msg("p1", "a1", "prompter"),
    msg("a2", "t1", "assistant", rank=1),
    msg("p2", "a2", "prompter", rank=0, review_result=False),
    msg("a3", "p2", "assistant"),
    msg("p3", "a2", "prompter", text="  \n\t", rank=1),
    msg("p4", "a2", "prompter"),
    msg("a4", "p4", "assistant"),
    msg("p5", "a2", "prompter", rank=2),
    msg("a5", "t1", "assistant"),
    *pair("t2", lang="de"),
    msg("t3", None, "assistant", lang="en"),
    msg("t3-p", "t3", "prompter"),
    msg("t4", None, "prompter", lang="en"),
    msg("o1", "missing", "prompter"),
    msg("o2", "o1", "assistant"),
    msg("l1", "l2", "prompter"),
    msg("l2", "l1", "assistant"),
    msg("l3", "l3", "prompter"),
    msg("l4", "l1", "assistant"),
]


RICH_DROPPED = {
    "orphan": 2,
    "loop": 4,
    "language": 0,
    "tree_state": 0,
    "deleted": 1,
    "review_failed": 1,
    "empty_text": 1,
    "under_dropped_parent": 2,
}
"""RICH's messages dropped, by reason (the comments above RICH)."""


def rich(**kwargs: Any) -> Conversations:
    return build_conversations(frame(*RICH), **kwargs)
