"""Default service configs and the paper's recipes, shipped as package data (`rlep.configs`)."""
