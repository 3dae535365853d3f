"""Shared scaffolding of the test suites (imported as `support.x`; tests/ is on sys.path)."""
