"""The fault campaign's invariants read from real sandbox hosts (docs/chaos.md): a deployed host holds them all,
and each way a host can break them is seen out of band, through nsenter, as the campaign reads it."""

from __future__ import annotations

import pytest

from kdeploy_lab.chaos import invariants as inv
from tests.conftest import Deployment


def _facts(dep: Deployment, host: str = "h1") -> inv.HostFacts:
    return inv.read_host(dep.fleet, host, dep.service_dir, dep.service)


@pytest.mark.hosts(2)
def test_a_deployed_host_holds_every_invariant_and_each_break_is_seen(deployment: Deployment) -> None:
    assert deployment.kdeploy("push", "test") == 0
    facts = _facts(deployment)
    assert inv.settled(facts) and inv.host_violations(facts) == [], facts
    assert facts.current == deployment.current() and facts.started and facts.unit_same
    assert inv.server_violations("s", [facts, _facts(deployment, "h2")]) == []  # one payload, one environment
    d = deployment.service_dir

    # a release nobody gated, current pointing at it, the service restarted on it: what a lost switch leaves
    current = deployment.current()
    deployment.sh("h1", f"cp -a {d}/releases/{current} {d}/releases/R-ungated && "
                        f"ln -sfn releases/R-ungated {d}/.current.tmp && mv -T {d}/.current.tmp {d}/current && "
                        f"systemctl restart {deployment.service}")
    found = inv.host_violations(_facts(deployment))
    assert any("R-ungated never passed a gate" in v for v in found), found
    assert inv.server_violations("s", [_facts(deployment), _facts(deployment, "h2")])  # its payload is unknown

    # `current` moved back without a restart: the service runs what `current` no longer points to
    deployment.sh("h1", f"sleep 1; ln -sfn releases/{current} {d}/.current.tmp && mv -T {d}/.current.tmp {d}/current")
    found = inv.host_violations(_facts(deployment))
    assert found and all("started before `current` moved" in v for v in found), found

    # a lock held with no kdeploy running, a staging directory, a pending switch, an edited unit
    deployment.sh("h1", f"mkdir {d}/releases/.staging-x; echo tok > {d}/pending; "
                        f"echo '# edited' >> {deployment.unit_path}; systemctl daemon-reload")
    deployment.fleet.exec("h1", ["sh", "-c", f"flock {d}/.lock sleep 30 >/dev/null 2>&1 &"])
    facts = _facts(deployment)
    assert not inv.settled(facts)
    found = " | ".join(inv.host_violations(facts))
    for words in ("lock is held", "still pending", "not release"):
        assert words in found, found
    assert inv.staging_violations([facts]) == ["h1: staging left behind: .staging-x"]
