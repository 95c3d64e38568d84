"""torchrun's agent (`torch.distributed.run`, its own arguments and behaviour) with its failure report cut to one
line. When a rank fails, the rank has printed its error already; torchrun would then print the traceback of its
own `ChildFailedError` and a box of the failures, which say nothing more to a user. `launch.torchrun` starts
this module instead of `torch.distributed.run`."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


def main(argv: list[str] | None = None) -> int:
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
        print(f"torchrun: rank {rank} (pid {failure.pid}) ended first, with {how}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
