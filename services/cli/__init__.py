"""The top of the stack: the `rlep` command line (may import any layer; runs jobs through `rlep.services.launch`)."""
