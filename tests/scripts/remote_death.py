"""A rank on another node dies while this node's rank waits for it (as in an nccl collective whose peer is gone, which
may never return). One rank per node, launched with `disttrain launch --nnodes 2 --run-dir RUN_DIR` on each node:

    python remote_death.py RUN_DIR HOST

Both ranks keep their status file current (as the Trainer's ranks do); after 3 s the rank on HOST kills itself with
SIGKILL, and the other sleeps on: only its launcher, told by HOST's, can end it before the watchdog's timeout. (The
rendezvous numbers the nodes by arrival, so the dying rank is chosen by its host, not by its rank.)"""

import os
import signal
import socket
import sys
import time
from pathlib import Path

from disttrain.monitor import RankStatus

rank = int(os.environ["RANK"])
status = RankStatus(Path(sys.argv[1]), rank, int(os.environ["GROUP_RANK"]))
status.phase("forward", step=1)
time.sleep(3)
if socket.gethostname() == sys.argv[2]:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(600)
