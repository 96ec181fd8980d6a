"""`python -m kvserve.model.quant`: compile the CPU kernels now (run by `make setup`)."""

import sys

from kvserve.model.quant.build import main

sys.exit(main())
