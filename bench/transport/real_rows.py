"""The real oasst rows (SNAKETUNE_BENCH_ROWS) that bench/RESULTS.md's real-model, recipe and convergence figures were
measured on: 100 English oasst1 trees (en_100.hf_rows.jsonl) and a sample of 520 oasst2 trees
(openpaws_oasst2.hf_rows.jsonl), both in oasst's flat export format, as one file with one copy of each tree. One tree
(250e1d51-..., 12 messages) is in both files; the download stage refuses a duplicate message_id (it did on
2026-12-04), so its second copy is left out here. Any oasst1 or oasst2 export in the flat format works the same.

    python3 bench/transport/real_rows.py OASST_DIR OUT.jsonl[.xz]      (.xz: compressed, as it travels)
"""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

FILES = ("en_100.hf_rows.jsonl", "openpaws_oasst2.hf_rows.jsonl")


def main(src: Path, out: Path) -> None:
    seen_trees: set[str] = set()
    kept = 0
    xz = out.suffix == ".xz"
    with lzma.open(out, "wt", encoding="utf-8", preset=6) if xz else open(out, "w", encoding="utf-8") as w:
        for name in FILES:
            rows = [json.loads(line) for line in (src / name).open(encoding="utf-8") if line.strip()]
            trees = {r["message_tree_id"] for r in rows}
            for row in rows:
                if row["message_tree_id"] not in seen_trees:
                    w.write(json.dumps(row, ensure_ascii=False) + "\n")
                    kept += 1
            seen_trees |= trees
    print(f"{out}: {kept} rows, {len(seen_trees)} trees")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
