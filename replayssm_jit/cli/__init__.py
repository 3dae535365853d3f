"""The top layer: the command-line programs (`python -m replayssm_jit demo | aot | autotune`).
Nothing in the package imports it."""
