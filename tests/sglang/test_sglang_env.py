"""lab/kdeploy_lab/sglang_env.py: the cached SGLang venv (built by the session fixture) and its error paths."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from kdeploy_lab import sglang_env


def test_the_cached_venv_records_what_it_was_built_from(sglang_python: str):
    path = Path(sglang_python).parent.parent
    data = sglang_env.info(path)
    assert data is not None and data["spec"] == sglang_env.spec()
    assert data["build_seconds"] > 0 and data["size_bytes"] > 10**9
    assert "sglang==0.5.23" in data["packages"] and "torch==2.13.0+cpu" in data["packages"]
    assert sglang_env.is_ready(path)


def test_ensure_venv_returns_at_once_when_ready_even_from_many_threads(sglang_python: str):
    path = Path(sglang_python).parent.parent
    results: list[Path] = []
    start = time.monotonic()
    threads = [threading.Thread(target=lambda: results.append(sglang_env.ensure_venv(path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [path] * 4 and time.monotonic() - start < 10


def test_a_changed_package_set_means_not_ready(tmp_path: Path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to("/usr/bin/python3")
    spec = sglang_env.spec()
    (tmp_path / sglang_env.MARKER).write_text(json.dumps({"spec": spec}))
    assert sglang_env.is_ready(tmp_path)
    (tmp_path / sglang_env.MARKER).write_text(json.dumps({"spec": {**spec, "sglang": "sglang==0.5.22"}}))
    assert not sglang_env.is_ready(tmp_path)
    (tmp_path / sglang_env.MARKER).unlink()
    assert not sglang_env.is_ready(tmp_path) and sglang_env.info(tmp_path) is None


def test_missing_interpreter_is_one_line(tmp_path: Path):
    with pytest.raises(sglang_env.SglangEnvError) as err:
        sglang_env.ensure_venv(tmp_path / "v", python=Path("/nonexistent/python3"))
    assert "\n" not in str(err.value) and "/nonexistent/python3 not found" in str(err.value)


def test_no_pip_and_no_ensurepip_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sglang_env, "_pip_runner", lambda python: None)
    monkeypatch.setattr(sglang_env, "_has_ensurepip", lambda python: False)
    with pytest.raises(sglang_env.SglangEnvError, match=r"no pip >= 22\.3 and no ensurepip .*python3-venv"):
        sglang_env.ensure_venv(tmp_path / "v")
    assert not (tmp_path / "v" / sglang_env.MARKER).exists()


def test_default_path_follows_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(sglang_env.ENV_PATH, "/tmp/elsewhere")
    assert sglang_env.default_path() == Path("/tmp/elsewhere")
    monkeypatch.delenv(sglang_env.ENV_PATH)
    assert sglang_env.default_path() == sglang_env.DEFAULT_PATH
