"""``--rdzv-conf k=v,...`` read as torchrun reads it, plus two kindnesses. Pure, no I/O.

torchrun's rendezvous handlers look up the keys they know and ignore the rest, so a
typo or a stray character goes unnoticed: ``--rdzv-conf='join_timeout=5,timeout=5'``,
written where no shell removes the quotes (a Python list of arguments, a YAML file), gives
torchrun the keys ``'join_timeout`` and ``timeout`` with the value ``5'``... and torchrun
ignores the first key and keeps its default. Here an unknown key is ignored too, but with
a warning naming it and the known keys; one pair of matching quotes around the whole
value is stripped first, and the warning says so.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

QUOTES = ("'", '"')


class RendezvousConfigError(ValueError):
    """A bad rendezvous setting; the message is one line meant for the user."""


@dataclass(frozen=True)
class ConfItems:
    """The known ``key=value`` pairs in order, and one warning line per thing ignored."""

    items: tuple[tuple[str, str], ...]
    warnings: tuple[str, ...]

    @property
    def text(self) -> str:
        """The known pairs as ``k=v,...`` again."""
        return ",".join(f"{key}={value}" for key, value in self.items)


def unquote(text: str) -> tuple[str, bool]:
    """``text`` without one pair of matching quotes around all of it; whether it had them."""
    text = text.strip()
    if len(text) >= 2 and text[0] in QUOTES and text[-1] == text[0]:
        return text[1:-1], True
    return text, False


def read_conf(text: str, known: Collection[str], backend: str) -> ConfItems:
    """Split ``text`` into pairs, keeping those whose key is in ``known``.

    An item without ``=`` or without a key is an error (as in torchrun);
    values are checked by the backend, which knows their types."""
    body, quoted = unquote(text)
    warnings: list[str] = []
    if quoted:
        warnings.append(f"--rdzv-conf: removed the quotes around {text.strip()!r} "
                        "(a shell would have; torchrun keeps them and so ignores the first "
                        "key and misreads the last value)")
    items: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, sep, value = (x.strip() for x in item.partition("="))
        if not (sep and key):
            raise RendezvousConfigError(f"--rdzv-conf: expected key=value, got {item!r}")
        if key in known:
            items.append((key, value))
        else:
            warnings.append(f"--rdzv-conf: unknown key {key!r} for {backend} ignored, as "
                            f"torchrun does (known: {', '.join(sorted(known))})")
    return ConfItems(tuple(items), tuple(warnings))
