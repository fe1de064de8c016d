"""Local test hosts with real systemd, OpenSSH and journald: one systemd-nspawn container per host.

Every host boots the machine's own OS (``-D / --volatile=yes``): ``/`` is a tmpfs, ``/usr`` is the
machine's (read-only), ``/etc`` is an overlay whose upper dir is per host, ``/srv`` and ``/opt`` are
bound per host and survive a reboot of the host. A venv built from ``/usr/bin/python3`` is bound
read-only at :data:`HOST_VENV` in every host. Optionally (``Sandbox(sglang=...)``) the cached CPU SGLang
venv of :mod:`kdeploy_lab.sglang_env` (the real ``sglang==0.5.23``, also built from ``/usr/bin/python3``) is
bound read-only at :data:`SGLANG_HOST_VENV`; both venvs carry the reference server as ``kdeploy_refserver``.

Network: a bridge ``kdbr<i>`` with 10.213.<i>.1/24 on the machine, per host a network namespace and a
veth pair ``kd<i>-h<I>`` <-> ``eth0`` with address 10.213.<i>.(10+I). There is no default route inside:
hosts reach each other and the machine only.

Everything is named after the instance number (0..9), so several sandboxes coexist, and everything of
an instance can be found again by name after a crash: processes (by the nspawn command line and by
cgroup), network namespaces, links, cgroups, nspawn's propagate dirs and the state dir.

Needs root and ``apt-get install systemd-container openssh-server``; systemd does not have to be the
machine's PID 1 (``--register=no --keep-unit``). ``up(become_user=NAME)`` needs ``sudo`` on the machine too
(the hosts run the machine's ``/usr/bin/sudo``): root may not log in over SSH there, NAME logs in with the
sandbox key and has passwordless sudo, as on fleets that deploy with ``become``.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from kdeploy.core.errors import ExitCode, KdeployError

DEFAULT_DIR = Path(os.environ.get("KDEPLOY_SANDBOX_DIR", "/var/lib/kdeploy-sandbox"))
HOST_VENV = "/opt/kdeploy-sandbox/venv"
SGLANG_HOST_VENV = "/opt/kdeploy-sandbox/sglang"
MAX_HOSTS = 200
MAX_INSTANCE = 9
INSTALL_HINT = "apt-get install systemd-container openssh-server"
SYSTEM_PYTHON = Path("/usr/bin/python3")   # Debian's python: the only one visible inside the hosts
SSHD = Path("/usr/sbin/sshd")               # what the hosts run (they share the machine's /usr)
INOTIFY_SYSCTL = Path("/proc/sys/fs/inotify/max_user_instances")
INOTIFY_MIN = 8192   # every host's systemd/journald/logind use ~8 instances, all charged to uid 0
NETNS_DIR = Path("/run/netns")
SYS_NET = Path("/sys/class/net")
CGROUP_FS = Path("/sys/fs/cgroup")
NSPAWN_RUN = Path("/run/systemd/nspawn")
NSPAWN_DIRS = (NSPAWN_RUN / "propagate", NSPAWN_RUN / "unix-export")
PATH_INSIDE = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STOP_GRACE = 30.0    # seconds an orderly poweroff may take before the host is killed
# --dist-init-addr port of a server that spans hosts: torch's usual MASTER_PORT, clear of SGLang's HTTP port
# (30000) and of the few ports SGLang takes just above the dist-init port
RENDEZVOUS_PORT = 29500


class SandboxError(KdeployError):
    """The local sandbox cannot be built or torn down (missing root, packages, ...)."""

    exit_code = ExitCode.INVALID

# Units masked in every host. Any failed unit turns `systemctl is-system-running` into "degraded", and a
# wait-online unit would hold the boot for minutes. Masking a unit the machine does not have is harmless.
MASKED_UNITS = (
    # fail or make noise in a container booted from this machine's OS
    "postgresql.service", "postgresql@.service", "e2scrub_reap.service", "systemd-pstore.service",
    "apt-daily.timer", "apt-daily-upgrade.timer", "man-db.timer", "dpkg-db-backup.timer",
    "e2scrub_all.timer", "fstrim.timer",
    # eth0 is configured from outside: a network manager would flush its address or wait for DHCP
    "systemd-networkd.service", "systemd-networkd.socket", "systemd-networkd-wait-online.service",
    "NetworkManager.service", "NetworkManager-wait-online.service", "networking.service", "dhcpcd.service",
    # machine-level daemons of common cloud/CI images that fail inside a container
    "cloud-init-local.service", "cloud-init.service", "cloud-config.service", "cloud-final.service",
    "snapd.service", "snapd.socket", "snapd.seeded.service", "docker.service", "docker.socket",
    "containerd.service", "multipathd.service", "multipathd.socket", "ModemManager.service",
    "unattended-upgrades.service",
)
SSHD_DROPIN = """\
# Written by kdeploy sandbox
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin {permit_root}
PasswordAuthentication no
KbdInteractiveAuthentication no
AuthorizedKeysFile /etc/ssh/authorized_keys/%u .ssh/authorized_keys
UseDNS no
MaxSessions 100
MaxStartups 100:30:200
"""
SUDO = Path("/usr/bin/sudo")
DOAS = Path("/usr/bin/doas")
BECOME_UID = 1500  # the become user's uid and gid in every host
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}\Z")
# tool -> Debian package, for the one-line install hint
TOOLS = {"ip": "iproute2", "tc": "iproute2", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
         "nsenter": "util-linux"}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]")
_T = TypeVar("_T")


@dataclass(frozen=True)
class SandboxHost:
    name: str        # "h1".."hN": the inventory host name
    index: int       # 1..N
    address: str     # 10.213.<instance>.(10+index)
    machine: str     # nspawn machine name, also the netns and host-side veth name: "kd<instance>-h<index>"


class _HostProcess(subprocess.Popen[bytes]):
    """A systemd-nspawn child meant to outlive this process (`kdeploy sandbox up` returns while the hosts
    run): reaped when seen dead, and no ResourceWarning when collected while it still runs."""

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.poll()


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    comm: str
    machine: str | None      # set for a systemd-nspawn process of ours
    container_init: bool     # PID 1 of a container (its innermost PID namespace)


# ---------------------------------------------------------------------------------------------------
# small helpers


def edit_inventory(path: Path, change: Callable[[CommentedMap], None]) -> None:
    """Load the inventory at ``path``, apply ``change`` to the document, write it back in the sandbox's style."""
    yaml = YAML()
    yaml.indent(mapping=2, sequence=4, offset=2)
    doc = yaml.load(path.read_text())
    change(doc)
    with path.open("w") as fh:
        yaml.dump(doc, fh)


def span_servers(doc: CommentedMap, nodes_per_server: int) -> None:
    """Group the inventory's sandbox hosts, in order, into servers of ``nodes_per_server`` nodes each (a
    ``servers:`` section, s1, s2, ...; the first node is the head) and make the service's ``sglang.tp`` the
    total over a server's nodes (and ``gate.workers``, which counts a server's), so each node runs as many
    workers as a one-host server does. The unit
    renderer derives ``--nnodes/--node-rank/--dist-init-addr`` from that section. 1 leaves ``doc`` as it is."""
    if isinstance(nodes_per_server, bool) or not isinstance(nodes_per_server, int) or nodes_per_server < 1:
        raise SandboxError(f"nodes per server must be a positive integer, got {nodes_per_server!r}")
    if nodes_per_server == 1:
        return
    names = list(doc["groups"]["sandbox"]["hosts"])
    if len(names) % nodes_per_server:
        raise SandboxError(f"{len(names)} sandbox hosts do not split into servers of {nodes_per_server} nodes: "
                           f"the number of hosts must be a multiple of the nodes per server")
    service = doc["defaults"]["service"]
    sglang = service.get("sglang") or {}
    # a copy: the caller's service dict is not changed. `gate.workers` counts the server's workers too.
    spanned = {**service, "sglang": {**sglang, "tp": int(sglang.get("tp", 1)) * nodes_per_server}}
    gate = service.get("gate") or {}
    if gate.get("workers"):
        spanned["gate"] = {**gate, "workers": int(gate["workers"]) * nodes_per_server}
    doc["defaults"]["service"] = spanned
    servers = CommentedMap()
    for first in range(0, len(names), nodes_per_server):
        nodes = CommentedSeq(names[first:first + nodes_per_server])
        nodes.fa.set_flow_style()
        servers[f"s{first // nodes_per_server + 1}"] = CommentedMap(nodes=nodes, rendezvous_port=RENDEZVOUS_PORT)
    doc["servers"] = servers


def _tail_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _run(argv: list[str], *, input: str | None = None, check: bool = True, timeout: float = 60.0,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a tool; an expected failure becomes a one-line SandboxError."""
    try:
        stdin = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}
        proc = subprocess.run(argv, **stdin, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
    except FileNotFoundError:
        raise SandboxError(f"{argv[0]} not found: {INSTALL_HINT}") from None
    except subprocess.TimeoutExpired:
        raise SandboxError(f"`{' '.join(argv[:4])} ...` timed out after {timeout:.0f}s") from None
    if check and proc.returncode != 0:
        reason = _tail_line(proc.stderr) or _tail_line(proc.stdout) or f"exit status {proc.returncode}"
        raise SandboxError(f"`{' '.join(argv[:6])}` failed: {reason}")
    return proc


def _ip_batch(lines: Iterable[str], *, netns: str | None = None, force: bool = False) -> None:
    commands = "".join(f"{line}\n" for line in lines)
    if not commands:
        return
    argv = ["ip", *(["-n", netns] if netns else []), *(["-force"] if force else []), "-batch", "-"]
    _run(argv, input=commands, check=not force)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


def _atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read(path: Path | str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return None


def _nspawn_machine(cmdline: list[str]) -> str | None:
    """The machine name of a systemd-nspawn command line, else None."""
    if not cmdline or os.path.basename(cmdline[0]) != "systemd-nspawn":
        return None
    for i, arg in enumerate(cmdline):
        if arg in ("-M", "--machine") and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if arg.startswith("--machine="):
            return arg.partition("=")[2]
    return None


def _scan_processes() -> Iterator[tuple[_Proc, str]]:
    """Every live (non-zombie) process with the text of its /proc/PID/cgroup."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        status = _read(f"/proc/{pid}/status")
        if status is None:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue   # a zombie: already dead, only waiting for its parent to reap it
        raw = _read(f"/proc/{pid}/cmdline") or ""
        cmdline = raw.split("\0")[:-1] if raw.endswith("\0") else raw.split("\0")
        nspid = fields.get("NSpid", "").split()
        yield (_Proc(pid=pid, ppid=int(fields.get("PPid", "0").strip() or 0),
                     comm=fields.get("Name", "").strip(), machine=_nspawn_machine(cmdline),
                     container_init=len(nspid) > 1 and nspid[-1] == "1"),
               _read(f"/proc/{pid}/cgroup") or "")


def _pid_alive(pid: int) -> bool:
    status = _read(f"/proc/{pid}/status")
    if status is None:
        return False
    state = next((line for line in status.splitlines() if line.startswith("State:")), "")
    return "Z" not in state.split(":", 1)[-1].split()[:1]


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _rmdir_tree(path: Path) -> bool:
    """rmdir a cgroup directory depth-first; True when it is gone."""
    if not path.is_dir():
        return True
    for dirpath, _dirs, _files in os.walk(path, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
    return not path.exists()


def _parallel(func: Callable[[SandboxHost], _T], hosts: list[SandboxHost], workers: int = 16) -> list[_T]:
    if len(hosts) <= 1:
        return [func(h) for h in hosts]
    with ThreadPoolExecutor(max_workers=min(workers, len(hosts))) as pool:
        return list(pool.map(func, hosts))


def _ssh_banner(address: str, timeout: float = 0.5) -> bool:
    """True when something answering like sshd listens on address:22 (cheap, no key exchange)."""
    try:
        with socket.create_connection((address, 22), timeout=timeout) as sock:
            sock.settimeout(1.0)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------


class Sandbox:
    """One sandbox instance: N nspawn hosts on their own bridge, driven from this machine."""

    def __init__(self, root: Path = DEFAULT_DIR, instance: int = 0, *, sglang: bool | None = None) -> None:
        """``sglang``: bind the CPU SGLang venv into the hosts at :data:`SGLANG_HOST_VENV` on ``up()``:
        True builds it first when needed (minutes, once), None binds it when it is already built, False
        never (tests that do not need it stay fast)."""
        if isinstance(instance, bool) or not isinstance(instance, int) or not 0 <= instance <= MAX_INSTANCE:
            raise SandboxError(f"sandbox instance must be 0..{MAX_INSTANCE}, got {instance!r}")
        self.root = Path(root).absolute()
        if ":" in str(self.root):
            raise SandboxError(f"sandbox directory must not contain ':' (systemd-nspawn bind syntax): {root}")
        self.instance = instance
        self.state_dir = self.root / str(instance)
        self.cache_dir = self.root / "cache"
        self.key_path = self.cache_dir / "id_ed25519"
        self.known_hosts_path = self.state_dir / "known_hosts"
        self.ssh_config_path = self.state_dir / "ssh_config"
        self.venv_path = self.cache_dir / "venv"
        self.sglang = sglang
        self.bridge = f"kdbr{instance}"
        self.network = ipaddress.ip_network(f"10.213.{instance}.0/24")
        self.gateway = f"10.213.{instance}.1"
        self.cgroup_name = f"kdeploy-sandbox-{instance}"
        self._name_re = re.compile(rf"kd{instance}-h([1-9][0-9]*)\Z")
        self._cgroup_re = re.compile(rf":/{re.escape(self.cgroup_name)}(?:/|$)", re.MULTILINE)
        self._children: dict[str, _HostProcess] = {}

    # --- naming -------------------------------------------------------------------------------------

    def _host(self, index: int) -> SandboxHost:
        return SandboxHost(name=f"h{index}", index=index, address=f"10.213.{self.instance}.{10 + index}",
                           machine=f"kd{self.instance}-h{index}")

    def _host_dir(self, host: SandboxHost) -> Path:
        return self.state_dir / host.name

    def _get(self, name: str) -> SandboxHost:
        for host in self.hosts():
            if host.name == name:
                return host
        raise SandboxError(f"no host {name!r} in sandbox {self.instance} (hosts: "
                           f"{', '.join(h.name for h in self.hosts()) or 'none, it is down'})")

    def _ours(self, name: str) -> bool:
        return bool(self._name_re.match(name))

    # --- queries ------------------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        try:
            meta = json.loads((self.state_dir / "meta.json").read_text())
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def bastion(self) -> SandboxHost | None:
        """The jump host of a sandbox brought up with ``bastion=True`` (its last host), else None."""
        index = self._meta().get("bastion")
        return self._host(int(index)) if isinstance(index, int) else None

    def become_user(self) -> str | None:
        """The SSH user of a sandbox brought up with ``become_user`` (root cannot log in then), else None."""
        name = self._meta().get("become_user")
        return name if isinstance(name, str) and name else None

    def hosts(self) -> list[SandboxHost]:
        """The hosts of this sandbox as it was brought up ([] when it is down)."""
        try:
            count = int(json.loads((self.state_dir / "meta.json").read_text())["hosts"])
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return [self._host(i) for i in range(1, count + 1)]

    def sglang_venv(self) -> Path | None:
        """The SGLang venv bound into the hosts of the running sandbox, or None."""
        try:
            path = json.loads((self.state_dir / "meta.json").read_text()).get("sglang")
        except (OSError, ValueError, AttributeError):
            return None
        return Path(path) if isinstance(path, str) and path else None

    def _resolve_sglang(self) -> Path | None:
        """The SGLang venv to bind on up(), per ``self.sglang`` (see ``__init__``)."""
        from kdeploy_lab import sglang_env

        if self.sglang is False:
            return None
        if self.sglang is None and not sglang_env.is_ready():
            return None
        try:
            path = sglang_env.ensure_venv(log=lambda msg: print(msg, file=sys.stderr, flush=True))
        except sglang_env.SglangEnvError as exc:
            raise SandboxError(str(exc)) from None
        if ":" in str(path):
            raise SandboxError(f"the SGLang venv path must not contain ':' (systemd-nspawn bind syntax): {path}")
        return path

    def _nspawn_pid(self, host: SandboxHost) -> int | None:
        child = self._children.get(host.name)
        if child is not None and child.poll() is not None:
            del self._children[host.name]     # reap our own child so it does not linger as a zombie
        text = _read(self._host_dir(host) / "nspawn.pid")
        if not text or not text.strip().isdigit():
            return None
        pid = int(text.strip())
        if not _pid_alive(pid):
            return None
        cmdline = (_read(f"/proc/{pid}/cmdline") or "").split("\0")
        return pid if _nspawn_machine(cmdline) == host.machine else None

    def _alive(self, host: SandboxHost) -> bool:
        return self._nspawn_pid(host) is not None

    def _leader(self, host: SandboxHost) -> int | None:
        """The container's PID 1 as seen from the machine (a child of its systemd-nspawn)."""
        nspawn = self._nspawn_pid(host)
        if nspawn is None:
            return None
        for proc, _cgroup in _scan_processes():
            if proc.ppid == nspawn and proc.container_init:
                return proc.pid
        return None

    def _processes(self) -> list[_Proc]:
        """Live processes of this instance: its nspawns, and anything in its cgroups (orphans too)."""
        found = []
        for proc, cgroup in _scan_processes():
            if proc.pid == os.getpid():
                continue
            if (proc.machine is not None and self._ours(proc.machine)) or self._cgroup_re.search(cgroup):
                found.append(proc)
        return found

    def _netns(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(NETNS_DIR) if self._ours(n))
        except OSError:
            return []

    def _links(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(SYS_NET) if self._ours(n))
        except OSError:
            return []

    def cpu_seconds(self) -> float:
        """CPU seconds used so far inside all of this instance's hosts (the cgroup v2 ``cpu.stat`` its
        containers run under): what the benches charge to the hosts. NaN without a v2 hierarchy."""
        for path in (CGROUP_FS / "unified" / self.cgroup_name / "cpu.stat", CGROUP_FS / self.cgroup_name / "cpu.stat"):
            with contextlib.suppress(OSError):
                for line in path.read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
        return float("nan")

    def _cgroup_dirs(self) -> list[Path]:
        dirs = [CGROUP_FS / self.cgroup_name]
        with contextlib.suppress(OSError):
            dirs += [CGROUP_FS / h / self.cgroup_name for h in sorted(os.listdir(CGROUP_FS))]
        return [d for d in dirs if d.is_dir()]

    def _nspawn_dirs(self) -> list[Path]:
        found = []
        for base in NSPAWN_DIRS:
            with contextlib.suppress(OSError):
                found += [base / n for n in sorted(os.listdir(base)) if self._ours(n)]
        return found

    def leftovers(self) -> list[str]:
        """Anything of this instance still on the machine, one human-readable item each."""
        items = [f"process {p.pid} ({p.comm}{' ' + p.machine if p.machine else ''})" for p in self._processes()]
        items += [f"netns {n}" for n in self._netns()]
        items += [f"link {n}" for n in self._links()]
        if (SYS_NET / self.bridge).exists():
            items.append(f"bridge {self.bridge}")
        items += [f"cgroup {d}" for d in self._cgroup_dirs()]
        items += [f"nspawn dir {d}" for d in self._nspawn_dirs()]
        items += [f"mount {m}" for m in self._mounts()]
        if self.state_dir.exists():
            items.append(f"state dir {self.state_dir}")
        return items

    def status(self) -> list[dict[str, Any]]:
        """Per host: name, address, machine, nspawn_pid, running, link ("UP"/"DOWN"/None), system."""
        def one(host: SandboxHost) -> dict[str, Any]:
            pid = self._nspawn_pid(host)
            link: str | None = None
            flags = _read(SYS_NET / host.machine / "flags")
            if flags is not None:
                link = "UP" if int(flags.strip(), 16) & 0x1 else "DOWN"
            system = "unreachable"
            if pid is not None and link == "UP":
                with contextlib.suppress(SandboxError):
                    proc = _run(self._ssh_argv(host, "systemctl is-system-running", connect_timeout=3),
                                check=False, timeout=10)
                    if proc.returncode != 255 and proc.stdout.strip():
                        system = proc.stdout.strip()
            return {"name": host.name, "address": host.address, "machine": host.machine,
                    "nspawn_pid": pid, "running": pid is not None, "link": link, "system": system}
        return _parallel(one, self.hosts())

    # --- requirements, locks, cache -----------------------------------------------------------------

    def check_requirements(self) -> None:
        if os.geteuid() != 0:
            raise SandboxError("kdeploy sandbox needs root")
        if shutil.which("systemd-nspawn") is None or not (shutil.which("sshd") or SSHD.exists()):
            raise SandboxError(f"kdeploy sandbox needs systemd-nspawn and sshd: {INSTALL_HINT}")
        missing = [tool for tool in TOOLS if shutil.which(tool) is None]
        if missing:
            packages = sorted({TOOLS[t] for t in missing})
            raise SandboxError(f"kdeploy sandbox needs {', '.join(missing)}: apt-get install {' '.join(packages)}")
        if not SYSTEM_PYTHON.exists():
            raise SandboxError(f"kdeploy sandbox needs {SYSTEM_PYTHON}: apt-get install python3 python3-venv")
        if not self._cgroup_bases():
            raise SandboxError(f"kdeploy sandbox needs a mounted cgroup hierarchy under {CGROUP_FS}")

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Serialise the short machine-wide steps (cache, inotify, bridges) between sandbox processes."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _ensure_cache(self) -> None:
        with self._lock():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            pub = self.key_path.with_name(self.key_path.name + ".pub")
            if not (self.key_path.is_file() and pub.is_file()):
                for path in (self.key_path, pub):
                    path.unlink(missing_ok=True)
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kdeploy-sandbox",
                      "-f", str(self.key_path)])
            python = self.venv_path / "bin" / "python"
            if not (python.exists() and (self.venv_path / "pyvenv.cfg").is_file()):
                shutil.rmtree(self.venv_path, ignore_errors=True)
                tmp = Path(tempfile.mkdtemp(dir=self.cache_dir, prefix=".venv-"))
                try:
                    _run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(tmp)], timeout=120)
                    tmp.chmod(0o755)
                    tmp.rename(self.venv_path)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
            self._install_refserver(self.venv_path)

    def _install_refserver(self, venv: Path) -> None:
        source = Path(__file__).with_name("refserver.py")
        if not source.is_file():
            return
        purelib = _run([str(venv / "bin" / "python"), "-c",
                        "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
        target = Path(purelib) / "kdeploy_refserver.py"
        data = source.read_bytes()
        if _read(target) != data.decode(errors="replace"):
            target.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(target, data)

    def _cgroup_bases(self) -> list[Path]:
        """Hierarchies each nspawn gets its own cgroup in: name=systemd + unified, or a pure cgroup2."""
        hybrid = [CGROUP_FS / "systemd", CGROUP_FS / "unified"]
        bases = [b for b in hybrid if (b / "cgroup.procs").exists()]
        if not bases and (CGROUP_FS / "cgroup.procs").exists():
            bases = [CGROUP_FS]
        return bases

    # --- machine-wide state: inotify and the bridge --------------------------------------------------

    def _inotify_orig(self) -> Path:
        return self.root / "inotify.orig"

    def _raise_inotify(self) -> None:
        current = int((_read(INOTIFY_SYSCTL) or "0").strip() or 0)
        if current >= INOTIFY_MIN:
            return
        orig = self._inotify_orig()
        with contextlib.suppress(FileExistsError):
            fd = os.open(orig, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{current}\n")
        INOTIFY_SYSCTL.write_text(f"{INOTIFY_MIN}\n")

    def _others_up(self) -> bool:
        """Is any other sandbox instance (of any sandbox directory) present on this machine?"""
        with contextlib.suppress(OSError):
            if any(re.fullmatch(r"kdbr[0-9]", n) and n != self.bridge for n in os.listdir(SYS_NET)):
                return True
        return any(p.machine and re.fullmatch(r"kd[0-9]-h[0-9]+", p.machine) and not self._ours(p.machine)
                   for p, _cgroup in _scan_processes())

    def _restore_inotify(self) -> None:
        orig = self._inotify_orig()
        text = _read(orig)
        if text is None or self._others_up():
            return
        with contextlib.suppress(ValueError, OSError):
            INOTIFY_SYSCTL.write_text(f"{int(text.strip())}\n")
        orig.unlink(missing_ok=True)

    def _check_subnet_free(self) -> None:
        out = _run(["ip", "-o", "-4", "addr", "show"]).stdout
        for line in out.splitlines():
            parts = line.split()
            if "inet" not in parts:
                continue
            dev, cidr = parts[1], parts[parts.index("inet") + 1]
            with contextlib.suppress(ValueError):
                if dev != self.bridge and ipaddress.ip_interface(cidr).network.overlaps(self.network):
                    raise SandboxError(f"{self.network} is already used by {dev} ({cidr}): "
                                       "use another sandbox instance")

    def _create_bridge(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        with contextlib.suppress(OSError):
            Path(f"/proc/sys/net/ipv6/conf/{self.bridge}/disable_ipv6").write_text("1\n")
        _ip_batch([f"addr add {self.gateway}/24 dev {self.bridge}", f"link set {self.bridge} up"])

    # --- up -------------------------------------------------------------------------------------------

    def up(self, n: int, *, timeout: float = 120.0, bastion: bool = False,
           host_certs: bool = False, become_user: str | None = None, srv_mib: int | None = None) -> list[SandboxHost]:
        """Boot n hosts (in parallel) and return once each one's sshd accepts our key.

        ``bastion``: one more host, h<n+1>, is the jump host and the n others answer only through it.
        ``host_certs``: every host key is signed by the sandbox CA and known_hosts trusts only that CA.
        ``become_user``: sshd refuses root (``PermitRootLogin no``); this user logs in with the sandbox key
        and has passwordless sudo (``/etc/sudoers.d/kdeploy-sandbox``).
        ``srv_mib``: every host's ``/srv`` is a tmpfs of that size, mounted on this machine's side of the bind, so
        it survives the host's resets and filling it (a disk-full fault) cannot fill this machine's disk.
        """
        self.check_requirements()
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_HOSTS:
            raise SandboxError(f"number of sandbox hosts must be 1..{MAX_HOSTS}, got {n!r}")
        if become_user is not None:
            if become_user == "root" or not USER_NAME.match(become_user):
                raise SandboxError(f"--become-user must be a user name other than root (lower case letters, "
                                   f"digits, `_`, `-`), got {become_user!r}")
            if not (SUDO.exists() and SUDO.stat().st_mode & 0o4000):
                raise SandboxError(f"--become-user needs sudo on this machine (setuid {SUDO}): apt-get install sudo")
        current = self.hosts()
        if current and all(self._alive(h) for h in current):
            raise SandboxError(f"sandbox already up ({len(current)} hosts): kdeploy sandbox down first")
        if self.leftovers():
            self._teardown()          # a crashed or half-dead earlier run of this instance
        hosts = [self._host(i) for i in range(1, n + 1 + int(bastion))]
        sglang = self._resolve_sglang()    # may build it first (minutes, once): before the boot deadline
        deadline = time.monotonic() + timeout
        try:
            self._ensure_cache()
            if sglang is not None:
                with self._lock():
                    self._install_refserver(sglang)
            self._check_subnet_free()
            with self._lock():
                self._raise_inotify()
                self._create_bridge()
            self.state_dir.mkdir(parents=True)
            _write(self.state_dir / "meta.json", json.dumps({
                "hosts": len(hosts), "instance": self.instance, "sglang": str(sglang) if sglang else None,
                "bastion": n + 1 if bastion else None, "become_user": become_user}) + "\n")
            self._prepare_network(hosts)
            pub = self.key_path.with_name(self.key_path.name + ".pub").read_text()
            host_keys = _parallel(lambda h: self._prepare_etc(h, hosts, pub, become_user), hosts)
            if srv_mib is not None:
                for host in hosts:
                    _run(["mount", "-t", "tmpfs", "-o", f"size={int(srv_mib)}m,mode=755", "kdeploy-sandbox-srv",
                          str(self._host_dir(host) / "srv")])
            _write(self.known_hosts_path, "".join(host_keys))
            self._write_ssh_config(hosts)
            for host in hosts:
                self._boot(host)
            failed = threading.Event()     # one host failing ends the wait for all of them

            def wait(host: SandboxHost) -> str:
                try:
                    return self._wait_ready(host, deadline, timeout, failed)
                except BaseException:
                    failed.set()
                    raise
            _parallel(wait, hosts, workers=64)
            if host_certs:
                self.certify_all(hosts)
            if bastion:
                for host in hosts[:-1]:
                    self.hide(host.name)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                self._teardown()
            if isinstance(exc, OSError):
                raise SandboxError(f"sandbox up failed: {exc}") from None
            raise
        return hosts

    def _prepare_network(self, hosts: list[SandboxHost]) -> None:
        _ip_batch(line for h in hosts for line in
                  (f"netns add {h.machine}", f"link add {h.machine} type veth peer name eth0 netns {h.machine}"))
        for h in hosts:
            with contextlib.suppress(OSError):
                Path(f"/proc/sys/net/ipv6/conf/{h.machine}/disable_ipv6").write_text("1\n")
        _ip_batch(f"link set {h.machine} master {self.bridge} up" for h in hosts)

        def inside(h: SandboxHost) -> None:
            _run(["nsenter", f"--net={NETNS_DIR / h.machine}", "sysctl", "-q", "-w",
                  "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])
            _ip_batch(["link set lo up", f"addr add {h.address}/24 dev eth0", "link set eth0 up"],
                      netns=h.machine)
        _parallel(inside, hosts)

    def _prepare_etc(self, host: SandboxHost, hosts: list[SandboxHost], client_pub: str,
                     become_user: str | None = None) -> str:
        """The host's own upper /etc; returns its known_hosts line."""
        d = self._host_dir(host)
        etc = d / "etc"
        for sub in (etc / "ssh" / "sshd_config.d", etc / "ssh" / "authorized_keys", etc / "systemd" / "system",
                    d / "srv", d / "opt" / "kdeploy-sandbox" / "venv", d / "opt" / "kdeploy-sandbox" / "sglang"):
            sub.mkdir(parents=True, exist_ok=True)
        for path in (d, etc, etc / "ssh", etc / "ssh" / "sshd_config.d", etc / "ssh" / "authorized_keys",
                     etc / "systemd", etc / "systemd" / "system", d / "srv", d / "opt",
                     d / "opt" / "kdeploy-sandbox", d / "opt" / "kdeploy-sandbox" / "venv",
                     d / "opt" / "kdeploy-sandbox" / "sglang"):
            path.chmod(0o755)    # they become /etc, /srv, /opt inside: sshd's StrictModes checks them
        _write(etc / "hostname", f"{host.name}\n")
        _write(etc / "machine-id", f"{uuid.uuid4().hex}\n", 0o444)
        _write(etc / "hosts", "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
               + "".join(f"{h.address} {h.name}\n" for h in hosts))
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name,
              "-f", str(etc / "ssh" / "ssh_host_ed25519_key")])
        _write(etc / "ssh" / "sshd_config.d" / "10-kdeploy-sandbox.conf",
               SSHD_DROPIN.format(permit_root="no" if become_user else "prohibit-password"))
        _write(etc / "ssh" / "authorized_keys" / "root", client_pub)  # refused by sshd with become_user
        if become_user:
            self._add_become_user(etc, become_user, client_pub)
        for unit in MASKED_UNITS:
            link = etc / "systemd" / "system" / unit
            link.unlink(missing_ok=True)
            link.symlink_to("/dev/null")
        keytype, key = (etc / "ssh" / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        return f"{host.name},{host.address} {keytype} {key}\n"

    @staticmethod
    def _add_become_user(etc: Path, name: str, client_pub: str) -> None:
        """``name`` in the host's passwd/group/shadow (the machine's, plus one line: the upper /etc replaces
        whole files), its key, its home (made at boot by tmpfiles) and passwordless sudo (and doas) for it."""
        for file, line, mode in (("passwd", f"{name}:x:{BECOME_UID}:{BECOME_UID}::/home/{name}:/bin/sh", 0o644),
                                 ("group", f"{name}:x:{BECOME_UID}:", 0o644),
                                 ("shadow", f"{name}:*:19000:0:99999:7:::", 0o640)):
            base = Path("/etc") / file
            kept = [ln for ln in (base.read_text().splitlines() if base.exists() else [])
                    if ln.split(":", 1)[0] != name]
            _write(etc / file, "\n".join([*kept, line]) + "\n", mode)
            if file == "shadow":
                os.chown(etc / file, 0, base.stat().st_gid if base.exists() else 0)
        _write(etc / "ssh" / "authorized_keys" / name, client_pub)
        (etc / "tmpfiles.d").mkdir(exist_ok=True)
        _write(etc / "tmpfiles.d" / "kdeploy-sandbox.conf", f"d /home/{name} 0750 {name} {name} -\n")
        (etc / "sudoers.d").mkdir(mode=0o755, exist_ok=True)
        _write(etc / "sudoers.d" / "kdeploy-sandbox", f"{name} ALL=(ALL:ALL) NOPASSWD: ALL\n", 0o440)
        if DOAS.exists():  # optional: `become_method: doas` works on these hosts too
            _write(etc / "doas.conf", f"permit nopass {name} as root\n", 0o600)

    def _ssh_options(self, connect_timeout: int = 5) -> list[str]:
        return ["-F", "none", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts_path}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "IdentitiesOnly=yes", "-o", f"ConnectTimeout={connect_timeout}",
                "-o", "LogLevel=ERROR", "-i", str(self.key_path)]

    def _ssh_argv(self, host: SandboxHost, command: str, connect_timeout: int = 5) -> list[str]:
        """``command`` run as root over SSH: through sudo when root may not log in."""
        user = self.become_user()
        return ["ssh", *self._ssh_options(connect_timeout), f"{user or 'root'}@{host.address}",
                f"sudo -n {command}" if user else command]

    def _write_ssh_config(self, hosts: list[SandboxHost]) -> None:
        """`ssh -F <state>/ssh_config h1` works, and so does kdeploy: with a bastion, the inventory names
        the hosts by these aliases and the config sends them through it (ProxyJump)."""
        common = (f"Host *\n  User {self.become_user() or 'root'}\n  IdentityFile {self.key_path}\n"
                  "  IdentitiesOnly yes\n"
                  f"  UserKnownHostsFile {self.known_hosts_path}\n  GlobalKnownHostsFile /dev/null\n"
                  "  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n  LogLevel ERROR\n")
        bastion = self.bastion()
        per_host = "".join(
            f"Host {'bastion ' if h == bastion else ''}{h.name}\n  HostName {h.address}\n"
            + ("  ProxyJump bastion\n" if bastion and h != bastion else "") for h in hosts)
        _write(self.ssh_config_path, per_host + common)

    # --- jump host and host certificates --------------------------------------------------------------

    @property
    def ca_path(self) -> Path:
        """The sandbox's SSH certificate authority (private key; ``.pub`` beside it)."""
        return self.state_dir / "host_ca"

    def hide(self, name: str) -> None:
        """Make the host answer only the other hosts: inside its network namespace every packet to this
        machine (the bridge's address) is prohibited, so a direct connection times out, one through a jump
        host works."""
        host = self._get(name)
        _run(["ip", "-n", host.machine, "route", "replace", "prohibit", f"{self.gateway}/32"])

    def unhide(self, name: str) -> None:
        host = self._get(name)
        _run(["ip", "-n", host.machine, "route", "del", "prohibit", f"{self.gateway}/32"], check=False)

    def certify(self, name: str, ca: Path, *, principals: list[str] | None = None,
                validity: str = "-5m:+52w") -> None:
        """Sign the host's key with ``ca`` (``ssh-keygen -s``) and make its sshd offer the certificate."""
        host = self._get(name)
        with tempfile.TemporaryDirectory() as tmp:
            pub = Path(tmp) / "host.pub"
            pub.write_text(self.exec(name, ["cat", "/etc/ssh/ssh_host_ed25519_key.pub"]).stdout)
            _run(["ssh-keygen", "-q", "-s", str(ca), "-I", f"sandbox-{host.name}", "-h",
                  "-n", ",".join(principals or [host.name, host.address]), "-V", validity, str(pub)])
            cert = (Path(tmp) / "host-cert.pub").read_text()
        self.exec(name, ["sh", "-c", "cat > /etc/ssh/ssh_host_ed25519_key-cert.pub && printf '%s\n' "
                         "'HostCertificate /etc/ssh/ssh_host_ed25519_key-cert.pub' "
                         "> /etc/ssh/sshd_config.d/20-kdeploy-cert.conf && systemctl reload ssh"], input=cert)

    def uncertify(self, name: str) -> None:
        self.exec(name, ["sh", "-c", "rm -f /etc/ssh/ssh_host_ed25519_key-cert.pub "
                         "/etc/ssh/sshd_config.d/20-kdeploy-cert.conf && systemctl reload ssh"])

    def certify_all(self, hosts: list[SandboxHost]) -> None:
        """Every host signed by a new sandbox CA; known_hosts then trusts that CA and nothing else."""
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"kdeploy-sandbox-{self.instance}-ca",
              "-f", str(self.ca_path)])
        _parallel(lambda h: self.certify(h.name, self.ca_path), hosts)
        ca_pub = self.ca_path.with_name(self.ca_path.name + ".pub").read_text().strip()
        _write(self.known_hosts_path, f"@cert-authority * {ca_pub}\n")

    def _boot(self, host: SandboxHost) -> None:
        """Start the host's systemd-nspawn in its own cgroups (else all hosts share one cgroup tree and
        their units fail with 219/CGROUP)."""
        d = self._host_dir(host)
        procs_files = []
        for base in self._cgroup_bases():
            group = base / self.cgroup_name / host.name
            group.mkdir(parents=True, exist_ok=True)
            procs_files.append(os.fsencode(group / "cgroup.procs"))

        def enter_cgroups() -> None:    # runs in the child between fork and exec: os calls only
            pid = str(os.getpid()).encode()
            for path in procs_files:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)

        argv = ["systemd-nspawn", "-q", "-D", "/", "--volatile=yes", f"--overlay=/etc:{d / 'etc'}:/etc",
                "-M", host.machine, "-b", f"--network-namespace-path={NETNS_DIR / host.machine}",
                "--register=no", "--keep-unit", "--resolv-conf=off", "--timezone=off", "--link-journal=no",
                f"--bind={d / 'srv'}:/srv", f"--bind={d / 'opt'}:/opt",
                f"--bind-ro={self.venv_path}:{HOST_VENV}", "systemd.firstboot=off"]
        sglang = self.sglang_venv()
        if sglang is not None:
            argv.insert(-1, f"--bind-ro={sglang}:{SGLANG_HOST_VENV}")
        with open(d / "console.log", "ab") as log:
            log.write(f"--- kdeploy sandbox: boot {host.name} at {time.strftime('%F %T')} ---\n".encode())
            log.flush()
            try:
                child = _HostProcess(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, close_fds=True, preexec_fn=enter_cgroups)
            except (OSError, subprocess.SubprocessError) as exc:
                raise SandboxError(f"{host.name}: cannot start systemd-nspawn: {exc}") from None
        self._children[host.name] = child
        _write(d / "nspawn.pid", f"{child.pid}\n")

    def _console_tail(self, host: SandboxHost, lines: int = 3) -> str:
        try:
            with open(self._host_dir(host) / "console.log", "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 8192))
                text = fh.read().decode(errors="replace")
        except OSError:
            return "(no console log)"
        text = _ANSI.sub("", text).replace("\r", "\n")
        kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
        tail = " | ".join(kept) or "(console log empty)"
        return tail if len(tail) <= 400 else "..." + tail[-397:]

    def _wait_ready(self, host: SandboxHost, deadline: float, timeout: float,
                    abort: threading.Event | None = None) -> str:
        """Poll until sshd accepts our key and boot has finished; returns `is-system-running`."""
        last = "sshd not answering"
        while True:
            if abort is not None and abort.is_set():
                return "aborted"
            if not self._alive(host):
                raise SandboxError(f"{host.name} did not come up: systemd-nspawn exited; console: "
                                   f"{self._console_tail(host)}")
            if time.monotonic() > deadline:
                raise SandboxError(f"{host.name} did not come up within {timeout:g}s ({last}); console: "
                                   f"{self._console_tail(host)}")
            if _ssh_banner(host.address):
                remaining = max(5.0, deadline - time.monotonic())
                try:
                    proc = subprocess.run(self._ssh_argv(host, "systemctl is-system-running --wait"),
                                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                          timeout=remaining, check=False)
                except subprocess.TimeoutExpired:
                    last = "boot did not finish"
                    continue
                if proc.returncode != 255:
                    return proc.stdout.strip()
                last = f"ssh: {_tail_line(proc.stderr) or 'failed'}"
            time.sleep(0.1)

    # --- down -----------------------------------------------------------------------------------------

    def down(self) -> None:
        """Stop every host and remove everything of this instance; idempotent, also after a crash."""
        if os.geteuid() != 0:
            raise SandboxError("kdeploy sandbox needs root")
        self._teardown()
        left = self.leftovers()
        if left:
            raise SandboxError(f"sandbox down left {len(left)} thing(s) behind: {'; '.join(left[:5])}")

    def _stop_processes(self, grace: float) -> None:
        procs = self._processes()
        nspawns = {p.pid for p in procs if p.machine is not None}
        for p in procs:                           # containers whose nspawn is gone: power them off hard
            if p.container_init and p.ppid not in nspawns:
                _signal(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + grace
        while True:
            # nspawn forwards SIGTERM as SIGRTMIN+3 (orderly poweroff) to the container's systemd, which
            # loses it while still booting: repeat it until the host is gone or the grace is over
            for pid in nspawns:
                _signal(pid, signal.SIGTERM)
            self._wait_gone(nspawns, min(1.0, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline or not any(_pid_alive(pid) for pid in nspawns):
                break
        alive = {pid for pid in nspawns if _pid_alive(pid)}
        if alive:
            for p in self._processes():
                if p.container_init:
                    _signal(p.pid, signal.SIGKILL)  # kills the container's whole PID namespace
            self._wait_gone(alive, 1.0)
        for _ in range(50):                       # whatever is left: SIGKILL until nothing of ours lives
            rest = self._processes()
            if not rest:
                break
            for p in rest:
                _signal(p.pid, signal.SIGKILL)
            self._wait_gone({p.pid for p in rest}, 0.2)

    def _wait_gone(self, pids: set[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, child in list(self._children.items()):
                if child.poll() is not None:
                    del self._children[name]
            if not any(_pid_alive(pid) for pid in pids) or time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def _teardown(self, grace: float = STOP_GRACE) -> None:
        self._stop_processes(grace)
        for child in self._children.values():
            with contextlib.suppress(Exception):
                child.wait(timeout=1)
        self._children.clear()
        # deleting the veth removes its peer at once; `netns del` alone frees it asynchronously
        _ip_batch((f"link del {n}" for n in self._links()), force=True)
        _ip_batch((f"netns del {n}" for n in self._netns()), force=True)
        with self._lock():
            if (SYS_NET / self.bridge).exists():
                _ip_batch([f"link del {self.bridge}"], force=True)
            for d in self._nspawn_dirs():
                shutil.rmtree(d, ignore_errors=True)
            if not any(p.machine for p, _cgroup in _scan_processes()):   # nobody else uses them
                for d in (*NSPAWN_DIRS, NSPAWN_RUN):
                    with contextlib.suppress(OSError):
                        d.rmdir()
            self._restore_inotify()
        deadline = time.monotonic() + 5
        while True:
            remaining = [d for d in self._cgroup_dirs() if not _rmdir_tree(d)]
            remaining_links = self._links()
            if (not remaining and not remaining_links) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for mount in self._mounts():  # srv_mib's tmpfs: unmounted, else rmtree would leave it mounted and empty
            _run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def _mounts(self) -> list[str]:
        """This machine's mounts under the instance's state directory (``srv_mib``'s tmpfs)."""
        prefix = f"{self.state_dir}/"
        lines = (_read("/proc/self/mounts") or "").splitlines()
        return sorted({w[1] for w in (line.split() for line in lines) if len(w) > 1 and w[1].startswith(prefix)})

    # --- inventory ------------------------------------------------------------------------------------

    def write_inventory(self, path: Path, service: dict[str, Any], nodes_per_server: int = 1) -> None:
        """Write a kdeploy inventory for the running sandbox (atomically). ``nodes_per_server`` > 1: the hosts
        form servers that span that many hosts each (:func:`span_servers`)."""
        hosts = self.hosts()
        if not hosts:
            raise SandboxError(f"sandbox {self.instance} is not up: kdeploy sandbox up first")
        python = str(service.get("python", ""))
        if python.startswith(SGLANG_HOST_VENV + "/") and self.sglang_venv() is None:
            raise SandboxError(f"the service runs {python}, but sandbox {self.instance} has no SGLang venv: "
                               "bring it up with Sandbox(sglang=True) or use demo_service(sglang=False)")
        bastion = self.bastion()
        hosts = [h for h in hosts if h != bastion]
        defaults = CommentedMap()
        become_user = self.become_user()
        if bastion:  # user, port, key, known_hosts and the jump come from the ssh_config, by alias
            defaults["ssh_config"] = str(self.ssh_config_path.absolute())
        else:
            defaults["user"] = become_user or "root"
            defaults["port"] = 22
            defaults["identity_file"] = str(self.key_path.absolute())
            defaults["known_hosts"] = str(self.known_hosts_path.absolute())
        if become_user:
            defaults["become"] = True
        defaults["service"] = service
        names = CommentedSeq(h.name for h in hosts)
        names.fa.set_flow_style()
        group = CommentedMap()
        group["hosts"] = names
        host_map = CommentedMap()
        for h in hosts:
            entry = CommentedMap()
            entry["address"] = h.name if bastion else h.address
            host_map[h.name] = entry
        doc = CommentedMap()
        doc["defaults"] = defaults
        doc["groups"] = CommentedMap(sandbox=group)
        doc["hosts"] = host_map
        span_servers(doc, nodes_per_server)
        doc.yaml_set_start_comment(
            f"Written by `kdeploy sandbox up` for sandbox instance {self.instance} ({len(hosts)} hosts).\n"
            "The hosts are local systemd-nspawn containers; this file is valid until `kdeploy sandbox down`.")
        yaml = YAML()
        yaml.default_flow_style = False
        yaml.indent(mapping=2, sequence=4, offset=2)
        yaml.representer.ignore_aliases = lambda *_args: True
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            try:
                with os.fdopen(fd, "w") as fh:
                    yaml.dump(doc, fh)
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            raise SandboxError(f"cannot write inventory {path}: {exc}") from None

    # --- out-of-band access and fault injection -------------------------------------------------------

    def exec(self, name: str, argv: list[str], *, input: str | None = None, check: bool = True,
             timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run argv inside host `name` through nsenter (bypasses sshd and the network)."""
        host = self._get(name)
        leader = self._leader(host)
        if leader is None:
            raise SandboxError(f"{name} is not running")
        env = {"PATH": PATH_INSIDE, "LANG": "C.UTF-8", "HOME": "/root", "TERM": "dumb"}
        proc = _run(["nsenter", "-t", str(leader), "-a", *argv], input=input, check=False, timeout=timeout,
                    env=env)
        if check and proc.returncode != 0:
            reason = _tail_line(proc.stderr) or _tail_line(proc.stdout) or "no output"
            raise SandboxError(f"{name}: `{' '.join(argv)}` exited {proc.returncode}: {reason}")
        return proc

    def cut(self, name: str) -> None:
        """Unplug the host's cable: connects fail with "No route to host" after ~3 s."""
        host = self._get(name)
        _run(["ip", "link", "set", host.machine, "down"])
        _run(["ip", "neigh", "flush", "to", host.address, "dev", self.bridge], check=False)

    def blackhole(self, name: str) -> None:
        """Drop every frame to the host silently (link stays up): connects and sessions time out."""
        host = self._get(name)
        out = _run(["ip", "-n", host.machine, "-br", "link", "show", "eth0"]).stdout.split()
        if len(out) < 3:
            raise SandboxError(f"{name}: cannot read the MAC address of eth0")
        _run(["ip", "neigh", "replace", host.address, "lladdr", out[2], "dev", self.bridge, "nud", "permanent"])
        _run(["tc", "qdisc", "replace", "dev", host.machine, "root", "tbf", "rate", "8bit", "burst", "16",
              "limit", "16"])

    def heal(self, name: str) -> None:
        """Undo cut and blackhole."""
        host = self._get(name)
        _run(["ip", "link", "set", host.machine, "up"])
        _run(["tc", "qdisc", "del", "dev", host.machine, "root"], check=False)
        _run(["ip", "neigh", "del", host.address, "dev", self.bridge], check=False)

    def kill(self, name: str) -> None:
        """Abrupt power loss: SIGKILL the container's PID 1 (the whole PID namespace dies)."""
        host = self._get(name)
        leader = self._leader(host)
        if leader is None:
            raise SandboxError(f"{name} is not running")
        pid = self._nspawn_pid(host)
        _signal(leader, signal.SIGKILL)
        self._wait_gone({pid} if pid else set(), 30)

    def reboot(self, name: str, *, timeout: float = 120.0) -> None:
        """Hard reset (power cycle, kernel panic): every process of the host dies at once, then it boots again
        with its /etc, /srv and /opt as they were; /run and /tmp start empty, as after a real reset."""
        self.kill(name)
        self.start(name, timeout=timeout)

    def stop(self, name: str) -> None:
        """Orderly poweroff of one host; its /etc, /srv and /opt are kept for start()."""
        host = self._get(name)
        pid = self._nspawn_pid(host)
        if pid is None:
            return
        _signal(pid, signal.SIGTERM)
        self._wait_gone({pid}, STOP_GRACE)
        if _pid_alive(pid):
            leader = next((p.pid for p in self._processes() if p.ppid == pid and p.container_init), None)
            if leader is not None:
                _signal(leader, signal.SIGKILL)
            self._wait_gone({pid}, 5)
            _signal(pid, signal.SIGKILL)
            self._wait_gone({pid}, 5)

    def start(self, name: str, *, timeout: float = 120.0) -> None:
        """Boot a stopped or killed host again and wait for its sshd."""
        host = self._get(name)
        if self._alive(host):
            raise SandboxError(f"{name} is already running")
        in_host = re.compile(rf":/{re.escape(self.cgroup_name)}/{host.name}(?:/|$)", re.MULTILINE)
        for proc, cgroup in _scan_processes():   # stragglers of the previous boot (an orphaned init)
            if in_host.search(cgroup) and proc.pid != os.getpid():
                _signal(proc.pid, signal.SIGKILL)
        for base in self._cgroup_bases():
            group = base / self.cgroup_name / host.name
            for sub in [p for p in group.glob("*") if p.is_dir()]:
                _rmdir_tree(sub)
        for base in NSPAWN_DIRS:
            shutil.rmtree(base / host.machine, ignore_errors=True)
        self._boot(host)
        self._wait_ready(host, time.monotonic() + timeout, timeout)


def free_sandbox(instances: range = range(7)) -> Sandbox:
    """The first sandbox instance not up (the benchmarks': a test run may hold another), without the SGLang venv."""
    for instance in instances:
        box = Sandbox(instance=instance, sglang=False)
        box.check_requirements()
        if not box.hosts():
            return box
    raise SandboxError(f"no free sandbox instance ({instances.start}-{instances.stop - 1})")
