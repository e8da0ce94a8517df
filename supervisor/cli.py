"""Command line: ``elastic-supervisor run|check-config|status|node``.

``run`` accepts torchrun's flags (dashes or underscores) with the same meaning. Usage
and config errors print one line and exit 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from supervisor.abbrev import AmbiguousFlag, expand_abbreviations
from supervisor.config import ConfigError, Settings, build, from_environ, load_file, to_toml_dict
from supervisor.rendezvous.registry import check_backend
from supervisor.suggest import did_you_mean
from supervisor.version import __version__
from supervisor.workers.output import OutputPlan, OutputSpecError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def _suggestion(self, message: str) -> str:
        """The known flags closest to the first unknown one, as "; did you mean ...?"."""
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown == message:
            return ""
        known = {option.removeprefix("--") for action in self._actions
                 for option in action.option_strings if option.startswith("--")}
        for arg in unknown.split():
            name = arg.partition("=")[0]
            if name.startswith("--"):
                return did_you_mean(name.removeprefix("--").replace("_", "-"),
                                    {k for k in known if "_" not in k}, prefix="--")
        return ""


# a parser or one of its help groups (typeshed names their common base with an underscore)
def _flag(parser: argparse._ActionsContainer, name: str, *extra: str, **kw: Any) -> None:
    """Add ``--a-b`` with torchrun's ``--a_b`` alias; absent flags stay absent."""
    names = [f"--{name}"]
    if "-" in name:
        names.append(f"--{name.replace('-', '_')}")
    parser.add_argument(*extra, *names, default=argparse.SUPPRESS, **kw)


def _run_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="elastic-supervisor run",
        usage="%(prog)s [FLAGS] [--] SCRIPT [ARGS...]",
        # a script's own flags must never be taken as abbreviations of ours: prefixes are
        # expanded before the script only (supervisor.abbrev)
        allow_abbrev=False,
        description="Run a worker group under supervision (torchrun-compatible flags).",
    )
    # torchrun's flags
    _flag(p, "nnodes", help="N or MIN:MAX nodes (default 1:1)")
    _flag(p, "nproc-per-node", help="workers per node: N, cpu, gpu or auto (default 1)")
    _flag(p, "node-rank", type=int, help="this node's rank for the static backend")
    _flag(p, "max-restarts", type=int, help="failure restarts before giving up (default 0)")
    _flag(p, "rdzv-backend", help="static (default), c10d, etcd or etcd-v2")
    _flag(p, "rdzv-endpoint", help="c10d: HOST[:PORT] (29400); etcd: host:port[,host:port...]")
    _flag(p, "rdzv-id", help="job id shared by all nodes (default none)")
    _flag(p, "rdzv-conf", help="backend options k=v,... (join_timeout, last_call_timeout, ...)")
    _flag(p, "standalone", action="store_const", const=True, help="single node, random job id")
    _flag(p, "master-addr", help="address of the rank-0 node (static backend)")
    _flag(p, "master-port", type=int, help="port of the rank-0 worker's store")
    _flag(p, "local-addr", help="this node's address as other nodes reach it")
    _flag(p, "role", help="worker role name (default 'default')")
    _flag(p, "start-method", help="spawn (default), forkserver or fork (Python API only)")
    _flag(p, "shutdown-timeout", type=float, help="grace before SIGKILL on every stop (30 s)")
    _flag(p, "exit-barrier-timeout", type=float, help="wait for other nodes at the end (300 s)")
    _flag(p, "log-dir", help="base directory for per-rank logs and error files")
    _flag(p, "redirects", "-r", help="0-3 or per-rank map (1:3,0:1): redirect output to files")
    _flag(p, "tee", "-t", help="0-3 or per-rank map: copy output to files and the console")
    _flag(p, "local-ranks-filter", help="ranks whose console output is shown, e.g. 0,1")
    _flag(p, "log-line-prefix-template", help="console prefix, e.g. '[${role_name}${rank}]:'")
    _flag(p, "duplicate-stdout-filters", type=_csv, help="stdout lines to copy to a filter file")
    _flag(p, "duplicate-stderr-filters", type=_csv, help="stderr lines to copy to a filter file")
    _flag(p, "virtual-local-rank", action="store_const", const=True,
          help="LOCAL_RANK=0 and one device per worker")
    _flag(p, "numa-binding", help="node, socket, exclusive or core-complex")
    _flag(p, "run-path", action="store_const", const=True, help="run the script with runpy")
    _flag(p, "module", "-m", action="store_const", const=True,
          help="run the script as 'python -m MODULE'")
    _flag(p, "no-python", action="store_const", const=True,
          help="run the script as an executable, not with Python")
    ignored = p.add_argument_group(
        "torchrun flags accepted and ignored",
        "Accepted (and checked) so torchrun command lines run unchanged; they change nothing.")
    _flag(ignored, "monitor-interval", type=float, help="exits are noticed at once (pidfds)")
    _flag(ignored, "event-log-handler", help="events always go to --event-log (JSON lines)")
    _flag(ignored, "logs-specs",
          help="default (torch's DefaultLogsSpecs) only: our own log layout; plugins refused")
    _flag(ignored, "signals-to-handle",
          help="fixed: TERM/INT/QUIT stop, HUP reopens logs, USR1/USR2 are forwarded")
    # our own
    _flag(p, "config", dest="config_file", help="TOML config file (flags override it)")
    _flag(p, "health-host", help="health endpoint address (default 0.0.0.0)")
    _flag(p, "health-port", type=int, help="health endpoint port (default 29480, 0 = any)")
    _flag(p, "no-health", action="store_const", const=True, help="do not serve HTTP")
    _flag(p, "progress-timeout", type=float, help="liveness fails after this much silence (60 s)")
    _flag(p, "progress-pattern",
          help="regex: a worker output line matching it is progress (goodput, readiness)")
    _flag(p, "ready-when", help="launched or progress (default): when /readyz turns 200")
    _flag(p, "timer-file", help="deadline FIFO path (default: private runtime dir)")
    _flag(p, "no-watchdog", action="store_const", const=True, help="no deadline FIFO")
    _flag(p, "hang-dump", help="none, py-spy or signal:SIGUSR1 before killing a hung rank")
    _flag(p, "hang-state-timeout", type=float, help="D state longer than this is fatal (60 s)")
    _flag(p, "loop-nice", type=int,
          help="nice value of the event loop ahead of its workers (default 0: off; "
               "needs CAP_SYS_NICE or LimitNICE=)")
    _flag(p, "no-warm-restart", action="store_const", const=True,
          help="start restarted workers cold, not in pre-started interpreters")
    _flag(p, "preload", type=_csv,
          help="modules the node's fork server imports once; every attempt's workers "
               "start in interpreters forked from it, e.g. torch,torch._dynamo, or auto")
    _flag(p, "max-node-failures", type=int,
          help="a node that is the root cause of K failures in the window quarantines "
          "itself: exit 200 (default 0: off)")
    _flag(p, "node-failure-window", type=float, help="seconds failures count (3600)")
    _flag(p, "max-quarantined", type=int, help="nodes quarantined at most, job-wide (1)")
    _flag(p, "node-check", help="command (no shell) that exits 0 on a healthy node; run "
          "before joining, after a local failure, every --node-check-interval")
    _flag(p, "node-check-timeout", type=float, help="node check time limit (60 s)")
    _flag(p, "node-check-interval", type=float,
          help="node check period while workers run (default 0: none)")
    _flag(p, "node-check-retry", type=float,
          help="a node failing its check before joining re-checks after this (30 s)")
    _flag(p, "snapshot-memory-dir",
          help="tmpfs where training-state snapshots are kept (default /dev/shm)")
    _flag(p, "snapshot-memory-limit",
          help="the largest snapshot a rank may keep, e.g. 4G (default: no limit)")
    _flag(p, "snapshot-dir",
          help="directory (shared storage) where complete snapshot steps are persisted "
               "and a fresh run resumes from")
    _flag(p, "snapshot-persist-interval", type=float,
          help="seconds between two steps persisted to --snapshot-dir (300)")
    _flag(p, "snapshot-resume-any", action="store_const", const=True,
          help="use a --snapshot-dir whose manifest names another run id")
    _flag(p, "restart-backoff", help="BASE:MAX seconds of exponential backoff (default 0:0)")
    _flag(p, "restart-budget-window", type=float, help="healthy seconds that refill the budget")
    _flag(p, "no-restart-exit-codes", type=_int_csv, help="exit codes that end the job at once")
    _flag(p, "restart-exit-codes", type=_int_csv, help="only these exit codes are retried")
    _flag(p, "event-log", help="JSON-lines event log (default LOG_DIR/RUN_ID/events.jsonl)")
    _flag(p, "log-level", help="debug, info, warning or error")
    _flag(p, "log-format", help="auto, text or json")
    p.add_argument("training_script", nargs="?", default=argparse.SUPPRESS,
                   help="script (.py runs under this Python), module (-m) or command")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, default=argparse.SUPPRESS)
    return p


def _csv(text: str) -> list[str]:
    return [t for t in (s.strip() for s in text.split(",")) if t]


def _int_csv(text: str) -> list[int]:
    try:
        return [int(t) for t in _csv(text)]
    except ValueError:
        message = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def parse_run_args(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Turn ``run`` arguments plus the environment into validated Settings."""
    parser = _run_parser()
    try:
        argv = expand_abbreviations(argv, _takes_value(parser))
    except AmbiguousFlag as exc:
        parser.error(str(exc))
    ns = vars(parser.parse_args(argv))
    file_layer: dict[str, Any] = {}
    if "config_file" in ns:
        file_layer = load_file(ns.pop("config_file"))
    args = ns.get("training_script_args")
    if args and args[0] == "--":
        ns["training_script_args"] = args[1:]
    if "training_script" not in ns:
        # argparse gives REMAINDER an empty list even when absent: it must not override
        # the config file's arguments
        ns.pop("training_script_args", None)
    settings = build(file_layer, from_environ(environ), ns)
    check_backend(settings)
    return settings


def _takes_value(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Every option string of ``parser`` -> whether it takes a separate value."""
    # argparse keeps its actions in a private list; it is the only place that says this
    return {option: action.nargs != 0
            for action in parser._actions for option in action.option_strings}


def _check_config(argv: Sequence[str]) -> int:
    p = _Parser(
        prog="elastic-supervisor check-config",
        description="Validate a TOML config file (with PET_* variables applied, as `run` "
        "would) and print the resolved settings as JSON. Exit 0 valid, 2 invalid.",
    )
    p.add_argument("file", help="the TOML file (keys are the snake_case of run's flags)")
    ns = p.parse_args(list(argv))
    settings = build(load_file(ns.file), from_environ(os.environ))
    check_backend(settings)
    try:
        OutputPlan.from_settings(settings)  # --tee/--redirects/--local-ranks-filter values
    except OutputSpecError as exc:
        raise ConfigError(str(exc)) from None
    print(json.dumps(to_toml_dict(settings), indent=2, sort_keys=True))
    return 0


COMMANDS = {
    "run": "run a worker group under supervision, with torchrun's flags "
           "(also what flags without a command mean)",
    "check-config": "validate a TOML config file and print the resolved settings",
    "status": "show a running supervisor's state, read from its health endpoint",
    "node": "list or clear a job's node health records (quarantined nodes) in etcd",
}


def _top_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="elastic-supervisor",
        description="Supervise a gang-scheduled worker group (a drop-in for torchrun's "
        "agent). `elastic-supervisor COMMAND --help` describes each command.",
        epilog="examples:\n"
        "  elastic-supervisor run --nproc-per-node 2 examples/hello.py\n"
        "  elastic-supervisor check-config /etc/elastic-supervisor/config.toml\n"
        "  elastic-supervisor status --url http://127.0.0.1:29480",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"elastic-supervisor {__version__}")
    commands = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, text in COMMANDS.items():
        # listed with their descriptions; each command parses its own arguments
        commands.add_parser(name, help=text, add_help=False)
    return p


EXIT_SIGPIPE = 128 + 13  # what a shell reports for a tool whose reader went away


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elastic-supervisor`` command and ``python -m supervisor``."""
    try:
        code = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return code
    except BrokenPipeError:
        # `check-config FILE | head -1`: the reader has what it wanted; no traceback, and
        # no second complaint when Python flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_SIGPIPE
    except KeyboardInterrupt:
        return 128 + 2


def _main(args: list[str]) -> int:
    top = _top_parser()
    if not args:
        top.print_usage(sys.stderr)
        commands = ", ".join(COMMANDS)
        sys.stderr.write(f"{top.prog}: error: give a command ({commands}); --help says more\n")
        return EXIT_USAGE
    if args[0].startswith("-") and args[0] not in ("-h", "--help", "--version"):
        args = ["run", *args]  # torchrun style: flags straight away mean "run"
    ns, _ = top.parse_known_args(args[:1])
    rest = args[1:]
    try:
        if ns.command == "check-config":
            return _check_config(rest)
        if ns.command == "status":
            from supervisor.statuscmd import main_status

            return main_status(rest)
        if ns.command == "node":
            from supervisor.nodecmd import main_node

            return main_node(rest)
        if not rest and "PET_TRAINING_SCRIPT" not in os.environ:
            _run_parser().print_usage(sys.stderr)
            sys.stderr.write("elastic-supervisor run: error: give a script or command to run "
                             "(--help lists the flags)\n")
            return EXIT_USAGE
        settings = parse_run_args(rest, os.environ)
    except ConfigError as exc:
        print(f"elastic-supervisor: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from supervisor.app import run_supervisor

    return run_supervisor(settings)


if __name__ == "__main__":
    sys.exit(main())
