"""Messages between processes (app/parallel/messages.py, Watch.receive): a message that cannot
be sent or rebuilt ends the run with one line naming the peer and the likely cause, and many
tensors travel as one shared buffer (app/parallel/packed.py)."""

import errno
import os
import resource

import pytest
import torch
import torch.multiprocessing as mp

from app.parallel.messages import post
from app.parallel.packed import PackedTensors
from app.parallel.ps_server import ServerLinks
from app.parallel.ps_worker import ParameterServerSync
from app.parallel.watch import SyncFailure, TransportFailure, Watch
from app.runtime.devices import WorkerEnv

CONTEXT = mp.get_context("spawn")


def test_packed_tensors_keep_names_dtypes_shapes_and_values():
    tensors = {"w": torch.randn(3, 4, 2, 2).to(memory_format=torch.channels_last),
               "b": torch.arange(5, dtype=torch.float64), "count": torch.tensor(7),
               "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 3),
               "half": torch.randn(3).half()}
    packed = PackedTensors.of(tensors)
    assert packed.buffer.is_shared() and packed.buffer.dtype == torch.uint8
    out = packed.unpacked()
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name
    tensors["b"].add_(1)  # a copy, not an alias of the source
    assert not torch.equal(out["b"], tensors["b"])


def receive_a_state_and_report(queue, reports) -> None:
    """Spawned: receive a packed state through Watch and report its entries' sums."""
    state = Watch().receive(queue, "state")[1].unpacked()
    reports.put({name: float(t.double().sum()) for name, t in state.items()})


def test_a_state_of_many_entries_reaches_another_process_as_one_descriptor():
    tensors = {f"t{i}": torch.full((3,), float(i)) for i in range(400)}
    queue, reports = CONTEXT.Queue(), CONTEXT.Queue()
    child = CONTEXT.Process(target=receive_a_state_and_report, args=(queue, reports))
    child.start()
    before = len(os.listdir("/proc/self/fd"))
    post(queue, ("state", PackedTensors.of(tensors)), "the child")
    # The sender holds one duplicated descriptor per shared storage until it is fetched.
    assert len(os.listdir("/proc/self/fd")) - before <= 2
    sums = reports.get(timeout=60)
    child.join(timeout=30)
    assert sums == {name: 3 * float(i) for i, name in enumerate(tensors)}


def fail_to_rebuild(error: BaseException):
    raise error


class Unrebuildable:
    """Arrives, but raises `error` when the receiver unpickles it."""

    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self):
        return fail_to_rebuild, (self.error,)


@pytest.mark.parametrize("error, fragment", [
    (OSError(errno.EMFILE, "Too many open files"), "(raise the open-file limit: ulimit -n)"),
    (EOFError(), "could not pass a shared-memory handle"),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "the sender is gone"),
    (ValueError("bad pickle\nsecond line"), "ValueError: bad pickle"),
])
def test_a_message_that_cannot_be_rebuilt_is_one_line_naming_what_was_awaited(error, fragment):
    queue = CONTEXT.Queue()
    queue.put(("hello", Unrebuildable(error)))
    with pytest.raises(TransportFailure) as failure:
        Watch(timeout_s=30).receive(queue, "'hello' from the parameter server")
    message = str(failure.value)
    assert message.startswith("could not receive the 'hello' from the parameter server: ")
    assert fragment in message and "\n" not in message
    assert not failure.value.noticed_only  # the driver reports it as the root cause


def test_a_message_that_cannot_be_pickled_fails_its_sender_at_once():
    """Pickled by the queue's thread, it was dropped with a traceback there, and the worker
    waited for an answer until the timeout."""
    links = ServerLinks(CONTEXT.Queue(), [CONTEXT.Queue()])
    sync = ParameterServerSync(links, WorkerEnv(), Watch(timeout_s=3), bucket_mb=1,
                               check_every=10)
    with pytest.raises(TransportFailure) as failure:
        sync.gather(lambda: "not picklable")
    message = str(failure.value)
    assert message.startswith("could not send 'reduce' to the parameter server: ")
    assert "pickle" in message and "\n" not in message


def post_a_shared_tensor_and_exit(queue) -> None:
    post(queue, ("avg", torch.ones(4).share_memory_()), "the test")


def test_a_sender_that_exited_before_its_shared_memory_was_fetched_is_named_gone():
    queue = CONTEXT.Queue()
    sender = CONTEXT.Process(target=post_a_shared_tensor_and_exit, args=(queue,))
    sender.start()
    sender.join(timeout=60)  # its queue flushed the message before it exited
    assert sender.exitcode == 0
    with pytest.raises(TransportFailure, match="the sender is gone$"):
        Watch(timeout_s=30).receive(queue, "average")


def receive_with_no_descriptor_left(queue, reports) -> None:
    """Spawned: no descriptor can be opened any more, then a shared tensor arrives."""
    lowest_free = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest_free)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # the next open fails
    try:
        Watch(timeout_s=30).receive(queue, "'hello' from the parameter server")
        reports.put("received")
    except SyncFailure as failure:
        reports.put(str(failure))


def test_running_out_of_descriptors_while_receiving_says_to_raise_the_limit():
    queue, reports = CONTEXT.Queue(), CONTEXT.Queue()
    child = CONTEXT.Process(target=receive_with_no_descriptor_left, args=(queue, reports))
    child.start()
    post(queue, ("hello", torch.ones(8).share_memory_()), "the child")
    message = reports.get(timeout=60)
    child.join(timeout=30)
    assert message.startswith("could not receive the 'hello' from the parameter server: ")
    assert "ulimit -n" in message and "\n" not in message
