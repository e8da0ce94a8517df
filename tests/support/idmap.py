"""Check that a reorganisation of tests/ lost no test: old ids map one to one onto new ids.

    python -m tests.support.idmap BEFORE.txt AFTER.txt MOVES.txt

BEFORE/AFTER are ``pytest --collect-only -q`` outputs; MOVES has lines ``old -> new`` (a
file split in two has one line per part). An old id maps to the new id with the same
``::name[params]`` in one of the files its file moved to. Prints the mapping's summary and
every id without a partner; exits 1 if there is one.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path


def ids(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return [line for line in lines if line.startswith("tests/") and "::" in line]


def main(before: Path, after: Path, moves: Path) -> int:
    targets: dict[str, list[str]] = defaultdict(list)
    for line in moves.read_text().splitlines():
        if "->" in line:
            old, new = (part.strip() for part in line.split("->"))
            targets[old].append(new)
    new_ids = set(ids(after))
    mapping: dict[str, str] = {}
    lost = []
    for old_id in ids(before):
        file, _, rest = old_id.partition("::")
        found = [f"{new}::{rest}" for new in targets.get(file, [file])
                 if f"{new}::{rest}" in new_ids]
        if len(found) == 1:
            mapping[old_id] = found[0]
        else:
            lost.append(old_id)
    extra = sorted(new_ids - set(mapping.values()))
    renamed = sum(old != new for old, new in mapping.items())
    print(f"{len(ids(before))} ids before, {len(new_ids)} after: {len(mapping)} mapped one to "
          f"one ({renamed} under a new path), {len(lost)} lost, {len(extra)} new")
    for old_id in lost:
        print(f"lost: {old_id}")
    for new_id in extra:
        print(f"new:  {new_id}")
    return 1 if lost or len(set(mapping.values())) != len(mapping) else 0


if __name__ == "__main__":
    sys.exit(main(*map(Path, sys.argv[1:4])))
