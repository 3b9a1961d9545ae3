"""Shared pytest configuration: the real local control plane fixtures (``k8s_cluster``,
``namespace``; marker ``k8s``) come from the e2e cluster plugin."""

pytest_plugins = ["e2e.cluster.pytest_plugin"]
