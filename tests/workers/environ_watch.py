"""Run ``childpreload.watch_environ`` over a snippet, as a child program does, and print
the watched names the snippet used (one JSON list).

Usage: environ_watch.py CHILDPRELOAD_PATH NAME[,NAME...] SNIPPET
"""

from __future__ import annotations

import json
import sys

path, names, snippet = sys.argv[1:4]
module = type(sys)("__elastic_preload__")
with open(path, encoding="utf-8") as f:
    exec(compile(f.read(), path, "exec"), module.__dict__)
reads: list[str] = []
restore = module.watch_environ(names.split(","), reads)
try:
    exec(compile(snippet, "<snippet>", "exec"), {})
finally:
    restore()
print(json.dumps(reads))
