"""The KV policies, one module each (see `kvsieve.compress.policy` for the interface)."""
