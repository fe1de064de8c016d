"""kdtree_ext's settings, without SGLang (the module imports only the standard library)."""

from __future__ import annotations

import sys

import pytest

from tests.sglang.conftest import PAYLOAD

sys.path.insert(0, str(PAYLOAD))
import kdtree_ext

sys.path.remove(str(PAYLOAD))


def test_defaults():
    assert kdtree_ext.read_config({}) == kdtree_ext.Config(verify=True, defrag=False, nsplit=64)


@pytest.mark.parametrize("nsplit", ["1", "2", "64", "1024"])
def test_valid_nsplit(nsplit: str):
    assert kdtree_ext.read_config({"KDTREE_NSPLIT": nsplit}).nsplit == int(nsplit)


@pytest.mark.parametrize("nsplit", ["abc", "0", "-4", "48", "2048", "6.0", "0x40"])
def test_invalid_nsplit(nsplit: str):
    with pytest.raises(ValueError, match=r"KDTREE_NSPLIT=.* is not a power of two in 1\.\.1024"):
        kdtree_ext.read_config({"KDTREE_NSPLIT": nsplit})


@pytest.mark.parametrize(("name", "value"), [("KDTREE_VERIFY", "maybe"), ("KDTREE_DEFRAG_SORT", "2")])
def test_invalid_flags(name: str, value: str):
    with pytest.raises(ValueError, match=name):
        kdtree_ext.read_config({name: value})


def test_flags():
    cfg = kdtree_ext.read_config({"KDTREE_VERIFY": "off", "KDTREE_DEFRAG_SORT": "1", "KDTREE_NSPLIT": "8"})
    assert cfg == kdtree_ext.Config(verify=False, defrag=True, nsplit=8)


def test_config_error_is_a_system_exit():
    """SGLang's load_plugins() catches Exception from plugins; a SystemExit gets through and ends the process."""
    assert issubclass(kdtree_ext.ConfigError, SystemExit) and not issubclass(kdtree_ext.ConfigError, Exception)
