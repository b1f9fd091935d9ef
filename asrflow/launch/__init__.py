"""Starting training on several processes: torchrun on one machine, Slurm across machines."""
