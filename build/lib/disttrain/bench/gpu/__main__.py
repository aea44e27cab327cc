"""`python -m disttrain.bench.gpu`: the same as `disttrain bench gpu`."""

import sys

from disttrain.bench.gpu import main

sys.exit(main())
