"""The store for this torchrun round's process group: new every round, whatever torchrun keeps.

With the c10d rendezvous torchrun's agent serves one TCPStore for all rounds
(TORCHELASTIC_USE_AGENT_STORE=True), and init_process_group("env://") writes its keys there
without a round prefix: a restarted rank reads the previous round's gloo addresses and fails
("Gloo connectFullMesh failed ... Connection refused", pytorch/pytorch#135712); nor can
TORCHELASTIC_RESTART_COUNT name the round (each node's agent counts only its own restarts).
So rank 0 opens a new store each round and publishes its address in the handed-over one; the
others connect to it, reading again while an earlier round's address refuses connections
(torchrun stops every process of a round before the next rendezvous completes). Without the
agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a launcher that only sets the
variables) rank 0 serves the handed-over store itself, new every round.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from app.parallel.watch import POLL_S, SyncFailure

ADDRESS_KEY = "imagenet-dp/process-group-store"  # host:port of rank 0's store for this round


def round_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """A store only this round's processes use (rank 0 serves it)."""
    timeout = timedelta(seconds=timeout_s)
    # torch's own env:// rendezvous: a client of the agent's store, or rank 0 serving one.
    handed_over, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return handed_over  # rank 0 serves it: as new as this round's processes
    host = os.environ["MASTER_ADDR"]  # rank 0's machine (torchrun puts global rank 0 there)
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        handed_over.set(ADDRESS_KEY, f"{host}:{store.port}")
        return store
    host, port = published_address(handed_over, timeout_s)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def published_address(store: dist.Store, timeout_s: float) -> tuple[str, int]:
    """Rank 0's address once it answers; polled without blocking calls, so the wait has a
    deadline and notices that torchrun (our parent) is gone."""
    parent = os.getppid()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            raise SyncFailure("torchrun's agent is gone")
        if store.check([ADDRESS_KEY]):
            host, port = store.get(ADDRESS_KEY).decode().rsplit(":", 1)
            if accepts_connections(host, int(port)):
                return host, int(port)
        time.sleep(POLL_S)
    raise SyncFailure(f"rank 0 did not open this round's store within {timeout_s:.0f} s "
                      "(raise --sync-timeout if this is expected)")


def accepts_connections(host: str, port: int) -> bool:
    """A plain connection attempt: refused for an earlier round's address (and, unlike a
    TCPStore client, it logs nothing while it is)."""
    try:
        with socket.create_connection((host, port), timeout=POLL_S * 4):
            return True
    except OSError:
        return False
