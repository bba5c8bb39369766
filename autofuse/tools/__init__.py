"""What measures autofuse rather than runs it: the `bench`, `demo` and `profile` commands and the helpers the
benchmark suites share. The runtime imports nothing from here (tests/test_registry.py checks it); the command
line loads a module of it only when its command runs."""
