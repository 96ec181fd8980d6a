"""`python -m kvserve.model.kernels`: compile the CPU kernels now (run by `make setup`)."""

import sys

from kvserve.model.kernels.build import main

sys.exit(main())
