"""What a rank of `disttrain launch [--fork] forked_view.py OUT [CODE]` sees, written to OUT/rank{R}.json: whether
torch was imported before the script ran (a forked rank's server imported it), its argv, `__name__`, first import
path, folder and torch threads. Rank 1 then leaves with `sys.exit(CODE)` when CODE is given."""

import json
import os
import sys

preloaded = "torch" in sys.modules

import torch  # noqa: E402

out, rank = sys.argv[1], int(os.environ["RANK"])
view = {"preloaded": preloaded, "argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
        "threads": torch.get_num_threads()}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(view, f)
if len(sys.argv) > 2 and rank == 1:
    sys.exit(int(sys.argv[2]))
