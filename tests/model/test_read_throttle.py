"""The storage throttle: readers in different processes share one rate, as ranks share storage."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from elastic_ep.model.read_throttle import ReadThrottle, create_rate_file

CHARGE = "import sys; from elastic_ep.model.read_throttle import ReadThrottle; " \
         "[ReadThrottle(sys.argv[1], 10.0).charge(250_000) for _ in range(4)]"  # 1 MB at 10 MB/s: 0.1 s alone


def test_two_processes_reading_at_once_take_twice_as_long_as_one():
    path = create_rate_file()
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, "-c", CHARGE, path], env=env) for _ in range(2)]
        assert [p.wait(60) for p in procs] == [0, 0]
        both_s = time.monotonic() - t0
        # 2 MB through one 10 MB/s link: at least 0.2 s however the two interleave
        assert both_s >= 0.2, both_s
    finally:
        os.unlink(path)


def test_no_rate_or_no_file_reads_freely(tmp_path):
    t0 = time.monotonic()
    ReadThrottle("", 10.0).charge(10**9)
    ReadThrottle(str(tmp_path / "gone"), 10.0).charge(10**9)  # its server removed it
    (tmp_path / "rate").write_bytes(b"")
    ReadThrottle(str(tmp_path / "rate"), 0).charge(10**9)
    assert time.monotonic() - t0 < 1.0


def test_one_reader_waits_its_bytes_at_the_rate():
    path = create_rate_file()
    try:
        throttle = ReadThrottle(path, 10.0)
        t0 = time.monotonic()
        throttle.charge(1_000_000)
        assert time.monotonic() - t0 >= 0.1 and throttle.waited_s >= 0.09
    finally:
        os.unlink(path)
