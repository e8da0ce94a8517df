"""Worker output: torchrun's routes, whole prefixed console lines, per-rank files, rotation.

The pure rules (``supervisor.workers.logs``) are tested on bytes; the pumps in-process with
real pipes; the rest end to end through the real daemon (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
from pathlib import Path

import anyio
import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.workers.logs import (
    CONTINUATION_MARK,
    ERR,
    OUT,
    LineSplitter,
    OutputSpecError,
    Piece,
    StreamRoute,
    Target,
    matching_lines,
    parse_ranks_filter,
    parse_std_map,
    render,
    render_prefix,
    route_stream,
)
from supervisor.workers.output import OutputPlan
from tests.support import deps
from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER

BASE = ["--health-port", "0", "--shutdown-timeout", "5"]
MARK = CONTINUATION_MARK.decode()


# ====================================================================== pure rules


def test_std_map_single_value_applies_to_every_rank() -> None:
    assert parse_std_map("3", 2, what="tee") == {0: 3, 1: 3}


def test_std_map_per_rank_with_multi_digit_ranks() -> None:
    assert parse_std_map("0:1,10:3", 12, what="tee") == {**dict.fromkeys(range(12), 0),
                                                         0: 1, 10: 3}


@pytest.mark.parametrize("text", ["4", "0:4", "a:1", "0-1"])
def test_std_map_rejects_bad_values(text: str) -> None:
    with pytest.raises(OutputSpecError):
        parse_std_map(text, 2, what="redirects")


def test_ranks_filter() -> None:
    assert parse_ranks_filter("") is None
    assert parse_ranks_filter("0,12") == frozenset({0, 12})
    with pytest.raises(OutputSpecError):
        parse_ranks_filter("0,x")


def test_default_prefix_is_torchruns() -> None:
    prefix = render_prefix(None, role_name="trainer", rank=5, local_rank=1, hostname="h",
                           restart_count=2)
    assert prefix == b"[trainer1]:"


def test_prefix_template_knows_hostname_and_restart_count() -> None:
    prefix = render_prefix("${hostname}/${rank}/${restart_count} ${unknown}:", role_name="r",
                           rank=5, local_rank=1, hostname="node7", restart_count=2)
    assert prefix == b"node7/5/2 ${unknown}:"


@pytest.mark.parametrize(
    ("redirect", "tee", "shown", "bit", "expected"),
    [
        (0, 0, True, OUT, StreamRoute(Target.INHERIT)),
        (0, 0, False, OUT, StreamRoute(Target.DEVNULL)),
        (1, 0, True, OUT, StreamRoute(Target.PIPE, to_console=False)),
        (1, 0, True, ERR, StreamRoute(Target.INHERIT)),
        (0, 3, True, ERR, StreamRoute(Target.PIPE, to_console=True)),
        (0, 3, False, ERR, StreamRoute(Target.PIPE, to_console=False)),
        (2, 1, True, OUT, StreamRoute(Target.PIPE, to_console=True)),
    ],
)
def test_routes(redirect: int, tee: int, shown: bool, bit: int, expected: StreamRoute) -> None:
    assert route_stream(redirect, tee, shown, bit) == expected


@pytest.mark.parametrize(
    ("redirects", "tee", "ranks_filter"),
    [("0", "0", ""), ("3", "0", ""), ("0", "3", "1"), ("1", "2", "0"), ("0:1,1:2", "1:3", "")],
)
def test_routes_match_torchrun(
    tmp_path: Path, redirects: str, tee: str, ranks_filter: str
) -> None:
    """Cross-check against torch 2.13's own DefaultLogsSpecs.reify."""
    api = deps.need_module("torch.distributed.elastic.multiprocessing.api")
    shown = parse_ranks_filter(ranks_filter)
    specs = api.DefaultLogsSpecs(
        log_dir=str(tmp_path), redirects=api.Std.from_str(redirects),
        tee=api.Std.from_str(tee), local_ranks_filter=set(shown) if shown else None,
    )
    dest = specs.reify({r: {"TORCHELASTIC_RUN_ID": "x"} for r in range(2)})
    plan = OutputPlan(redirects, tee, 2, local_ranks_filter=ranks_filter)
    for rank in range(2):
        for bit, paths, tees in ((OUT, dest.stdouts, dest.tee_stdouts),
                                 (ERR, dest.stderrs, dest.tee_stderrs)):
            route = plan.routes[rank][bit]
            torch_target = {"": Target.INHERIT, os.devnull: Target.DEVNULL}.get(
                paths[rank], Target.PIPE)
            assert (route.target, route.to_console) == (torch_target, rank in tees)


def test_splitter_holds_a_partial_line_until_its_newline() -> None:
    s = LineSplitter()
    assert s.feed(b"a\nb") == [Piece(b"a\n")]
    assert s.feed(b"c\nd\ne") == [Piece(b"bc\n"), Piece(b"d\n")]
    assert s.flush() == [Piece(b"e\n")]
    assert s.flush() == []


def test_splitter_cuts_a_long_line_and_marks_the_rest() -> None:
    s = LineSplitter(limit=4)
    assert s.feed(b"abcdefghij") == [Piece(b"abcd\n"), Piece(b"efgh\n", continued=True)]
    assert s.pending == 2
    assert s.feed(b"k\nxy\n") == [Piece(b"ijk\n", continued=True), Piece(b"xy\n")]


def test_splitter_cuts_long_lines_inside_one_chunk() -> None:
    s = LineSplitter(limit=4)
    assert s.feed(b"ab\nabcdefg\ncd\n") == [
        Piece(b"ab\n"), Piece(b"abcd\n"), Piece(b"efg\n", continued=True), Piece(b"cd\n"),
    ]


def test_splitter_does_not_cut_inside_a_utf8_character() -> None:
    s = LineSplitter(limit=4)
    text = "aaé€b".encode()  # a a c3a9 e282ac b
    pieces = s.feed(text) + s.flush()
    assert [p.data.rstrip(b"\n").decode() for p in pieces] == ["aaé", "€b"]


lines_strategy = st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
                          max_size=30)


@given(lines=lines_strategy, cuts=st.lists(st.integers(0, 400), max_size=20),
       limit=st.integers(4, 16), last_newline=st.booleans())
def test_splitter_keeps_every_byte_in_order_and_bounded(
    lines: list[bytes], cuts: list[int], limit: int, last_newline: bool
) -> None:
    data = b"\n".join(lines) + (b"\n" if last_newline and lines else b"")
    s = LineSplitter(limit=limit)
    pieces: list[Piece] = []
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    for a, b in itertools.pairwise(bounds):
        pieces += s.feed(data[a:b])
        assert s.pending <= limit
    pieces += s.flush()
    rebuilt = bytearray()
    for piece in pieces:
        assert piece.data.endswith(b"\n")
        for i, line in enumerate(piece.data[:-1].split(b"\n")):
            assert len(line) <= limit
            if i == 0 and piece.continued:
                rebuilt[-1:] = b""  # the cut added a newline that was not in the stream
            rebuilt += line + b"\n"
    expected = data if data.endswith(b"\n") or not data else data + b"\n"
    assert bytes(rebuilt) == expected


def test_render_prefixes_every_line_and_marks_continuations() -> None:
    pieces = [Piece(b"a\nb\n"), Piece(b"c\n", continued=True)]
    assert render(pieces, b"[r0]:") == b"[r0]:a\n[r0]:b\n[r0]:" + CONTINUATION_MARK + b"c\n"
    assert render(pieces, b"") == b"a\nb\n" + CONTINUATION_MARK + b"c\n"


def test_matching_lines_checks_content_not_prefix() -> None:
    pieces = [Piece(b"apple pie\nplum\nred orange\n")]
    assert matching_lines(pieces, [b"apple", b"orange"], b"[x]:") == (
        b"[x]:apple pie\n[x]:red orange\n")
    assert matching_lines(pieces, [b"[x]"], b"[x]:") == b""


# ====================================================================== pumps in-process


async def test_full_console_holds_the_worker_back_without_buffering(tmp_path: Path) -> None:
    """Backpressure: a console nobody reads stops the pump; memory stays bounded."""
    console_r, console_w = os.pipe()
    os.set_blocking(console_r, False)
    rank_dir = tmp_path / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    plan = OutputPlan("0", "1", 1, console_fds=(console_w, console_w))
    block = (b"y" * 99 + b"\n") * 655  # ~64 KiB of whole lines
    sent = bytearray()  # what the "worker" managed to write
    async with anyio.create_task_group() as tg:
        await tg.start(plan.run)
        worker_out, _ = plan.open_rank(0, rank_dir, 0, 0)
        assert worker_out is not None
        os.set_blocking(worker_out, False)
        with anyio.fail_after(20):
            while len(sent) < 64 << 20:  # offer up to 64 MiB
                try:
                    sent += block[: os.write(worker_out, block)]
                except BlockingIOError:
                    if plan.console_blocked:
                        break  # the worker's pipe is full and the pump waits: held back
                    with anyio.move_on_after(0.05):  # let the pump take what it can
                        await anyio.wait_writable(worker_out)
        assert plan.console_blocked
        assert len(sent) < 4 << 20  # pipe (1 MiB) + console pipe + one block in flight
        plan.after_spawn(0)  # closes the worker's end: EOF once the pump catches up
        console = bytearray()

        async def read_console() -> None:
            while True:
                await anyio.wait_readable(console_r)
                chunk = os.read(console_r, 1 << 20)
                if not chunk:
                    return
                console.extend(chunk)

        tg.start_soon(read_console)
        await plan.drain(0)  # everything is written to the console pipe now
        tg.cancel_scope.cancel()
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(console_r, 1 << 20):
            console.extend(chunk)
    os.close(console_w)
    os.close(console_r)
    lines = bytes(sent).split(b"\n")
    lines = lines[:-1] if not lines[-1] else lines
    assert console == b"".join(b"[default0]:" + line + b"\n" for line in lines)
    assert (rank_dir / "stdout.log").read_bytes() == sent


async def test_drain_gives_up_on_a_pipe_a_leaked_descendant_keeps_open(tmp_path: Path) -> None:
    console_r, console_w = os.pipe()
    rank_dir = tmp_path / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    plan = OutputPlan("0", "1", 1, console_fds=(console_w, console_w))
    async with anyio.create_task_group() as tg:
        await tg.start(plan.run)
        worker_out, _ = plan.open_rank(0, rank_dir, 0, 0)
        assert worker_out is not None
        leaked = os.dup(worker_out)  # a grandchild's copy of the worker's stdout
        plan.after_spawn(0)
        os.write(leaked, b"a line\npartial")
        with anyio.fail_after(5):
            await plan.drain(0, timeout=0.2)  # the worker is dead; the grandchild is not
        tg.cancel_scope.cancel()
    os.close(console_w)
    with os.fdopen(console_r, "rb") as f:
        assert f.read() == b"[default0]:a line\n[default0]:partial\n"
    assert (rank_dir / "stdout.log").read_bytes() == b"a line\npartial"
    with pytest.raises(BrokenPipeError):
        os.write(leaked, b"more\n")
    os.close(leaked)


async def test_stuck_console_cannot_keep_output_out_of_the_files(tmp_path: Path) -> None:
    console_r, console_w = os.pipe()
    os.set_blocking(console_w, False)  # ours only: the plan opens a description of its own
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(console_w, b"." * 4096)  # nobody will ever read this console
    rank_dir = tmp_path / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    plan = OutputPlan("0", "1", 1, console_fds=(console_w, console_w))
    data = b"".join(b"line %d\n" % i for i in range(30_000))  # ~250 KB: fits the pipe
    async with anyio.create_task_group() as tg:
        await tg.start(plan.run)
        worker_out, _ = plan.open_rank(0, rank_dir, 0, 0)
        assert worker_out is not None
        os.write(worker_out, data)
        plan.after_spawn(0)  # the worker is gone
        with anyio.fail_after(10):
            await plan.drain(0, timeout=0.2)
        tg.cancel_scope.cancel()
    os.close(console_w)
    os.close(console_r)
    assert (rank_dir / "stdout.log").read_bytes() == data


async def test_open_rank_leaves_nothing_open_when_a_log_file_cannot_be_made(
    tmp_path: Path,
) -> None:
    plan = OutputPlan("3", "0", 1)
    async with anyio.create_task_group() as tg:
        await tg.start(plan.run)
        (tmp_path / "stderr.log").mkdir()  # stdout's pump starts, stderr's file fails
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(IsADirectoryError):
            plan.open_rank(0, tmp_path, 0, 0)
        with anyio.fail_after(5):
            await plan.drain(0)  # the started pump saw EOF: nothing to wait for
        assert set(os.listdir("/proc/self/fd")) == before
        tg.cancel_scope.cancel()


# ====================================================================== the daemon


def rank_file(log_dir: Path, attempt: int, rank: int, name: str = "stdout.log") -> Path:
    return log_dir / "none" / f"attempt_{attempt}" / str(rank) / name


@pytest.mark.xdist_group("load")  # 800 000 lines through the console: not beside another load
async def test_tee_keeps_lines_whole_prefixed_and_complete(tmp_path: Path) -> None:
    n = 200_000
    args = [*BASE, "--nproc-per-node", "4", "--tee", "3", "--log-dir", str(tmp_path),
            FAKE_WORKER, "--lines", str(n)]
    async with supervisor(args) as sup:
        assert await sup.wait(timeout=100) == 0
    seen: dict[str, list[int]] = {str(r): [] for r in range(4)}
    pattern = re.compile(r"\[default(\d)\]:(?:line (\d) (\d+)|ready (\d) \d+ 0)")
    for text in sup.out.lines:
        m = pattern.fullmatch(text)
        assert m is not None, f"broken console line: {text[:200]!r}"
        assert m.group(1) == (m.group(2) or m.group(4))
        if m.group(3):
            seen[m.group(1)].append(int(m.group(3)))
    assert all(numbers == list(range(n)) for numbers in seen.values())
    for rank in range(4):
        data = rank_file(tmp_path, 0, rank).read_bytes()
        body, ready = data.rsplit(b"\n", 2)[0], data.split(b"\n")[-2]
        assert body == "\n".join(f"line {rank} {i}" for i in range(n)).encode()
        assert ready.startswith(f"ready {rank} ".encode())


async def test_partial_last_line_is_flushed_at_exit(tmp_path: Path) -> None:
    args = [*BASE, "--tee", "3", "--log-dir", str(tmp_path), FAKE_WORKER,
            "--partial", "no newline here"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 0
    assert sup.out.lines[-1] == "[default0]:no newline here"
    assert rank_file(tmp_path, 0, 0).read_bytes().endswith(b"\nno newline here")


def peak_rss(pid: int) -> int:
    """The process's high-water RSS in bytes (VmHWM); psutil has only the current RSS."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_huge_line_without_newline_keeps_memory_bounded(tmp_path: Path) -> None:
    size = 10 * 1024 * 1024
    args = [*BASE, "--tee", "3", "--log-dir", str(tmp_path), FAKE_WORKER,
            "--long-line", str(size)]
    async with supervisor(args) as sup:
        await sup.out.expect(r"^\[default0\]:ready 0 ")
        await sup.serving()  # its HTTP stack is imported: not part of what grows
        before = peak_rss(sup.pid)
        sup.signal(signal.SIGUSR1)  # forwarded: the worker writes the line
        received = 0
        first = True
        while received < size - 64 * 1024:  # all but what is held back for the newline
            m = await sup.out.expect(r"^\[default0\]:(.*)$")
            head = "" if first else MARK
            assert m.group(1).startswith(head) and set(m.group(1)[len(head):]) == {"x"}
            received += len(m.group(1)) - len(head)
            first = False
        grown = peak_rss(sup.pid) - before
        rss = psutil.Process(sup.pid).memory_info().rss
        sup.signal(signal.SIGUSR1)  # the worker exits: the rest is flushed
        assert await sup.wait() == 0
    rest = sup.out.lines[-1]
    assert rest.startswith(f"[default0]:{MARK}x")
    assert received + len(rest) - len(f"[default0]:{MARK}") == size
    assert grown < 4 * 1024 * 1024, f"supervisor grew by {grown} bytes (RSS now {rss})"
    data = rank_file(tmp_path, 0, 0).read_bytes()
    assert data.endswith(b"\n" + b"x" * size)


async def test_sighup_reopens_log_files_without_losing_lines(tmp_path: Path) -> None:
    args = [*BASE, "--tee", "3", "--log-dir", str(tmp_path), FAKE_WORKER, "--trap", "1"]
    log = rank_file(tmp_path, 0, 0)
    async with supervisor(args) as sup:
        await sup.out.expect(r"^\[default0\]:ready 0 ")
        sup.signal(signal.SIGUSR1)
        await sup.out.expect(r"^\[default0\]:got SIGUSR1 0$")
        log.rename(log.with_name("stdout.log.1"))  # what logrotate does
        sup.signal(signal.SIGHUP)
        await sup.err.expect(r"log files reopened")
        sup.signal(signal.SIGUSR2)
        await sup.out.expect(r"^\[default0\]:got SIGUSR2 0$")
        assert log.read_text() == "got SIGUSR2 0\n"
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
    rotated = log.with_name("stdout.log.1").read_text().splitlines()
    assert rotated[0].startswith("ready 0 ") and rotated[1:] == ["got SIGUSR1 0"]


async def test_each_restart_writes_its_own_attempt_files(tmp_path: Path) -> None:
    args = [*BASE, "--nproc-per-node", "2", "--tee", "3", "--max-restarts", "1",
            "--log-dir", str(tmp_path), FAKE_WORKER, "--exit", "3", "--fail-rank", "1",
            "--fail-attempts", "1"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 0
    # rank 0 of attempt 0 may be stopped before it says anything: rank 1 fails at once
    assert re.fullmatch(r"(ready 0 \d+ 0\n)?", rank_file(tmp_path, 0, 0).read_text())
    assert re.fullmatch(r"ready 1 \d+ 0\n", rank_file(tmp_path, 0, 1).read_text())
    for rank in (0, 1):
        assert re.fullmatch(rf"ready {rank} \d+ 1\n", rank_file(tmp_path, 1, rank).read_text())
    assert len([t for t in sup.out.lines if t.startswith("[default1]:ready 1 ")]) == 2


async def test_duplicate_filters_copy_matching_console_lines(tmp_path: Path) -> None:
    args = [*BASE, "--nproc-per-node", "2", "--tee", "3", "--log-dir", str(tmp_path),
            "--duplicate-stdout-filters", "apple,orange", "--duplicate-stderr-filters", "pear",
            FAKE_WORKER, "--say", "an apple", "--say", "a plum", "--say", "an orange",
            "--say-err", "a pear", "--say-err", "an apple on stderr"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 0
    attempt = tmp_path / "none" / "attempt_0"
    out = (attempt / "filtered_stdout.log").read_text().splitlines()
    err = (attempt / "filtered_stderr.log").read_text().splitlines()
    assert sorted(out) == ["[default0]:an apple", "[default0]:an orange",
                           "[default1]:an apple", "[default1]:an orange"]
    assert sorted(err) == ["[default0]:a pear", "[default1]:a pear"]


async def test_redirects_and_ranks_filter_decide_what_reaches_the_console(
    tmp_path: Path,
) -> None:
    args = [*BASE, "--nproc-per-node", "2", "--redirects", "1", "--tee", "2",
            "--local-ranks-filter", "1", "--log-dir", str(tmp_path), FAKE_WORKER,
            "--say", "to stdout", "--say-err", "to stderr"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 0
    assert sup.out.lines == []  # stdout is redirected for both ranks
    worker_err = [t for t in sup.err.lines if "to stderr" in t]
    assert worker_err == ["[default1]:to stderr"]  # rank 0 is filtered out
    for rank in (0, 1):
        assert "to stdout" in rank_file(tmp_path, 0, rank).read_text()
        assert rank_file(tmp_path, 0, rank, "stderr.log").read_text() == "to stderr\n"


async def test_untouched_streams_inherit_the_console_without_prefix(tmp_path: Path) -> None:
    args = [*BASE, "--log-dir", str(tmp_path), FAKE_WORKER, "--say", "plain"]
    async with supervisor(args) as sup:
        assert await sup.wait() == 0
    assert "plain" in sup.out.lines
    assert not rank_file(tmp_path, 0, 0).exists()


async def test_prefix_template_from_the_environment(tmp_path: Path) -> None:
    template = "${hostname}|${rank}|${restart_count}|${role_name}> "
    args = [*BASE, "--tee", "1", "--role", "trainer", "--log-dir", str(tmp_path),
            FAKE_WORKER, "--say", "hi"]
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": template}
    async with supervisor(args, env=env) as sup:
        assert await sup.wait() == 0
    assert f"{socket.gethostname()}|0|0|trainer> hi" in sup.out.lines
