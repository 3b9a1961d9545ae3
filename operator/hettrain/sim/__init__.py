"""Discrete-event scale and failure simulator built on the planner and cost model. Pure."""
