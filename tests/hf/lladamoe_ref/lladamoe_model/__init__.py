"""The package of the vendored LLaDA-MoE files (see ../README.md); added here, not vendored."""
