"""``python -m imagenet_ais.cli.torchrun [TORCHRUN OPTIONS] train.py ...``: torchrun
(torch.distributed.run) as it is, except that a stop is not told as its failure. Its agent passes
SIGTERM or Ctrl-C (SIGINT) on to the ranks and waits for them, and they save and say so; then this
exits quietly with the status of a process that the signal ended (128 + N: 143, 130), where
torchrun adds a SignalException traceback and its warnings and exits 1, whatever the ranks did.
Ranks that all end as stopped after saving (75: Slurm's SIGUSR1 warning, which they take
themselves) end it with 75, and ranks that all end because some rank never met them (6, told in
one line by a rank: train/watchdog.py) end it with 6, where torchrun told a ChildFailedError. A
rank that fails otherwise is told as torchrun tells it.

An elastic job (``--nnodes MIN:MAX``) goes on after losing the node whose agent was rank 0:
torchrun (2.4 to 2.11) hands its ranks a store that only the first round's rank-0 agent makes, and
an agent that becomes rank 0 later fails an assertion instead (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
makes each round's rank 0 host its own; a value of yours stands)."""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed import run
from torch.distributed.elastic.agent.server import api as agent
from torch.distributed.elastic.multiprocessing import api as processes
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from imagenet_ais.errors import EXIT_PREEMPTED, EXIT_RANKS_LOST

# The agent's warnings that narrate a stop by a signal (torch 2.4 to 2.11): that it came, and that it
# went on to each rank. (One that it had to kill a rank that did not end in time stays.)
NARRATION = ("Received %s death signal, shutting down workers", "Sending process %s closing signal %s")
FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"  # its agent's line for a rank's end
TOLD = (EXIT_PREEMPTED, EXIT_RANKS_LOST)  # the ranks' own ends, each said by them in one line


def _not_narration(record: logging.LogRecord) -> bool:
    stopped = record.msg == FAILED and isinstance(record.args, tuple) and record.args[0] in TOLD
    return not (stopped or (record.msg in NARRATION and isinstance(sys.exc_info()[1], SignalException)))


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    for module in (agent, processes):
        logging.getLogger(module.__name__).addFilter(_not_narration)
    try:
        run.main(argv)
    except SignalException as e:  # (the ranks have ended: the agent waits for them first)
        sys.exit(128 + e.sigval)
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        if len(codes) != 1 or not codes <= set(TOLD):
            raise
        sys.exit(codes.pop())


if __name__ == "__main__":
    main()
