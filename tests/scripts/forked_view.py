"""What a rank of `disttrain launch [--fork] forked_view.py OUT [END]` sees, written to OUT/rank{R}.json: whether
torch was imported before the script ran (a forked rank's server imported it), its argv, `__name__`, first import
path, folder and torch threads, and whether a process it forked unwound its stack on os._exit(0). END: a number,
rank 1 then leaves with `sys.exit(END)`; `os._exit`, every rank leaves with `os._exit(0)` (as
`disttrain.runtime.exit_process` does)."""

import json
import os
import sys

preloaded = "torch" in sys.modules

import torch  # noqa: E402

out, rank = sys.argv[1], int(os.environ["RANK"])
child = os.fork()  # a process the rank forks (as a data loader does) leaves at once through os._exit(0)
if child == 0:
    try:
        os._exit(0)
    finally:  # reached only if os._exit raised
        open(os.path.join(out, f"unwound{rank}"), "w").close()
os.waitpid(child, 0)
view = {"preloaded": preloaded, "argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
        "threads": torch.get_num_threads(), "child_unwound": os.path.exists(os.path.join(out, f"unwound{rank}"))}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(view, f)
end = sys.argv[2] if len(sys.argv) > 2 else ""
if end == "os._exit":
    os._exit(0)
if end and rank == 1:
    sys.exit(int(end))
