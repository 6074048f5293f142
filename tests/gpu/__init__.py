"""GPU checks (`make test-gpu`). A package so that its conftest.py is not imported as a second top-level
`conftest` module, which would shadow tests/conftest.py for `from conftest import ...` in the other test files."""
