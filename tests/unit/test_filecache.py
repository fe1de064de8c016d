import os
import threading
import time
from pathlib import Path

from kdeploy.core.filecache import FileCache


def test_parsed_once_until_a_file_changes(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "missing"
    a.write_text("one\n")
    loads: list[str] = []
    cache: FileCache[str] = FileCache()

    def load() -> str:
        loads.append(a.read_text())
        return a.read_text().strip()

    assert [cache.get([a, b], load) for _ in range(3)] == ["one"] * 3 and loads == ["one\n"]
    a.write_text("two\n")                              # rewritten in place: size and mtime change
    assert cache.get([a, b], load) == "two"
    st = a.stat()
    tmp = tmp_path / "a.tmp"
    tmp.write_text("six\n")                            # same size, mtime put back: replaced by a rename
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    tmp.replace(a)
    assert cache.get([a, b], load) == "six"
    b.write_text("")                                   # a file that appears counts as a change
    assert cache.get([a, b], load) == "six" and len(loads) == 4
    assert cache.get([a], load) == "six" and len(loads) == 5    # another set of files: its own entry


def test_threads_asking_at_once_parse_once(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    cache: FileCache[int] = FileCache()
    calls: list[int] = []

    def slow() -> int:
        calls.append(1)
        time.sleep(0.05)
        return 42

    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(cache.get([tmp_path / "f"], slow))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [42] * 8 and calls == [1]
