"""Pure builders: (job, Plan, config) -> Kubernetes objects as plain dicts."""
