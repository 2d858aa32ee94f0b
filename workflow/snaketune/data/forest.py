"""The cleaning rules every stage that reads message trees shares (conversations, preference pairs).

- Messages are linked into trees by parent_id; orphans (a parent that is not in the data) and parent loops
  are counted and skipped.
- A tree is kept when its root's ``lang`` is in ``dataset.languages`` (empty keeps all) and its
  ``tree_state`` is in ``dataset.tree_states`` (empty keeps all; a tree without a state is kept).
- A message that is deleted, failed review (``review_result: false``) or has empty text is dropped with its
  whole subtree: a reply makes no sense without what it answers.
- Siblings are ordered best first: numbered ranks (0 = best) before unranked, then older, then by id.
- Splits are by tree: the source's own split when it has one, else a hash of ``message_tree_id``.

Every decision is deterministic (sorted iteration, hash-based split), so the same input always gives the
same trees in the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from snaketune.data.cells import Source
from snaketune.data.messages import SPLITS, DataError, Message, parse

# Reasons a message is dropped, in the order they are checked; stats list every one (0 included) so the
# stats file has the same keys whatever the data.
MESSAGE_DROP_REASONS = (
    "orphan",
    "loop",
    "language",
    "tree_state",
    "deleted",
    "review_failed",
    "empty_text",
    "under_dropped_parent",
)
TREE_DROP_REASONS = ("language", "tree_state")
DEFAULT_TREE_STATES = ("ready_for_export",)
"""oasst's finished trees (all of OpenAssistant/oasst1; LAION's `*_ready.*` exports); oasst2 and LAION's
`*_all.*` exports also hold trees still growing, halted by moderators or aborted for low quality."""


@dataclass
class Forest:
    """The surviving trees of a message table, with everything the filters dropped."""

    src: Source
    messages: int
    """Rows read."""
    roots: list[Message]
    """Every root (parent_id null), sorted by message_id."""
    trees: list[tuple[Message, dict[str, list[Message]]]]
    """(root, surviving children of each surviving message, best first) of every tree whose root survived."""
    dropped: dict[str, int]
    """Messages dropped per reason (MESSAGE_DROP_REASONS)."""
    trees_dropped: dict[str, int]
    """Whole trees left out per reason (TREE_DROP_REASONS)."""
    use_source_split: bool
    """Whether the rows carry a split of their own (then that is the split, else a hash)."""

    @property
    def messages_kept(self) -> int:
        return self.messages - sum(self.dropped.values())


def _find_roots(by_id: dict[str, Message]) -> tuple[dict[str, str], dict[str, str]]:
    """Map each message to its root id, or to 'orphan' / 'loop' when no root is reachable.

    Walks each parent chain once and memoizes every message on it, so the whole pass is O(n) and a
    cycle (a -> b -> a, or a message that is its own parent) ends the walk instead of looping forever.
    """
    root_of: dict[str, str] = {}
    unreachable: dict[str, str] = {}
    for start in by_id:
        chain: list[str] = []
        on_chain: set[str] = set()
        current: str | None = start
        while True:
            if current in root_of:
                root, reason = root_of[current], None
                break
            if current in unreachable:
                root, reason = None, unreachable[current]
                break
            if current in on_chain:
                root, reason = None, "loop"
                break
            message = by_id.get(current)  # type: ignore[arg-type]
            if message is None:
                root, reason = None, "orphan"  # the chain names a parent that is not in the data
                break
            chain.append(message.message_id)
            on_chain.add(message.message_id)
            if message.parent_id is None:
                root, reason = message.message_id, None
                break
            current = message.parent_id
        for message_id in chain:
            if root is not None:
                root_of[message_id] = root
            else:
                unreachable[message_id] = reason  # type: ignore[assignment]
    return root_of, unreachable


def sibling_order(message: Message) -> tuple[bool, float, str, str]:
    """Best child first: numbered ranks (0 = best) before unranked, then older, then by id for ties."""
    return (message.rank is None, message.rank or 0.0, message.created_date, message.message_id)


def _own_drop_reason(message: Message) -> str | None:
    if message.deleted:
        return "deleted"
    if not message.review_result:
        return "review_failed"
    if message.text is None or not message.text.strip():
        return "empty_text"
    return None


def _prune_tree(
    root: Message, children: dict[str, list[Message]], dropped: dict[str, int]
) -> dict[str, list[Message]]:
    """Drop bad messages with their subtrees; return the surviving children of each surviving message.

    Dropping happens before any path is chosen, so ``top1`` follows the best *surviving* child.
    """
    kept_children: dict[str, list[Message]] = {}
    stack: list[tuple[Message, bool]] = [(root, False)]
    while stack:  # iterative: oasst1 threads can be deeper than Python's recursion limit allows for
        message, parent_dropped = stack.pop()
        reason = "under_dropped_parent" if parent_dropped else _own_drop_reason(message)
        if reason is not None:
            dropped[reason] += 1
        else:
            kept_children[message.message_id] = []
        for child in children.get(message.message_id, ()):
            stack.append((child, reason is not None))
    for message_id, kept in kept_children.items():
        kept.extend(c for c in children.get(message_id, ()) if c.message_id in kept_children)
    return kept_children


def _children_map(parsed: list[Message], root_of: dict[str, str]) -> dict[str, list[Message]]:
    """Children of every message, best first. One pass over the rows: O(n log k), no per-row filtering."""
    children: dict[str, list[Message]] = {}
    for m in parsed:
        if m.parent_id is not None and m.message_id in root_of:
            children.setdefault(m.parent_id, []).append(m)
    for kids in children.values():
        kids.sort(key=sibling_order)
    return children


def _check_languages(wanted: set[str], roots: list[Message], src: Source) -> None:
    """A wanted language that no tree has is a typo (pt for pt-BR) or the wrong file: say what there is."""
    have: dict[str, int] = {}
    for root in roots:
        have[root.lang] = have.get(root.lang, 0) + 1
    absent = sorted(wanted - have.keys())
    if absent:
        listing = ", ".join(
            f"{lang} ({n} tree{'s' * (n != 1)})"
            for lang, n in sorted(have.items(), key=lambda x: (-x[1], x[0]))
        )
        codes = ", ".join(map(repr, absent))
        raise DataError(
            f"config key 'dataset.languages': {codes} {'occurs' if len(absent) == 1 else 'occur'} in no tree "
            f"of {src.name} (the filter reads the lang of each tree's root message); allowed: the languages "
            f"the data has: {listing}"
        )


def clean(
    messages: pd.DataFrame,
    *,
    languages: Sequence[str] = (),
    tree_states: Sequence[str] = (),
    source_name: str | None = None,
) -> Forest:
    """Check the messages and apply the cleaning rules (module docstring); DataError for malformed input or
    a language that no tree has."""
    if isinstance(languages, str) or isinstance(tree_states, str):
        raise TypeError("languages and tree_states must be sequences of strings, not a string")
    parsed, src = parse(messages, source_name)
    root_of, unreachable = _find_roots({m.message_id: m for m in parsed})
    dropped = dict.fromkeys(MESSAGE_DROP_REASONS, 0)
    for reason in unreachable.values():
        dropped[reason] += 1
    children = _children_map(parsed, root_of)
    tree_size: dict[str, int] = {}
    for root_id in root_of.values():
        tree_size[root_id] = tree_size.get(root_id, 0) + 1
    wanted, states = set(languages), set(tree_states)
    roots = sorted((m for m in parsed if m.parent_id is None), key=lambda m: m.message_id)
    _check_languages(wanted, roots, src)
    trees_dropped = dict.fromkeys(TREE_DROP_REASONS, 0)
    trees = []
    for root in roots:
        reason = None
        if wanted and root.lang not in wanted:
            reason = "language"
        elif states and root.tree_state is not None and root.tree_state not in states:
            reason = "tree_state"
        if reason is not None:
            trees_dropped[reason] += 1
            dropped[reason] += tree_size[root.message_id]
            continue
        kept_children = _prune_tree(root, children, dropped)
        if root.message_id in kept_children:
            trees.append((root, kept_children))
    return Forest(
        src=src,
        messages=len(parsed),
        roots=roots,
        trees=trees,
        dropped=dropped,
        trees_dropped=trees_dropped,
        use_source_split=any(m.split is not None for m in parsed),
    )


# ---- splits -------------------------------------------------------------------------------------------


def split_hash(message_tree_id: str) -> float:
    """A tree's position in [0, 1): stable across runs, machines and Python versions (unlike hash())."""
    return int(hashlib.sha256(message_tree_id.encode("utf-8")).hexdigest()[:16], 16) / 2**64


def assign_splits(
    tree_roots: dict[str, Message], validation_fraction: float, use_source: bool, src: Source
) -> tuple[dict[str, str], dict[str, str] | None]:
    """Split per tree id; return the assignment and the fallback move made (if any)."""
    if not use_source:
        return split_by_hash(tree_roots, validation_fraction)
    assignment: dict[str, str] = {}
    for tree_id, root in sorted(tree_roots.items()):
        if root.split is None:
            raise DataError(
                f"{src.where('split', root.row, root.message_id)}: "
                f"the root of tree {tree_id!r} has no split while other rows have one; "
                f"allowed: {', '.join(SPLITS)}"
            )
        assignment[tree_id] = root.split
    return assignment, both_splits(assignment)


def sample(ids, max_trees: int | None) -> set[str]:
    """The ids `dataset.max_trees` keeps: the first max_trees by a hash of each id salted apart from the split's (so
    the sample keeps the split's proportions), all where max_trees is None or not below their number."""
    ids = set(ids)
    if max_trees is None or len(ids) <= max_trees:
        return ids
    return set(sorted(ids, key=lambda t: (split_hash("max_trees:" + t), t))[:max_trees])


def split_by_hash(ids, validation_fraction: float) -> tuple[dict[str, str], dict[str, str] | None]:
    """Each id's split by its hash against validation_fraction (the same id, the same split, on any machine), both
    splits kept non-empty (`both_splits`); returns the assignment and the fallback move made (if any)."""
    assignment = {
        unit: "validation" if split_hash(unit) < validation_fraction else "train" for unit in sorted(ids)
    }
    return assignment, both_splits(assignment)


def both_splits(assignment: dict[str, str]) -> dict[str, str] | None:
    """Move one unit (chosen by hash, so the choice is stable) into a split that has none, in place: tiny datasets
    (or filters that remove every held-out unit) must still give both splits, since training evaluates on
    validation. Returns the move made, or None."""
    if len(assignment) < 2:
        return None
    by_hash = sorted(assignment, key=lambda t: (split_hash(t), t))
    fallback = None
    if "validation" not in assignment.values():
        fallback = {"message_tree_id": by_hash[0], "moved_to": "validation"}
    elif "train" not in assignment.values():
        fallback = {"message_tree_id": by_hash[-1], "moved_to": "train"}
    if fallback is not None:
        assignment[fallback["message_tree_id"]] = fallback["moved_to"]
    return fallback
