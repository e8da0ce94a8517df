"""Abbreviated long flags, as torchrun's argparse takes them (``--redirect=3``).

torchrun's parser accepts any unambiguous prefix of a long flag anywhere on the command
line, the script's own arguments included (on Python 3.11 ``torchrun train.py --log 1``
hands ``--log-dir 1`` to torchrun, not ``--log 1`` to the script). Here prefixes are
expanded only before the script (or ``--``), so a script's arguments reach it as given,
and a prefix is resolved against torchrun's own flags first: ``--re`` means
``--redirects`` to torchrun, as it does here, although it would also match our
``--ready-when`` and ``--restart-*`` flags. The dash and underscore spellings of a flag
are one flag. Pure logic: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

# torchrun 2.13's long flags, dash spelling (tests/unit/test_flag_abbreviations.py checks this
# against torch.distributed.run.get_args_parser() when torch is installed)
TORCHRUN_FLAGS: frozenset[str] = frozenset({
    "duplicate-stderr-filters", "duplicate-stdout-filters", "event-log-handler", "help",
    "local-addr", "local-ranks-filter", "log-dir", "logs-specs", "master-addr",
    "master-port", "max-restarts", "module", "monitor-interval", "nnodes", "no-python",
    "node-rank", "nproc-per-node", "numa-binding", "rdzv-backend", "rdzv-conf",
    "rdzv-endpoint", "rdzv-id", "redirects", "role", "run-path", "shutdown-timeout",
    "signals-to-handle", "standalone", "start-method", "tee", "virtual-local-rank",
})


class AmbiguousFlag(ValueError):
    """A prefix that matches several flags; the message is one line naming them."""


def expand_abbreviations(
    args: Sequence[str], takes_value: Mapping[str, bool], *,
    torchrun_flags: Collection[str] = TORCHRUN_FLAGS,
) -> list[str]:
    """``args`` with each abbreviated long flag before the script written out in full.

    ``takes_value`` maps every option string of the parser (``--log-dir``, ``-r``...) to
    whether it takes a separate value, which is how the script's position is found.
    Unknown flags are left for the parser to refuse.
    """
    names = {_name(option) for option in takes_value if option.startswith("--")}
    out: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            return [*out, *args[index:]]  # the script (or `--`) and everything after it
        option, sep, value = arg.partition("=")
        if option.startswith("--") and option not in takes_value:
            option = _expand(_name(option), names, torchrun_flags) or option
        out.append(f"{option}{sep}{value}")
        index += 1
        if not sep and takes_value.get(option, False) and index < len(args):
            out.append(args[index])  # the flag's value, whatever it looks like
            index += 1
    return out


def _name(option: str) -> str:
    return option.removeprefix("--").replace("_", "-")


def _expand(prefix: str, names: Collection[str], torchrun_flags: Collection[str]) -> str | None:
    """The full ``--flag`` for ``prefix``, None if nothing matches; raises AmbiguousFlag."""
    if not prefix:
        return None
    for pool in ([n for n in names if n in torchrun_flags], list(names)):
        matches = sorted({n for n in pool if n.startswith(prefix)})
        if len(matches) == 1:
            return f"--{matches[0]}"
        if matches:
            listed = ", ".join(f"--{m}" for m in matches)
            raise AmbiguousFlag(f"ambiguous option: --{prefix} could match {listed}")
    return None
