"""The pure parts of the scale bench's process sampling, the slope fit and the journal floor."""

from __future__ import annotations

import json
import os
import socket

import pytest

from kdeploy_lab import floor, procwatch

STATUS = """Name:\tkdeploy
State:\tS (sleeping)
VmPeak:\t  512000 kB
VmHWM:\t   91234 kB
VmRSS:\t   80000 kB
Threads:\t17
"""


def test_parse_status_reads_rss_peak_and_threads() -> None:
    assert procwatch.parse_status(STATUS) == (80000, 91234, 17)


def test_parse_status_of_a_zombie_has_no_memory_fields() -> None:
    assert procwatch.parse_status("Name:\tkdeploy\nState:\tZ (zombie)\nThreads:\t1\n") == (0, 0, 1)


def test_count_fds_counts_sockets_apart() -> None:
    targets = ["/dev/null", "pipe:[123]", "socket:[456]", "socket:[789]", "/tmp/x", "anon_inode:[eventpoll]"]
    assert procwatch.count_fds(targets) == (6, 2)


def test_sample_sees_a_socket_this_process_opens() -> None:
    before = procwatch.sample(os.getpid())
    with socket.socket() as _sock:
        during = procwatch.sample(os.getpid())
    assert before is not None and during is not None
    assert during.sockets == before.sockets + 1 and during.threads >= 1 and during.rss_kb > 0


def test_peaks_keep_the_maximum_of_each_field() -> None:
    peaks = procwatch.Peaks()
    peaks.add(procwatch.ProcSample(rss_kb=100, hwm_kb=150, threads=3, fds=10, sockets=2))
    peaks.add(procwatch.ProcSample(rss_kb=120, hwm_kb=120, threads=9, fds=7, sockets=5))
    assert (peaks.rss_kb, peaks.threads, peaks.fds, peaks.sockets, peaks.samples) == (150, 9, 10, 5, 2)


def test_slope_is_the_least_squares_fit() -> None:
    assert procwatch.slope([(16, 1.0), (32, 1.5), (64, 2.5), (128, 4.5)]) == pytest.approx(0.03125)
    assert procwatch.slope([(16, 2.0), (32, 2.0)]) == 0
    assert procwatch.slope([(16, 1.0)]) is None
    assert procwatch.slope([(16, 1.0), (16, 2.0)]) is None


def _journal(*entries: tuple[float, str] | tuple[float, str, str]) -> str:
    return "\n".join(json.dumps({"__REALTIME_TIMESTAMP": str(int(e[0] * 1e6)), "MESSAGE": e[1],
                                 **({"SYSLOG_IDENTIFIER": e[2]} if len(e) > 2 else {})}) for e in entries)


def test_restart_window_runs_from_stopping_to_the_next_ready_line() -> None:
    text = _journal((99.0, floor.READY_LINE), (100.0, "Stopping sglang-demo.service - SGLang..."),
                    (100.5, "Stopped sglang-demo.service"), (100.5, "Started sglang-demo.service"),
                    (102.25, floor.READY_LINE), (103.0, floor.READY_LINE))
    assert floor.restart_window(text + "\nnot json\n") == (100.0, 102.25)


def test_restart_window_leaves_out_the_time_the_unit_waited_for_its_start() -> None:
    """The old run was gone at 101.0; the tool's start came at 101.75: 0.75 s of the tool's, not the floor's.
    The service's own "Started ..." line does not count as systemd's."""
    text = _journal((100.0, "Stopping x.service...", "systemd"), (100.2, "Started worker 1", "python"),
                    (101.0, "x.service: Deactivated successfully.", "systemd"),
                    (101.75, "Started x.service - SGLang.", "systemd"), (102.0, "Started worker 2", "python"),
                    (103.0, floor.READY_LINE, "python"))
    assert floor.restart_window(text) == (100.0, 102.25)
    served = _journal((99.0, "Stopping now", "python"), (100.0, "Stopping x.service...", "systemd"),
                      (101.0, floor.READY_LINE, "python"))
    assert floor.restart_window(served) == (100.0, 101.0)  # only systemd's "Stopping" starts the window


def test_restart_window_ignores_a_stop_before_since() -> None:
    text = _journal((100.0, "Stopping x.service"), (101.0, floor.READY_LINE), (105.0, "Stopping x.service"),
                    (106.5, floor.READY_LINE))
    assert floor.restart_window(text, since=104.0) == (105.0, 106.5)


def test_restart_window_is_none_without_a_ready_line_after_the_stop() -> None:
    assert floor.restart_window(_journal((99.0, floor.READY_LINE), (100.0, "Stopping x.service"))) is None
    assert floor.restart_window("") is None


def test_fleet_floor_is_the_slowest_host_and_needs_every_host() -> None:
    assert floor.fleet_floor({"h1": (10.0, 12.0), "h2": (10.5, 13.5), "h3": (11.0, 12.0)}) == (3.0, "h2")
    assert floor.fleet_floor({"h1": (10.0, 12.0), "h2": None}) is None
    assert floor.fleet_floor({}) is None
