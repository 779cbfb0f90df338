"""Examples that use jkernel from outside the package (the simulator, the sensitivity helpers)."""
