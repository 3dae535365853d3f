"""The bottom layer: argument checks, dtype tables and limits, row tiles, model shapes and the
version. It imports nothing else of the package."""
