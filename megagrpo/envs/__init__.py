"""Multi-turn environments: the interface, the built-in environments, and the sandbox their tools run
code in."""
