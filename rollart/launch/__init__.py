"""Starting a run: every node as a local process (`local`), as a Slurm job (`slurm`), or every node in
one process on a virtual clock (`inprocess`, the simulation mode)."""
