from hpc_ddp.cli import main
from hpc_ddp.runtime.exits import exit_process

exit_process(main())
