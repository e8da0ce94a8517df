"""A fake worker: a real interpreter whose behaviour the test chooses by flags.

It prints ``ready <rank> <pid>`` once set up, so tests synchronise on that line.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time


def say(text: str) -> None:
    """One write per line, so lines of workers sharing a console never interleave."""
    os.write(1, (text + "\n").encode())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--exit", type=int, default=None, help="exit with this code after ready")
    p.add_argument("--fail-rank", type=int, default=None, help="only this rank fails")
    p.add_argument("--fail-attempts", type=int, default=None,
                   help="fail only while TORCHELASTIC_RESTART_COUNT < N")
    p.add_argument("--hang", action="store_true", help="sleep forever after ready")
    p.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM")
    p.add_argument("--grandchild", default=None, help="spawn a sleeping grandchild; pid to file")
    p.add_argument("--grandchild-session", action="store_true",
                   help="the grandchild leaves our session (setsid), as a daemon would")
    p.add_argument("--chatter", type=float, default=0.0,
                   help="after ready, print 'chatter RANK N' every this many seconds forever")
    p.add_argument("--dump-env", default=None, help="write env JSON to DIR/<rank>.json")
    p.add_argument("--trap", default=None, help="on SIGUSR1/2 print 'got SIGNAME'")
    p.add_argument("--error-message", default=None, help="write a torch-style error file")
    p.add_argument("--lines", type=int, default=0, help="print N numbered lines first")
    p.add_argument("--usr1-exit", type=int, default=None,
                   help="on SIGUSR1, exit with this code (only ranks/attempts that fail)")
    p.add_argument("--say", action="append", default=[], help="print this line on stdout")
    p.add_argument("--say-err", action="append", default=[], help="print this line on stderr")
    p.add_argument("--print-env", default=None,
                   help="print 'env NAME=VALUE ...' for these comma-separated names")
    p.add_argument("--partial", default=None, help="after ready, write this without a newline")
    p.add_argument("--link", action="store_true",
                   help="after ready, link to rank 0 over TCP at MASTER_ADDR:MASTER_PORT (a "
                   "collective's connections), print 'linked RANK', exit 1 when a link breaks")
    p.add_argument("--long-line", type=int, default=0,
                   help="after ready, on SIGUSR1 write N bytes with no newline; exit on the next")
    args, _rest = p.parse_known_args()
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.trap:
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda n, _f: say(f"got {signal.Signals(n).name} {rank}"))
    if args.dump_env:
        path = os.path.join(args.dump_env, f"{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(dict(os.environ), f)
        os.replace(path + ".tmp", path)
    if args.grandchild:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                 start_new_session=args.grandchild_session)
        for path in (f"{args.grandchild}.{rank}", f"{args.grandchild}.{rank}.a{restart}"):
            with open(path, "w") as f:  # the latest, and this attempt's
                f.write(str(child.pid))
    if args.long_line:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # before ready: no race
    failing = args.fail_rank is None or args.fail_rank == rank
    if args.fail_attempts is not None and restart >= args.fail_attempts:
        failing = False
    if args.usr1_exit is not None and failing:
        code = args.usr1_exit
        signal.signal(signal.SIGUSR1, lambda _n, _f: os._exit(code))
    for i in range(args.lines):
        say(f"line {rank} {i}")
    for text in args.say:
        say(text)
    for text in args.say_err:
        os.write(2, (text + "\n").encode())
    if args.print_env:
        names = filter(None, args.print_env.split(","))
        say("env " + " ".join(f"{n}={os.environ.get(n, '')}" for n in names))
    say(f"ready {rank} {os.getpid()} {restart}")
    if args.partial is not None:
        os.write(1, args.partial.encode())
    if args.long_line:
        write_long_line(args.long_line)
    links = link(rank, int(os.environ.get("WORLD_SIZE", "1"))) if args.link else []
    if args.exit is not None and failing:
        if args.error_message:
            write_error_file(args.error_message)
        sys.exit(args.exit)
    if args.link:
        select.select(links, [], [])
        say(f"link lost {rank}")
        sys.exit(1)
    for i in range(sys.maxsize if args.chatter else 0):
        say(f"chatter {rank} {i}")
        time.sleep(args.chatter)
    if args.hang or args.ignore_term or args.trap or args.grandchild or args.usr1_exit is not None:
        while True:
            time.sleep(3600)


def link(rank: int, world: int) -> list[socket.socket]:
    """Rank 0 accepts one connection from every other rank; the links once all are made
    (then a link that breaks, a peer gone, exits 1: a collective's broken connection)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        server = socket.create_server((addr, port))
        links = [server.accept()[0] for _ in range(world - 1)]
    else:
        deadline = time.monotonic() + 60
        while True:
            try:
                links = [socket.create_connection((addr, port), timeout=1)]
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # rank 0 is not listening yet
        links[0].settimeout(None)
    say(f"linked {rank}")
    return links


def write_error_file(message: str) -> None:
    """The format torch's @record writes (ProcessFailure's error file)."""
    path = os.environ["TORCHELASTIC_ERROR_FILE"]
    data = {"message": {"message": f"RuntimeError: {message}",
                        "extraInfo": {"py_callstack": "Traceback (most recent call last):\n"
                                      f"RuntimeError: {message}\n",
                                      "timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(data, f)


def write_long_line(size: int) -> None:
    """On SIGUSR1, write ``size`` bytes of 'x' with no newline; return on the next SIGUSR1."""
    signal.sigwait({signal.SIGUSR1})
    block = b"x" * 65536
    left = size
    while left:
        left -= os.write(1, block[: min(left, len(block))])
    signal.sigwait({signal.SIGUSR1})


if __name__ == "__main__":
    main()
