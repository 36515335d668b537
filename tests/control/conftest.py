"""Loaded first for every test under tests/control; pytest puts this folder on sys.path for it, which is
how the tests of each subpackage import the shared stand-ins (`control_standins`)."""
