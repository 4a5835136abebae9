"""``python -m spechead.kernels [--test-paths]``: which builds this CPU runs, or the test suite's paths."""

import sys

import torch

from spechead.kernels import active_isa, host_isas, test_paths, unavailable_reason

if "--test-paths" in sys.argv:
    print(" ".join(test_paths()))
else:
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; builds this CPU runs: {host_isas()}")
    print(f"active: {active_isa() or 'none (' + unavailable_reason() + ')'}")
