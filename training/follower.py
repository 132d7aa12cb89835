"""Entry point of a data-parallel follower process: ``python -m training.follower <read fd> <write fd>``
(started by training.distributed.Followers; its orders come down the pipe, see there)."""

from __future__ import annotations

import sys

from training.distributed import follower_main

if __name__ == "__main__":
    follower_main(int(sys.argv[1]), int(sys.argv[2]))
