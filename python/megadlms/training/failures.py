"""A failure on one rank outside the training step stops every rank within seconds
(docs/reliability.md, "No waiting outside the step").

The step pairs its collectives even when a rank fails (its reductions carry a failure flag);
evaluation, a save's metadata, the data loaders' construction and logging do not: a rank
that raises there leaves its peers in their next collective until the collective timeout
(10 minutes by default). A :class:`FailureChannel` closes that hole with the store the
process group already has (torchrun's agent store, or rank 0's TCPStore):

* every such phase runs inside :meth:`FailureChannel.phase`; an exception there publishes
  ``rank R failed in <phase> at iteration N: <error>`` under one key (the first failure
  wins), waits up to ``linger`` seconds for every peer to acknowledge it (rank 0 may host
  the store), then propagates as before;
* a daemon thread on every rank polls that key (one cheap ``check`` per ``poll`` seconds);
  when a peer published, it gives its own main thread ``grace`` seconds to fail too (an error
  every rank raises, such as a save's, then stays each rank's own), else it prints the
  failure, acknowledges it and ends the process with exit status 1.

Why the watcher ends the process instead of aborting the group: a rank blocked inside a
gloo or NCCL collective cannot poll, and nothing short of an abort returns from that wait;
after a peer's failure nothing is left for the rank to do that does not need the group (a
save needs every rank), so the one code path for gloo and NCCL, with or without torchrun's
agent, is to print the failure and exit. A checkpoint save in flight is lost the way a
killed rank's is (its ``.tmp`` directory is ignored; ``latest`` is untouched).

Only a process that owns its process group (``megadlms.pretrain.run``) starts a channel: a
test or user that hands the trainer its own group keeps today's behaviour.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional, Type

import torch.distributed as dist

_log = logging.getLogger("megadlms.training")

KEY, ACKS = "failure", "failure_acks"
EXIT_CODE = 1
"""A peer's failure: the exit status of every rank that stops because another one failed."""


def _say(message: str) -> None:
    """The message on stderr, after whatever the logging handlers still hold."""
    for handler in logging.getLogger().handlers + _log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def _exit_process(message: str) -> None:
    """The watcher's default action: the process ends (module docstring); the message is out."""
    os._exit(EXIT_CODE)


class FailureChannel:
    """One run's "a rank failed" channel over a store shared by every rank (module docstring).

    ``store``: the process group's store (:meth:`for_default_group`); ``poll``: seconds
    between the watcher's checks; ``grace``: how long a peer's failure waits for this rank's
    own; ``linger``: how long a failing rank waits for its peers' acknowledgements before it
    raises; ``on_peer_failure``: what a peer's failure does to this rank, after its message is
    printed (default: exit with :data:`EXIT_CODE`)."""

    def __init__(
        self,
        store,
        rank: int,
        world: int,
        *,
        poll: float = 0.2,
        grace: float = 1.0,
        linger: float = 5.0,
        on_peer_failure: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.poll, self.grace, self.linger = poll, grace, linger
        self.on_peer_failure = on_peer_failure or _exit_process
        self.iteration = 0  # the trainer's, for the message
        self._failing = threading.Event()  # this rank's own failure is being published
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_default_group(cls, **kw) -> FailureChannel:
        """A channel over the default process group's store (under its own key prefix)."""
        store = dist.PrefixStore("megadlms/rank_failure/", dist.distributed_c10d._get_default_store())
        return cls(store, dist.get_rank(), dist.get_world_size(), **kw)

    def start(self) -> FailureChannel:
        """Start the watcher thread (nothing to watch in a world of one)."""
        if self.world > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="megadlms-failure-watcher", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the watcher (the run is over: a peer's later failure is its own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll * 10)
            self._thread = None

    @contextlib.contextmanager
    def phase(self, name: str, only: Type[BaseException] = Exception):
        """Run a phase whose failure the other ranks cannot learn otherwise: an exception in it
        (of class ``only``: the step publishes only its unpaired failures) is published before it
        propagates. KeyboardInterrupt and SystemExit are not: they stop one rank by design."""
        try:
            yield
        except only as exc:
            self._publish(name, exc)
            raise

    def _publish(self, name: str, exc: BaseException) -> None:
        self._failing.set()
        if self.world == 1:
            return
        message = (
            f"rank {self.rank} failed in {name} at iteration {self.iteration}: {type(exc).__name__}: {exc}"
        )
        try:
            # compare_set with an empty expected value creates the key only if it is absent: the first wins
            first = self.store.compare_set(KEY, "", message).decode() == message
        except Exception as store_exc:  # noqa: BLE001 - the store is gone (its host exited): raise the real error
            _log.warning(f"could not tell the other ranks of this failure: {str(store_exc).splitlines()[0]}")
            return
        if not first:
            return  # a peer failed first: this rank's watcher acknowledges it
        deadline = time.monotonic() + self.linger
        # Acknowledging peers exit: after the last, the store may be gone with rank 0 (an error ends the wait)
        with contextlib.suppress(Exception):
            while self.store.add(ACKS, 0) < self.world - 1 and time.monotonic() < deadline:
                time.sleep(self.poll / 4)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                if not self.store.check([KEY]):
                    continue
                message = self.store.get(KEY).decode()
            except Exception:  # noqa: BLE001 - the store's host exited: the run is over either way
                return
            if message.startswith(f"rank {self.rank} "):
                return  # this rank's own failure: its main thread raises it
            if self._failing.wait(self.grace):  # this rank fails too: its own error propagates
                with contextlib.suppress(Exception):
                    self.store.add(ACKS, 1)
                return
            note = f"rank {self.rank}: stopping because {message} (no collective timeout waited for)"
            _say(note)  # before the acknowledgement: the failing rank (maybe the store's host) then exits
            with contextlib.suppress(Exception):
                self.store.add(ACKS, 1)
            self.on_peer_failure(note)
            return


@contextlib.contextmanager
def guarded(channel: Optional[FailureChannel], name: str, only: type = Exception):
    """``channel.phase(name, only)``, or nothing without a channel."""
    if channel is None:
        yield
        return
    with channel.phase(name, only):
        yield
