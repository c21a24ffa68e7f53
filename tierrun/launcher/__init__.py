"""The ``tierrun`` launcher: torchrun's flags and elastic agent on tierrun's store."""
