"""The top of the stack: the `rlep` command line and the local/Ray stack it starts (may import any layer)."""
