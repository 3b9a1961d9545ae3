"""Local real Kubernetes control plane for tests: build, up/down, kwok fake GPU nodes."""
