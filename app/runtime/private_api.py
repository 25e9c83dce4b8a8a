"""Every private name of Python and torch that this program uses, each where no public way does
the job, so that a release that moves one breaks here and in tests/test_private_api.py rather
than somewhere in a run. Imports nothing of app/, and torch only when a loader is asked for.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import re
import signal
from multiprocessing import forkserver
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterator


def forkserver_pid() -> int | None:
    """The pid of the forkserver this process started (None: none yet), kept on the module's
    private ForkServer instance: no public function returns it, nor is the server a Process."""
    return forkserver._forkserver._forkserver_pid  # noqa: SLF001


@contextlib.contextmanager
def forkserver_restart_refused(instead: Callable[[], None]) -> Iterator[None]:
    """Meanwhile, starting a process calls `instead` (which raises where the server died)
    where Python's ensure_running would silently start a new server on finding the old one
    dead (even one still tearing down, so no check beforehand closes the gap). No public
    switch: this shadows the method of the module's private ForkServer instance."""
    server = forkserver._forkserver  # noqa: SLF001
    server.ensure_running = instead
    try:
        yield
    finally:
        del server.ensure_running


class PassedFd:
    """An open file descriptor of the process that starts a child, opened in the child as it
    starts (an int there), sent as multiprocessing sends its own pipes and locks through the
    forkserver's socket: `reduction.DupFd`, undocumented; no public way does it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction  # noqa: PLC0415
        return (_opened_in_child, (reduction.DupFd(self.fd),))


def _opened_in_child(passed: Any) -> int:
    return passed.detach()


def run_exit_handlers() -> None:
    """What sys.exit would run (atexit's handlers, last registered first), for a process that
    then ends with os._exit: atexit registers and unregisters, but runs them only at exit."""
    atexit._run_exitfuncs()  # noqa: SLF001


def loader_processes(loader: Any) -> list[BaseProcess]:
    """The processes of a torch DataLoader with persistent workers (none before its first
    pass), from its private iterator: active_children() drops one that died already."""
    return list(getattr(getattr(loader, "_iterator", None), "_workers", []))


@functools.cache
def loader_polling_every(seconds: float) -> type:
    """torch's DataLoader, whose wait for a batch checks every `seconds` (torch: 5 s) that its
    processes live: the default of its private `_try_get_data(timeout)`. No public setting does
    it; the public `timeout` ends the wait with an error, even a persistent loader's at an epoch's
    start."""
    from torch.utils.data import DataLoader  # noqa: PLC0415 (only where a loader is built)
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter  # noqa: PLC0415

    class PollingIterator(_MultiProcessingDataLoaderIter):
        def _try_get_data(self, timeout: float = seconds):
            return super()._try_get_data(timeout)

    class PollingLoader(DataLoader):
        def _get_iterator(self):
            if self.num_workers == 0:
                return super()._get_iterator()
            self.check_worker_number_rationality()
            return PollingIterator(self)

    return PollingLoader


# torch's words for a loader process that its SIGCHLD handler saw die (torch/csrc/DataLoader.cpp).
_TORCH_SAYS_DIED = re.compile(
    r"DataLoader worker \(pid (?P<pid>\d+)\) (?:is killed by signal: (?P<signal>[^.]+)\.|"
    r"exited unexpectedly with exit code (?P<code>-?\d+))")
_SIGNALS_BY_DESCRIPTION = {signal.strsignal(number): number for number in signal.Signals}


def loader_death_told(error: BaseException) -> tuple[int, int | None] | None:
    """(pid, exit code) of the loader process that torch's `error`, an error it quotes or its
    cause names as dead; the code is minus the killing signal, None for a signal with no name.
    None where it names none. Read from torch's text, which is no API: by then the process may
    be reaped, and torch exposes the pid and the cause nowhere else."""
    told = None
    while error is not None and told is None:
        told = _TORCH_SAYS_DIED.search(str(error))
        error = error.__cause__ or error.__context__
    if told is None:
        return None
    if told["code"] is not None:
        return int(told["pid"]), int(told["code"])
    number = _SIGNALS_BY_DESCRIPTION.get(told["signal"])
    return int(told["pid"]), -number if number else None


def names_a_loader(error: BaseException) -> bool:
    """Whether torch's `error` is about one of its loader processes, told or not how it ended
    ("exited unexpectedly", from its wait)."""
    return "DataLoader worker (pid" in str(error)


@functools.cache  # looked up once per operation: the step calls it
def foreach(operation: str) -> Callable[..., Any]:
    """torch._foreach_<operation> (copy_, lerp_, mul_): one call over a list of tensors in few
    kernels, as torch's optimizers do, where a loop launches one per tensor; no public name."""
    import torch  # noqa: PLC0415 (the loaders' processes import this module without torch)
    return getattr(torch, f"_foreach_{operation}")


def allow_graphs_per_code(graphs: int) -> None:
    """A ResNet's blocks share one `forward` code object, and dynamo keeps at most
    `recompile_limit` (8) graphs per code object, then runs eagerly with a warning. The limit is
    raised to one graph per region, mode and size (short batches never compile). Dynamo's
    settings have no public face but torch._dynamo.config."""
    import torch._dynamo  # noqa: PLC0415
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, graphs)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, graphs)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (dynamo's own bookkeeping)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415
    return counters["stats"]["unique_graphs"]


@functools.cache
def cpu_computes_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16, or AMX's tiles), where oneDNN runs
    bf16 convolutions and matrix products natively; elsewhere it emulates them, slower than
    fp32. torch.cpu names the checks only privately."""
    import torch  # noqa: PLC0415
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
