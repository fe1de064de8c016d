"""One host's push as explicit states: Decided -> Staged -> Switched (provisional) -> Confirmed | RolledBack |
Reverted, and the ends a push may take on the way (Done, Refused, Withdrawn).

Each state carries what its cleanup needs, so the end of the push (``HostPush.close``) asks the state, not
the report, what to leave behind:

| state | the host | at the end |
| --- | --- | --- |
| ``Decided`` | lock held, state read, nothing changed yet | history line |
| ``Refused`` | refused in preflight or staging: as it was | nothing |
| ``Done`` | ended in the stage pass (``unchanged``) | history line |
| ``Staged`` | the release to switch to is on disk, not current | history line (its turn failed before the switch) |
| ``Withdrawn`` | stopped before its switch (skipped, Ctrl-C, the pre_host hook) | its staged release removed |
| ``Switched`` | switched provisionally; then confirmed, rolled back or reverted | history line |
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kdeploy.core import provisional, release
from kdeploy.core.errors import InvalidInput, KdeployError, PreflightRefused, Unreachable
from kdeploy.core.gatespec import GateSpec
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.layout import service_dir
from kdeploy.core.render import unit_filename
from kdeploy.core.report import Cancelled, HostResult, PhaseFailed, Result
from kdeploy.core.state import Decision, HostState, decide
from kdeploy.flows.membership import behind_router
from kdeploy.flows.options import Options, recorded_command
from kdeploy.flows.pairing import pair_for
from kdeploy.flows.preflight import preflight_step, preflight_verdict
from kdeploy.flows.record import confirmed_line, finish_command
from kdeploy.flows.session import Wanted, connect, lock_and_read, open_remote, raise_if_cancelled
from kdeploy.flows.switch import Node, Outcome, Reverted, go_back, revert_after, switch_and_gate
from kdeploy.host import lock, parity
from kdeploy.host.pair import Pairing
from kdeploy.ssh.remote import InputFailed, Remote

if TYPE_CHECKING:
    from kdeploy.host.router import RouterClient

RELOCK_WAIT = 30.0  # after a reconnect: the host's own revert may be holding the lock while it runs


@dataclass(frozen=True)
class Decided:
    """The lock is held and the state read; ``decision`` says what the push must do. Nothing changed yet."""

    state: HostState
    decision: Decision


@dataclass(frozen=True)
class Refused:
    """Refused in preflight or staging: the host is left exactly as it was, without a history line."""

    state: HostState | None


@dataclass(frozen=True)
class Done:
    """Ended in the stage pass with nothing to switch (``unchanged``)."""

    state: HostState


@dataclass(frozen=True)
class Staged:
    """Waiting for its turn: ``target`` is on disk (staged by this push, ``staged``; or current already, for a
    restart alone), not yet current."""

    state: HostState
    decision: Decision
    target: str
    staged: str | None  # what this push put in releases/: removed if the push stops before switching


@dataclass(frozen=True)
class Withdrawn:
    """Stopped before its switch (not its turn, Ctrl-C, a refusing pre_host hook): its staged release is
    removed, so the host is left as it was."""

    staged: Staged


@dataclass(frozen=True)
class Switched:
    """``current`` moved provisionally: the host goes back by itself at ``pending.deadline`` unless confirmed."""

    staged: Staged
    pending: provisional.Pending


State = Decided | Refused | Done | Staged | Withdrawn | Switched


class HostPush:
    """One host's push in two passes, so a fleet can stage everywhere before the first restart, while a host
    holds a connection only while one of its passes runs (bounded by ``--parallel``, not by the fleet).

    ``prepare`` (the stage pass) connects, takes the lock, reads the state, runs the preflight and stages,
    then lets go of lock and connection: a host that is done (no-op, refused, failed) records its history
    first; a staged host leaves its release on disk, not yet current. ``activate`` (its batch's turn)
    connects again, retakes the lock, re-reads the state and checks nothing moved meanwhile (else decides
    again, and stages again if needed), then switches, restarts and gates (rolling back on failure), records
    and lets go. ``close`` lets go of whatever is still held; a host that never got its turn (skipped,
    interrupted) gets its staged release removed, over a connection of its own.

    ``hold``: a staged host keeps its connection and lock between the passes (no reconnect), for a rollout
    whose hosts all fit in ``--parallel``: it holds no more connections at once than that either way.
    """

    def __init__(self, inventory: Inventory, host: HostConfig, local: Wanted, opts: Options,
                 result: HostResult, cancel: threading.Event, router: RouterClient | None = None,
                 hold: bool = False) -> None:
        """``cancel``: Ctrl-C; checked before each change and during the upload. ``router``: the host's
        router, which ``activate`` drains it from and admits it to again."""
        self.inventory, self.host, self.local, self.opts, self.result = inventory, host, local, opts, result
        self.cancel = cancel
        self.router = router
        self.hold = hold
        self.command = recorded_command(opts, "push")
        self.remote: Remote | None = None
        self.held: lock.HeldLock | None = None
        self.at: State | None = None
        self.turn = False  # activate() ran: a failure from here on is the push's own, not a stop
        self.leftover: str | None = None  # staged by this push, then superseded: removed when it ends
        self.outcome: Outcome | None = None  # how the switch ended (None: no switch, or its end is unknown)
        self.started = time.monotonic()

    @property
    def pending(self) -> bool:
        """Prepared and waiting for its turn to restart."""
        return isinstance(self.at, Staged)

    @property
    def target(self) -> str | None:
        """The release its turn switches to."""
        return self.at.target if isinstance(self.at, Staged) else None

    @property
    def state(self) -> HostState | None:
        """The host's state as last read under the lock."""
        at = self.at.staged if isinstance(self.at, (Withdrawn, Switched)) else self.at
        return at.state if at is not None else None

    def prepare(self) -> None:
        """The stage pass: ends Staged holding nothing (or the lock, with ``hold``), or ended and closed."""
        if self.decide():
            self.stage()

    def decide(self) -> bool:
        """The stage pass up to the decision: connect, lock, read, decide and check; ends Decided holding the
        lock and connection (True), or ended and closed."""
        try:
            self.remote = connect(self.inventory, self.host, self.result, self.opts.reach)
            with self.result.phase("preflight") as phase:
                self.held, state = lock_and_read(self.remote, self.host, self.opts.lock_wait, with_files=True,
                                                 command=self.command)
                self.at = self._decide(state)
                phase.detail = self._preflight(self.at)
            raise_if_cancelled(self.cancel)
            return True
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            self.stopped_by(exc)
            self.close()
            return False

    @property
    def changes(self) -> bool:
        """Decided on a change (not a no-op)."""
        return isinstance(self.at, Decided) and not self.at.decision.no_op

    def stage(self, restart: bool = False) -> None:
        """The rest of the stage pass, from Decided; ``restart``: a peer node of its server changes, and a
        node never restarts alone (its group would break), so a node with nothing to change restarts too."""
        try:
            assert isinstance(self.at, Decided)
            if restart and self.at.decision.no_op:
                self.at = self._decide(self.at.state, force_restart=True)
            self.at = self._stage_if_needed(self.at)
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            self.stopped_by(exc)
        finally:
            if not isinstance(self.at, Staged):
                self.close()
            elif not self.hold:
                self._release_until_turn()

    def _decide(self, state: HostState, force_restart: bool = False) -> Decided:
        return Decided(state, decide(self.local.payload.identity, self.local.unit_text, state,
                                     force_restart=self.opts.force_restart or force_restart,
                                     secrets=self.local.secrets))

    def _preflight(self, at: Decided) -> str:
        """The preflight phase's words; the checks (one round trip) run only before a change, and may refuse."""
        host, local, state, decision = self.host, self.local, at.state, at.decision
        assert self.remote is not None and self.held is not None
        detail = f"lock taken; current {state.current or 'none'}; {state.unit.summary}"
        if not decision.no_op:
            detail += parity.model_change(host.name, state.current, state.gates.get(state.current or ""),
                                          local.spec, self.opts.accept_parity_change)
        if decision.reasons:
            detail += "; " + "; ".join(decision.reasons)
        if self.held.stale:
            detail += f"; took over STALE lock left by {self.held.stale.describe()} (holder gone)"
        # The checks start the service's python, nvidia-smi and journalctl: only worth it before a change.
        if not decision.no_op and not self.opts.skip_preflight:
            upload = sum(local.payload.files[p].size for p in decision.delta.upload)
            out = self.remote.ask(preflight_step(host))
            detail += "; " + preflight_verdict(host, out, upload, release.entries(local.payload.files))
        return detail

    def _stage_if_needed(self, at: Decided) -> Done | Staged:
        """Finish a no-op host; else stage what the decision asks for (nothing for a restart alone)."""
        if at.decision.no_op:
            with self.result.phase("stage") as phase:
                phase.detail = "nothing changed: no upload, no restart"
            self.result.release = at.state.current
            self.result.finish("unchanged")
            return Done(at.state)
        if not at.decision.stage:
            assert at.state.current is not None
            return Staged(at.state, at.decision, at.state.current, None)
        staged = self._stage(at)
        return Staged(at.state, at.decision, staged, staged)

    def _release_until_turn(self) -> None:
        """Between the passes: release the lock (nothing to record yet) and disconnect. The staged release
        stays in ``releases/``, not current; ``activate`` checks it is still there."""
        if self.held is not None:
            self.held.release()
            self.held = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    def _resume(self, at: Staged) -> Staged | Done:
        """Connect again, retake the lock, re-read the state (one round trip) and check that nothing moved
        since the stage pass (another push or a rollback may have run meanwhile). If something did, decide
        again: a host now in sync is ``unchanged``; else the staged release is used if it is still intact
        (it holds every file, whatever is current), or a new one is staged."""
        with self.result.phase("resume") as phase:
            self.remote = open_remote(self.inventory, self.host, self.opts.reach)
            self.held, state = lock_and_read(self.remote, self.host, self.opts.lock_wait, with_files=True,
                                             command=self.command)
            moved = changed_since_staging(at.state, state, at.staged)
            phase.detail = f"lock taken again; {moved + ', decided again' if moved else 'nothing moved since staging'}"
        if not moved:
            return Staged(state, at.decision, at.target, at.staged)
        decided = self._decide(state)
        intact = at.staged is not None and at.staged in state.releases
        if decided.decision.stage and intact:
            return Staged(state, decided.decision, at.staged, at.staged)
        self.leftover = at.staged if intact else None
        self.at = decided  # the old staged release is no longer this push's to remove: it is the leftover
        return self._stage_if_needed(decided)

    def _stage(self, at: Decided) -> str:
        """Stage the new release; returns its id. A failure leaves the host unchanged (the staging dir is
        removed) and is no bug of kdeploy's: a payload file edited during the push is invalid input (exit 2),
        anything else on the host refuses it (exit 7), like a full disk."""
        host, local, delta = self.host, self.local, at.decision.delta
        assert self.remote is not None
        with self.result.phase("stage") as phase:
            target = release.release_id(local.payload.manifest, local.unit_text)
            meta = release.release_meta(local.payload.manifest, local.payload.modes, local.unit_text,
                                        unit_filename(host.service), local.spec.to_json())
            self.result.attempted = target
            try:
                tarball = release.TarStream(local.payload, delta.upload, meta)
                failure = self.remote.ask(release.stage_step(service_dir(host.service), target, at.state.has_release,
                                                             delta), stdin=tarball, cancel=self.cancel)
            except InputFailed as exc:  # a payload file vanished or shrank while the tar read it
                failure = release.StageFailure(f"cannot read the payload: {exc}")
            if failure:
                changed = release.changed_since_scan(local.payload, delta.upload)
                if changed:
                    more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
                    raise InvalidInput(f"{host.name}: payload file {local.payload.files[changed[0]].source}{more} "
                                       "changed during the push, host unchanged: push again")
                raise PreflightRefused(failure.describe(f"{service_dir(host.service)}/releases"))
            phase.detail = (f"{target}: {delta.describe()} files, {tarball.sent} bytes sent"
                            f"{', unit changed' if at.decision.install_unit else ''}")
            return target

    def activate(self) -> None:
        """The batch pass (its turn) of a one-node server: Staged -> Switched -> an outcome; ends holding
        nothing. A server of several nodes takes its turn through ``ServerPush``."""
        ServerPush([self]).activate()

    def resume(self) -> bool:
        """Its turn begins: connected and locked again if it let go between the passes; True when it is
        still Staged (else it ended: the host moved to what this push wants meanwhile)."""
        self.turn = True
        assert isinstance(self.at, Staged)
        if self.remote is None:
            raise_if_cancelled(self.cancel)
            self.at = self._resume(self.at)
        if not isinstance(self.at, Staged):
            return False
        self.result.release = self.at.target
        return True

    def node(self, pending: provisional.Pending | None = None, pair: Pairing | None = None) -> Node:
        """Staged -> Switched: its part of the server's switch, under the server's ``pending`` token and
        deadline (its own target and previous release); the head's parity baseline is taken here, before
        the switch (through its ``pair``, a prefill or decode server's partner)."""
        at, remote = self.at, self.remote
        assert isinstance(at, Staged) and remote is not None
        previous = at.state.confirmed
        spec = self.local.spec
        baseline = parity.baseline(remote, service_dir(self.host.service), self.result, spec, at.target,
                                   (at.state.current, self._spec_of(at.state, at.state.current)), pair
                                   ) if self.opts.verify and spec.serves else None
        mine = provisional.new_pending(previous, at.target, revert_after(self.host, spec))
        if pending is not None:
            mine = mine.joined(pending)
        self.at = Switched(at, mine)
        wrote = "changed" if at.decision.secrets_changed else None
        return Node(remote, self.host, self.result, mine, spec, self._spec_of(at.state, previous),
                    install_unit=at.decision.install_unit,
                    secrets=self.local.secrets if at.decision.secrets_changed else None, baseline=baseline,
                    pair=pair, record=lambda success, gated: confirmed_line(
                        self.host, self.result, self.started, self.local, command=self.command, success=success,
                        gated=gated, secrets=wrote))

    def stopped_by(self, exc: BaseException) -> None:
        """End the host with ``exc``'s result; the state says what the push leaves behind."""
        self.result.fail(exc)
        if isinstance(exc, Cancelled | PreflightRefused) and isinstance(self.at, Staged):
            self.at = Withdrawn(self.at)
        elif isinstance(exc, PreflightRefused) and not isinstance(self.at, Switched):
            self.at = Refused(self.state)

    def _spec_of(self, state: HostState, release_id: str | None) -> GateSpec:
        """How ``release_id`` was gated when it was deployed; this push's spec for releases kdeploy staged
        before it stored one (less its config line, which reflects the new settings)."""
        stored = state.gates.get(release_id or "")
        return stored or self.local.spec.model_copy(update={"config_line": None, "config": {}})

    def reconnect_and_go_back(self, lost: Unreachable) -> None:
        """The link dropped after the switch began: reconnect, take the lock again, and put the last confirmed
        release back, unless the host already did so by itself."""
        relocked = self.relock(lost)
        if relocked is None:
            return
        node, state = relocked
        if state.pending is None or state.pending.token != node.pending.token:
            self.result.release = state.current
            self.result.finish("rolled_back", f"connection lost during the deploy ({lost}); the host had already "
                                              f"gone back to {state.current or 'nothing'} by itself")
            self.outcome = Reverted(state.current)
            return
        try:
            self.outcome = go_back([node], f"connection lost during the deploy ({lost})")
        except Unreachable as again:
            self.held = None
            self.result.finish("unreachable", f"connection lost during the deploy ({lost}), and again on the way "
                                              f"back ({again}); the host goes back by itself at the deadline")

    def relock(self, lost: Unreachable) -> tuple[Node, HostState] | None:
        """After a lost link: a new connection and the lock again (ending the old holder), with the state as it
        is now and its part of the switch to go back with; None when it ended (not switched, or unreachable:
        it goes back by itself at the deadline)."""
        at = self.at
        if not isinstance(at, Switched):
            self.result.fail(lost)
            return None
        pending = at.pending
        assert self.remote is not None
        try:
            remote = connect(self.inventory, self.host, self.result, self.opts.reach)
        except Unreachable as exc:
            self.result.finish("unreachable", f"connection lost after switching to {pending.target}; reconnect "
                                              f"failed ({exc}); the host goes back to "
                                              f"{pending.previous or 'nothing (first deploy)'} by itself at "
                                              f"{time.strftime('%H:%M:%S', time.localtime(pending.deadline))}")
            return None
        self.remote.close()
        self.remote = remote
        sdir = service_dir(self.host.service)
        try:
            with self.result.phase("relock") as phase:
                if self.held is not None and self.held.remote_pid:
                    remote.ask(lock.end_holder_step(sdir, self.held.remote_pid))
                # Holding the lock, no revert can be half way: one waiting for it would end us, stop it.
                waiting = provisional.stop_revert_service(provisional.timer_unit(self.host.service.name))
                self.held, state = lock_and_read(remote, self.host, RELOCK_WAIT, first=waiting, command=self.command)
                phase.detail = f"lock taken again; current {state.current or 'none'}"
        except KdeployError as exc:
            self.held = None
            self.result.finish("unreachable", f"connection lost after switching to {pending.target}; {exc}; the "
                                              "host goes back by itself at the deadline unless confirmed")
            return None
        return Node(remote, self.host, self.result, pending, self.local.spec,
                    self._spec_of(at.staged.state, pending.previous)), state

    def skip(self, why: str, result: str = "skipped") -> None:
        """Its turn will not come (max-fail, a failed canary, Ctrl-C): Staged -> Withdrawn."""
        if isinstance(self.at, Staged) and not self.turn and not self.result.done:
            self.at = Withdrawn(self.at)
            self.result.finish(result, why)

    def close(self) -> None:
        """Record and clean up through the lock holder (no extra round trip), then let go of the host. A host
        that never got its turn holds nothing by now: its staged release is removed over a new connection."""
        if isinstance(self.at, Staged) and not self.turn:  # ended by others (the pre_host hook, Ctrl-C)
            self.at = Withdrawn(self.at)
        try:
            if self.held is None and isinstance(self.at, Withdrawn) and self.at.staged.staged:
                self._remove_staged(self.at.staged.staged)
            elif self.held is not None and self.remote is not None:
                finish = self._finish_command()
                if not self.held.release(finish) and finish:  # the holder's link died (we reconnected)
                    self.remote.run(finish, timeout=60)
        except KdeployError as exc:
            self.result.log.append(f"could not record history or clean up after the push: {exc}")
        finally:
            self.held = None
            if self.remote is not None:
                self.remote.close()
                self.remote = None

    def _remove_staged(self, staged: str) -> None:
        """Connect and take the lock again (never waiting) to remove the release this push staged and never
        activated; if someone made it current or pending meanwhile, it is theirs now and stays."""
        self.remote = open_remote(self.inventory, self.host, self.opts.reach)
        held, state = lock_and_read(self.remote, self.host, 0, command=self.command)
        theirs = staged in (state.current, state.pending.target if state.pending else None)
        held.release("" if theirs else release.prune_command(service_dir(self.host.service), [staged]))
        self.result.release = state.current

    def _finish_command(self) -> str:
        """What the state leaves behind, run by the lock holder as its last act."""
        at = self.at
        sdir = service_dir(self.host.service)
        if isinstance(at, Withdrawn):
            self.result.release = at.staged.state.current
            return release.prune_command(sdir, [at.staged.staged]) if at.staged.staged else ""
        if isinstance(at, Refused):
            return ""
        state = self.state
        keep = {state.current, state.confirmed} if state else set()
        drop = release.prune_command(sdir, [self.leftover] if self.leftover not in (None, *keep) else [])
        decision = at.decision if isinstance(at, Decided | Staged) else at.staged.decision if isinstance(
            at, Switched) else None
        wrote_secrets = decision is not None and decision.secrets_changed
        return "\n".join(c for c in (finish_command(self.host, self.result, self.started,
                                                     state.releases if state else [], self.local, keep,
                                                     command=self.command,
                                                     secrets="changed" if wrote_secrets else None),
                                      drop) if c)


class ServerPush:
    """One server's push: its nodes' ``HostPush`` in rank order (one for a single host), taken through both
    passes as one. Locks are taken in rank order (two controllers never hold parts of one server while each
    waits for the rest); every node is decided before any stages, and when one changes every node restarts;
    a node that fails or is refused before the switch ends the server's push, its peers left as they were;
    the switch, gate and any way back are the server's (``switch.switch_and_gate``)."""

    def __init__(self, nodes: list[HostPush], name: str | None = None) -> None:
        self.nodes = nodes
        self.head = nodes[0]
        self.name = name or self.head.host.name

    @property
    def pending(self) -> bool:
        """Staged on every node and waiting for its turn."""
        return all(n.pending for n in self.nodes)

    @property
    def ok(self) -> bool:
        return all(n.result.ok for n in self.nodes)

    def confirmed(self) -> dict[str, str | None]:
        """Each node's last confirmed release as read under its lock: where a failed canary goes back to."""
        return {n.host.name: n.state.confirmed if n.state else None for n in self.nodes}

    def prepare(self) -> None:
        """The stage pass of every node, in rank order."""
        if len(self.nodes) == 1:
            self.head.prepare()
            return
        for node in self.nodes:
            if not node.decide():
                return self._abandon(node)
        restart = any(n.changes for n in self.nodes)
        for node in self.nodes:
            node.stage(restart)
        failed = next((n for n in self.nodes if n.result.done and not n.result.ok), None)
        if failed is not None:
            self._abandon(failed)

    def _abandon(self, failed: HostPush) -> None:
        """``failed`` ended the server's push before any switch: every other node ends as it was (a staged
        release removed), with ``failed``'s result (``skipped`` when that one ended well: it moved meanwhile)."""
        ended = failed.result.result if not failed.result.ok else Result.SKIPPED
        why = f"server {self.name}: node {failed.host.name} {failed.result.result}: {failed.result.error or ''}"
        for node in self.nodes:
            if node is failed or node.result.done:
                continue
            if isinstance(node.at, Decided):
                node.at = Refused(node.state)
            elif isinstance(node.at, Staged):
                node.at = Withdrawn(node.at)
            node.result.finish(ended, why.rstrip(": "))
            node.close()

    def skip(self, why: str, result: str = "skipped") -> None:
        for node in self.nodes:
            node.skip(why, result)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def activate(self) -> None:
        """The server's turn: every node resumed (rank order), then, drained from the router by its head, the
        switch of every node under one token, restart, gate, and confirm or the way back of every node. Ends
        holding nothing."""
        nodes = self.nodes
        try:
            for node in nodes:
                if not node.resume():
                    if len(nodes) > 1:
                        self._abandon(node)
                    return
            raise_if_cancelled(self.head.cancel)
            head = self.head
            assert head.remote is not None
            with pair_for(head.inventory, head.host, head.router, head.opts.reach) as pair:
                behind_router(head.remote, head.host, head.result, head.router, head.cancel,
                              lambda: self._switch(pair))
        except Unreachable as exc:
            if len(nodes) == 1:
                self.head.reconnect_and_go_back(exc)
            else:
                self._recover(exc)
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            for node in nodes:
                node.stopped_by(exc)
        finally:
            self.close()

    def _recover(self, lost: Unreachable) -> None:
        """A link to a node dropped after the switch began: every node reconnected and locked again, then every
        node back to its last confirmed release together (one that went back by itself restarts with its
        peers, whose group it left). A node that cannot be reached again leaves the server to the host side:
        every node not confirmed goes back by itself at the one deadline."""
        relocked = [node.relock(lost) for node in self.nodes]
        contexts = [r[0] for r in relocked if r is not None]
        if len(contexts) < len(self.nodes):
            gone = ", ".join(n.host.name for n, r in zip(self.nodes, relocked, strict=True) if r is None)
            for node in contexts:
                node.result.finish("unreachable", f"connection lost during the deploy ({lost}); {gone} cannot be "
                                                  "reached: every node goes back by itself at the deadline")
            return
        try:
            outcome = go_back(contexts, f"connection lost during the deploy ({lost})")
        except Unreachable as again:
            for node in contexts:
                node.held = None
                node.result.finish("unreachable", f"connection lost during the deploy ({lost}), and again on the "
                                                  f"way back ({again}); every node goes back by itself at the deadline")
            return
        for node in self.nodes:
            node.outcome = outcome

    def _switch(self, pair: Pairing | None) -> Outcome:
        """Staged -> Switched on every node -> Confirmed or RolledBack. The reverts' deadline counts from
        here, not from before the drain. ``pair``: the head's partner (a prefill or decode server)."""
        first = self.head.node(pair=pair)
        outcome = switch_and_gate([first, *(n.node(first.pending) for n in self.nodes[1:])],
                                  verify=self.head.opts.verify)
        for node in self.nodes:
            node.outcome = outcome
        return outcome


def changed_since_staging(before: HostState, now: HostState, staged: str | None) -> str:
    """What changed on a host between the stage pass and its batch (empty: nothing), in words."""
    if now.current != before.current:
        return f"current moved from {before.current or 'none'} to {now.current or 'none'}"
    if (now.pending and now.pending.token) != (before.pending and before.pending.token):
        return "the host's pending switch changed"
    if now.unit_text != before.unit_text or now.manifest != before.manifest:
        return "the installed unit or the current release changed"
    if staged and staged not in now.releases:
        return f"staged release {staged} was removed"
    return ""
