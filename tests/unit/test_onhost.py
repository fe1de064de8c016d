"""The programs that run on the hosts (kdeploy/onhost/), run here as the host runs them."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kdeploy import onhost
from kdeploy.core import layout, provisional, systemd
from kdeploy.onhost import probe_sglang, readmit, verify_release

PLUGINS = "def load_plugins():\n    return 'sglang.srt.plugins'\n"
HOOKS = "class HookRegistry:\n    kinds = ('around',)\n"
ALLOCATOR = "class PagedAlloc:\n    def __init__(self, size, need_sort=False):\n        pass\n"
REGISTRY = "def register_attention_backend(name):\n    return 'triton'\n"
CHOICES = "def add_attention_backend_choices(choices):\n    pass\n"


def _sglang(root: Path) -> Path:
    """A source tree shaped like SGLang's, as much as the probe reads of it."""
    for path, text in {"version.py": "__version__ = '0.5.23'\n", "srt/plugins/__init__.py": PLUGINS,
                       "srt/plugins/hook_registry.py": HOOKS, "srt/mem_cache/allocator/paged.py": ALLOCATOR,
                       "srt/layers/attention/attention_registry.py": REGISTRY,
                       "srt/arg_groups/choices.py": CHOICES}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_probe_reads_what_sglang_offers_from_its_sources(tmp_path: Path) -> None:
    root = str(_sglang(tmp_path / "sglang"))
    found = probe_sglang.cached_inspect(root, "")
    assert found["plugin_loader"] and found["hook_registry"] and found["attention_registry"]
    assert found["triton_backend"] and found["allocators"] == ["PagedAlloc"]
    assert found["backend_choices"] == "sglang.srt.arg_groups.choices"


def test_probe_reuses_its_cache_until_a_source_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _sglang(tmp_path / "sglang")
    cache = str(tmp_path / "probe.json")
    first = probe_sglang.cached_inspect(str(root), cache)
    assert json.loads(Path(cache).read_text())["found"] == first
    monkeypatch.setattr(probe_sglang, "inspect", lambda *a: pytest.fail("parsed again with nothing changed"))
    assert probe_sglang.cached_inspect(str(root), cache) == first
    (root / "srt/plugins/hook_registry.py").write_text("class Other:\n    pass\n")
    monkeypatch.undo()
    assert probe_sglang.cached_inspect(str(root), cache)["hook_registry"] is False


def test_probe_prints_one_line_without_sglang() -> None:
    """Run as the host runs it: ``python -I -c <source>``, with an interpreter that has no SGLang."""
    out = subprocess.run([sys.executable, "-I", "-c", onhost.source("probe_sglang.py")], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("KDEPLOY_PROBE ") and json.loads(out.removeprefix("KDEPLOY_PROBE "))["installed"] is False


def _staged(tmp_path: Path) -> Path:
    (tmp_path / ".kdeploy").mkdir()
    for name, data in {"a.py": b"a", "d/b.bin": b"b" * 100_000}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / ".kdeploy/manifest.sha256").write_text("".join(
        f"{hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()}  ./{n}\n" for n in ("a.py", "d/b.bin")))
    return tmp_path


def test_verify_release_passes_a_staged_release_that_matches(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(_staged(tmp_path))
    verify_release.main(["verify", ".kdeploy/manifest.sha256"])
    assert [p for p, _ in verify_release.read_manifest(".kdeploy/manifest.sha256")] == ["./d/b.bin", "./a.py"]


def test_verify_release_names_the_files_that_differ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(_staged(tmp_path))
    Path("a.py").write_text("edited on the way")
    with pytest.raises(SystemExit, match=r"1 staged file\(s\) differ from the manifest \(sha256\): ./a.py"):
        verify_release.main(["verify", ".kdeploy/manifest.sha256"])


@pytest.mark.parametrize("program", [provisional._REVERT, systemd._FOLLOW], ids=["revert", "follow"])
def test_shell_programs_are_filled_and_parse(program: str) -> None:
    assert not re.search(r"@[A-Z_]+@", program)
    subprocess.run(["sh", "-n", "-c", program], check=True)


def test_a_mark_without_a_value_is_refused() -> None:
    with pytest.raises(KeyError):
        onhost.shell("revert.sh", LOCK=".lock")


def test_the_readmit_program_names_the_paths_of_the_layout() -> None:
    """It runs on the host without kdeploy, so it spells the two paths it reads itself."""
    assert (readmit.PENDING, readmit.KEY) == (layout.PENDING, layout.READMIT_KEY)
