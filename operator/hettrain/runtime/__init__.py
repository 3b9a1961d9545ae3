"""The training runtime (pods' entrypoint): imports torch, never the operator side."""
