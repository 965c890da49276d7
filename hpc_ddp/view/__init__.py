"""Looking at runs without a server: `hpc-ddp runs` lists them, `hpc-ddp plot` draws one."""
