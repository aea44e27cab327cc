"""A module `disttrain launch -m hello_ranks` runs: each rank prints its rank and the world size."""

import os

print(f"hello from rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
