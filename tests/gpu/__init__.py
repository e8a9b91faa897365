"""The GPU tests (README.md): a package, so that its conftest and modules do not collide with
tests/conftest.py's `conftest` or with test files of the same name elsewhere."""
