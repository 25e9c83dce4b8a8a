"""app/parallel/rounds.py: a restarted rank never joins the previous round's process group.
(The whole restart under torchrun: tests/test_reliability.py.)"""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from app.parallel.plans import free_port
from app.parallel.rounds import ADDRESS_KEY, published_address
from app.parallel.watch import SyncFailure


def serve() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def test_an_earlier_rounds_address_is_passed_over_until_rank_0_publishes_its_own():
    handed_over = serve()  # what torchrun's agent keeps across rounds
    # Left by rank 0 of the previous round, which torchrun has stopped: nothing listens there.
    handed_over.set(ADDRESS_KEY, f"127.0.0.1:{free_port()}")
    this_round = serve()
    publish = threading.Timer(1.0, handed_over.set,
                              (ADDRESS_KEY, f"127.0.0.1:{this_round.port}"))
    publish.start()
    try:
        assert published_address(handed_over, timeout_s=30) == ("127.0.0.1", this_round.port)
    finally:
        publish.join()


def test_waiting_for_rank_0_has_a_deadline():
    handed_over = serve()
    with pytest.raises(SyncFailure, match="rank 0 did not open this round's store within 1 s"):
        published_address(handed_over, timeout_s=1)
