"""ZeroMQ between a scheduler (ROUTER, binds) and its worker ranks (DEALER, connect).

A worker announces itself with `[b"hello", WorkerHello]`; every plan goes to every rank as one
frame, and every rank answers with one StepResult frame (rank 0's carries the sampled tokens).
ROUTER/DEALER queue rather than drop, and nothing is pickled: frames are common.protocol bytes.

A lost rank is noticed without waiting for a step deadline: the ROUTER pings every connection
(ZMTP heartbeats, answered by libzmq's I/O thread even while a rank computes a long step) and a
socket monitor reports each closed connection. A killed rank's connection closes at once; a
stopped one's after HEARTBEAT_TIMEOUT_MS.
"""
from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.protocol import ProtocolError, StepPlan, StepResult, WorkerHello, decode, encode

HELLO = b"hello"
RESULT = b"result"
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 4000
log = logging.getLogger(__name__)


class WorkerLink:
    """The scheduler's end: who the ranks are, send a plan to all, gather their results."""

    def __init__(self, address: str, world_size: int, context: zmq.Context | None = None) -> None:
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes over its identity
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.socket.bind(address)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()  # results and closed connections, both awaited by gather
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.world_size = world_size
        self.ranks: dict[int, bytes] = {}  # rank -> ZeroMQ identity
        self.hellos: dict[int, WorkerHello] = {}
        self.fds: dict[int, int] = {}  # rank -> file descriptor of its connection (names it in monitor events)
        self.lost: int | None = None  # a rank of the group whose connection closed
        self.last_seen = time.monotonic()  # any frame from any rank
        self.generation = 0  # advances whenever the group of ranks is forgotten
        # results of a later plan that a rank sent while an earlier plan's were gathered (with
        # async scheduling two plans are in flight, and ranks run at their own pace)
        self.early: list[tuple[bytes, StepResult]] = []

    @property
    def ready(self) -> bool:
        return len(self.ranks) == self.world_size

    def poll_hello(self, timeout_ms: int) -> WorkerHello | None:
        """Take one pending frame; returns the hello if it was one (anything else is stale)."""
        if not self.socket.poll(timeout_ms):
            return None
        self.check_connections()  # first: a closed connection's descriptor may be reused by this hello's
        identity, kind, payload, fd = self._recv()
        return self._register(identity, payload, fd) if kind == HELLO else None

    def silent_for(self) -> float:
        """Seconds since any rank was last heard from (idle ranks say hello every few seconds)."""
        return time.monotonic() - self.last_seen

    def check_connections(self) -> int | None:
        """Take the monitor's events; returns the rank of the group whose connection closed, if any."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            rank = next((r for r, fd in self.fds.items() if fd == event["value"]), None)
            if rank is None:
                continue  # not a rank's connection (a stray peer, or one already forgotten)
            del self.fds[rank]
            if self.ready:
                self.lost = rank
                log.warning("worker rank %d disconnected", rank)
            else:  # the group is still forming: wait for the rank to come back
                self.ranks.pop(rank, None)
                self.hellos.pop(rank, None)
        return self.lost

    def _register(self, identity: bytes, payload: bytes, fd: int) -> WorkerHello | None:
        self.last_seen = time.monotonic()
        try:
            hello = decode(payload)
        except ProtocolError as exc:
            log.warning("dropped a malformed hello: %s", exc)
            return None
        if not isinstance(hello, WorkerHello) or not 0 <= hello.rank < self.world_size:
            log.warning("dropped a hello for a rank outside the group: %r", hello)
            return None
        if hello.world_size != self.world_size:  # its ranks would wait for each other forever
            log.warning("dropped the hello of rank %d of a group of %d: this scheduler's group has %d ranks "
                        "(--tensor-parallel-size)", hello.rank, hello.world_size, self.world_size)
            return None
        known = self.hellos.get(hello.rank)
        if self.ready and known is not None and (self.ranks[hello.rank], known) != (identity, hello):
            log.warning("rank %d changed (restarted or replaced): the group starts over", hello.rank)
            self.forget_workers()
        self.ranks[hello.rank] = identity
        self.hellos[hello.rank] = hello
        self.fds[hello.rank] = fd
        return hello

    def drain(self) -> None:
        """Take every pending frame while idle: keep-alive hellos, stale results."""
        self.early.clear()
        while self.poll_hello(timeout_ms=0) is not None or self.socket.poll(0):
            pass

    def forget_workers(self) -> None:
        self.ranks.clear()
        self.hellos.clear()
        self.fds.clear()
        self.lost = None
        self.early.clear()
        self.generation += 1

    def send_plan(self, plan: StepPlan) -> None:
        frame = encode(plan)
        for identity in self.ranks.values():
            self.socket.send_multipart([identity, frame])

    def gather(self, plan: StepPlan, timeout_s: float, on_wait=None) -> StepResult | None:
        """Rank 0's result for `plan` once every rank answered; None when the deadline passes or
        a rank fails or disconnects. `on_wait` runs about twice a second meanwhile (the scheduler's
        heartbeats)."""
        deadline = time.monotonic() + timeout_s
        waiting = set(self.ranks.values())
        result = None
        queued, self.early = self.early, []
        while waiting:
            if queued:
                identity, message = queued.pop(0)
            else:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    return None
                ready = dict(self.poller.poll(min(left_ms, 500)))
                if self.monitor in ready and self.check_connections() is not None:
                    return None
                if self.socket not in ready:
                    if on_wait is not None:
                        on_wait()
                    continue
                identity, kind, payload, fd = self._recv()
                self.last_seen = time.monotonic()
                if kind == HELLO:
                    known = identity in self.ranks.values()
                    self._register(identity, payload, fd)
                    if known:
                        continue  # a keep-alive from a rank we know
                    return None  # a rank restarted mid-step: its state is gone
                try:
                    message = decode(payload)
                except ProtocolError as exc:
                    log.warning("dropped a malformed result: %s", exc)
                    continue
                if not isinstance(message, StepResult):
                    continue
            if message.epoch == plan.epoch and message.step > plan.step:
                self.early.append((identity, message))  # a later plan's: for its own gather
                continue
            if (message.step, message.epoch) != (plan.step, plan.epoch):
                continue  # stale
            waiting.discard(identity)
            if message.error:
                return message  # any rank's failure fails the step
            if identity == self.ranks.get(0):
                result = message
        self.early += queued
        return result

    def _recv(self) -> tuple[bytes, bytes, bytes, int]:
        """identity, kind, payload, and the file descriptor of the connection it came on."""
        frames = self.socket.recv_multipart(copy=False)
        fd = frames[-1].get(zmq.SRCFD)
        if len(frames) != 3:
            return frames[0].bytes, b"", b"", fd
        return frames[0].bytes, frames[1].bytes, frames[2].bytes, fd

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)


class SchedulerLink:
    """A worker rank's end: say hello, receive plans, answer with results."""

    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def hello(self, hello: WorkerHello) -> None:
        self.socket.send_multipart([HELLO, encode(hello)])

    def recv_plan(self, timeout_ms: int | None = None) -> StepPlan | None:
        """The next plan, or None after `timeout_ms`. A malformed frame is logged and dropped."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        frame = self.socket.recv()
        try:
            message = decode(frame)
        except ProtocolError as exc:
            log.warning("dropped a malformed plan (%d bytes): %s", len(frame), exc)
            return None
        if not isinstance(message, StepPlan):
            log.warning("dropped a %s sent as a plan", type(message).__name__)
            return None
        return message

    def send_result(self, result: StepResult) -> None:
        self.socket.send_multipart([RESULT, encode(result)])

    def close(self) -> None:
        self.socket.close(0)
