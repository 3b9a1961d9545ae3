"""Human views of a plan: rich tables for the terminal and matplotlib pictures.

Not part of the pure core: it may import rich and matplotlib, never kopf, kubernetes or torch.
"""
