import sys

from hpc_ddp.cli import main

sys.exit(main())
