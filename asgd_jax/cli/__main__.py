import sys

from asgd_jax.cli import main

sys.exit(main())
